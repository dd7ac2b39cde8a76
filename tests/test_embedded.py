"""The built-in model's conversion is the same checkpoint in every environment: its fingerprint
is what drafters and manifests pin, so a drafter trained on a GPU box must be accepted for the
same target converted on a laptop (with or without HF_HUB_OFFLINE)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _convert_in(cache, offline: bool) -> str:
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env["QFD_CACHE"] = str(cache)
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    code = "from qfd.embedded import ensure_embedded; from qfd.manifest import fingerprint; print(fingerprint(ensure_embedded('smollm2-135m')))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.slow
def test_conversion_fingerprint_does_not_depend_on_offline_mode(tmp_path, embedded_model_dir):
    assert _convert_in(tmp_path / "online", offline=False) == _convert_in(tmp_path / "offline", offline=True)

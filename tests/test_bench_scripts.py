"""The device scripts (bench/*.sh) name only what exists: every `bench/X.py` they run is there and
takes each `--flag` given on that command line, and every pytest file and `-k` expression they
run selects tests. Device time is scarce (a call that dies on a renamed flag is lost), and these
scripts only ever run on a GPU, so this reads them as text on the CPU."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "bench").glob("*.sh"))


def commands(script: Path) -> list[str]:
    """The script's lines with backslash continuations joined."""
    return script.read_text().replace("\\\n", " ").splitlines()


def bench_calls(script: Path) -> list[tuple[str, list[str]]]:
    """(bench/X.py, the --flags written on its command line) for each python call of a bench script."""
    calls = []
    for line in commands(script):
        if line.lstrip().startswith("#"):
            continue
        for match in re.finditer(r"python3?\s+\"?(?:\$SRC/)?(bench/[\w]+\.py)\"?([^|;&]*)", line):
            flags = re.findall(r"(?<![\w$-])(--[a-z][a-z0-9-]*)", match.group(2))
            calls.append((match.group(1), flags))
    return calls


def accepted_flags(bench: str) -> set[str]:
    """The options a bench script's argparse parser declares (read from its source)."""
    return set(re.findall(r"add_argument\(\s*\"(--[a-z][a-z0-9-]*)\"", (ROOT / bench).read_text()))


def test_the_scripts_run_python_benches():
    """The parser below finds what it should (a regex that matches nothing would pass everything)."""
    found = {bench for script in SCRIPTS for bench, _ in bench_calls(script)}
    assert {"bench/bench_int4_kernels.py", "bench/bench_steps.py", "bench/bench_e2e.py"} <= found
    assert (["draft", "train"], ["--stage", "--target", "--data"]) in [(w, f[:3]) for s in SCRIPTS for w, f in qfd_calls(s)]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bench_calls_use_existing_scripts_and_flags(script):
    for bench, flags in bench_calls(script):
        assert (ROOT / bench).is_file(), f"{script.name} runs {bench}, which does not exist"
        unknown = sorted(set(flags) - accepted_flags(bench))
        assert not unknown, f"{script.name}: {bench} does not take {unknown}"


def qfd_calls(script: Path) -> list[tuple[list[str], list[str]]]:
    """(subcommand words, the --flags written on its command line) of each `python3 -m qfd` call."""
    calls = []
    for line in commands(script):
        match = re.search(r"-m qfd((?:\s+[a-z][a-z0-9-]*)+)([^|;&]*)", line)
        if match and not line.lstrip().startswith("#"):
            calls.append((match.group(1).split(), re.findall(r"(?<![\w$-])(--[a-z][a-z0-9-]*)", match.group(2))))
    return calls


@functools.lru_cache(maxsize=None)
def qfd_help(words: tuple[str, ...]) -> str:
    env = dict(os.environ, COLUMNS="250", NO_COLOR="1")
    done = subprocess.run([sys.executable, "-m", "qfd", *words, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, f"qfd {' '.join(words)} --help failed: {done.stderr[-500:]}"
    return done.stdout


@pytest.mark.parametrize("script", [s for s in SCRIPTS if qfd_calls(s)], ids=lambda p: p.name)
def test_qfd_calls_use_existing_options(script):
    for words, flags in qfd_calls(script):
        text = qfd_help(tuple(words))
        unknown = [flag for flag in flags if not re.search(re.escape(flag) + r"(?![a-z0-9-])", text)]
        assert not unknown, f"{script.name}: qfd {' '.join(words)} does not take {unknown}"


def pytest_calls(script: Path) -> list[tuple[list[str], str | None]]:
    """(test files, the literal -k expression or None) of each `pytest` call in a script."""
    calls = []
    for line in commands(script):
        match = re.search(r"-m pytest\s+(.*)", line)
        if match is None or line.lstrip().startswith("#"):
            continue
        files = re.findall(r"(tests/\w+\.py)", match.group(1))
        k = re.search(r"-k \"([^\"$]+)\"", match.group(1))
        calls.append((files, k.group(1) if k else None))
    return calls


@pytest.mark.parametrize("script", [s for s in SCRIPTS if pytest_calls(s)], ids=lambda p: p.name)
def test_pytest_calls_select_tests(script):
    for files, k in pytest_calls(script):
        assert files, f"{script.name}: a pytest call without test files"
        for name in files:
            assert (ROOT / name).is_file(), f"{script.name} runs {name}, which does not exist"
        if k is None:
            continue
        listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files, "-k", k],
                                cwd=ROOT, capture_output=True, text=True, timeout=300)
        selected = [line for line in listed.stdout.splitlines() if "::" in line]
        assert selected, f"{script.name}: pytest {' '.join(files)} -k {k!r} selects no test\n{listed.stdout[-2000:]}"


def test_a_renamed_flag_is_caught(tmp_path, monkeypatch):
    """The check fails on a flag the bench does not declare."""
    script = tmp_path / "gpu_x.sh"
    script.write_text('timeout 9 python3 bench/bench_steps.py --device cuda \\\n    --no-such-flag --out x.json\n')
    calls = bench_calls(script)
    assert calls == [("bench/bench_steps.py", ["--device", "--no-such-flag", "--out"])]
    assert set(calls[0][1]) - accepted_flags("bench/bench_steps.py") == {"--no-such-flag"}

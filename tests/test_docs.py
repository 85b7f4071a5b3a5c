"""docs/ARCHITECTURE.md stays true: every file it names exists, and every module of the three
packages is named there."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "ARCHITECTURE.md"
PACKAGES = ("common/mnn_rollout", "runtime/mnn_runtime", "operator/rollout_operator")


def named_files() -> list[tuple[str, list[Path]]]:
    """(token, matches) for every backticked file name in the "Where each concept lives" list; a
    bare name (``rest.py``) is in the folder of the line's first full path."""
    section = DOC.read_text().split("## Where each concept lives", 1)[1]
    out = []
    for line in section.splitlines():
        base: Path | None = None
        for token in re.findall(r"`([^`\s]+\.(?:py|md|yaml))`", line):
            if "/" in token:
                base = (ROOT / token).parent
                out.append((token, sorted(ROOT.glob(token))))
            else:
                assert base is not None, f"{line!r}: a bare file name before any full path"
                out.append((token, sorted(base.glob(token))))
    return out


def test_every_file_the_architecture_page_names_exists() -> None:
    files = named_files()
    assert len(files) > 40
    missing = [token for token, found in files if not found]
    assert missing == []


def test_every_module_is_on_the_architecture_page() -> None:
    named = {p.resolve() for _, found in named_files() for p in found}
    modules = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
               if p.name != "__init__.py" and "grpc_v2" not in p.parts]
    unnamed = sorted(str(p.relative_to(ROOT)) for p in modules if p.resolve() not in named)
    assert unnamed == [], "name these in docs/ARCHITECTURE.md"


def test_no_comment_or_doc_cites_a_file_outside_the_repository() -> None:
    """The project's planning files (facts, design, style) are not in this repository: a comment or
    document states the fact itself instead of citing them."""
    outside = tuple(f"{name}.md" for name in ("FACTS", "DESIGN", "STYLE"))
    found = []
    for path in ROOT.rglob("*"):
        if any(part.startswith(".") or part in ("build", "node_modules") for part in path.relative_to(ROOT).parts):
            continue
        if path.is_file() and path.suffix in (".py", ".md", ".yaml", ".tpl", ".toml", ".txt", "") and \
                path.stat().st_size < 1_000_000:
            text = path.read_text(errors="replace")
            found += [f"{path.relative_to(ROOT)}: {name}" for name in outside if name in text]
    assert found == []

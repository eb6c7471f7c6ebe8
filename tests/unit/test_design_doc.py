"""docs/design.md's tables name every module: a new module gets its row's mention with its purpose.

The two tables are "Packages" (rows `hetd/`, `workers/`, `policies/`) and "The rooms of
`hetd/`" (rows such as `protocol/` for ``hetd/protocol/``, or a module of its own such as
`config.py`). Every ``*.py`` file under ``hetd/``, ``workers/`` and ``policies/`` counts, except
``__init__.py`` and ``__main__.py`` (a package is its row, not a module of it). A module is in the
table when it has a row of its own, or when the row of the deepest package that holds it names it
in backticks: its name (`wire`), its file (`wire.py`), or its path below that package
(`dpmp/search` or `dpmp/search.py`).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"
PACKAGES = ("hetd", "workers", "policies")
# Each table's heading, and the directory its rows' first cells are relative to.
TABLES = {"## Packages": "", "## The rooms of `hetd/`": "hetd/"}


def _rows() -> dict[str, str]:
    """Row key (``hetd/protocol/``, ``hetd/config.py``) -> the row's text, from both tables."""
    rows: dict[str, str] = {}
    section = None
    for line in DESIGN.read_text().splitlines():
        if line.startswith("## "):
            section = TABLES.get(line.strip())
            continue
        if section is None or not line.startswith("| `"):
            continue
        first = line.split("|")[1].strip()
        match = re.fullmatch(r"`([\w./]+)`", first)
        if match:
            rows[section + match.group(1)] = line
    return rows


def _modules() -> list[str]:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name in ("__init__.py", "__main__.py") or "__pycache__" in path.parts:
                continue
            found.append(path.relative_to(ROOT).as_posix())
    return found


def _named(module: str, rows: dict[str, str]) -> bool:
    if module in rows:
        return True
    holders = [key for key in rows if key.endswith("/") and module.startswith(key)]
    if not holders:
        return False
    package = max(holders, key=len)
    rel = module[len(package) :]
    stem = Path(rel).stem
    names = {stem, stem + ".py", rel, rel.removesuffix(".py")}
    return any(f"`{name}`" in rows[package] for name in names)


def test_the_tables_are_read() -> None:
    rows = _rows()
    assert {"hetd/", "workers/", "policies/", "hetd/protocol/", "hetd/config.py"} <= set(rows)


def test_every_module_is_in_the_design_tables() -> None:
    rows = _rows()
    missing = [m for m in _modules() if not _named(m, rows)]
    assert not missing, (
        f"{len(missing)} module(s) missing from docs/design.md's tables (name each in its "
        f"package's row with a one-line purpose): {', '.join(missing)}"
    )

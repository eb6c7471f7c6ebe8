"""The import graph with the rooms opened: every module of ``hetd``, ``workers`` and ``policies`` a
node, every import an edge (inside functions and under ``TYPE_CHECKING`` too). A module's level is
one more than the highest level it imports; the levels are the longest chain (docs/design.md,
"Levels"). ``python tests/unit/test_import_levels.py`` prints them and the longest chain.
"""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("hetd", "workers", "policies")
MAX_LEVELS = 15


def modules() -> dict[str, Path]:
    """Module name -> its file, for every module of the three packages."""
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ``known`` that module ``name`` imports (a name imported from a package is
    its submodule when there is one, else the package)."""

    def owner(dotted: str) -> str | None:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {m for a in node.names if (m := owner(a.name)) is not None}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package
                for _ in range(node.level - 1):
                    up = up.rpartition(".")[0]
                base = f"{up}.{base}" if base else up
            for a in node.names:
                full = f"{base}.{a.name}"
                m = full if full in known else owner(base)
                if m is not None:
                    out.add(m)
    out.discard(name)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                scc = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    scc.append(w)
                    if w == v:
                        break
                if len(scc) > 1:
                    found.append(scc)
    return found


def levels(edges: dict[str, set[str]]) -> dict[str, int]:
    """Each module's level (the graph has no cycle)."""
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(edges)))

    @functools.cache
    def level(name: str) -> int:
        return 1 + max((level(m) for m in edges[name]), default=0)

    return {name: level(name) for name in edges}


def longest_chain(edges: dict[str, set[str]], level: dict[str, int]) -> list[str]:
    top = max(sorted(level), key=level.__getitem__)
    chain = [top]
    while level[chain[-1]] > 1:
        chain.append(min(m for m in edges[chain[-1]] if level[m] == level[chain[-1]] - 1))
    return chain


def test_no_cycles_and_at_most_fifteen_levels() -> None:
    edges = graph()
    assert "hetd.core.engine" in edges and "workers.cli" in edges  # the walk found the packages
    assert cycles(edges) == []
    level = levels(edges)
    chain = longest_chain(edges, level)
    assert max(level.values()) <= MAX_LEVELS, " -> ".join(chain)


def test_a_chain_is_counted_through_function_level_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "hetd"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from hetd import b\n")
    (pkg / "b.py").write_text("from . import c\n")
    (pkg / "c.py").write_text("import os\n")
    known = {f"hetd.{n}": pkg / f"{n}.py" for n in "abc"}
    edges = {name: imports(name, path, known) for name, path in known.items()}
    assert edges == {"hetd.a": {"hetd.b"}, "hetd.b": {"hetd.c"}, "hetd.c": set()}
    assert levels(edges)["hetd.a"] == 3


if __name__ == "__main__":
    g = graph()
    lv = levels(g)
    print(f"levels {max(lv.values())} cycles {len(cycles(g))}")
    print(" -> ".join(longest_chain(g, lv)))
    for name in ("hetd.core.engine", "hetd.server.daemon", "hetd.cli.main", "workers.cli"):
        print(f"  {name}: level {lv[name]}")

"""The product's import graph has no cycle: no module of engine_manager or app is imported back, directly or through
others, by what it imports. The graph is grimp's (what lint-imports checks the contracts on): function-local and
TYPE_CHECKING imports count. engine_manager.testing (the fixtures, never imported by the product) is left out.

KNOWN_CYCLE_EDGES lists the imports that close a cycle today, each with what removes it: the check ignores them, and
fails when one no longer closes a cycle (take it off the list), so the list only shrinks. Checked on the real tree,
and on a temporary copy with one cycle planted."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("engine_manager", "app")
FIXTURES = "engine_manager.testing"

KNOWN_CYCLE_EDGES: dict[tuple[str, str], str] = {}      # none today: a cycle that appears fails the test

# Runs in a fresh interpreter whose path starts with the tree to read (the real one or a copy): every import
# between two product modules, as (importer, imported, the first line that imports).
_EDGES = """
import json, sys
import grimp
graph = grimp.build_graph(*sys.argv[1:], cache_dir=None)
out = []
for m in sorted(graph.modules):
    for n in sorted(graph.find_modules_directly_imported_by(m)):
        d = graph.get_import_details(importer=m, imported=n)
        out.append((m, n, min((x["line_number"] for x in d), default=0)))
print(json.dumps(out))
"""


def import_edges(where: Path) -> dict[tuple[str, str], int]:
    try:
        import grimp  # noqa: F401 - installed with import-linter (the lint extra)
    except ImportError:
        from conftest import require_or_skip
        require_or_skip("grimp is missing: install the lint extra (./scripts/test does)")
    env = {**os.environ, "PYTHONPATH": str(where)}    # the tree's packages, not the installed (editable) ones
    cp = subprocess.run([sys.executable, "-c", _EDGES, *PRODUCT], cwd=where, env=env, capture_output=True,
                        text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert cp.returncode == 0, cp.stderr
    return {(a, b): line for a, b, line in json.loads(cp.stdout)
            if not (a == FIXTURES or a.startswith(FIXTURES + ".") or b == FIXTURES or b.startswith(FIXTURES + "."))}


def cycles(edges) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    succ: dict[str, list[str]] = {}
    for a, b in edges:
        succ.setdefault(a, []).append(b)
        succ.setdefault(b, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(succ):
        if root in index:
            continue
        work = [(root, iter(succ[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(succ[w])))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return sorted(found)


def describe(comps: list[list[str]], edges: dict[tuple[str, str], int]) -> str:
    lines = []
    for comp in comps:
        members = set(comp)
        lines.append("cycle: " + ", ".join(comp))
        lines += [f"    {a} -> {b} (l.{line})" for (a, b), line in sorted(edges.items())
                  if a in members and b in members]
    return "\n".join(lines)


def test_the_cycle_finder_finds_a_cycle_and_only_a_cycle():
    assert cycles([("a", "b"), ("b", "c"), ("c", "a"), ("c", "d"), ("d", "e")]) == [["a", "b", "c"]]
    assert cycles([("a", "b"), ("b", "a"), ("x", "y"), ("y", "x"), ("a", "x")]) == [["a", "b"], ["x", "y"]]
    assert cycles([("a", "b"), ("b", "c"), ("a", "c")]) == []


def test_the_product_has_no_import_cycle_but_the_known_ones():
    edges = import_edges(ROOT)
    left = cycles(e for e in edges if e not in KNOWN_CYCLE_EDGES)
    assert not left, ("import cycles (move what both sides need below them, or pass it in):\n"
                      + describe(left, edges))
    # a known edge that is gone, or no longer closes a cycle, leaves the list
    closing = {frozenset(c) for c in cycles(edges)}
    stale = [f"{a} -> {b}" for a, b in KNOWN_CYCLE_EDGES
             if (a, b) not in edges or not any({a, b} <= c for c in closing)]
    assert not stale, f"no longer a cycle: take {stale} off KNOWN_CYCLE_EDGES in tests/test_import_graph.py"


@pytest.mark.parametrize("where, imported, statement", [
    # the lowest module reaching for the plan store: fmt -> plans -> placement -> fmt
    ("engine_manager/fmt.py", "engine_manager.plans", "from engine_manager import plans"),
    # a panel's helper reaching for the window that imports every panel: plot_export -> main_window -> bench_view
    ("app/plot_export.py", "app.main_window", "from app.main_window import MainWindow"),
])
def test_one_planted_import_makes_a_cycle_that_the_check_names(tmp_path, where, imported, statement):
    tree = tmp_path / "tree"
    for pkg in PRODUCT:
        shutil.copytree(ROOT / pkg, tree / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    probe = tree / where
    text = probe.read_text().rstrip("\n") + "\n\n\ndef _cycle_probe():\n"
    line = text.count("\n") + 1
    probe.write_text(text + f"    {statement}\n")      # function-local: a lazy import is still an edge
    importer = where.removesuffix(".py").replace("/", ".")
    edges = import_edges(tree)
    left = cycles(e for e in edges if e not in KNOWN_CYCLE_EDGES)
    assert any({importer, imported} <= set(c) for c in left), describe(left, edges)
    assert f"{importer} -> {imported} (l.{line})" in describe(left, edges)

"""One word for one thing in the product code (engine_manager/, app/): the Bearer header, the API key's format,
the byte units, shard 1 of a split, and module docstrings a reader takes in at once."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from engine_manager.engines._http import bearer_headers
from engine_manager.settings import API_KEY_PREFIX, Settings, load_settings, new_api_key

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = sorted(p for d in ("engine_manager", "app") for p in (ROOT / d).rglob("*.py")
                 if "testing" not in p.relative_to(ROOT).parts)


def _rel(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


def test_the_bearer_header_is_built_in_one_place():
    assert bearer_headers("k-123") == {"Authorization": "Bearer k-123"}
    assert bearer_headers(None) == {} and bearer_headers("") == {}
    built = re.compile(r"""f?["']Bearer \{|["']Bearer ["']\s*\+""")
    found = [f"{_rel(p)}:{i}" for p in PRODUCT if _rel(p) != "engine_manager/engines/_http.py"
             for i, line in enumerate(p.read_text().splitlines(), 1) if built.search(line)]
    assert found == [], "build the header with engine_manager.engines._http.bearer_headers"


def test_one_api_key_format(tmp_path):
    key = new_api_key()
    assert key.startswith(API_KEY_PREFIX) and key != new_api_key()
    assert Settings.model_validate({"api_key": key}).api_key == key       # the setting accepts what is generated
    loaded = load_settings(env={}, path=tmp_path / "settings.json", generate_key=True)
    assert loaded.settings.api_key.startswith(API_KEY_PREFIX) and len(loaded.settings.api_key) == len(key)
    makers = [f"{_rel(p)}:{i}" for p in PRODUCT if _rel(p) != "engine_manager/settings.py"
              for i, line in enumerate(p.read_text().splitlines(), 1) if "token_urlsafe" in line]
    assert makers == [], "make an API key with engine_manager.settings.new_api_key"


UNIT_NAMES = {"KIB", "MIB", "GIB", "KB", "MB", "GB", "KiB", "MiB", "GiB", "GIBI", "MEBI"}


def test_byte_units_are_defined_only_in_fmt():
    found = []
    for p in PRODUCT:
        if _rel(p) == "engine_manager/fmt.py":
            continue
        for node in ast.parse(p.read_text()).body:
            if isinstance(node, ast.Assign):
                names = [n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)]
                found += [f"{_rel(p)}:{node.lineno} {n}" for n in names if n in UNIT_NAMES]
    assert found == [], "import the units from engine_manager.fmt"


def test_one_first_shard_function():
    homes = [_rel(p) for p in PRODUCT for node in ast.parse(p.read_text()).body
             if isinstance(node, ast.FunctionDef) and node.name == "first_shard"]
    assert homes == ["engine_manager/gguf_split.py"]


# A module docstring says what the module is for, what it exports and what a reader must know, for every module;
# measurements and longer reasoning live in benchmarks/results/ (design_figures.md, design_rationale.md).
MAX_DOC_LINES = 15


def _doc_lines(p: Path) -> int:
    doc = ast.get_docstring(ast.parse(p.read_text()), clean=False)
    return len(doc.strip("\n").splitlines()) if doc else 0


@pytest.mark.parametrize("p", PRODUCT, ids=_rel)
def test_module_docstrings_are_short(p):
    n = _doc_lines(p)
    assert n <= MAX_DOC_LINES, (f"{_rel(p)}'s docstring has {n} lines; say what a reader needs in "
                                f"{MAX_DOC_LINES} and move measurements to benchmarks/results/")

"""The reference path shares no code with paging, prefix lookup or scheduling. Follows the
reference module's own imports (not the top-level package __init__) through kvpage and fails if any of them
reaches kvpage.cache or kvpage.engine."""

from __future__ import annotations

import ast
from pathlib import Path

import kvpage

ROOT = Path(kvpage.__file__).parent
# kv_format is the engine's quantiser: the reference rounds K/V with its own (verify.kv_oracle).
FORBIDDEN = (
    "kvpage.cache",
    "kvpage.engine",
    "kvpage.model.paged_attention",
    "kvpage.kv.format",
)


def _module_file(name: str) -> Path | None:
    rel = Path(*name.split(".")[1:])
    for candidate in (ROOT / rel.with_suffix(".py"), ROOT / rel / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _kvpage_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvpage"):
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names if a.name.startswith("kvpage")}
    return names


def reached_modules(start: str) -> set[str]:
    """Every kvpage module `start` imports, directly or not."""
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name in seen or name == "kvpage":
            continue
        seen.add(name)
        path = _module_file(name)
        if path is not None:
            todo += sorted(_kvpage_imports(path))
    return seen


def test_reference_imports_no_paging_prefix_or_scheduling_code():
    seen = reached_modules("kvpage.reference.generator")
    reached = sorted(n for n in seen if n.startswith(FORBIDDEN))
    assert not reached, f"the reference reaches {reached}"
    assert "kvpage.model.attention" in seen and "kvpage.sampling" in seen  # the walk works

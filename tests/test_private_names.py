"""No module touches a private name (`_x`) that another package defines: packages meet through
public names only. Mutants included: they plant bugs through declared seams and public methods
(kvpage.engine.hooks, kvpage.verify.mutants.base), so an internal rename cannot silently turn a
mutant into a "missed" one, and no cleanup of a scheduler or cache internal needs the gate's
permission."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvpage"


def _package(path: Path) -> str:
    """kvpage/engine/scheduler.py -> "engine"; kvpage/config.py -> "config"; tests -> "tests"."""
    rel = path.relative_to(ROOT).parts
    if rel[0] != "kvpage":
        return rel[0]
    return rel[1].removesuffix(".py")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined(tree: ast.AST) -> set[str]:
    """Private names a module defines: functions, classes, module or class attributes, and
    attributes it assigns on `self`."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return {n for n in names if _private(n)}


def _owners() -> dict[str, set[str]]:
    owners: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        for name in _defined(ast.parse(path.read_text())):
            owners.setdefault(name, set()).add(_package(path))
    return owners


def _touches(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of every private name reached through another object or imported."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append((node.lineno, node.attr))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvpage"):
            found += [(node.lineno, a.name) for a in node.names if _private(a.name)]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in (
            "getattr",
            "setattr",
        ):
            args = node.args
            if len(args) > 1 and isinstance(args[1], ast.Constant) and _private(str(args[1].value)):
                found.append((node.lineno, str(args[1].value)))
    return found


def _violations(sources: list[tuple[Path, str]]) -> list[str]:
    """`sources`: (path as if in the repository, its text)."""
    owners = _owners()
    out = []
    for path, text in sources:
        here = _package(path)
        for line, name in _touches(ast.parse(text)):
            if name in owners and here not in owners[name]:
                out.append(f"{path.relative_to(ROOT)}:{line}: {name} (of {sorted(owners[name])})")
    return out


def _repository() -> list[tuple[Path, str]]:
    return [(path, path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))]


def test_no_package_touches_another_packages_private_names():
    assert _violations(_repository()) == []


def test_mutants_touch_no_private_name_at_all():
    """Stricter for the mutants: not even a private of their own package's engine parts."""
    found = [
        f"{path.name}:{line}: {name}"
        for path in sorted((PACKAGE / "verify" / "mutants").glob("*.py"))
        for line, name in _touches(ast.parse(path.read_text()))
    ]
    assert found == []


def test_the_check_sees_what_it_should():
    """Planted reach-ins are found: a private method of the scheduler called from verify, a
    private helper imported across packages, and a getattr by name."""
    planted = PACKAGE / "verify" / "planted.py"
    text = (
        "from kvpage.engine.scheduler import _prompt_tokens\n"
        "def f(engine):\n"
        "    return engine.scheduler._make_room, getattr(engine.cache, '_reserve')\n"
    )
    assert _violations([(planted, text)]) == [
        "kvpage/verify/planted.py:1: _prompt_tokens (of ['engine'])",
        "kvpage/verify/planted.py:3: _make_room (of ['engine'])",
        "kvpage/verify/planted.py:3: _reserve (of ['cache'])",
    ]

"""The import graph: no cycles between modules, and no import upward between the layers.

Layers, lowest first (docs/architecture.md): a module may import its own package and the layers
below it, never one above. `kvpage/__init__.py` is the public face and may import anything."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvpage"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "host_memory"),  # host_memory: glibc malloc settings, imports nothing
    ("config", "structured_params", "sampling_params"),
    ("sampling",),
    ("cache",),
    ("kv",),
    ("model",),
    ("lora",),  # computed over the model's projections (their oneDNN packing)
    ("structured",),  # llguidance grammars over the model's tokenizer
    ("speculative",),  # proposers and the rejection rule; the engine verifies drafts
    ("parallel",),
    ("engine",),
    ("reference",),
    ("server",),
    ("serve_replicas",),
    ("verify",),
    ("audit",),
    ("experiments",),
    ("cli",),
)
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.AST, runtime_only: bool) -> list[tuple[int, str]]:
    """(line, module) of every kvpage import; `runtime_only` skips `if TYPE_CHECKING:` blocks."""
    skipped: set[int] = set()
    if runtime_only:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                skipped |= {id(n) for n in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvpage"):
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("kvpage")]
    return found


def _graph(runtime_only: bool) -> dict[str, set[str]]:
    modules = {_module(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for _, target in _imports(ast.parse(path.read_text()), runtime_only):
            while target not in modules:  # `from kvpage.x import y`: y may be a module or a name
                target = target.rpartition(".")[0]
            if target != name:
                graph[name].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _upward(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for src, targets in sorted(graph.items()):
        if src == "kvpage":
            continue  # the public face
        for dst in sorted(targets):
            if dst != "kvpage" and RANK[_layer(dst)] > RANK[_layer(src)]:
                bad.append(f"{src} -> {dst}")
            elif dst == "kvpage":
                bad.append(f"{src} -> kvpage (the public face is for users, not for the package)")
    return bad


def test_every_package_has_a_layer():
    assert {_layer(m) for m in _graph(False) if m != "kvpage"} == set(RANK)


def test_no_import_cycles():
    assert _cycles(_graph(runtime_only=True)) == []


def test_no_upward_imports():
    assert _upward(_graph(runtime_only=False)) == []


def test_the_checks_see_what_they_should():
    """A planted cycle and a planted upward edge are found."""
    graph = _graph(False)
    graph["kvpage.cache.manager"].add("kvpage.engine.scheduler")
    graph["kvpage.engine.scheduler"].add("kvpage.cache.manager")
    assert ["kvpage.cache.manager", "kvpage.engine.scheduler"] in [
        [m for m in c if m in ("kvpage.cache.manager", "kvpage.engine.scheduler")]
        for c in _cycles(graph)
    ]
    assert "kvpage.cache.manager -> kvpage.engine.scheduler" in _upward(graph)

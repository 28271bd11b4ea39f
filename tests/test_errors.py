"""One root for every library error: `except KVPageError` catches anything kvpage
raises on purpose. The roots that were outside it keep their second base (RuntimeError,
AttributeError) for callers that catch that, and keep how they are reported (a CLI line, an HTTP
status). Exported errors are all raised somewhere: no dead names in the public API."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import pkgutil
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

import kvpage
from kvpage import errors
from kvpage.errors import InvalidConfig, InvalidRequest, KVPageError

ROOT = Path(kvpage.__file__).parent


HAVE_RAY = importlib.util.find_spec("ray") is not None


def _import_every_module() -> list[str]:
    """Every module of the package. `__main__` modules are skipped (importing one runs the CLI),
    and so are those that need Ray where it is not installed (it is an extra: `.[ray]`)."""
    names = []
    for info in pkgutil.walk_packages(kvpage.__path__, "kvpage.", onerror=_on_package_error):
        if info.name.rsplit(".", 1)[-1] == "__main__":
            continue
        try:
            importlib.import_module(info.name)
        except ModuleNotFoundError as err:
            if not _ray_missing(err):
                raise
            continue
        names.append(info.name)
    return names


def _on_package_error(name: str) -> None:
    """walk_packages swallows a package that fails to import unless told otherwise."""
    err = sys.exc_info()[1]
    if not _ray_missing(err):
        raise err


def _ray_missing(err: BaseException | None) -> bool:
    return (
        not HAVE_RAY
        and isinstance(err, ModuleNotFoundError)
        and (err.name or "").split(".")[0] == "ray"
    )


def _kvpage_exceptions() -> list[type[BaseException]]:
    """Every exception class defined in kvpage, at module level or not, found through the
    subclass tree once every module is imported."""
    _import_every_module()
    found, todo = set(), [BaseException]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                found.add(sub)
                todo.append(sub)
    mine = [c for c in found if c.__module__ == "kvpage" or c.__module__.startswith("kvpage.")]
    return sorted(mine, key=lambda c: f"{c.__module__}.{c.__qualname__}")


def test_every_module_imports():
    names = _import_every_module()
    assert "kvpage.audit.errors" in names and "kvpage.cli.common" in names
    assert ("kvpage.serve_replicas.ray_serve" in names) == HAVE_RAY


def test_every_kvpage_exception_derives_from_kvpage_error():
    classes = _kvpage_exceptions()
    # Not vacuous: the walk finds the errors of the CLI, the server, the kernel, the auditor and
    # the verifier, not just those of kvpage.errors.
    names = {c.__name__ for c in classes}
    assert {"CliError", "ApiError", "EngineFailure", "NativeBuildError"} <= names
    assert {"AuditError", "MissingSeam", "InvalidConfig", "UnsafeFaultRefused"} <= names
    outside = [
        f"{c.__module__}.{c.__qualname__}" for c in classes if not issubclass(c, KVPageError)
    ]
    assert not outside, f"library errors not rooted in KVPageError: {outside}"


def _error(module: str, name: str) -> type[BaseException]:
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize(
    "module, name, second",
    [
        ("kvpage.server.engine_loop", "EngineFailure", RuntimeError),
        ("kvpage.server.engine_loop", "ServerShutdown", RuntimeError),
        ("kvpage.model.native_build", "NativeBuildError", RuntimeError),
        ("kvpage.verify.mutants.base", "MissingSeam", AttributeError),
        ("kvpage.errors", "InvalidConfig", ValueError),
        ("kvpage.errors", "InvalidRequest", ValueError),
    ],
)
def test_second_bases_are_kept(module, name, second):
    """Code outside kvpage may catch these as the builtin they were before."""
    assert issubclass(_error(module, name), second)


def test_a_cli_error_is_still_one_line_without_its_class_name(capsys):
    """cli.main catches CliError before KVPageError: its message names the flag, no class."""
    from kvpage.cli import main

    assert main(["generate", "--prompt-ids", "1", "--max-tokens", "0"]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("error: kvpage generate: argument --max-tokens"), line
    assert "CliError" not in line


def test_an_audit_error_is_still_one_line_with_its_class_name(capsys, tmp_path):
    from kvpage.cli import main

    assert main(["audit", "--base-url", "ftp://x", "--model", "m", "--report", str(tmp_path)]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("error: AuditUsageError: "), line


@pytest.fixture(scope="module")
def client():
    from kvpage import EngineConfig, LLMEngine
    from kvpage.server import create_app

    with TestClient(create_app(LLMEngine(EngineConfig(num_blocks=16)))) as c:
        yield c


def test_an_api_error_is_still_its_http_status(client):
    """app.py's handler for ApiError is found before the catch-all one (a 500): Starlette looks
    handlers up along the MRO, and ApiError comes before KVPageError and Exception in it."""
    r = client.post("/v1/completions", json={"model": "nope", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text
    r = client.post("/v1/completions", json={"model": "builtin:tiny-llama", "prompt": "hi", "n": 0})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text


# --- dead exports ------------------------------------------------------------------------------
def _names_imported_from_errors() -> set[str]:
    """Names any kvpage module but the package's __init__ (which only re-exports) takes from
    kvpage.errors: `from kvpage.errors import X` or `errors.X`."""
    used = set()
    for path in ROOT.rglob("*.py"):
        if path == ROOT / "__init__.py" or path == ROOT / "errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "kvpage.errors":
                used |= {alias.name for alias in node.names}
            elif isinstance(node, ast.Attribute) and _is_name(node.value, "errors"):
                used.add(node.attr)
    return used


def _is_name(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def test_every_error_in_kvpage_errors_is_used():
    """Raised or caught by some module, or the base of one that is. By import, not by name: the
    engine's CacheCorruption event shares its name with the error that nothing raised."""
    defined = {
        name: obj
        for name, obj in vars(errors).items()
        if isinstance(obj, type)
        and issubclass(obj, BaseException)
        and obj.__module__ == errors.__name__
    }
    used = _names_imported_from_errors()
    bases = {base for cls in defined.values() for base in cls.__mro__[1:]}
    dead = sorted(name for name, cls in defined.items() if name not in used and cls not in bases)
    assert not dead, f"exported but never used: {dead}"


def test_the_public_api_names_exist():
    missing = [name for name in kvpage.__all__ if not hasattr(kvpage, name)]
    assert not missing and "CacheCorruption" not in kvpage.__all__
    assert issubclass(InvalidConfig, KVPageError) and issubclass(InvalidRequest, KVPageError)

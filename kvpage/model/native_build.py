"""Building kvpage's native kernels (kvpage/model/native/*.cpp): each is one C++ file with no
torch dependency (it may include the headers beside it, native/*.h), compiled with the system C++
compiler at first use into a cache directory, keyed by its source, those headers, the compiler,
the flags and the CPU, and loaded through ctypes.

Why not a torch extension: the torch headers take a minute to compile on two cores and need
ninja; these files build in about a second. KVPAGE_NATIVE=0 (`enabled()` False) turns every
kernel off, and callers keep their torch path."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from kvpage.errors import KVPageError

FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC", "-std=c++17")


class NativeBuildError(KVPageError, RuntimeError):
    """A kernel did not compile or load; the message has the compiler's output."""


_tape: list | None = None  # the calls being recorded (`recording`), else None
_inside = False  # a recorded call is running: what it does is the call, not the caller's


def call(fn, *args) -> None:
    """Run one kernel entry point on its arguments: a ctypes function, or a Python function
    that writes its result into an argument (a torch kernel with no native twin, such as
    oneDNN's GEMM into a buffer). Every kernel call goes through here, so that a decode tape
    (kvpage.model.decode_tape) can record a step's calls (fn, args) and replay them."""
    global _inside
    if _tape is None:
        fn(*args)
        return
    _tape.append((fn, args))
    _inside = True
    try:
        fn(*args)
    finally:
        _inside = False


def is_recording() -> bool:
    """Whether kernel calls are being recorded: a kernel without a native entry point then
    writes into a buffer through `call` (replayable) rather than returning a new tensor."""
    return _tape is not None


def inside_call() -> bool:
    """Whether a recorded call is running (its torch operators are the call's own)."""
    return _inside


@contextmanager
def recording(calls: list) -> Iterator[list]:
    """Append every kernel call made inside to `calls` (not reentrant)."""
    global _tape
    if _tape is not None:
        raise RuntimeError("already recording kernel calls")
    _tape = calls
    try:
        yield calls
    finally:
        _tape = None


def enabled() -> bool:
    return os.environ.get("KVPAGE_NATIVE", "1") != "0"


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


def load(
    source: Path, what: str, bind: Callable[[ctypes.CDLL], ctypes.CDLL], flags=FLAGS
) -> ctypes.CDLL | None:
    """The kernel in `source`, built and bound; None (with a warning naming `what` and the
    cause) where it is off, no compiler is found, or it does not build or load: the caller's
    torch path then runs."""
    if not enabled():
        return None
    cxx = compiler()
    if cxx is None:
        warnings.warn(f"no C++ compiler: {what} uses the torch path", stacklevel=3)
        return None
    try:
        return bind(ctypes.CDLL(str(build(source, cxx, flags))))
    except (NativeBuildError, OSError) as err:
        warnings.warn(f"{what} kernel unavailable, using the torch path: {err}", stacklevel=3)
        return None


def build(source: Path, compiler: str, flags: tuple[str, ...] = FLAGS) -> Path:
    """The shared library for this source, flags and CPU, compiled once into the cache dir."""
    digest = hashlib.sha256(source.read_bytes())
    for header in sorted(source.parent.glob("*.h")):  # what the sources include
        digest.update(header.read_bytes())
    digest.update(" ".join((compiler, *flags, _cpu_signature())).encode())
    target = _cache_dir() / f"{source.stem}-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    # Compile beside the target and rename: concurrent first uses never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    proc = subprocess.run(
        [compiler, *flags, str(source), "-o", tmp], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        os.unlink(tmp)
        raise NativeBuildError(f"{compiler} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    os.replace(tmp, target)
    return target


def _cache_dir() -> Path:
    base = os.environ.get("KVPAGE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvpage"
    )
    path = Path(base) / "kernels"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _cpu_signature() -> str:
    """-march=native code must not be loaded on another CPU sharing the cache (a network home)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.sha256(flags.encode()).hexdigest()[:16]

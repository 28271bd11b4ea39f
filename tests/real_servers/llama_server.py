"""llama.cpp's `llama-server`, built on demand from the same llama-cpp-python sdist the bench peer
uses (bench/peers/llama_cpp.py: its download, unpack, cmake lookup and GGUF conversion are reused
as they are), in its own build folder next to the bench's (the bench builds with the server off):

    $KVPAGE_BENCH_CACHE/llama.cpp-<version>/build-server/bin/llama-server

A one-time build (minutes on 2 cores), then a no-op."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.peers import llama_cpp as peer
from tests.real_servers.process import Served, free_port, serve_process

TARGET = "llama-server"
# The bench's flags with the server on; no libcurl (nothing is downloaded at run time).
FLAGS = [f for f in peer.CMAKE_FLAGS if not f.startswith("-DLLAMA_BUILD_SERVER")]
FLAGS += ["-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_CURL=OFF"]


def build_dir() -> Path:
    return peer.CACHE / "build-server"


def binary_path() -> Path:
    return build_dir() / "bin" / TARGET


def is_built() -> bool:
    return binary_path().is_file() and os.access(binary_path(), os.X_OK)


def build(jobs: int = 2, log=print) -> Path:
    """Configure and build `llama-server` once; raises the bench's PeerError on failure."""
    if is_built():
        return binary_path()
    src = peer.fetch_source(log)
    cmake = peer.find_cmake()
    log_path = peer.CACHE / "build-server.log"
    log(f"llama.cpp: building {TARGET} into {build_dir()} (one time; log: {log_path})")
    t0 = time.perf_counter()
    with open(log_path, "w") as fh:
        for cmd in (
            [cmake, "-S", str(src), "-B", str(build_dir()), *FLAGS],
            [cmake, "--build", str(build_dir()), "--target", TARGET, f"-j{jobs}"],
        ):
            fh.write(f"$ {' '.join(cmd)}\n")
            fh.flush()
            if subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT).returncode != 0:
                tail = log_path.read_text(errors="replace").splitlines()[-5:]
                raise peer.PeerError(f"{TARGET} build failed ({log_path}): " + " | ".join(tail))
    if not is_built():
        raise peer.PeerError(f"the build finished but {binary_path()} is missing ({log_path})")
    log(f"llama.cpp: {TARGET} built in {time.perf_counter() - t0:.0f}s")
    return binary_path()


READY_S = 180.0


@contextmanager
def llama_server(gguf: Path, name: str, workdir: Path, slots: int = 4) -> Iterator[Served]:
    """`llama-server` on 127.0.0.1 with its defaults for caching (prompt cache on, one cache for
    all clients), `slots` parallel sequences of 2048 tokens each, 2 threads."""
    port = free_port()
    cmd = [str(build()), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--alias", name, "-c", str(2048 * slots), "-np", str(slots), "-t", "2"]
    url = f"http://127.0.0.1:{port}"
    with serve_process(cmd, dict(os.environ), url, workdir / "llama-server.log", READY_S) as s:
        yield s


if __name__ == "__main__":
    print(build())

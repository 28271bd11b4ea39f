"""llama.cpp as a benchmark peer: its own `llama-batched-bench` on the benchmark's model.

Everything lives in a cache directory outside the repository (`$KVPAGE_BENCH_CACHE`, default
`~/.cache/kvpage-bench`), under `llama.cpp-<version>/`:

    sdist/     the llama-cpp-python sdist (`pip download --no-binary :all:`), which vendors llama.cpp
    src/       the unpacked sdist; llama.cpp is src/llama_cpp_python-<version>/vendor/llama.cpp
    build/     the CMake build; the binary is build/bin/llama-batched-bench
    build.log  the last configure + build log
    models/    GGUF files converted from the Hugging Face model, one folder per model hash

The one-time build (`python bench/peers/llama_cpp.py build`) takes minutes (~8 on 2 cores). The
conversion uses the sdist's own `convert_hf_to_gguf.py` with its vendored `gguf-py`; it imports
`sentencepiece` (`pip install -e '.[bench]'`; without it the converter runs under the vLLM peer's
virtualenv, when installed). The benchmark's random model has no tokenizer, so a
minimal byte-fallback BPE `tokenizer.json` of the model's vocabulary size is written next to it
(batched-bench feeds random token ids, the tokenizer only has to load).

`llama-batched-bench` runs `npl` sequences of `npp` random prompt tokens, prefills them all (in
`-b`/`-ub` batches), then makes `ntg` decode passes of one token per sequence, computing logits for
every token fed but not sampling. It prints T_PP (prefill), T_TG (decode) and T = T_PP + T_TG,
excluding model load and its own warm-up; `run_batched_bench` parses that table.

No third-party imports: the bench scripts import this module unconditionally.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

VERSION = "0.3.36"
SDIST = f"llama_cpp_python-{VERSION}"
TARGET = "llama-batched-bench"
CACHE = (
    Path(os.environ.get("KVPAGE_BENCH_CACHE") or Path.home() / ".cache" / "kvpage-bench")
    / f"llama.cpp-{VERSION}"
)
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_OPENSSL=OFF",
]
# llama.cpp 0.3.36's AMX kernels (the Q8_0 and k-quant matmuls on CPUs with AMX-INT8) fault with
# an invalid opcode on Linux: its worker threads execute tile instructions without their own
# tile permission and configuration (ggml-org/llama.cpp PR 26954), which kills Q8_0 runs on a
# Sapphire Rapids Xeon. There the build turns AMX off; f32, bf16 and Q8_0 then take its
# AVX-512 (VNNI, BF16) kernels.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
BUILD_STAMP = "kvpage-cmake-flags.txt"  # in the build folder: the flags it was configured with
Log = Callable[[str], None]


class PeerError(RuntimeError):
    """Why the peer cannot run here; the bench prints it as `llama.cpp: FAILED: <why>`."""


# --- paths --------------------------------------------------------------------------------------
def source_dir() -> Path:
    return CACHE / "src" / SDIST / "vendor" / "llama.cpp"


def binary_path() -> Path:
    return CACHE / "build" / "bin" / TARGET


def is_built() -> bool:
    """The binary exists and was built with this CPU's flags (an older build is rebuilt)."""
    stamp = CACHE / "build" / BUILD_STAMP
    if not (binary_path().is_file() and os.access(binary_path(), os.X_OK)):
        return False
    return stamp.is_file() and stamp.read_text() == " ".join(cmake_flags())


def cmake_flags() -> list[str]:
    """CMAKE_FLAGS, plus AMX off where the CPU has it (see NO_AMX)."""
    if not cpu_has("amx_int8"):
        return list(CMAKE_FLAGS)
    return [*CMAKE_FLAGS, f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]


def cpu_has(flag: str) -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return False
    return flag in line.split()


# --- build --------------------------------------------------------------------------------------
def fetch_source(log: Log = print) -> Path:
    """The sdist, downloaded with the running interpreter's pip and unpacked (once)."""
    src = source_dir()
    if (src / "CMakeLists.txt").is_file():
        return src
    sdist_dir = CACHE / "sdist"
    sdist_dir.mkdir(parents=True, exist_ok=True)
    tarball = sdist_dir / f"{SDIST}.tar.gz"
    if not tarball.is_file():
        log(f"llama.cpp: downloading the llama-cpp-python {VERSION} sdist into {sdist_dir}")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        cmd += [f"llama-cpp-python=={VERSION}", "-d", str(sdist_dir)]
        _check(cmd, "pip download")
    if not tarball.is_file():
        raise PeerError(f"pip download left no {tarball.name} in {sdist_dir}")
    unpack = CACHE / "src.partial"
    shutil.rmtree(unpack, ignore_errors=True)
    unpack.mkdir(parents=True)
    with tarfile.open(tarball) as tar:
        tar.extractall(unpack, filter="data")
    shutil.rmtree(CACHE / "src", ignore_errors=True)
    unpack.rename(CACHE / "src")
    if not (src / "CMakeLists.txt").is_file():
        raise PeerError(f"the sdist has no vendored llama.cpp at {src}")
    return src


def find_cmake() -> str:
    venv_cmake = Path(sys.executable).with_name("cmake")
    found = shutil.which("cmake") or (str(venv_cmake) if venv_cmake.is_file() else None)
    if found is None:
        raise PeerError(
            "cmake not found: apt-get install cmake build-essential (or pip install cmake)"
        )
    if shutil.which("c++") is None and shutil.which("g++") is None:
        raise PeerError("no C++ compiler: apt-get install build-essential")
    return found


def build(jobs: int = 2, log: Log = print) -> Path:
    """Configure and build `llama-batched-bench` (a no-op when the binary exists)."""
    if is_built():
        return binary_path()
    src = fetch_source(log)
    cmake = find_cmake()
    out = CACHE / "build"
    log_path = CACHE / "build.log"
    log(
        f"llama.cpp: building {TARGET} from the llama-cpp-python {VERSION} sdist in {out} "
        f"(one time, takes minutes: ~8 on 2 cores; log: {log_path})"
    )
    t0 = time.perf_counter()
    with open(log_path, "w") as fh:
        for cmd in (
            [cmake, "-S", str(src), "-B", str(out), *cmake_flags()],
            [cmake, "--build", str(out), "--target", TARGET, f"-j{jobs}"],
        ):
            fh.write(f"$ {' '.join(cmd)}\n")
            fh.flush()
            if subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT).returncode != 0:
                tail = log_path.read_text(errors="replace").splitlines()[-5:]
                raise PeerError(f"build failed ({log_path}): " + " | ".join(tail))
    (out / BUILD_STAMP).write_text(" ".join(cmake_flags()))
    if not is_built():
        raise PeerError(f"the build finished but {binary_path()} is missing ({log_path})")
    log(f"llama.cpp: built in {time.perf_counter() - t0:.0f}s")
    return binary_path()


# --- model conversion ---------------------------------------------------------------------------
def write_tokenizer(dst: Path, vocab_size: int) -> None:
    """A minimal Llama-style byte-fallback BPE of exactly `vocab_size` tokens: <unk> <s> </s>
    (ids 0-2, the benchmark model's pad/bos/eos), the 256 byte tokens <0x00>..<0xFF>, then filler
    tokens with no merges. Enough for the converter's LlamaHfVocab path and llama.cpp's SPM vocab."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    if vocab_size < len(vocab):
        raise PeerError(f"vocab_size {vocab_size} is below the {len(vocab)} base tokens")
    for i in range(len(vocab), vocab_size):
        vocab[f"\u2581t{i}"] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.save(str(dst / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
    }
    (dst / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def model_key(hf_dir: Path) -> str:
    """The model's config and weights (the random weights follow from config + seed + torch, so
    the config alone is not quite enough), hashed; names the cache folder of its GGUF files."""
    h = hashlib.sha256((hf_dir / "config.json").read_bytes())
    for weights in sorted(hf_dir.glob("*.safetensors")):
        with open(weights, "rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()[:16]


# The sdist's converter, run with one change: Qwen2 takes the Llama-HF vocab path the minimal
# tokenizer above is written for. Its own path (a GPT-2 BPE) names the pre-tokenizer by hashing a
# real tokenizer's output and refuses one it does not know; the vocab only has to load.
CONVERT_BOOTSTRAP = """
import os, runpy, sys
script = sys.argv[1]
here = os.path.dirname(script)
sys.path[:0] = [here, os.path.join(here, "gguf-py")]
from conversion.qwen import Qwen2Model
Qwen2Model.set_vocab = lambda self: self._set_vocab_llama_hf()
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
"""


def converter_outtypes() -> list[str]:
    """The `--outtype` choices of the sdist's converter (f32 and, in 0.3.36, bf16 among them)."""
    text = (source_dir() / "convert_hf_to_gguf.py").read_text()
    m = re.search(r'"--outtype".*?choices=\[([^\]]*)\]', text, re.S)
    return re.findall(r'"(\w+)"', m.group(1)) if m else ["f32"]


def converter_python() -> str:
    """The interpreter the converter runs under: this one when it has the converter's
    `sentencepiece`, else the vLLM peer's finished virtualenv (torch, transformers, tokenizers and
    sentencepiece are all there; never installed for this)."""
    if importlib.util.find_spec("sentencepiece") is not None:
        return sys.executable
    try:
        from . import vllm_cpu
    except ImportError:  # run as a script: no package around it
        vllm_cpu = None
    if vllm_cpu is not None and vllm_cpu.is_installed(venv := vllm_cpu.bench_venv()):
        return str(vllm_cpu.venv_python(venv))
    raise PeerError(
        "convert_hf_to_gguf.py imports sentencepiece: pip install -e '.[bench]' "
        "(or pip install sentencepiece==0.2.3), or install the vLLM peer's venv"
    )


def convert(hf_dir: str | Path, outtype: str = "f32", log: Log = print) -> Path:
    """`hf_dir` (config.json + safetensors, as `save_pretrained` writes it) as a GGUF of `outtype`,
    converted once per model hash and cached."""
    hf_dir = Path(hf_dir)
    src = fetch_source(log)
    if outtype not in converter_outtypes():
        raise PeerError(f"the converter has no --outtype {outtype}")
    folder = CACHE / "models" / model_key(hf_dir)
    out = folder / f"model-{outtype}.gguf"
    if out.is_file():
        return out
    python = converter_python()
    # The converter's input: the model's files (linked) plus a tokenizer.
    stage = folder / "kvpage-bench"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    for f in hf_dir.iterdir():
        if f.suffix in (".json", ".safetensors") and not f.name.startswith("tokenizer"):
            (stage / f.name).symlink_to(f.resolve())
    write_tokenizer(stage, int(json.loads((hf_dir / "config.json").read_text())["vocab_size"]))
    log(f"llama.cpp: converting the model to {out} ({outtype})")
    tmp = out.with_suffix(".partial")
    cmd = [python, "-c", CONVERT_BOOTSTRAP, str(src / "convert_hf_to_gguf.py"), str(stage)]
    cmd += ["--outfile", str(tmp), "--outtype", outtype]
    try:
        _check(cmd, "convert_hf_to_gguf.py", cwd=src)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    tmp.rename(out)
    return out


# --- running ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class BatchedBenchResult:
    """One row of llama-batched-bench's table plus its setup line. Times in seconds."""

    pp: int  # prompt tokens per sequence
    tg: int  # decode passes (tokens fed) per sequence
    pl: int  # sequences
    n_kv: int
    t_pp: float  # prefill time: all pl * pp prompt tokens
    s_pp: float  # prefill tokens/s
    t_tg: float  # decode time: tg passes of pl tokens
    s_tg: float  # decode tokens/s
    t: float  # t_pp + t_tg
    s: float  # (prompt + decode tokens) / t
    setup: dict[str, int]  # n_kv_max, n_batch, n_ubatch, flash_attn, n_threads, ...
    process_wall: float  # the whole subprocess: model load and warm-up included

    @property
    def output_tok_s(self) -> float:
        """Generated tokens per second over the whole run (prefill + decode)."""
        return self.pl * self.tg / self.t


_ROW = re.compile(
    r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*" + r"\|\s*([\d.]+)\s*" * 6
)
_SETUP = re.compile(r"(\w+) = (-?\d+)")


def parse_output(text: str, process_wall: float = float("nan")) -> list[BatchedBenchResult]:
    setup: dict[str, int] = {}
    rows = []
    for line in text.splitlines():
        if "n_kv_max =" in line:
            setup = {k: int(v) for k, v in _SETUP.findall(line)}
        elif m := _ROW.match(line.strip()):
            ints, floats = m.groups()[:4], m.groups()[4:]
            rows.append(
                BatchedBenchResult(
                    *map(int, ints), *map(float, floats), setup=setup, process_wall=process_wall
                )
            )
    return rows


def context_size(npp: int, ntg: int, npl: int) -> int:
    """KV cells for npl unshared sequences of npp + ntg, rounded up to 256."""
    need = npl * (npp + ntg)
    return -(-need // 256) * 256


def run_batched_bench(
    gguf: str | Path,
    npp: int = 128,
    ntg: int = 64,
    npl: int = 32,
    threads: int = 2,
    ctx: int | None = None,
    batch: int = 2048,
    ubatch: int = 512,
    timeout: float = 1800,
    shared_prompt: bool = False,
) -> BatchedBenchResult:
    """`llama-batched-bench -m GGUF -c CTX -b 2048 -ub 512 -npp 128 -ntg 64 -npl 32 -t 2`, parsed.
    `shared_prompt` adds `-pps`: one prompt of npp tokens, prefilled once and shared by all npl
    sequences (its T_PP then covers npp tokens, not npl * npp)."""
    if not is_built():
        raise PeerError(f"{binary_path()} is not built (python bench/peers/llama_cpp.py build)")
    ctx = ctx or context_size(npp, ntg, npl)
    cmd = [str(binary_path()), "-m", str(gguf), "-c", str(ctx), "-b", str(batch)]
    cmd += ["-ub", str(ubatch), "-npp", str(npp), "-ntg", str(ntg), "-npl", str(npl)]
    cmd += ["-t", str(threads)] + (["-pps"] if shared_prompt else [])
    for _ in range(ROW_TRIES):
        proc, wall = _run_timed(cmd, timeout)
        text = proc.stdout + "\n" + proc.stderr
        rows = parse_output(text, wall)
        if proc.returncode != 0 or rows:
            break
    if proc.returncode != 0 or len(rows) != 1:
        tail = " | ".join(line for line in text.splitlines() if line.strip())
        raise PeerError(f"{TARGET} exit {proc.returncode}, {len(rows)} rows: {tail[-400:]}")
    return rows[0]


# 0.3.36's batched-bench now and then exits 0 without its last table row (its log thread loses
# it; seen on a loaded 2-core machine, most often on Q8_0 GGUFs): such a run is run again. The
# row's times are batched-bench's own, so a rerun changes nothing measured.
ROW_TRIES = 3


def _run_timed(cmd: list[str], timeout: float) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        raise PeerError(f"{TARGET} ran past {timeout:.0f}s") from err
    return proc, time.perf_counter() - t0


def _check(cmd: list[str], what: str, cwd: Path | None = None) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)
    if proc.returncode != 0:
        tail = " | ".join((proc.stdout + proc.stderr).strip().splitlines()[-4:])
        raise PeerError(f"{what} failed (exit {proc.returncode}): {tail[-600:]}")


# --- command line -------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description="llama.cpp peer: build, convert, run batched-bench")
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help=f"build {TARGET} into {CACHE} (minutes, once)")
    b.add_argument("-j", "--jobs", type=int, default=2)
    r = sub.add_parser("run", help="convert an HF model dir (cached) and run batched-bench on it")
    r.add_argument("hf_dir")
    r.add_argument("--outtype", default="f32")
    r.add_argument("--npp", type=int, default=128)
    r.add_argument("--ntg", type=int, default=64)
    r.add_argument("--npl", type=int, default=32)
    r.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    try:
        if args.cmd == "build":
            print(build(args.jobs))
            return
        build()
        res = run_batched_bench(
            convert(args.hf_dir, args.outtype), args.npp, args.ntg, args.npl, args.threads
        )
        print(res)
    except PeerError as err:
        print(f"llama.cpp: FAILED: {err}")
        sys.exit(1)


if __name__ == "__main__":
    main()

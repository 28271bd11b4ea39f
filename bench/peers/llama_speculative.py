"""llama.cpp's speculative decoding as a benchmark peer: `llama-speculative` (a target GGUF with
the same model's Q8_0 GGUF as its draft) and `llama-completion` (the same target, plain greedy
decoding), single stream, on a prompt given as token ids, their output read back as token ids.

The binaries are built in bench/peers/llama_cpp.py's build folder (same sdist, same CMake flags,
so AMX stays off where it faults) beside its `llama-batched-bench`: `python
bench/peers/llama_speculative.py build` (a minute or two once llama.cpp's libraries are built).

Token ids in, token ids out. Both tools take the prompt as text and print text, and the
benchmark's random model has no real tokenizer (bench/peers/llama_cpp.py writes a minimal one
whose filler tokens cannot be reached from text). So the GGUFs that llama_cpp.convert makes are
copied once with an *addressable* vocabulary: every id >= FIRST_CHAR_ID is the one character
chr(CHAR_BASE + id) (a supplementary-plane code point, four UTF-8 bytes), no other change (same
tensors, same specials, byte tokens 3-258 kept, the leading-space prefix off). llama.cpp's SPM
tokenizer then maps such a string to exactly those ids (no two characters form a vocabulary
entry, so nothing merges), and prints each generated id as its character. `check_prompt` runs
`llama-tokenize` once to prove the prompt's ids survive the round trip.

Timings are the tools' own: llama-speculative prints `encoded N tokens in T s` (the prompt through
target and draft) and `decoded N tokens in T s` (the whole generation loop: drafting, verifying,
sampling), plus n_drafted / n_accept; llama-completion prints common_perf_print's `prompt eval
time` and `eval time` (model passes), and its wall from the first to the last token is not
printed, so its decode rate is eval runs / eval time.

No third-party imports at module level (the bench's tests import it); `gguf` is the sdist's
vendored gguf-py, imported only to write the addressable copy.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

try:
    from . import llama_cpp
except ImportError:  # run as a script: no package around it
    import llama_cpp  # type: ignore[no-redef]

PeerError = llama_cpp.PeerError
TARGETS = ("llama-speculative", "llama-completion", "llama-tokenize")
BUILD_STAMP = "kvpage-speculative-flags.txt"  # the flags TARGETS were last built with
# ids 0-2 are the specials, 3-258 the byte tokens <0x00>..<0xFF>; from 259 on, one character each
FIRST_CHAR_ID = 259
CHAR_BASE = 0x20000  # plane 2: every code point from here is a single, non-surrogate character


# --- build --------------------------------------------------------------------------------------
def binary(name: str) -> Path:
    return llama_cpp.CACHE / "build" / "bin" / name


def is_built() -> bool:
    stamp = llama_cpp.CACHE / "build" / BUILD_STAMP
    if not all(binary(t).is_file() for t in TARGETS) or not stamp.is_file():
        return False
    return stamp.read_text() == " ".join(llama_cpp.cmake_flags())


def build(jobs: int = 2, log: llama_cpp.Log = print) -> None:
    """TARGETS in llama_cpp's build folder, configured (and its libraries built) by
    llama_cpp.build first; a no-op when they exist with this CPU's flags."""
    if is_built():
        return
    llama_cpp.build(jobs, log)
    out = llama_cpp.CACHE / "build"
    log_path = llama_cpp.CACHE / "build-speculative.log"
    log(f"llama.cpp: building {', '.join(TARGETS)} in {out} (log: {log_path})")
    cmd = [llama_cpp.find_cmake(), "--build", str(out), "--target", *TARGETS, f"-j{jobs}"]
    with open(log_path, "w") as fh:
        if subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT).returncode != 0:
            tail = log_path.read_text(errors="replace").splitlines()[-5:]
            raise PeerError(f"build failed ({log_path}): " + " | ".join(tail))
    (out / BUILD_STAMP).write_text(" ".join(llama_cpp.cmake_flags()))


# --- the addressable vocabulary -----------------------------------------------------------------
def ids_to_text(ids: list[int]) -> str:
    """The text llama.cpp tokenizes back to `ids` (after its BOS) in an addressable GGUF."""
    low = [i for i in ids if i < FIRST_CHAR_ID]
    if low:
        raise PeerError(f"token ids {low[:5]} are below {FIRST_CHAR_ID}: not addressable as text")
    return "".join(chr(CHAR_BASE + i) for i in ids)


def text_to_ids(text: str) -> list[int]:
    """The ids of a generated text: one id per addressable character; any other character came
    from byte tokens (ids 3-258), one per UTF-8 byte (undecodable bytes arrive as surrogate
    escapes, see run_text)."""
    ids: list[int] = []
    for ch in text:
        code = ord(ch)
        if code >= CHAR_BASE + FIRST_CHAR_ID:
            ids.append(code - CHAR_BASE)
        elif 0xDC80 <= code <= 0xDCFF:  # a lone byte >= 0x80 (surrogateescape)
            ids.append(3 + code - 0xDC00)
        else:
            ids.extend(3 + b for b in ch.encode("utf-8"))
    return ids


def addressable_vocab(tokens: list[str]) -> list[str]:
    """`tokens` (a GGUF's tokenizer.ggml.tokens) with every id from FIRST_CHAR_ID on renamed to
    its character; the specials and byte tokens below it are kept as they are."""
    return tokens[:FIRST_CHAR_ID] + [chr(CHAR_BASE + i) for i in range(FIRST_CHAR_ID, len(tokens))]


def addressable_gguf(gguf_path: Path, log: llama_cpp.Log = print) -> Path:
    """`gguf_path` copied (once) as `<stem>-ids.gguf` beside it with the addressable vocabulary
    and no leading-space prefix; tensors and every other key unchanged."""
    out = gguf_path.with_name(f"{gguf_path.stem}-ids.gguf")
    if out.is_file():
        return out
    sys.path.insert(0, str(llama_cpp.source_dir() / "gguf-py"))
    import gguf  # the sdist's vendored gguf-py (numpy only)

    log(f"llama.cpp: writing {out.name} (token ids addressable as text)")
    reader = gguf.GGUFReader(gguf_path)
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    tmp = out.with_suffix(".partial")
    writer = gguf.GGUFWriter(tmp, arch=arch, endianess=reader.endianess)
    tokens_key, prefix_key = gguf.Keys.Tokenizer.LIST, gguf.Keys.Tokenizer.ADD_PREFIX
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        if field.name == prefix_key:
            continue
        value = field.contents()
        if field.name == tokens_key:
            value = addressable_vocab(value)
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub)
    writer.add_add_space_prefix(False)
    for t in reader.tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    tmp.rename(out)
    return out


def check_prompt(gguf_path: Path, prompt: list[int]) -> None:
    """`prompt` (BOS first) is what llama.cpp makes of its text: llama-tokenize, compared."""
    if not prompt or prompt[0] != 1:
        raise PeerError("the prompt must start with BOS (id 1): llama.cpp adds it to the text")
    cmd = [str(binary("llama-tokenize")), "-m", str(gguf_path), "--ids", "--log-disable"]
    cmd += ["-p", ids_to_text(prompt[1:])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    m = re.search(r"\[([\d,\s]*)\]", proc.stdout)
    got = [int(x) for x in m.group(1).split(",") if x.strip()] if m else None
    if got != prompt:
        shown = "nothing" if got is None else f"{got[:6]}... ({len(got)} ids)"
        raise PeerError(f"llama-tokenize gives {shown}, not the prompt {prompt[:6]}...")


# --- runs ---------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SpeculativeRun:
    """One llama-speculative run: its own timings and counters, the generated ids."""

    n_input: int
    t_encode: float  # s: the prompt through the target and the draft
    n_predict: int  # tokens generated (the loop stops past -n, so a few more than asked)
    t_decode: float  # s: the whole generation loop
    n_draft: int  # --draft-max
    n_drafted: int
    n_accept: int
    tokens: list[int]
    process_wall: float

    @property
    def rounds(self) -> int:
        """Target passes over drafts: every round drafts exactly n_draft tokens (one sequence,
        no tree, no probability cutoff in this example)."""
        return self.n_drafted // self.n_draft if self.n_draft else 0


@dataclass(frozen=True, slots=True)
class PlainRun:
    """One llama-completion run: prompt eval and eval (decode passes) times, generated ids."""

    n_prompt: int
    t_prompt: float  # s
    n_eval: int  # decode passes (the first token comes from the prompt pass)
    t_eval: float  # s
    t_total: float  # s: common_perf_print's total (prompt, decode and sampling; not the load)
    tokens: list[int]
    process_wall: float


_ENCODED = re.compile(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_COUNTER = re.compile(r"\b(n_draft|n_predict|n_drafted|n_accept)\s*=\s*(\d+)")
_PROMPT_EVAL = re.compile(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens")
_EVAL = re.compile(r"(?<!prompt )eval time =\s*([\d.]+) ms /\s*(\d+) runs")
_TOTAL = re.compile(r"total time =\s*([\d.]+) ms")


def parse_speculative(stdout: str, stderr: str, prompt: list[int], wall: float) -> SpeculativeRun:
    enc, dec = _ENCODED.search(stderr), _DECODED.search(stderr)
    counters = {k: int(v) for k, v in _COUNTER.findall(stderr)}
    if not (enc and dec) or len(counters) != 4:
        raise PeerError("llama-speculative printed no timings: " + _tail(stderr))
    tokens = generated(stdout, prompt)
    return SpeculativeRun(
        int(enc.group(1)), float(enc.group(2)), int(dec.group(1)), float(dec.group(2)),
        counters["n_draft"], counters["n_drafted"], counters["n_accept"], tokens, wall,
    )  # fmt: skip


def parse_completion(stdout: str, stderr: str, prompt: list[int], wall: float) -> PlainRun:
    pe, ev, total = _PROMPT_EVAL.search(stderr), _EVAL.search(stderr), _TOTAL.search(stderr)
    if not (pe and ev and total):
        raise PeerError("llama-completion printed no perf lines: " + _tail(stderr))
    t_prompt, n_prompt = float(pe.group(1)) / 1e3, int(pe.group(2))
    t_eval, t_total = float(ev.group(1)) / 1e3, float(total.group(1)) / 1e3
    tokens = generated(stdout, prompt)
    return PlainRun(n_prompt, t_prompt, int(ev.group(2)), t_eval, t_total, tokens, wall)


def generated(stdout: str, prompt: list[int]) -> list[int]:
    """The ids printed after the echoed prompt: both tools print the prompt's text (its BOS as
    "<s>" or not at all) and then every generated token's, and end with a blank line."""
    text = ids_to_text(prompt[1:])
    at = stdout.find(text)
    if at < 0:
        raise PeerError("the output does not echo the prompt: " + _tail(stdout))
    tail = stdout[at + len(text) :]
    return text_to_ids(tail[:-2] if tail.endswith("\n\n") else tail)


def run_speculative(
    target: Path, draft: Path, prompt: list[int], n_predict: int, n_draft: int,
    threads: int = 2, timeout: float = 900,
) -> SpeculativeRun:  # fmt: skip
    """`llama-speculative -m TARGET -md DRAFT --spec-draft-n-max K -n N --temp 0 --ignore-eos -t
    T -td T`: greedy, one sequence (-np 1: no draft tree), both models on `threads` threads;
    K drafts every round (this example has no draft-probability cutoff)."""
    cmd = [str(binary("llama-speculative")), "-m", str(target), "-md", str(draft)]
    cmd += ["--spec-draft-n-max", str(n_draft), "-np", "1"]
    cmd += _common_args(prompt, n_predict, threads) + ["-td", str(threads), "-tbd", str(threads)]
    stdout, stderr, wall = _run(cmd, timeout)
    return parse_speculative(stdout, stderr, prompt, wall)


def run_completion(
    target: Path, prompt: list[int], n_predict: int, threads: int = 2, timeout: float = 900
) -> PlainRun:
    """`llama-completion -m TARGET -n N --temp 0 --ignore-eos -no-cnv -t T`: greedy, plain."""
    cmd = [str(binary("llama-completion")), "-m", str(target), "-no-cnv"]
    cmd += _common_args(prompt, n_predict, threads)
    stdout, stderr, wall = _run(cmd, timeout)
    return parse_completion(stdout, stderr, prompt, wall)


def _common_args(prompt: list[int], n_predict: int, threads: int) -> list[str]:
    ctx = -(-(len(prompt) + n_predict + 64) // 256) * 256  # room for the overshoot of drafts
    args = ["-p", ids_to_text(prompt[1:]), "-n", str(n_predict), "-c", str(ctx)]
    args += ["--temp", "0", "--ignore-eos", "--seed", "0"]
    return args + ["-t", str(threads), "-tb", str(threads)]


def _run(cmd: list[str], timeout: float) -> tuple[str, str, float]:
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as err:
        raise PeerError(f"{Path(cmd[0]).name} ran past {timeout:.0f}s") from err
    wall = time.perf_counter() - t0
    # Byte tokens >= 0x80 print raw, possibly not UTF-8: kept as surrogate escapes.
    stdout = proc.stdout.decode("utf-8", errors="surrogateescape")
    stderr = proc.stderr.decode("utf-8", errors="replace")
    if proc.returncode != 0:
        raise PeerError(f"{Path(cmd[0]).name} exit {proc.returncode}: {_tail(stderr)}")
    return stdout, stderr, wall


def _tail(text: str) -> str:
    return " | ".join(line for line in text.splitlines()[-4:] if line.strip())[-400:]


# --- command line -------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description="llama.cpp speculative peer: build its tools")
    ap.add_argument("cmd", choices=["build"])
    ap.add_argument("-j", "--jobs", type=int, default=2)
    args = ap.parse_args()
    try:
        build(args.jobs)
        print(", ".join(str(binary(t)) for t in TARGETS))
    except PeerError as err:
        print(f"llama.cpp: FAILED: {err}")
        sys.exit(1)


if __name__ == "__main__":
    main()

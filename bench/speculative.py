"""Speculative decoding, single stream: kvpage's int8 self-draft and n-gram prompt lookup against
kvpage's plain decoding and against llama.cpp's `llama-speculative` with the Q8_0 GGUF as its
draft (issue 44's bench item).

    python bench/speculative.py [--rounds 3] [--dtypes fp32,bf16] [--k 4] [--ngram-k 4]
                                [--lookup-min 1] [--lookup-max 4] [--llama-k K] [--threads 2]
                                [--model 125m] [--init-std 0.15] [--seed 0] [--no-llama-cpp]
                                [--quick]

One request of 128 prompt + 256 output tokens (greedy, EOS ignored) on bench/throughput.py's
125m model (seeded random weights, saved as a Hugging Face checkpoint), per dtype:
  kvpage            plain decoding, on both workloads (bench/speculative_workload.py)
  kvpage-draft      speculative_config {"method": "draft_model", "model": None, "quantization":
                    "int8", "num_speculative_tokens": --k}: the target's own int8 copy drafts
  kvpage-ngram      {"method": "ngram", "num_speculative_tokens": --ngram-k, prompt_lookup_min /
                    max}: on the grounded workload, a prompt that holds the model's own greedy
                    continuation of its prefix
  llama.cpp         llama-completion on the f32 / bf16 GGUF, plain greedy
  llama.cpp-draft   llama-speculative, the same target with the Q8_0 GGUF as its draft, --llama-k
                    (default --k) drafts per round (bench/peers/llama_speculative.py)
Every row is a fresh process, alone on the machine, once per round; the rounds interleave every
row, the order rotating each round. Printed: decode and end-to-end tok/s best (median) over the
rounds, the ratios speculative / plain and kvpage / llama.cpp, acceptance (accepted / drafted,
mean accepted length; bench/speculative_table.py), whether each speculative row's tokens equal
its plain row's (a kvpage mismatch is printed loudly and makes the exit status 1), and the load
average before and after (and the 1-minute load after every row). `--quick`: 1 x (32 + 32),
1 round, fp32 unless --dtypes says otherwise (a smoke test).

The random weights decide what speculation can gain here. At the bench model's init std (0.15,
throughput.INIT_STD: wide, so greedy tokens are not near-ties) the model is chaotic: its int8 copy
picks the fp32 model's next token only ~40% of the time (teacher-forced), llama.cpp's Q8_0 copy
about as often, and its greedy output neither repeats its prompt nor itself, so prompt lookup
finds nothing to draft (the grounded lines print both). `--init-std 0.05` (the same shape and
seed) gives ~88% int8 agreement; its llama.cpp rows need a fresh GGUF conversion (the bench
extra's sentencepiece: pip install -e '.[bench]').
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import speculative_table as tbl
import speculative_workload as wlm
import throughput
import torch
import transformers
from peers import llama_cpp, llama_speculative

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
GGUF_TYPE = {"fp32": "f32", "bf16": "bf16"}
DRAFT_GGUF_TYPE = "q8_0"
WORKER = Path(__file__).with_name("speculative_worker.py")


@dataclass(frozen=True, slots=True)
class Engine:
    name: str
    workloads: tuple[str, ...]  # the workload names it runs
    run: Callable[[str, list[wlm.Workload]], dict[str, tbl.Run]]  # (dtype, workloads) -> runs


class EngineFailed(RuntimeError):
    pass


# --- kvpage -------------------------------------------------------------------------------------
def kvpage_worker(model_dir: Path, workdir: Path, args, name: str, config: dict | None):
    """A Runner: bench/speculative_worker.py, a fresh process per call, alone."""

    def run(dtype: str, workloads: list[wlm.Workload]) -> dict[str, tbl.Run]:
        out = run_worker(model_dir, workdir, args, name, DTYPES[dtype], config, workloads)
        return {n: tbl.kvpage_run(r) for n, r in out["workloads"].items()}

    return run


def run_worker(model_dir, workdir, args, name, dtype, config, workloads, gaps=False) -> dict:
    spec = {"model_dir": str(model_dir), "dtype": dtype, "seed": args.seed, "gaps": gaps}
    spec |= {"threads": args.threads, "speculative_config": config}
    spec["workloads"] = [w.as_json() for w in workloads]
    spec_path, out_path = workdir / f"{name}-spec.json", workdir / f"{name}-out.json"
    spec_path.write_text(json.dumps(spec))
    out_path.unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    log = workdir / f"{name}.log"
    with open(log, "w") as fh:
        cmd = [sys.executable, str(WORKER), str(spec_path), str(out_path)]
        proc = subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT)
    if proc.returncode != 0 or not out_path.is_file():
        tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])
        raise EngineFailed(f"exit {proc.returncode}: {tail[-400:]}")
    return json.loads(out_path.read_text())


def kvpage_engines(model_dir: Path, workdir: Path, args) -> list[Engine]:
    draft = {"method": "draft_model", "model": None, "quantization": "int8"}
    draft["num_speculative_tokens"] = args.k
    ngram = {"method": "ngram", "num_speculative_tokens": args.ngram_k}
    ngram |= {"prompt_lookup_min": args.lookup_min, "prompt_lookup_max": args.lookup_max}
    rows = [
        ("kvpage", ("random", "grounded"), None),
        ("kvpage-draft", ("random",), draft),
        ("kvpage-ngram", ("grounded",), ngram),
    ]
    return [Engine(n, w, kvpage_worker(model_dir, workdir, args, n, c)) for n, w, c in rows]


# --- llama.cpp ----------------------------------------------------------------------------------
def llama_cpp_engines(model_dir: Path, args, prompt: list[int]) -> list[Engine]:
    """llama-completion and llama-speculative on the random workload. The build, the GGUFs (and
    their addressable copies) and a tokenizer round trip of the prompt happen here, before any
    round."""
    llama_speculative.build()
    types = [GGUF_TYPE[d] for d in args.dtypes] + [DRAFT_GGUF_TYPE]
    ggufs = {t: llama_speculative.addressable_gguf(llama_cpp.convert(model_dir, t)) for t in types}
    llama_speculative.check_prompt(ggufs[DRAFT_GGUF_TYPE], prompt)
    k = args.llama_k or args.k

    def plain(dtype: str, workloads: list[wlm.Workload]) -> dict[str, tbl.Run]:
        wl = workloads[0]
        r = llama_speculative.run_completion(
            ggufs[GGUF_TYPE[dtype]], wl.prompt, wl.max_tokens, args.threads
        )
        n = len(r.tokens)
        return {wl.name: tbl.Run(n, r.n_eval, r.t_eval, r.t_total, r.tokens)}

    def draft(dtype: str, workloads: list[wlm.Workload]) -> dict[str, tbl.Run]:
        wl = workloads[0]
        target, drafter = ggufs[GGUF_TYPE[dtype]], ggufs[DRAFT_GGUF_TYPE]
        r = llama_speculative.run_speculative(
            target, drafter, wl.prompt, wl.max_tokens, k, args.threads
        )
        run = tbl.Run(
            r.n_predict, r.n_predict - 1, r.t_decode, r.t_encode + r.t_decode, r.tokens,
            r.n_drafted, r.n_accept, r.rounds,
        )  # fmt: skip
        return {wl.name: run}

    return [Engine("llama.cpp", ("random",), plain), Engine("llama.cpp-draft", ("random",), draft)]


def failed_engines(reason: str) -> list[Engine]:
    def run(dtype, workloads):
        raise EngineFailed(reason)

    return [Engine(n, ("random",), run) for n in ("llama.cpp", "llama.cpp-draft")]


# --- the rounds ---------------------------------------------------------------------------------
def make_rows(engines: list[Engine], args) -> dict[tuple[str, str, str], tbl.Row]:
    rows = {}
    for wl in ("random", "grounded"):
        for dtype in args.dtypes:
            for e in engines:
                if wl in e.workloads:
                    rows[(wl, dtype, e.name)] = tbl.Row(wl, dtype, e.name)
    return rows


def run_rounds(engines: list[Engine], workloads: dict[str, wlm.Workload], rows, args) -> None:
    for r in range(args.rounds):
        order = engines[r % len(engines) :] + engines[: r % len(engines)]
        for dtype in args.dtypes:
            for engine in order:
                run_engine(engine, dtype, workloads, rows, r)


def run_engine(engine: Engine, dtype: str, workloads, rows, round_index: int) -> None:
    mine = [rows[(w, dtype, engine.name)] for w in engine.workloads]
    if any(row.error for row in mine):
        return
    t0 = time.perf_counter()
    try:
        runs = engine.run(dtype, [workloads[w] for w in engine.workloads])
    except Exception as err:  # a row that cannot run is reported in the table, not fatal
        for row in mine:
            row.error = f"{type(err).__name__}: {err}"
        print(f"round {round_index + 1} {dtype} {engine.name}: FAILED: {err}", flush=True)
        return
    parts = []
    for row in mine:
        run = runs[row.workload]
        row.runs.append(run)
        acc = "" if run.drafted is None else f", {run.accepted}/{run.drafted} drafts accepted"
        parts.append(f"{row.workload} decode {run.decode_rate:.1f} tok/s{acc}")
    spent, load = time.perf_counter() - t0, os.getloadavg()[0]
    print(
        f"round {round_index + 1} {dtype} {engine.name}: {'; '.join(parts)} "
        f"({spent:.0f}s, load {load:.2f})",
        flush=True,
    )


# --- checks -------------------------------------------------------------------------------------
def mismatch_gaps(rows, workloads, model_dir, workdir, args, n: int) -> list[str]:
    """For each kvpage speculative row whose tokens leave plain kvpage's: plain decoding's own
    top-2 logprob gap at the first differing output (a diagnostic run, untimed, after the
    rounds). A gap of 0 or one bf16 step is a tie the verification pass's multi-row kernels
    may break the other way; a wide gap is not."""
    lines = []
    for (wl, dtype, engine), row in rows.items():
        plain = rows.get((wl, dtype, "kvpage"))
        if engine not in ("kvpage-draft", "kvpage-ngram") or not (row.ok and plain and plain.ok):
            continue
        pos = tbl.first_diff(row.tokens[:n], plain.runs[0].tokens[:n])
        if pos is None:
            continue
        try:
            out = run_worker(
                model_dir, workdir, args, "gaps", DTYPES[dtype], None, [workloads[wl]], True
            )
        except EngineFailed as err:
            lines.append(f"  {dtype} {wl}: no gap diagnosis ({err})")
            continue
        gaps = out["workloads"][wl]["gaps"]
        lines.append(
            f"  {dtype} {wl}: {engine} leaves plain at output {pos}, where plain {dtype}'s top-2 "
            f"logprob gap is {gaps[pos]:.4f} (median over its outputs {statistics.median(gaps):.3f})"
        )
    return lines


def grounding_lines(rows, workloads, continuation: list[int], args) -> list[str]:
    """How grounded the grounded workload turned out: whether plain kvpage repeats C after the
    second P, and the 1-gram lookup bound (bench/speculative_workload.lookup_hits)."""
    lines = []
    grounded = workloads["grounded"]
    for dtype in args.dtypes:
        row = rows.get(("grounded", dtype, "kvpage"))
        if row is None or not row.ok:
            continue
        out = row.tokens
        _, m = wlm.grounded_split(len(grounded.prompt))
        same = tbl.first_diff(out[:m], continuation[:m])
        repeated = m if same is None else same
        hits = wlm.lookup_hits(grounded.prompt, out)
        lines.append(
            f"grounded {dtype}: plain kvpage repeats the prompt's continuation C for its first "
            f"{repeated}/{m} tokens; {hits}/{len(out)} output tokens follow an earlier "
            "occurrence of the token before them (the most any prompt lookup could accept)"
        )
    return lines


# --- main ---------------------------------------------------------------------------------------
def build_model(name: str, init_std: float, out_dir: Path) -> None:
    """bench/throughput.py's model (same seed, same config) with `init_std` as its initializer
    range: at throughput.INIT_STD the very weights of throughput.build_model, so the cached GGUFs
    of the other llama.cpp benches are these."""
    torch.manual_seed(1234)
    cfg = throughput.model_config(name, 1024)
    cfg.initializer_range = init_std
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    model.float().eval().save_pretrained(out_dir)


def load_text() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} CPUs"


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtypes", default=None, help="fp32,bf16 (--quick: fp32)")
    ap.add_argument("--k", type=int, default=4, help="draft model: num_speculative_tokens")
    ap.add_argument("--ngram-k", type=int, default=4, help="ngram: num_speculative_tokens")
    ap.add_argument("--lookup-min", type=int, default=1, help="ngram: prompt_lookup_min")
    ap.add_argument("--lookup-max", type=int, default=4, help="ngram: prompt_lookup_max")
    ap.add_argument("--llama-k", type=int, default=None, help="llama-speculative drafts (--k)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="125m", help="a bench/throughput.py MODELS name")
    ap.add_argument(
        "--init-std", type=float, default=throughput.INIT_STD,
        help="the random weights' std: the bench model's is 0.15 (see the module docstring)",
    )  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-llama-cpp", action="store_true", help="kvpage rows only")
    ap.add_argument("--quick", action="store_true", help="1 x (32 + 32), fp32, 1 round")
    args = ap.parse_args()
    if args.quick:
        args.rounds = 1
    args.dtypes = (args.dtypes or ("fp32" if args.quick else "fp32,bf16")).split(",")
    if set(args.dtypes) - set(DTYPES) or args.rounds < 1:
        raise SystemExit(f"--dtypes from {list(DTYPES)}, --rounds >= 1")
    return args


def main() -> None:
    args = parse_args()
    shape = wlm.QUICK if args.quick else wlm.FULL
    print(f"speculative single stream: 1 x ({shape.prompt} + {shape.output}), model {args.model} "
          f"(init std {args.init_std}), {args.threads} threads, {args.rounds} round(s), "
          f"{load_text()}", flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="kvpage-spec-") as tmp:
        model_dir, workdir = Path(tmp) / "model", Path(tmp)
        build_model(args.model, args.init_std, model_dir)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        workloads, continuation = make_workloads(model_dir, workdir, args, shape, vocab)
        engines = kvpage_engines(model_dir, workdir, args)
        if not args.no_llama_cpp:
            try:
                engines += llama_cpp_engines(model_dir, args, workloads["random"].prompt)
            except Exception as err:  # a peer that cannot run here is reported, not fatal
                print(f"llama.cpp: FAILED: {type(err).__name__}: {err}", flush=True)
                engines += failed_engines(f"{type(err).__name__}: {err}")
        rows = make_rows(engines, args)
        run_rounds(engines, workloads, rows, args)
        gaps = mismatch_gaps(rows, workloads, model_dir, workdir, args, shape.output)
    report(rows, workloads, continuation, args, shape, gaps)


def make_workloads(model_dir, workdir, args, shape, vocab) -> tuple[dict, list[int]]:
    """The random workload, and the grounded one after its untimed first run: plain fp32 kvpage
    continues the prefix P greedily, and that continuation C goes into the prompt."""
    random_wl = wlm.make_random(args.seed, shape, vocab)
    prefix = wlm.grounded_prefix(args.seed, shape, vocab)
    _, m = wlm.grounded_split(shape.prompt)
    first = wlm.Workload("prefix", prefix, m)
    out = run_worker(model_dir, workdir, args, "grounding", "float32", None, [first])
    continuation = out["workloads"]["prefix"]["tokens"]
    grounded = wlm.make_grounded(prefix, continuation, shape)
    print(f"workloads: random = BOS + {shape.prompt - 1} random ids; grounded = P + C[:{m}] + P "
          f"with |P| = {len(prefix)}, C = plain fp32 kvpage's greedy continuation of P", flush=True)  # fmt: skip
    return {"random": random_wl, "grounded": grounded}, continuation


def report(rows, workloads, continuation, args, shape, gaps: list[str]) -> None:
    k = args.llama_k or args.k
    print(
        f"\ndecode tok/s = tokens after the first / time after the first; e2e = output tokens / "
        f"whole request (llama.cpp: its own prompt + generation times); best (median) of "
        f"{args.rounds} round(s); x plain / x llama.cpp: the row's rate over its plain row's / "
        f"llama.cpp's same method's, decode (dec) and e2e, best/best (median/median); accept = accepted / drafted draft tokens, len = mean accepted length "
        f"(tokens per target pass). kvpage-draft: int8 self-draft k={args.k}; kvpage-ngram: "
        f"k={args.ngram_k}, lookup {args.lookup_min}-{args.lookup_max}; llama.cpp-draft: Q8_0 "
        f"draft, k={k}"
    )
    for line in tbl.table(rows, shape.output):
        print(line)
    for line in grounding_lines(rows, workloads, continuation, args):
        print(line)
    lines, ok = tbl.token_checks(rows, shape.output)
    for line in lines + gaps:
        print(line)
    print(f"after: {load_text()}")
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()

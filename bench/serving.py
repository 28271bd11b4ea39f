"""Online serving benchmark, `vllm bench serve`-style: `kvpage serve` against `vllm serve` (CPU)
and `llama-server`, each started alone on loopback, on the same request stream.

    python bench/serving.py [--models 125m] [--servers kvpage,vllm,llama.cpp] [--rates 0.5,1,2]
                            [--requests 100] [--rounds 3] [--dtype float32] [--threads 2]
                            [--max-seqs 32] [--slo-ttft-ms 2000] [--slo-tpot-ms 200]
                            [--vllm-eager] [--seed 0]
    python bench/serving.py --quick     # smoke test: small model, 1 round, 8 requests, one rate

Per round, each server in turn (the order rotates by one each round) is started fresh, alone
(bench/serving_servers.py), warmed up with 8 concurrent requests (untimed), then sent the stream
of every rate, lowest first (bench/serving_workload.py: Poisson arrivals, prompts of 64-1024
token ids, outputs of 16-256 with EOS ignored, 20% opening with a 512-token system prompt), each
request streamed through the `openai` client (bench/serving_client.py), and stopped. The table
(bench/serving_metrics.py): per rate and server, completed requests, request and output
throughput, goodput at the SLO and TTFT / TPOT / ITL / E2E at p50 and p99, each as the best
round (lowest latency, highest rate) and the median round in parentheses, then kvpage's ratios.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.real_servers' helpers

import serving_metrics as sm  # noqa: E402
import serving_servers as ss  # noqa: E402
from peers import llama_cpp, vllm_cpu  # noqa: E402
from serving_client import send_stream  # noqa: E402
from serving_workload import StreamRequest, StreamShape, make_stream, warmup_stream  # noqa: E402

MAX_MODEL_LEN = 2048  # the longest request is 1024 + 256 tokens
SLOT_CTX = 1536  # llama.cpp's context per slot: one request's 1280 tokens fit
GGUF_TYPE = {"float32": "f32", "bfloat16": "bf16"}
Key = tuple[str, float]  # (server, rate)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=None, help="throughput.py MODELS names (default 125m)")
    ap.add_argument("--servers", default=",".join(ss.SERVERS))
    ap.add_argument("--rates", default=None, help="requests/s, comma-separated (0.5,1,2)")
    ap.add_argument("--requests", type=int, default=None, help="per rate (default 100)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3)")
    ap.add_argument("--dtype", default="float32", choices=sorted(GGUF_TYPE))
    ap.add_argument("--threads", type=int, default=2, help="per server")
    ap.add_argument("--max-seqs", type=int, default=32, help="requests per step / slots")
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=200.0)
    ap.add_argument("--vllm-eager", action="store_true", help="vLLM with --enforce-eager")
    ap.add_argument("--request-timeout", type=float, default=900.0, help="seconds per request")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="small model, 1 round, 8 requests")
    args = ap.parse_args(argv)
    args.models = args.models or ("small" if args.quick else "125m")
    args.rates = [float(r) for r in (args.rates or ("2" if args.quick else "0.5,1,2")).split(",")]
    args.requests = args.requests or (8 if args.quick else 100)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.vllm_eager = args.vllm_eager or args.quick  # torch.compile's warm-up costs minutes
    args.servers = args.servers.split(",")
    if unknown := set(args.servers) - set(ss.SERVERS):
        raise SystemExit(f"unknown server(s) {sorted(unknown)}; choose from {list(ss.SERVERS)}")
    return args


# --- one server, one round ----------------------------------------------------------------------
def run_server(
    server: str,
    setup: ss.ServerSetup,
    streams: dict[float, list[StreamRequest]],
    warm: list[StreamRequest],
    tag: str,
    args,
) -> dict[float, sm.RunSummary]:
    """Starts `server`, warms it up, sends every rate's stream; its summary per rate."""
    slo = sm.Slo(args.slo_ttft_ms, args.slo_tpot_ms)
    t0 = time.perf_counter()
    out = {}
    with ss.started(server, setup, tag) as served:
        ready = time.perf_counter() - t0
        records, _ = send_stream(served.url, setup.name, warm, args.request_timeout)
        if bad := [r.error for r in records if not r.ok]:
            raise RuntimeError(f"warm-up: {len(bad)} failed, first: {bad[0]} ({served.log})")
        print(f"  {server}: ready in {ready:.0f} s, warmed up", flush=True)
        for rate, stream in streams.items():
            records, start = send_stream(served.url, setup.name, stream, args.request_timeout)
            summary = sm.summarize(records, start, slo, [len(r.prompt) for r in stream])
            out[rate] = summary
            print(f"  {server} @ {rate:g} req/s: {progress_line(summary, records)}", flush=True)
    return out


def progress_line(s: sm.RunSummary, records: list[sm.RequestRecord]) -> str:
    lat = s.latency_ms
    line = (
        f"{s.completed} ok, {s.failed} failed in {s.duration_s:.1f} s; {s.request_per_s:.2f} "
        f"req/s, {s.output_tok_per_s:.1f} out tok/s, goodput {s.goodput_per_s:.2f}/s; TTFT p50 "
        f"{lat['ttft'][50]:.0f} p99 {lat['ttft'][99]:.0f} ms, TPOT p50 {lat['tpot'][50]:.0f} "
        f"p99 {lat['tpot'][99]:.0f} ms"
    )
    if errors := [r.error for r in records if r.error]:
        line += f"; first error: {errors[0]}"
    if s.prompt_mismatches:
        line += f"; {s.prompt_mismatches} prompts counted at another length by the server"
    return line


# --- the table ----------------------------------------------------------------------------------
MS_FORMAT = {"ttft": "{:.0f}", "tpot": "{:.1f}", "itl": "{:.1f}", "e2e": "{:.0f}"}
COLUMNS = (
    ("req/s", "{:.2f}"),
    ("out tok/s", "{:.1f}"),
    ("goodput/s", "{:.2f}"),
    *((f"{n} p{q}", MS_FORMAT[n]) for n in sm.LATENCIES for q in sm.QUANTILES),
)


def cell(pair: tuple[float, float], fmt: str) -> str:
    best, med = pair
    return "-" if math.isnan(best) else f"{fmt.format(best)} ({fmt.format(med)})"


def table(
    args,
    streams: dict[float, list[StreamRequest]],
    results: dict[Key, list[sm.RunSummary]],
    failures: dict,
) -> None:
    slo = sm.Slo(args.slo_ttft_ms, args.slo_tpot_ms)
    print(
        f"\nbest round (median round) of {args.rounds}; latencies in ms (best = lowest), rates "
        f"per second (best = highest); goodput: requests with {slo}; sustains: rounds with "
        f"every request completed and p99 TTFT <= {slo.ttft_ms:g} ms"
    )
    head = f"{'server':<10} {'ok/sent':>8} {'sustains':>8} "
    head += " ".join(f"{c:>15}" for c, _ in COLUMNS)
    for rate, stream in streams.items():
        offered = len(stream) / stream[-1].arrival_s
        print(f"\n=== rate {rate:g} req/s ({len(stream)} requests; offered {offered:.2f} req/s)")
        print(head)
        print("-" * len(head))
        for server in args.servers:
            runs = results.get((server, rate), [])
            ok = f"{sum(r.completed for r in runs)}/{len(runs) * len(stream)}"
            kept = f"{sum(sm.sustains(r, slo) for r in runs)}/{len(runs)}"
            stats = sm.over_rounds(runs) if runs else {}
            cells = [cell(stats.get(c, (math.nan,) * 2), f) for c, f in COLUMNS]
            print(f"{server:<10} {ok:>8} {kept:>8} " + " ".join(f"{c:>15}" for c in cells))
        print_ratios(args, rate, results)
    for (server, tag), err in failures.items():
        print(f"FAILED: {server} in round {tag}: {err}")


def print_ratios(args, rate: float, results: dict[Key, list[sm.RunSummary]]) -> None:
    mine = results.get(("kvpage", rate))
    for peer in (s for s in args.servers if s != "kvpage"):
        theirs = results.get((peer, rate))
        if not mine or not theirs:
            continue
        a, b = sm.over_rounds(mine), sm.over_rounds(theirs)
        parts = []
        for key in ("req/s", "out tok/s", "ttft p99", "tpot p99"):
            (ab, am), (bb, bm) = a[key], b[key]
            parts.append(f"{key} {ab / bb:.2f}x ({am / bm:.2f}x)")
        print(f"kvpage / {peer}: " + ", ".join(parts))


# --- main ---------------------------------------------------------------------------------------
def prepare(name: str, args, tmp: Path, logs: Path) -> tuple[ss.ServerSetup, int, str | None]:
    """The model's HF folder (+ tokenizer) and GGUF; the setup, the vocabulary and why the GGUF
    could not be made (None when it was or was not needed)."""
    import throughput  # torch and transformers: only the parent's set-up needs them

    model = throughput.build_model(name, MAX_MODEL_LEN, str(tmp / "model"))
    vocab, params = model.config.vocab_size, sum(p.numel() for p in model.parameters())
    print(f"\n=== model {name}: {params / 1e6:.1f}M parameters, vocab {vocab}, {args.dtype}")
    del model  # the parent holds no weights while the servers run
    served = vllm_cpu.stage_model(tmp / "model", tmp / "served")  # + the minimal tokenizer
    gguf, why = None, None
    if "llama.cpp" in args.servers:
        try:
            gguf = llama_cpp.convert(tmp / "model", GGUF_TYPE[args.dtype])
        except llama_cpp.PeerError as err:
            why = str(err)
    setup = ss.ServerSetup(
        hf_dir=served,
        gguf=gguf,
        name=f"bench-{name}",
        dtype=args.dtype,
        threads=args.threads,
        max_seqs=args.max_seqs,
        max_model_len=MAX_MODEL_LEN,
        slot_ctx=SLOT_CTX,
        vllm_eager=args.vllm_eager,
        workdir=logs,
    )
    return setup, vocab, why


def run_model(name: str, args, tmp: Path, logs: Path) -> None:
    setup, vocab, gguf_error = prepare(name, args, tmp, logs)
    shape = StreamShape(requests=args.requests)
    streams = {rate: make_stream(rate, shape, vocab, args.seed) for rate in args.rates}
    warm = warmup_stream(shape, vocab, args.seed)
    results: dict[Key, list[sm.RunSummary]] = {}
    failures: dict[tuple[str, str], str] = {}
    for rnd in range(args.rounds):
        order = args.servers[rnd % len(args.servers) :] + args.servers[: rnd % len(args.servers)]
        print(f"round {rnd + 1}/{args.rounds}: {', '.join(order)}", flush=True)
        for server in order:
            if server == "llama.cpp" and gguf_error:
                failures[(server, "all")] = gguf_error
                continue
            try:
                per_rate = run_server(server, setup, streams, warm, f"r{rnd + 1}", args)
            except Exception as err:  # one server failing leaves the others' numbers
                failures[(server, str(rnd + 1))] = f"{type(err).__name__}: {str(err)[-600:]}"
                print(f"  {server}: FAILED ({type(err).__name__}), see the end", flush=True)
                continue
            for rate, summary in per_rate.items():
                results.setdefault((server, rate), []).append(summary)
    table(args, streams, results, failures)
    print(f"logs: {setup.workdir}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.rounds < 3 and not args.quick:
        print(f"warning: {args.rounds} round(s); use at least 3 for numbers worth quoting")
    print(
        f"serving bench: servers {','.join(args.servers)}, rates {args.rates} req/s, "
        f"{args.requests} requests per rate, {args.rounds} round(s), {args.threads} threads per "
        f"server, {args.max_seqs} sequences per step (llama.cpp: slots), vLLM eager "
        f"{args.vllm_eager}, seed {args.seed}"
    )
    started = time.perf_counter()
    for name in args.models.split(","):
        logs = Path(tempfile.mkdtemp(prefix=f"kvpage-serving-{name}-"))  # kept after the run
        with tempfile.TemporaryDirectory() as tmp:
            run_model(name, args, Path(tmp), logs)
    print(f"\ntotal wall {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()

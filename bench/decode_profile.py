"""Where one batched decode step's time goes: the model's forward (matmuls, attention, norms, the
LM head) against everything else the engine does around it (scheduling, metadata, snapshots and
pins, sampling, observers, outputs).

    python bench/decode_profile.py [--seqs 32] [--prompt 128] [--gen 64] [--steps 12]
                                   [--windows 3] [--threads 2] [--kv-heads 4] [--top 15]
                                   [--dtype float32|bfloat16] [--quantization none|int8]

Builds the 125M Llama of bench/throughput.py (`build_model`, same seed and init) with `--kv-heads`
KV heads, adds `--seqs` requests of `--prompt` random tokens (`--gen` outputs, EOS ignored) to one
kvpage engine and steps it until every sequence decodes. Then `--windows` consecutive windows of
`--steps` decode steps are timed: per step the wall time of `engine.step()`, the model's share
(forward hooks on the model and its LM head: no profiler running; of it, the linear layers'
share, from a timer around every Projection call and every weight GEMV, AMX kernel and packed
oneDNN call the decode plan makes itself; calls made from its one native call are not seen) and
the rest, in ms and as a % (target: non-model <= 10% at batch 32), in wall time and in this process's CPU time (with
`--threads 1` the CPU time is the one to compare across runs on a shared machine: waiting for a
core does not count). Last, one window under cProfile (Python functions by self
time) and one under torch.profiler (operators by self CPU time). Windows follow each other in one
run, so the context grows by `--steps` tokens from one to the next.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import statistics
import tempfile
import time

import torch
import transformers
from throughput import BLOCK_SIZE, FIRST_TOKEN_ID, MODELS, build_model

from kvpage import LLM, SamplingParams
from kvpage.model.native_amx import AmxLinear
from kvpage.model.native_gemv import WeightGemv
from kvpage.model.projection import Projection

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}  # cpu: this process, all threads


class ModelClock:
    """Wall and CPU time spent inside the model (forward + LM head), from module hooks, and the
    part of it in the linear layers (every Projection call: the matmul kernels and their Python)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.total = dict.fromkeys(CLOCKS, 0.0)
        self.linear = dict.fromkeys(CLOCKS, 0.0)
        self._start = dict.fromkeys(CLOCKS, 0.0)
        self._time_projections()
        model.register_forward_pre_hook(self._enter)
        model.register_forward_hook(self._leave)
        # The LM head is not a module call (a fused, prepacked Projection): time compute_logits.
        compute_logits = model.compute_logits

        def timed_logits(hidden: torch.Tensor) -> torch.Tensor:
            self._enter()
            try:
                return compute_logits(hidden)
            finally:
                self._leave()

        model.compute_logits = timed_logits

    def _time_projections(self) -> None:
        # Projection calls, and the weight GEMV and oneDNN's packed matmul called directly
        # (as a decode tape replays them): only the outermost is timed.
        clocks = list(CLOCKS.items())
        depth = [0]

        def timing(call):
            def timed(owner, x, *args, **kwargs):
                depth[0] += 1
                start = [clock() for _, clock in clocks] if depth[0] == 1 else None
                try:
                    return call(owner, x, *args, **kwargs)
                finally:
                    depth[0] -= 1
                    if start is not None:
                        for (name, clock), t0 in zip(clocks, start, strict=True):
                            self.linear[name] += clock() - t0

            return timed

        Projection.__call__ = timing(Projection.__call__)
        Projection.packed_unchecked = timing(Projection.packed_unchecked)
        for kernel in (WeightGemv, AmxLinear):
            kernel.__call__ = timing(kernel.__call__)
            kernel.run_unchecked = timing(kernel.run_unchecked)

    def _enter(self, *_) -> None:
        self._start = {name: clock() for name, clock in CLOCKS.items()}

    def _leave(self, *_) -> None:
        for name, clock in CLOCKS.items():
            self.total[name] += clock() - self._start[name]


def make_engine(model_dir: str, args) -> LLM:
    blocks = args.seqs * -(-(args.prompt + args.gen) // BLOCK_SIZE)
    llm = LLM(
        model_dir,
        block_size=BLOCK_SIZE,
        num_blocks=blocks,
        max_num_seqs=args.seqs,
        max_num_batched_tokens=2048,
        dtype=args.dtype,
        quantization=args.quantization,
        device="cpu",
        seed=0,
    )
    return llm  # LLM turns per-token progress outputs off, as generate() wants


def start_decoding(llm: LLM, args) -> None:
    """Add every request and step until each has its first token (the next step is all decode)."""
    rng = random.Random(0)
    vocab = llm.engine.model.config.vocab_size
    params = SamplingParams(max_tokens=args.gen, ignore_eos=True)
    for i in range(args.seqs):
        prompt = [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(args.prompt)]
        llm.engine.add_request(f"r{i}", prompt, params)
    while any(not seq.output_ids for seq in llm.engine.seqs.values()):
        llm.engine.step()
    for _ in range(2):  # warm the decode path (workspace buffers, allocator)
        llm.engine.step()


def timed_window(llm: LLM, clock: ModelClock, steps: int) -> dict[str, list[tuple]]:
    """Per clock, (total s, model s, linear layers s) of each decode step."""
    out: dict[str, list[tuple]] = {name: [] for name in CLOCKS}
    for _ in range(steps):
        clock.total = dict.fromkeys(CLOCKS, 0.0)
        clock.linear = dict.fromkeys(CLOCKS, 0.0)
        start = {name: c() for name, c in CLOCKS.items()}
        llm.engine.step()
        for name, c in CLOCKS.items():
            out[name].append((c() - start[name], clock.total[name], clock.linear[name]))
    return out


def print_window(index: int, rows: dict[str, list[tuple]], batch: int) -> None:
    print(f"\nwindow {index}: batch {batch}; wall | process CPU time")
    head = f"{'total ms':>9} {'model ms':>9} {'other ms':>9} {'other %':>8}"
    print(f"{'step':>4} {head} | {head}")
    for i, steps in enumerate(zip(*rows.values(), strict=True)):
        cells = [
            f"{t * 1e3:>9.2f} {m * 1e3:>9.2f} {(t - m) * 1e3:>9.2f} {100 * (t - m) / t:>7.1f}%"
            for t, m, _ in steps
        ]
        print(f"{i:>4} " + " | ".join(cells))


def summarise(name: str, windows: list[list[tuple]]) -> None:
    """Per window the median step; across windows the min and median of those."""
    med = [
        (statistics.median(t for t, _, _ in w), statistics.median(t - m for t, m, _ in w))
        for w in windows
    ]
    linear = [statistics.median(lin for _, _, lin in w) for w in windows]
    totals = [t for t, _ in med]
    others = [o for _, o in med]
    shares = [100 * o / t for t, o in med]
    print(f"\n{name} per decode step, median of each window -> min / median over windows")
    print(f"  total    {min(totals) * 1e3:8.2f} / {statistics.median(totals) * 1e3:8.2f} ms")
    model = [t - o for t, o in med]
    print(f"  model    {min(model) * 1e3:8.2f} / {statistics.median(model) * 1e3:8.2f} ms")
    print(
        f"   linears {min(linear) * 1e3:8.2f} / {statistics.median(linear) * 1e3:8.2f} ms  "
        "(the model's Projection calls, the LM head's included)"
    )
    print(f"  other    {min(others) * 1e3:8.2f} / {statistics.median(others) * 1e3:8.2f} ms")
    print(f"  other %  {min(shares):8.1f} / {statistics.median(shares):8.1f} %  (target <= 10%)")
    fastest = min((step for w in windows for step in w), key=lambda step: step[0])
    total, model, _ = fastest
    print(
        f"fastest step: total {total * 1e3:.2f} ms, model {model * 1e3:.2f} ms, other "
        f"{(total - model) * 1e3:.2f} ms ({100 * (total - model) / total:.1f}%): on a shared "
        "machine the least disturbed step"
    )


def profile_window(llm: LLM, steps: int, top: int) -> None:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        llm.engine.step()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    print(f"\n[cProfile] {steps} decode steps, top {top} by self time")
    print("\n".join(line for line in buf.getvalue().splitlines() if line.strip()))
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf).sort_stats("cumulative")
    stats.print_stats(r"kvpage/(engine|cache|verify)/", top)
    print(f"\n[cProfile] the engine's own functions, top {top} by cumulative time")
    print("\n".join(line for line in buf.getvalue().splitlines() if line.strip())[-8000:])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tp:
        for _ in range(steps):
            llm.engine.step()
    print(f"\n[torch.profiler] {steps} decode steps, top {top} operators by self CPU time")
    print(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--steps", type=int, default=12, help="decode steps per window")
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--quantization", default="none", choices=("none", "int8"))
    ap.add_argument("--no-profile", action="store_true", help="skip cProfile / torch.profiler")
    args = ap.parse_args()
    needed = 2 + args.steps * (args.windows + (0 if args.no_profile else 1))
    if needed > args.gen - 1:
        ap.error(f"--gen {args.gen} leaves too few decode steps for {needed}")
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    name = f"125m-kv{args.kv_heads}"
    MODELS.setdefault(name, {**MODELS["120m"], "num_key_value_heads": args.kv_heads})
    print(
        f"torch {torch.__version__}, {args.threads} threads, {args.dtype}, weights "
        f"{args.quantization}, model {name} "
        f"(d768, 12 layers, 12 heads / {args.kv_heads} kv heads, vocab 32000), "
        f"{args.seqs} seqs x ({args.prompt} prompt + {args.gen} generated), block {BLOCK_SIZE}"
    )
    with tempfile.TemporaryDirectory() as tmpdir:
        build_model(name, 1024, tmpdir)
        llm = make_engine(tmpdir, args)
    clock = ModelClock(llm.engine.model)
    start_decoding(llm, args)
    windows = []
    for w in range(args.windows):
        windows.append(timed_window(llm, clock, args.steps))
        print_window(w, windows[-1], args.seqs)
    for name in CLOCKS:
        summarise(name, [w[name] for w in windows])
    if not args.no_profile:
        profile_window(llm, args.steps // 2, args.top)


if __name__ == "__main__":
    main()

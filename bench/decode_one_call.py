"""The decode plan's layer calls from one native call (kvpage/model/native_decode_step.py) against
its Python loop of ~10 ctypes calls a layer, in one process, round by round:

    python bench/decode_one_call.py [--seqs 1] [--rounds 5] [--steps 20] [--threads 2]
                                    [--dtypes float32,bfloat16] [--quantization none|int8]

Two engines over the same 125M Llama of throughput.py (`build_model`), one per path, the same
`--seqs` requests of 128 random tokens. After both reach steady decode, each round times
`--steps` engine steps of one, then of the other (which goes first alternates). Prints per dtype
the ms per step of each path (min and median over rounds of each round's median step) and the
loop/one-call ratio, then checks that both engines generated the same tokens: the one call makes
the loop's calls with the loop's arguments, so the outputs are equal bit for bit."""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

import torch
import transformers
from throughput import BLOCK_SIZE, FIRST_TOKEN_ID, MODELS, build_model

from kvpage import LLM, SamplingParams

PROMPT = 128


def engine(model_dir: str, args, dtype: str, one_call: bool) -> LLM:
    gen = 8 + args.rounds * args.steps
    llm = LLM(
        model_dir,
        block_size=BLOCK_SIZE,
        num_blocks=args.seqs * -(-(PROMPT + gen) // BLOCK_SIZE),
        max_num_seqs=args.seqs,
        dtype=dtype,
        quantization=args.quantization,
        device="cpu",
        seed=0,
    )
    plan = llm.engine.model.decode_plan()
    if plan is None:
        raise SystemExit("this model builds no decode plan")
    plan.one_call = one_call
    rng = random.Random(0)
    vocab = llm.engine.model.config.vocab_size
    params = SamplingParams(max_tokens=gen, ignore_eos=True)
    for i in range(args.seqs):
        prompt = [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(PROMPT)]
        llm.engine.add_request(f"r{i}", prompt, params)
    while any(not seq.output_ids for seq in llm.engine.seqs.values()):
        llm.engine.step()
    for _ in range(3):  # warm the decode path (buffers, the one-call step's structs)
        llm.engine.step()
    return llm


def timed_steps(llm: LLM, steps: int) -> float:
    """The median wall time of `steps` engine steps, in ms."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        llm.engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def tokens(llm: LLM) -> list[list[int]]:
    return [list(seq.output_ids) for _, seq in sorted(llm.engine.seqs.items())]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--quantization", default="none", choices=["none", "int8"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    name = "125m-kv4"
    MODELS.setdefault(name, {**MODELS["120m"], "num_key_value_heads": 4})
    print(
        f"torch {torch.__version__}, {args.threads} threads, model {name}, weights "
        f"{args.quantization}, {args.seqs} seqs x {PROMPT} prompt tokens, {args.rounds} rounds "
        f"x {args.steps} decode steps per path"
    )
    with tempfile.TemporaryDirectory() as tmpdir:
        build_model(name, 1024, tmpdir)
        for dtype in args.dtypes.split(","):
            paths = {"one call": engine(tmpdir, args, dtype, True)}
            paths["loop"] = engine(tmpdir, args, dtype, False)
            ms: dict[str, list[float]] = {path: [] for path in paths}
            for r in range(args.rounds):
                for path in list(paths)[:: 1 if r % 2 == 0 else -1]:
                    ms[path].append(timed_steps(paths[path], args.steps))
            for path, rows in ms.items():
                print(
                    f"{dtype:>9} {path:>9}: {min(rows):6.2f} ms per step "
                    f"(median {statistics.median(rows):6.2f})"
                )
            ratio = min(ms["loop"]) / min(ms["one call"])
            med = statistics.median(ms["loop"]) / statistics.median(ms["one call"])
            same = tokens(paths["one call"]) == tokens(paths["loop"])
            print(f"{dtype:>9} loop / one call: {ratio:.3f}x (median {med:.3f}x)", end="")
            print(f"; tokens equal: {same}")
            for llm in paths.values():
                llm.close()
            if not same:
                raise SystemExit(f"{dtype}: the two paths generated different tokens")


if __name__ == "__main__":
    main()

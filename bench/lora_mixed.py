"""A mixed-adapter batch against base-only, one process: the cost of serving LoRA adapters.

    python bench/lora_mixed.py [--model 125m] [--dtype float32] [--requests 32] [--adapters 4]
                               [--rank 16] [--prompt 64] [--output 32] [--rounds 3] [--threads 2]

The model is bench/int8_weights.py's (bench/throughput.py's 125m shape, seeded weights). The
adapters are random (kvpage.verify.lora_adapters), rank `--rank` on all seven projections. Each
round runs, interleaved: `--requests` requests on the base model with adapters off, the same
requests with adapters on but none used, and the same requests spread over the base and
`--adapters` adapters (request i uses adapter i mod (adapters + 1), 0 = base). Reported: decode
ms per step (min / median over every step of every round), throughput, the overhead against
base-only, and whether each request's tokens equal the reference's for its adapter (the
reference merges the adapter into the weights in its own code).
CPU contention skews everything: run it on an otherwise idle machine."""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from int8_weights import SHAPES, build

from kvpage import LLMEngine, LoRARequest, SamplingParams
from kvpage.config import EngineConfig
from kvpage.lora.adapter import load_peft_adapter
from kvpage.reference.generator import generate
from kvpage.reference.lora_merge import merged_model
from kvpage.verify.lora_adapters import AdapterFiles, LoraSpec

MODES = ("base-only", "lora-on-unused", "mixed")


def run(model, adapters, args, mode: str, prompts) -> tuple[list[float], dict[str, list[int]]]:
    config = EngineConfig(
        model=f"bench:{args.model}",
        dtype=args.dtype,
        num_blocks=args.requests * -(-(args.prompt + args.output) // 16) + 4,
        max_num_seqs=args.requests,
        max_num_batched_tokens=max(2048, args.requests * args.prompt),
        enable_lora=mode != "base-only",
        max_loras=max(1, len(adapters)),
        max_lora_rank=args.rank,
    )
    engine = LLMEngine(config, model)
    for adapter in adapters if engine.lora_slots is not None else ():
        engine.lora_slots.register(adapter)
    params = SamplingParams(max_tokens=args.output, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        pick = i % (len(adapters) + 1)
        lora = None
        if mode == "mixed" and pick:
            lora = LoRARequest(adapters[pick - 1].name, adapters[pick - 1].path)
        engine.add_request(str(i), prompt, params, lora_request=lora)
    engine.step()  # every prompt prefilled at once: the budget holds them all
    times, tokens = [], {}
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - start)
        tokens.update({o.request_id: o.outputs[0].token_ids for o in outs if o.finished})
    return times, tokens


def agreement(model, adapters, prompts, tokens, args) -> str:
    """Requests whose tokens equal the reference's for their adapter (mixed mode)."""
    merged = [model] + [merged_model(model, a.path) for a in adapters]
    params = SamplingParams(max_tokens=args.output, ignore_eos=True)
    same = 0
    for i, prompt in enumerate(prompts):
        ref = generate(merged[i % len(merged)], prompt, params).token_ids
        same += ref == tokens[str(i)]
    return f"{same}/{len(prompts)}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=tuple(SHAPES), default="125m")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--output", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = build(args.model, args.dtype, "none")
    specs = [
        LoraSpec(f"a{i}", seed=900 + i, rank=args.rank, alpha=2.0 * args.rank)
        for i in range(args.adapters)
    ]
    files = AdapterFiles(model.config)  # PEFT directories, for the reference to read
    written = [files(s) for s in specs]
    adapters = [
        load_peft_adapter(s.name, w.path, model.config, s.rank)
        for s, w in zip(specs, written, strict=True)
    ]
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, 32000) for _ in range(args.prompt)] for _ in range(args.requests)]
    times = {m: [] for m in MODES}
    tokens = {}
    for _ in range(max(1, args.rounds)):
        for mode in MODES:  # interleaved round by round
            ts, tokens[mode] = run(model, adapters, args, mode, prompts)
            times[mode] += ts
    print(f"\n{args.model} {args.dtype}, {args.requests} requests ({args.adapters} adapters of "
          f"rank {args.rank} + base), {args.threads} threads, {args.rounds} rounds")  # fmt: skip
    base_min, base_med = min(times["base-only"]), statistics.median(times["base-only"])
    print(
        f"{'mode':>16} {'min ms':>8} {'median ms':>10} {'tok/s':>8} {'overhead min':>13} {'med':>6}"
    )
    for mode in MODES:
        ts = times[mode]
        med = statistics.median(ts)
        print(
            f"{mode:>16} {min(ts) * 1e3:8.2f} {med * 1e3:10.2f} {args.requests / med:8.1f} "
            f"{min(ts) / base_min - 1:12.1%} {med / base_med - 1:6.1%}"
        )
    same_base = sum(
        tokens["base-only"][k] == tokens["lora-on-unused"][k] for k in tokens["base-only"]
    )
    print(f"adapters on, unused: tokens equal to base-only on {same_base}/{args.requests}")
    print(f"mixed: tokens equal to the per-adapter reference on "
          f"{agreement(model, adapters, prompts, tokens['mixed'], args)}")  # fmt: skip


if __name__ == "__main__":
    main()

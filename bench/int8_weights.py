"""Int8 weights against unquantized weights: decode speed on the 125M bench model, one process:

    python bench/int8_weights.py [--model 125m] [--dtype float32] [--batch 16] [--prompt 32]
                                 [--output 32] [--rounds 5] [--threads 2] [--seed 0]

The model is bench/throughput.py's `--models 120m` / `125m` shape (12 layers, d=768, ffn 2048,
vocab 32000; 125m: 12 heads / 4 KV heads), built in kvpage with seeded weights (no checkpoint,
no transformers). Two workloads, each timed per decode step after its prefill step (so only
decode is measured): batch 1 (one request) and batched (`--batch` requests decoding together).
Every round runs none then int8 for both workloads, so machine-load drift hits each alike; per
weights: ms per decode step (min / median over every step of every round), decode tokens/s
from the median, and int8's ratio to none. The weight bytes of the linear layers are printed
too: what the int8 kernel reads instead of float32.
CPU contention skews everything: run it on an otherwise idle machine."""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from kvpage import LLMEngine, SamplingParams
from kvpage.config import EngineConfig, ModelConfig, RopeConfig
from kvpage.model import build_model, init_seeded_, quantize_model_, resolve_dtype
from kvpage.model.int8 import Int8Linear

SHAPES = {  # bench/throughput.py's MODELS
    "120m": dict(num_kv_heads=12),
    "125m": dict(num_kv_heads=4),
}
WEIGHTS = ("none", "int8")


def model_config(name: str) -> ModelConfig:
    return ModelConfig(
        model_type="llama",
        vocab_size=32000,
        hidden_size=768,
        num_layers=12,
        num_heads=12,
        head_dim=64,
        intermediate_size=2048,
        max_position_embeddings=2048,
        norm_eps=1e-6,
        rope=RopeConfig(theta=10000.0),
        revision=f"bench:{name}",
        **SHAPES[name],
    )


def build(name: str, dtype: str, quantization: str):
    model = build_model(model_config(name))
    init_seeded_(model)
    model = model.to(resolve_dtype(dtype)).eval()
    return quantize_model_(model, quantization)


def linear_bytes(model) -> int:
    total = 0
    for name, m in model.named_modules():
        if isinstance(m, Int8Linear):
            total += m.weight_int8.numel() + m.scales.numel() * m.scales.element_size()
        elif isinstance(m, torch.nn.Linear) and name != "lm_head":
            total += m.weight.numel() * m.weight.element_size()
    return total


def decode_steps(model, args, quantization: str, batch: int, rng: random.Random) -> list[float]:
    """Seconds of each decode step of `batch` requests (the prefill step not counted)."""
    config = EngineConfig(
        model=f"bench:{args.model}",
        dtype=args.dtype,
        quantization=quantization,
        num_blocks=batch * -(-(args.prompt + args.output) // 16) + 4,
        max_num_seqs=max(batch, 1),
        max_num_batched_tokens=max(2048, batch * args.prompt),
    )
    engine = LLMEngine(config, model)
    params = SamplingParams(max_tokens=args.output, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), [rng.randrange(3, 32000) for _ in range(args.prompt)], params)
    engine.step()  # every prompt prefilled at once: the budget holds them all
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    engine.shutdown()
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=tuple(SHAPES), default="125m")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--output", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    models = {q: build(args.model, args.dtype, q) for q in WEIGHTS}
    for q, m in models.items():
        print(f"{q:>5}: linear-layer weights {linear_bytes(m) / 2**20:.1f} MiB")
    rng = random.Random(args.seed)
    times = {(q, b): [] for q in WEIGHTS for b in (1, args.batch)}
    for _ in range(max(1, args.rounds)):
        for q in WEIGHTS:  # interleaved: none, int8, none, int8, ...
            for b in (1, args.batch):
                times[(q, b)] += decode_steps(models[q], args, q, b, rng)
    report(times, args)


def report(times: dict, args) -> None:
    print(f"\n{args.model} {args.dtype}, {args.threads} threads, {args.rounds} rounds")
    print("ratio: none's time / int8's (> 1: int8 decodes faster), from the min and the median")
    head = f"{'workload':>10} {'weights':>7} {'min ms':>8} {'median ms':>10} {'tok/s':>8}"
    print(f"{head} {'ratio min':>9} {'ratio med':>9}")
    for b in (1, args.batch):
        base = times[("none", b)]
        for q in WEIGHTS:
            ts = times[(q, b)]
            med = statistics.median(ts)
            label = "batch 1" if b == 1 else f"batch {b}"
            print(
                f"{label:>10} {q:>7} {min(ts) * 1e3:8.2f} {med * 1e3:10.2f} {b / med:8.1f} "
                f"{min(base) / min(ts):9.2f} {statistics.median(base) / med:9.2f}"
            )


if __name__ == "__main__":
    main()

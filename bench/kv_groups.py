"""KV blocks held per request, sliding-window freeing on against one global table.

    python bench/kv_groups.py [--context 4096] [--window 512] [--layers 6] [--pattern 6]
                              [--requests 2] [--output 32] [--block 16]

A Gemma-3-shaped text model (random weights, built with transformers into a temp dir; 5 local :
1 global layers for the default pattern 6, Gemma 3 1B's window of 512) runs `--requests`
requests of `--context` tokens (prompt + output) twice: with per-layer-group KV (window groups
give back the blocks their window left, kvpage.cache.groups) and with one table for every layer
(`kv_layer_groups=False`). Held KV is counted in layer-blocks (one block of one layer: a page
of `rows` layers counts `rows`), so the two runs are in the same unit of memory; reported per
request at its last step (the steady state) and at the peak over every step, and the ratio
single / grouped. The tokens of both runs are compared (they must be equal).

Then the same for a Mistral-shaped model (`--layers` layers, every one windowed by `--window`):
one window group 0 that gives back what its window left, against the same plain table."""

from __future__ import annotations

import argparse
import random
import tempfile

import torch
import transformers

from kvpage import LLMEngine, SamplingParams
from kvpage.config import EngineConfig
from kvpage.model import load_model


def build(directory: str, args) -> None:
    n = args.layers
    kinds = [
        "full_attention" if (i + 1) % args.pattern == 0 else "sliding_attention" for i in range(n)
    ]
    cfg = transformers.Gemma3TextConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=n,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        query_pre_attn_scalar=32,
        sliding_window=args.window,
        layer_types=kinds,
        max_position_embeddings=args.context + 64,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    transformers.Gemma3ForCausalLM(cfg).save_pretrained(directory)


def build_mistral(directory: str, args) -> None:
    cfg = transformers.MistralConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=1,
        sliding_window=args.window,
        max_position_embeddings=args.context + 64,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    transformers.MistralForCausalLM(cfg).save_pretrained(directory)


def run(directory: str, model, args, grouped: bool) -> tuple[dict[str, list[int]], dict]:
    config = EngineConfig(
        model=directory,
        block_size=args.block,
        max_num_seqs=args.requests,
        max_model_len=args.context + 8,
        kv_layer_groups=grouped,
    )
    engine = LLMEngine(config, model)
    rows = engine.kv_layout.rows
    rng = random.Random(1)
    params = SamplingParams(max_tokens=args.output, ignore_eos=True)
    for i in range(args.requests):
        prompt = [rng.randrange(3, 512) for _ in range(args.context - args.output)]
        engine.add_request(str(i), prompt, params)
    last: dict[str, int] = {}
    peak: dict[str, int] = {}
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        held = {rid: seq.table.num_held() * rows for rid, seq in engine.seqs.items()}
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
        for rid, n in held.items():
            last[rid] = n
            peak[rid] = max(peak.get(rid, 0), n)
    per = args.requests
    return tokens, {
        "last": sum(last.values()) / per,
        "peak": sum(peak.values()) / per,
        "groups": engine.kv_layout.num_groups,
        "rows": rows,
        "window_frees": engine.cache.stats.window_frees,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--pattern", type=int, default=6)
    p.add_argument("--requests", type=int, default=2)
    p.add_argument("--output", type=int, default=32)
    p.add_argument("--block", type=int, default=16)
    args = p.parse_args()
    local = args.layers - args.layers // args.pattern
    shapes = (
        (build, f"gemma3-shaped: {args.layers} layers ({local} local : {args.layers - local} "),
        (build_mistral, f"mistral-shaped: {args.layers} layers (all windowed, 0 "),
    )
    for make, title in shapes:
        print(
            f"{title}global), window {args.window}, context {args.context}, "
            f"block {args.block}, {args.requests} requests"
        )
        report(make, args)


def report(make, args) -> None:
    with tempfile.TemporaryDirectory() as directory:
        make(directory, args)
        model = load_model(directory)[0]
        tok_on, on = run(directory, model, args, grouped=True)
        tok_off, off = run(directory, model, args, grouped=False)
    for name, r in (("window freeing", on), ("one global table", off)):
        print(
            f"  {name:17s} layer-blocks held per request: last step {r['last']:.0f}, "
            f"peak {r['peak']:.0f}  ({r['groups']} groups, {r['rows']} layers/page, "
            f"{r['window_frees']} window frees)"
        )
    print(
        f"  ratio single / grouped: last step {off['last'] / on['last']:.2f}x, "
        f"peak {off['peak'] / on['peak']:.2f}x; tokens equal: {tok_on == tok_off}"
    )


if __name__ == "__main__":
    main()

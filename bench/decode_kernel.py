"""The paged decode kernel against the torch path it replaces, one layer's decode attention at a
time, interleaved round by round in one process:

    python bench/decode_kernel.py [--seqs 32] [--heads 12] [--kv-heads 4] [--head-dim 64]
                                  [--context 150,220] [--threads 1] [--rounds 5] [--layers 12]
                                  [--dtype float32|bfloat16]

kernel: `PagedDecode` reading K/V where they lie in a shuffled `KVStorage` pool. torch: what a
step runs without it -- `KVStorage.gather_blocks` into a padded (S, KVH, C, D) copy, then
`decode_attention` (SDPA in float32, grouped matmuls in 16-bit). Both are timed over `--layers`
calls (one step of a model with that many layers); prints min and median ms per step and the
torch/kernel ratio, plus the largest difference between the two outputs."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvpage.kv.format import kv_format
from kvpage.kv.storage import KVStorage
from kvpage.model.decode_attention import decode_attention
from kvpage.model.native_attention import PagedDecode

BLOCK = 16


def build(args):
    """A one-layer pool of random K/V, shuffled block tables, contexts and queries."""
    g = torch.Generator().manual_seed(0)
    low, high = map(int, args.context.split(","))
    lens = torch.randint(low, high + 1, (args.seqs,), generator=g)
    max_blocks = -(-high // BLOCK)
    num_blocks = args.seqs * max_blocks + 8
    dtype = getattr(torch, args.dtype)
    storage = KVStorage(
        1, num_blocks, BLOCK, args.kv_heads, args.head_dim, kv_format("auto", dtype), "cpu"
    )
    storage.data.copy_(torch.randn(storage.data.shape, generator=g))
    tables = torch.randperm(num_blocks, generator=g)[: args.seqs * max_blocks]
    tables = tables.view(args.seqs, max_blocks)
    q = torch.randn(args.seqs, args.heads, args.head_dim, generator=g).to(dtype)
    return q, storage, tables, lens


def torch_path(q, storage: KVStorage, tables, lens, scale):
    """What a decode step runs without the kernel: the engine's block gather, then attention."""
    k, v = storage.gather_blocks(0, tables)  # (S, KVH, C, D)
    mask = (torch.arange(k.shape[2])[None, :] < lens[:, None]).view(len(lens), 1, 1, -1)
    return decode_attention(q, k, v, mask, scale)


def timed(fn, layers: int) -> float:
    t0 = time.perf_counter()
    for _ in range(layers):
        fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--context", default="150,220", help="context lengths drawn from low,high")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    q, storage, tables, lens = build(args)
    scale = args.head_dim**-0.5
    kernel = PagedDecode(tables, lens, storage.num_blocks, BLOCK)
    k_pool, v_pool = storage.layer_pools(0)
    runs = {
        "kernel": lambda: kernel(q, k_pool, v_pool, scale),
        "torch": lambda: torch_path(q, storage, tables, lens, scale),
    }
    diff = (runs["kernel"]().float() - runs["torch"]().float()).abs().max().item()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):  # interleaved: machine noise hits both alike
        for name, fn in runs.items():
            times[name].append(timed(fn, args.layers) * 1e3)
    print(
        f"torch {torch.__version__}, {args.threads} threads, {args.dtype}, {args.seqs} seqs, "
        f"{args.heads} heads / {args.kv_heads} KV heads, head_dim {args.head_dim}, contexts "
        f"{args.context}, {args.layers} layers per step, {args.rounds} rounds; max |kernel - "
        f"torch| = {diff:.2e}"
    )
    for name, ts in times.items():
        print(f"  {name:<7} ms per step: min {min(ts):7.2f}  median {statistics.median(ts):7.2f}")
    k_min, t_min = min(times["kernel"]), min(times["torch"])
    k_med, t_med = statistics.median(times["kernel"]), statistics.median(times["torch"])
    print(f"  torch / kernel: {t_min / k_min:.2f}x (min), {t_med / k_med:.2f}x (median)")


if __name__ == "__main__":
    main()

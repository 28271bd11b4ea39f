"""The physical limits of a benchmark row (issue 42.3): the machine's memory bandwidth and matmul
peak, measured, and the least time a workload can take on them.

    python bench/roofline.py [--threads 2] [--shape 2048,1024,4096] [--reps 20]
                             [--models qwen2.5-0.5b,llama3.2-1b]

The machine (`measure`), with torch ops on `--threads` threads (`torch.set_num_threads`):
  bandwidth  STREAM-style kernels on float32 arrays of max(256 MiB, 8 x the last-level cache)
             each, best of `reps`, bytes counted as STREAM does (every array read or written once,
             no write-allocate traffic): copy `b.copy_(a)` (2 arrays), triad
             `torch.add(b, c, alpha=3, out=a)` (3 arrays) and read `a.sum()` (1 array, the
             access pattern of a decode step's weights). The floor uses the fastest of the three.
  matmul     x (M, K) @ W (N, K)^T in float32 and bfloat16 at M = 2048 rows (the step's token
             budget), K x N a layer's largest matmul (the MLP's d x intermediate), best of `reps`,
             by the faster of torch's linear (MKL underneath) and oneDNN's matmul on the weight
             reordered once into its blocked layout (what kvpage's projections call: on the dev
             machine 2.5x torch's linear in float32, 520 vs 202 GFLOP/s at 2048 x 768 x 2048).

A model's cost (`ModelCost.from_config`, from its config.json; Llama, Mistral, Qwen2, Qwen3):
  weight bytes read per forward pass: every decoder layer's weights (matmuls, biases, norms), the
  final norm and the LM head (a tied model reads its embedding as the head; the embedding lookup
  reads one row per token, left out). int8: 1 byte per matmul weight + one scale per output
  channel in the model dtype (kvpage.model.int8), the head likewise when it is quantized.
  KV bytes per cached position: 2 (K and V) x layers x KV heads x head_dim x the KV dtype's bytes.
  FLOPs: 2 per matmul weight per token fed through the layers, 4 x layers x heads x head_dim per
  (query, key) pair of attention, 2 x d x vocab per LM-head evaluation (as throughput.FlopModel).

The floor of a workload (`floor`): every sequence's prompt is prefilled (a prefix all share once),
then each is fed its decode tokens one pass at a time, the LM head evaluated once per output.
  memory bound  passes x weight bytes + KV bytes read, / bandwidth: a pass reads every weight at
                least once and the passes are sequential (a token is fed after the one before it
                is sampled), so there are at least 1 + the longest decode of them; every decode
                token reads the K and V of its sequence's positions so far (per sequence, as
                paged attention reads them; a shared prefix is read by each sequence).
  compute bound FLOPs / the measured matmul peak of the row's dtype.
The floor is the larger of the two (its `bound` says which): no engine can beat either on this
machine. A row's roofline fraction is floor / measured wall (100% = at the limit). Norms, RoPE,
softmax and sampling are left out, so the fraction is an upper bound on how close a row is.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")  # the layer layouts ModelCost counts
PREFILL_ROWS = 2048  # the step token budget of the benchmarks (throughput.MAX_BATCHED_TOKENS)
MIN_ARRAY_BYTES = 256 << 20
Q8_0_BYTES = 34 / 32  # llama.cpp's Q8_0: blocks of 32 int8 codes and one float16 scale


# --- the model's cost ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ModelCost:
    """Element counts of one forward pass, from a model's config (dtype-free)."""

    layer_matmul: int  # weights of every decoder layer's q, k, v, o, gate, up, down
    layer_rows: int  # their output channels (one int8 scale each)
    layer_other: int  # biases and norms of the decoder layers
    final_norm: int
    head: int  # d x vocab: the LM head (a tied model's embedding)
    vocab: int
    kv_width: int  # K and V elements per cached position: 2 x layers x KV heads x head_dim
    attn_width: int  # layers x heads x head_dim

    @classmethod
    def from_config(cls, cfg: dict) -> ModelCost:
        family = cfg.get("model_type", "llama")
        if family not in FAMILIES:
            raise ValueError(f"no cost model for {family!r} (one of {FAMILIES})")
        d, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
        heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or 0
        kv_heads = kv_heads or heads
        hd = cfg.get("head_dim") or d // heads
        q, kv = heads * hd, kv_heads * hd
        matmul = d * q + 2 * d * kv + q * d + 3 * d * inter
        rows = q + 2 * kv + d + 2 * inter + d
        other = 2 * d + _biases(cfg, family, d, q, kv, inter)
        if family == "qwen3":
            other += 2 * hd  # q_norm, k_norm
        return cls(
            layer_matmul=layers * matmul,
            layer_rows=layers * rows,
            layer_other=layers * other,
            final_norm=d,
            head=d * cfg["vocab_size"],
            vocab=cfg["vocab_size"],
            kv_width=2 * layers * kv,
            attn_width=layers * q,
        )

    def weight_bytes(self, dtype: str, int8: bool = False, int8_head: bool = False) -> int:
        """Bytes one forward pass reads: the layers, the final norm and the LM head."""
        b = DTYPE_BYTES[dtype]
        layers = self.layer_matmul + self.layer_rows * b if int8 else self.layer_matmul * b
        head = self.head + self.vocab * b if int8_head else self.head * b
        return layers + head + (self.layer_other + self.final_norm) * b

    def q8_0_bytes(self) -> int:
        """llama.cpp's Q8_0 GGUF: every matmul weight and the head in Q8_0, the rest float32."""
        quantized = (self.layer_matmul + self.head) * Q8_0_BYTES
        return int(quantized) + (self.layer_other + self.final_norm) * 4


def _biases(cfg: dict, family: str, d: int, q: int, kv: int, inter: int) -> int:
    """Per layer: Qwen2 always has q/k/v biases; Llama-style configs say so."""
    n = q + 2 * kv if family == "qwen2" else 0
    if cfg.get("attention_bias"):
        n += q + 2 * kv + d
    if cfg.get("mlp_bias"):
        n += 2 * inter + d
    return n


# --- the work of a workload ---------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Work:
    """What a workload must compute: per sequence its prompt and the tokens fed after it (one
    decode pass each); `shared` leading prompt tokens are common to all (prefilled once); the LM
    head runs decodes + 1 times per sequence (the prompt's last token, then every decode)."""

    prompts: tuple[int, ...]
    decodes: tuple[int, ...]
    shared: int = 0

    @classmethod
    def of_generate(cls, prompts: list[list[int]], max_tokens: list[int]) -> Work:
        """A sampler's workload: max_tokens outputs, the last one never fed back."""
        return cls(
            tuple(map(len, prompts)), tuple(m - 1 for m in max_tokens), common_prefix(prompts)
        )

    @property
    def passes(self) -> int:
        """Sequential forward passes at the least: the prefill, then the longest decode."""
        return 1 + max(self.decodes)


def common_prefix(prompts: list[list[int]]) -> int:
    """Leading tokens every prompt has (0 for a single prompt: nothing to share)."""
    if len(prompts) < 2:
        return 0
    n = min(map(len, prompts))
    first = prompts[0]
    for i in range(n):
        if any(p[i] != first[i] for p in prompts):
            return i
    return n


def _pairs(start: int, end: int) -> int:
    """Attention (query, key) pairs of the queries at positions start..end-1 (t sees t + 1 keys)."""
    return (end * (end + 1) - start * (start + 1)) // 2


def flops(cost: ModelCost, work: Work) -> float:
    shared = work.shared
    fed = shared + sum(p - shared + d for p, d in zip(work.prompts, work.decodes, strict=True))
    pairs = _pairs(0, shared) + sum(
        _pairs(shared, p + d) for p, d in zip(work.prompts, work.decodes, strict=True)
    )
    heads = sum(d + 1 for d in work.decodes)
    return 2.0 * cost.layer_matmul * fed + 4.0 * cost.attn_width * pairs + 2.0 * cost.head * heads


def kv_bytes_read(cost: ModelCost, work: Work, kv_bytes: int) -> float:
    """Every decode token at position t reads the K and V of positions 0..t of its sequence."""
    positions = sum(_pairs(p, p + d) for p, d in zip(work.prompts, work.decodes, strict=True))
    return float(positions) * cost.kv_width * kv_bytes


def bytes_read(cost: ModelCost, work: Work, weight_bytes: int, kv_bytes: int) -> float:
    return work.passes * float(weight_bytes) + kv_bytes_read(cost, work, kv_bytes)


# --- the floor ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Floor:
    """The least time of a workload on this machine: the larger of its memory and compute bounds."""

    memory_s: float
    compute_s: float

    @property
    def seconds(self) -> float:
        return max(self.memory_s, self.compute_s)

    @property
    def bound(self) -> str:
        return "mem" if self.memory_s >= self.compute_s else "mm"

    def fraction(self, wall: float) -> float:
        return self.seconds / wall


def floor(
    cost: ModelCost,
    work: Work,
    bandwidth: float,
    peak: float,
    weight_bytes: int,
    kv_bytes: int,
) -> Floor:
    """`bandwidth` in bytes/s, `peak` in FLOP/s, `weight_bytes` per pass, `kv_bytes` per
    element of the KV cache."""
    return Floor(
        bytes_read(cost, work, weight_bytes, kv_bytes) / bandwidth, flops(cost, work) / peak
    )


# --- the machine --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Machine:
    threads: int
    array_mib: int
    bandwidth_gbs: dict[str, float]  # copy, triad, read -> GB/s (1e9 bytes), best of the reps
    shape: tuple[int, int, int]  # (M, K, N) of the matmul peak
    peak_gflops: dict[str, float]  # dtype -> GFLOP/s, best of the reps

    @property
    def bytes_per_s(self) -> float:
        return max(self.bandwidth_gbs.values()) * 1e9

    def flops_per_s(self, dtype: str) -> float:
        return self.peak_gflops[dtype] * 1e9

    def best_with(self, other: Machine) -> Machine:
        """Each figure the higher of the two measurements (same threads, arrays and shape)."""
        bw = {k: max(v, other.bandwidth_gbs.get(k, 0.0)) for k, v in self.bandwidth_gbs.items()}
        mm = {k: max(v, other.peak_gflops.get(k, 0.0)) for k, v in self.peak_gflops.items()}
        return Machine(self.threads, self.array_mib, bw, self.shape, mm)

    def lines(self) -> list[str]:
        bw = ", ".join(f"{k} {v:.1f}" for k, v in self.bandwidth_gbs.items())
        m, k, n = self.shape
        mm = ", ".join(f"{d} {v:.1f}" for d, v in self.peak_gflops.items())
        return [
            f"memory bandwidth ({self.threads} threads, torch, {self.array_mib} MiB float32 "
            f"arrays, best of reps): {bw} GB/s; the floor uses {self.bytes_per_s / 1e9:.1f}",
            f"matmul peak (torch linear or oneDNN packed, {m} x {k} @ ({n} x {k})^T, {self.threads} threads, best "
            f"of reps): {mm} GFLOP/s",
        ]


def last_level_cache_bytes() -> int:
    """The largest cache /sys lists for cpu0 (0 when unknown)."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip()
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * mult)
    return max(sizes, default=0)


def _best(fn, reps: int) -> float:
    fn()  # warm: pages touched, kernels picked
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_bandwidth(reps: int = 20) -> tuple[int, dict[str, float]]:
    """(array MiB, {copy, triad, read: GB/s}) on torch's current thread count. The kernels take
    turns, rep by rep, so a burst of load from elsewhere costs each a few reps, not its best."""
    import torch

    n = max(MIN_ARRAY_BYTES, 8 * last_level_cache_bytes()) // 4
    a, b, c = (torch.rand(n) for _ in range(3))  # written: every page is resident
    size = 4 * n
    kernels = {  # name -> (bytes moved, the kernel)
        "copy": (2 * size, lambda: b.copy_(a)),
        "triad": (3 * size, lambda: torch.add(b, c, alpha=3.0, out=a)),
        "read": (size, lambda: a.sum()),
    }
    best = dict.fromkeys(kernels, float("inf"))
    for _, fn in kernels.values():
        fn()  # warm: kernels picked
    for _ in range(reps):
        for name, (_, fn) in kernels.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return size >> 20, {k: moved / best[k] / 1e9 for k, (moved, _) in kernels.items()}


def measure_matmul(shape: tuple[int, int, int], dtype: str, reps: int = 5) -> float:
    """GFLOP/s at (M, K) @ (N, K)^T in `dtype`: the faster of torch's linear and oneDNN's
    matmul on the prepacked weight (where this torch has oneDNN for the dtype)."""
    import torch

    m, k, n = shape
    x = torch.randn(m, k).to(getattr(torch, dtype))
    w = torch.randn(n, k).to(getattr(torch, dtype))
    with torch.inference_mode():
        t = _best(lambda: torch.nn.functional.linear(x, w), reps)
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(w)
        except RuntimeError:  # no oneDNN kernel for this dtype on this CPU
            packed = None
        if packed is not None:
            pointwise = torch.ops.mkldnn._linear_pointwise
            t = min(t, _best(lambda: pointwise(x, packed, None, "none", [], ""), reps))
    return 2.0 * m * k * n / t / 1e9


def measure(
    threads: int,
    shape: tuple[int, int, int] = (PREFILL_ROWS, 1024, 4096),
    dtypes: tuple[str, ...] = ("float32", "bfloat16"),
    reps: int = 20,
) -> Machine:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        mib, bw = measure_bandwidth(reps)
        peaks = {d: measure_matmul(shape, d, max(3, reps // 2)) for d in dtypes}
    finally:
        torch.set_num_threads(before)
    return Machine(threads, mib, bw, shape, peaks)


def model_shape(cfg: dict) -> tuple[int, int, int]:
    """The matmul peak's shape for a model: its MLP up projection at the prefill's row count."""
    return (PREFILL_ROWS, cfg["hidden_size"], cfg["intermediate_size"])


# --- command line -------------------------------------------------------------------------------
def describe_model(name: str, cfg: dict, machine: Machine) -> list[str]:
    """Per dtype: weight bytes per pass and the single-stream decode ceiling (batch 1 at 128
    cached positions: weights + KV read per token, / bandwidth)."""
    cost = ModelCost.from_config(cfg)
    lines = [
        f"{name}: {cost.layer_matmul / 1e6:.1f}M layer matmul weights, head {cost.head / 1e6:.1f}M"
    ]
    for dtype, int8 in (("float32", False), ("bfloat16", False), ("bfloat16", True)):
        wb = cost.weight_bytes(dtype, int8=int8, int8_head=int8)
        step = (wb + 128 * cost.kv_width * DTYPE_BYTES[dtype]) / machine.bytes_per_s
        label = f"int8 ({dtype} scales, int8 head)" if int8 else dtype
        lines.append(
            f"  {label:<32} {wb / 2**20:8.1f} MiB per pass; batch-1 decode at 128 positions: "
            f"{step * 1e3:6.1f} ms/token at the least, {1 / step:6.1f} tok/s at the most"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shape", default=f"{PREFILL_ROWS},1024,4096", help="M,K,N of the matmul")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--models", default="", help="throughput.py MODELS names to describe")
    args = ap.parse_args()
    shape = tuple(int(x) for x in args.shape.split(","))
    machine = measure(args.threads, shape, reps=args.reps)  # type: ignore[arg-type]
    for line in machine.lines():
        print(line)
    if args.models:
        sys.path.insert(0, str(Path(__file__).parent))
        import throughput  # bench/: the benchmark's model shapes

        for name in args.models.split(","):
            cfg = json.loads(throughput.model_config(name, 1024).to_json_string())
            for line in describe_model(name, cfg, machine):
                print(line)


if __name__ == "__main__":
    main()

"""Int8 weights against unquantized weights, and kvpage's weight GEMV kernel against torch's
kernels, on the 125M bench model. Three modes:

    python bench/int8_weights.py [--model 125m] [--dtype float32] [--batch 16] [--prompt 32]
                                 [--output 32] [--rounds 5] [--threads 2] [--seed 0]
    python bench/int8_weights.py --single [--configs fp32,bf16,int8-fp32,int8-bf16]
                                 [--rounds 3] [--prompt 128] [--output 128] [--threads 2]
                                 [--peers llama.cpp] [--llama-cpp-types f32,bf16,q8_0]
    python bench/int8_weights.py --batched [--requests 32] [--prompt 128] [--output 64]
                                 [--configs int8-fp32,int8h-fp32,int8-bf16,int8h-bf16]
                                 [--rounds 3] [--peers llama.cpp] [--llama-cpp-types q8_0]
    python bench/int8_weights.py --kernel-sweep [--rows 1,2,4,8,16] [--threads 2]

Configs `int8h-*`: int8 weights with the LM head quantized too (EngineConfig.quantize_lm_head),
what llama.cpp's Q8_0 does with output.weight.

Single-stream mode (`--single`): one request of `--prompt` random tokens and `--output` tokens
(EOS ignored; 1 x 128 + 128 by default, bench/solo.py's `single` workload), kvpage with its
native kernels on and off (KVPAGE_NATIVE=0: the paged attention and the weight GEMV kernels
both off), per config: fp32, bf16, int8 weights with fp32 / bf16 activations. Every cell is a
fresh process (bench/int8_weights.py --worker), alone, once per round; the rounds interleave
every cell, the order rotating each round. The model is bench/throughput.py's 125m as a
Hugging Face checkpoint (seeded), so `--peers llama.cpp` runs `llama-batched-bench -npp P -ntg O
-npl 1` on its GGUFs (`--llama-cpp-types`; q8_0 is the format to compare int8 with) in the same
rounds. The machine's load average is printed before and after. Printed: output tok/s (output tokens / wall of the generate call) at the fastest round
and the median; prefill ms and decode tok/s likewise; and whether kernel-on tokens equal
kernel-off tokens (greedy) per config.

Batched mode (`--batched`): bench/throughput.py's scenario bb, `--requests` x (`--prompt` +
`--output`) = 32 x (128 + 64), all added at once, kvpage int8 with the head float and int8 against
`llama-batched-bench -npl 32` on the Q8_0 GGUF; every cell a fresh process, alone, once per round,
the order rotating; out tok/s, prefill tok/s and decode tok/s, fastest (median) round.

Kernel sweep (`--kernel-sweep`): per linear shape of the model (qkv 768->1280, o 768->768,
gate_up 768->4096, down 2048->768, LM head 768->32000) and rows of x, the microseconds of one call
of kvpage's kernel and of torch's (int8: aten::_weight_int8pack_mm; bf16 and fp32: oneDNN with a
prepacked weight, as kvpage.model.projection calls it), min and median over calls that cycle
through enough weight copies to exceed the L3 (so weights come from memory, as in a model).
kvpage.model.native_gemv.MAX_ROWS comes from it. For bf16 where the CPU has AMX, an `amx` column
times kvpage.model.native_amx's tile kernel too (to its 32 rows): its MIN_ROWS comes from it.

Decode-step mode (the default):
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
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvpage import LLM, LLMEngine, SamplingParams
from kvpage.config import EngineConfig, ModelConfig, RopeConfig
from kvpage.model import (
    build_model,
    init_seeded_,
    native_amx,
    native_gemv,
    quantize_model_,
    resolve_dtype,
)
from kvpage.model.int8 import Int8Linear, quantize_per_channel
from kvpage.model.projection import packable_dtype
from kvpage.model.widened import widened_linear

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
    p.add_argument("--prompt", type=int, default=None, help="32; --single: 128")
    p.add_argument("--output", type=int, default=None, help="32; --single: 128")
    p.add_argument("--rounds", type=int, default=None, help="5; --single: 3")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--single", action="store_true", help="single-stream tok/s, kernels on/off")
    p.add_argument("--batched", action="store_true", help="--requests at once vs llama.cpp")
    p.add_argument("--requests", type=int, default=32, help="--batched: requests (llama -npl)")
    p.add_argument("--configs", default=",".join(CONFIGS), help="--single: " + ",".join(CONFIGS))
    p.add_argument("--native", default=",".join(NATIVE_ENV), help="--single: on,gemv-off,off")
    p.add_argument("--peers", default="", help="--single: llama.cpp")
    p.add_argument("--llama-cpp-types", default="f32,bf16,q8_0")
    p.add_argument("--kernel-sweep", action="store_true", help="kernel vs torch per shape, rows")
    p.add_argument("--rows", default="1,2,4,8,16,32", help="--kernel-sweep: rows of x")
    p.add_argument("--kinds", default="", help="--kernel-sweep: int8-fp32,int8-bf16,bf16,fp32")
    p.add_argument("--shapes", type=int, default=len(SWEEP_SHAPES), help="--kernel-sweep: first N")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # a --single cell: its spec (JSON)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.worker:
        return single_worker(json.loads(args.worker))
    if args.kernel_sweep:
        return kernel_sweep(args)
    single = args.single
    if args.batched:
        args.prompt, args.output = args.prompt or 128, args.output or 64
        args.rounds = args.rounds or 3
        return batched_rounds(args)
    args.prompt = args.prompt or (128 if single else 32)
    args.output = args.output or (128 if single else 32)
    args.rounds = args.rounds or (3 if single else 5)
    if single:
        return single_rounds(args)
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


# --- single stream: kernels on and off, each cell a process of its own --------------------------
CONFIGS = {  # name -> (dtype, quantization, LM head in int8 too)
    "fp32": ("float32", "none", False),
    "bf16": ("bfloat16", "none", False),
    "int8-fp32": ("float32", "int8", False),
    "int8-bf16": ("bfloat16", "int8", False),
    "int8h-fp32": ("float32", "int8", True),  # EngineConfig.quantize_lm_head: as Q8_0 does
    "int8h-bf16": ("bfloat16", "int8", True),
}
NATIVE_ENV = {  # kernel state -> the environment that sets it
    "on": {},
    "gemv-off": {"KVPAGE_GEMV_MAX_ROWS": "0"},  # the weight kernel off, attention kernel on
    "off": {"KVPAGE_NATIVE": "0"},  # every native kernel off: torch throughout
}


def single_rounds(args) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    import throughput  # noqa: E402 (bench/ on the path: the HF model builder)

    configs = args.configs.split(",")
    states = args.native.split(",")
    bad = set(configs) - set(CONFIGS) or set(states) - set(NATIVE_ENV)
    if bad:
        raise SystemExit(f"unknown config or kernel state {sorted(bad)}")
    rng = random.Random(args.seed)
    prompt = [rng.randrange(3, 32000) for _ in range(args.prompt)]
    with tempfile.TemporaryDirectory() as tmp:
        throughput.build_model(args.model, 1024, tmp)
        cells = [(c, s) for c in configs for s in states]
        peers = llama_cpp_cells(args, Path(tmp)) if "llama.cpp" in args.peers else {}
        print(
            f"single stream: 1 x ({args.prompt} prompt + {args.output} out), model {args.model}, "
            f"{args.threads} threads, {args.rounds} rounds, {_load()}; kernel states: "
            + ", ".join(f"{k} = {v or 'default'}" for k, v in NATIVE_ENV.items() if k in states)
        )
        results: dict = {cell: [] for cell in [*cells, *peers]}
        failed: set = set()
        for r in range(args.rounds):
            order = [*cells, *peers]
            order = order[r % len(order) :] + order[: r % len(order)]
            for cell in [c for c in order if c not in failed]:
                out = peers[cell]() if cell in peers else run_cell(cell, tmp, prompt, args)
                if out is None:
                    failed.add(cell)
                    continue
                results[cell].append(out)
                print(f"round {r + 1} {cell[0]} {cell[1]}: {out['wall']:.2f}s", flush=True)
    kept = [c for c in cells if c not in failed]
    single_report(results, kept, [c for c in peers if c not in failed], args)
    print(f"load after: {_load()}")


def run_cell(cell: tuple[str, str], model_dir: str, prompt, args, batched: bool = False) -> dict:
    """`prompt`: one prompt, or (`batched`) a list of them, generated at once."""
    dtype, quantization, head = CONFIGS[cell[0]]
    spec = dict(model_dir=model_dir, dtype=dtype, quantization=quantization)
    spec |= dict(prompts=prompt) if batched else dict(prompt=prompt)
    spec |= dict(output=args.output, seed=args.seed, quantize_lm_head=head)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    for key in ("KVPAGE_NATIVE", "KVPAGE_GEMV_MAX_ROWS"):
        env.pop(key, None)
    env |= NATIVE_ENV[cell[1]]
    cmd = [sys.executable, __file__, "--threads", str(args.threads), "--worker", json.dumps(spec)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        # A cell that cannot run here (bfloat16's oneDNN pack needs AVX-512 or AVX-NE-CONVERT) is
        # reported and dropped; the other cells go on.
        print(f"{cell} FAILED: {proc.stderr.strip().splitlines()[-1][:300]}", flush=True)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def single_worker(spec: dict) -> None:
    """One cell: build, warm up (untimed), run the request(s) once; print one JSON line. A
    `batched` spec: `prompts` (every one at once) instead of `prompt`."""
    prompts = spec.get("prompts") or [spec["prompt"]]
    blocks = len(prompts) * -(-(len(prompts[0]) + spec["output"]) // 16) + 16
    llm = LLM(
        spec["model_dir"], dtype=spec["dtype"], quantization=spec["quantization"], device="cpu",
        quantize_lm_head=spec.get("quantize_lm_head", False), block_size=16,
        num_blocks=max(64, blocks), max_num_seqs=64, max_num_batched_tokens=2048,
        seed=spec["seed"],
    )  # fmt: skip
    params = SamplingParams(max_tokens=spec["output"], ignore_eos=True)
    llm.generate(prompts[0][:48], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    start = time.monotonic()
    outs = llm.generate(prompts, params, use_tqdm=False)
    end = time.monotonic()
    first = max(o.metrics.first_token_time for o in outs)  # the last prompt's first token
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    steps = len(tokens[0]) - 1  # decode tokens per request after the first
    result = dict(wall=end - start, prefill=first - start, decode=(end - first) / steps)
    result |= dict(tokens=tokens[0] if len(outs) == 1 else tokens, gemv=native_gemv.available())
    llm.close()
    print(json.dumps(result))


def llama_cpp_cells(args, model_dir: Path, requests: int = 1) -> dict:
    """(type, "llama.cpp") -> a run of llama-batched-bench -npl `requests` on that GGUF type."""
    from peers import llama_cpp

    llama_cpp.build()
    cells = {}
    for outtype in args.llama_cpp_types.split(","):
        gguf = llama_cpp.convert(model_dir, outtype)

        def run(gguf=gguf, outtype=outtype) -> dict | None:
            try:
                r = llama_cpp.run_batched_bench(
                    gguf, args.prompt, args.output, requests, args.threads
                )
            except llama_cpp.PeerError as e:  # reported and dropped, as a kvpage cell is
                print(f"({outtype}, llama.cpp) FAILED: {str(e)[:300]}", flush=True)
                return None
            # T_TG covers `ntg` decode passes; kvpage samples its first token in the prefill.
            return dict(wall=r.t, prefill=r.t_pp, decode=r.t_tg / args.output, tokens=None)

        cells[(outtype, "llama.cpp")] = run
    return cells


def single_report(results: dict, cells: list, peers: list, args) -> None:
    n = args.output
    print(
        f"\nout tok/s = {n} / wall of the generate call (llama.cpp: / its T); decode tok/s = 1 / "
        f"time per decode token; fastest (median) of {args.rounds} rounds"
    )
    head = (
        f"{'config':<10} {'kernels':<9} {'out tok/s':>16} {'prefill ms':>16} {'decode tok/s':>16}"
    )
    print(f"{head}  {'tokens = kernels off':<20}")
    for cell in [*cells, *peers]:
        runs = results[cell]
        walls, pre, dec = ([r[k] for r in runs] for k in ("wall", "prefill", "decode"))
        rate = f"{n / min(walls):.1f} ({n / statistics.median(walls):.1f})"
        pms = f"{min(pre) * 1e3:.0f} ({statistics.median(pre) * 1e3:.0f})"
        dps = f"{1 / min(dec):.1f} ({1 / statistics.median(dec):.1f})"
        same = ""
        if cell[1] != "llama.cpp" and results.get((cell[0], "off")):
            ref = results[(cell[0], "off")][-1]["tokens"]
            same = "yes" if runs[-1]["tokens"] == ref else "NO"
        print(f"{cell[0]:<10} {cell[1]:<9} {rate:>16} {pms:>16} {dps:>16}  {same:<20}")


# --- batched: kvpage int8 (head on/off) against llama.cpp Q8_0, each engine alone per round ------
BATCHED_CONFIGS = "int8-fp32,int8h-fp32,int8-bf16,int8h-bf16"


def batched_rounds(args) -> None:
    """bench/throughput.py's scenario bb: `--requests` prompts of `--prompt` random tokens, all
    added at once, `--output` tokens each (EOS ignored); llama.cpp: `llama-batched-bench -npp P
    -ntg O -npl R` on the same model's GGUFs (`--llama-cpp-types`, default q8_0 here). kvpage with
    its native kernels on (the default). Every cell a fresh process, alone, once per round; the
    order rotates each round."""
    sys.path.insert(0, str(Path(__file__).parent))
    import throughput  # noqa: E402 (bench/ on the path: the HF model builder)

    configs = (args.configs if args.configs != ",".join(CONFIGS) else BATCHED_CONFIGS).split(",")
    if set(configs) - set(CONFIGS):
        raise SystemExit(f"unknown config {sorted(set(configs) - set(CONFIGS))}")
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, 32000) for _ in range(args.prompt)] for _ in range(args.requests)]
    if args.llama_cpp_types == "f32,bf16,q8_0":  # the --single default; Q8_0 is the peer here
        args.llama_cpp_types = "q8_0"
    with tempfile.TemporaryDirectory() as tmp:
        throughput.build_model(args.model, 1024, tmp)
        cells = [(c, "on") for c in configs]
        peers = llama_cpp_cells(args, Path(tmp), args.requests) if "llama.cpp" in args.peers else {}
        print(
            f"batched: {args.requests} x ({args.prompt} prompt + {args.output} out), model "
            f"{args.model}, {args.threads} threads, {args.rounds} rounds; load: {_load()}"
        )
        results: dict = {cell: [] for cell in [*cells, *peers]}
        failed: set = set()
        for r in range(args.rounds):
            order = [*cells, *peers]
            order = order[r % len(order) :] + order[: r % len(order)]
            for cell in [c for c in order if c not in failed]:
                out = peers[cell]() if cell in peers else run_cell(cell, tmp, prompts, args, True)
                if out is None:
                    failed.add(cell)
                    continue
                results[cell].append(out)
                print(f"round {r + 1} {cell[0]} {cell[1]}: {out['wall']:.2f}s", flush=True)
    batched_report(results, [c for c in [*cells, *peers] if c not in failed], args)
    print(f"load after: {_load()}")


def batched_report(results: dict, cells: list, args) -> None:
    n, p = args.requests * args.output, args.requests * args.prompt
    print(
        f"\nout tok/s = {n} output tokens / wall (llama.cpp: / its T = T_PP + T_TG); prefill "
        f"tok/s = {p} prompt tokens / time to the last first token (llama.cpp: / T_PP); decode "
        f"tok/s = {args.requests} / time per decode step; fastest (median) of {args.rounds} rounds"
    )
    print(
        f"{'config':<11} {'engine':<9} {'out tok/s':>16} {'prefill tok/s':>16} {'decode tok/s':>16}"
    )
    for cell in cells:
        runs = results[cell]
        walls, pre, dec = ([r[k] for r in runs] for k in ("wall", "prefill", "decode"))
        rate = f"{n / min(walls):.1f} ({n / statistics.median(walls):.1f})"
        pps = f"{p / min(pre):.0f} ({p / statistics.median(pre):.0f})"
        dps = f"{args.requests / min(dec):.1f} ({args.requests / statistics.median(dec):.1f})"
        engine = "llama.cpp" if cell[1] == "llama.cpp" else "kvpage"
        print(f"{cell[0]:<11} {engine:<9} {rate:>16} {pps:>16} {dps:>16}")


def _load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


# --- kernel sweep -------------------------------------------------------------------------------
SWEEP_SHAPES = [(768, 1280), (768, 768), (768, 4096), (2048, 768), (768, 32000)]  # (K, N)
SWEEP_KINDS = {  # name -> (activation dtype, weight bytes)
    "int8-fp32": (torch.float32, 1),
    "int8-bf16": (torch.bfloat16, 1),
    "bf16": (torch.bfloat16, 2),
    "fp32": (torch.float32, 4),
}


def kernel_sweep(args) -> None:
    if not native_gemv.available():
        raise SystemExit("the weight GEMV kernel is not available (a compiler? KVPAGE_NATIVE?)")
    rows = [int(r) for r in args.rows.split(",")]
    print(f"{args.threads} threads; us per call, min / median; ratio = torch / kernel")
    print("widened (int8, bf16): float32 GEMM on tiles widened per call, kvpage.model.widened")
    torch.manual_seed(args.seed)
    kinds = args.kinds.split(",") if args.kinds else list(SWEEP_KINDS)
    for name in kinds:
        x_dtype, wbytes = SWEEP_KINDS[name]
        print(f"== {name}")
        for k, n in SWEEP_SHAPES[: args.shapes]:
            copies = int(96e6 // (n * k * wbytes)) + 1  # together beyond the L3
            weights = [torch.randn(n, k) * 0.02 for _ in range(copies)]
            paths = [sweep_paths(w, name, x_dtype) for w in weights]
            amx = amx_paths(weights, name)
            for m in rows:
                x = torch.randn(m, k).to(x_dtype)
                times = [time_calls([lambda f=p[i], x=x: f(x) for p in paths]) for i in range(3)]
                (mine, theirs, wide) = times
                gbs = n * k * wbytes / mine[0] / 1e9
                widened = (
                    ""
                    if name == "fp32"
                    else f"  widened {wide[0] * 1e6:8.1f} / {wide[1] * 1e6:8.1f}"
                )
                if amx and m <= native_amx.MAX_ROWS:
                    t = time_calls([lambda f=f, x=x: f(x) for f in amx])
                    widened += f"  amx {t[0] * 1e6:8.1f} / {t[1] * 1e6:8.1f}"
                print(
                    f"K {k:5d} N {n:6d} rows {m:4d}  kernel {mine[0] * 1e6:8.1f} / "
                    f"{mine[1] * 1e6:8.1f} ({gbs:5.1f} GB/s)  torch {theirs[0] * 1e6:8.1f} / "
                    f"{theirs[1] * 1e6:8.1f}  ratio {theirs[0] / mine[0]:5.2f} / "
                    f"{theirs[1] / mine[1]:5.2f}{widened}",
                    flush=True,
                )


def amx_paths(weights: list[torch.Tensor], name: str) -> list:
    """The AMX kernel (kvpage.model.native_amx) on the same weights in bf16, where it runs."""
    if name != "bf16" or not native_amx.available() or not native_amx.fits(*weights[0].shape):
        return []
    return [native_amx.AmxLinear(w.to(torch.bfloat16).contiguous(), None) for w in weights]


def sweep_paths(w: torch.Tensor, name: str, x_dtype: torch.dtype):
    """(kvpage's kernel, torch's, the widened float32 GEMM) on one weight."""
    if name.startswith("int8"):
        codes, scales = quantize_per_channel(w, x_dtype)
        gemv = native_gemv.WeightGemv([codes], [scales], [None], x_dtype)
        return (
            gemv,
            lambda x: torch.ops.aten._weight_int8pack_mm(x, codes, scales),
            lambda x: widened_linear(x, codes, scales),
        )
    wd = w.to(x_dtype).contiguous()
    gemv = native_gemv.WeightGemv([wd], [None], [None], x_dtype)
    wide = lambda x: widened_linear(x, wd)  # noqa: E731
    if not packable_dtype(x_dtype):  # oneDNN cannot pack bf16 without AVX-512: torch's plain GEMM
        return gemv, lambda x: torch.nn.functional.linear(x, wd), wide
    packed = torch.ops.mkldnn._reorder_linear_weight(wd)
    return gemv, lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), wide


def time_calls(calls: list, seconds: float = 0.4) -> tuple[float, float]:
    """(min, median) seconds of one call, cycling through `calls` for at least `seconds`."""
    for call in calls:
        call()
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(times) < 2 * len(calls):
        call = calls[len(times) % len(calls)]
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return min(times), statistics.median(times)


if __name__ == "__main__":
    main()

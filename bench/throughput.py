"""Offline throughput of kvpage against Hugging Face `generate` (static padded batches) and Hugging
Face continuous batching (`generate_batch`), on the same random-weight Llama and the same prompts, in
one process:

    python bench/throughput.py [--models small,120m,125m] [--scenarios a,b,c,bb] [--requests 64]
                               [--repeats N] [--seed 0] [--threads 2] [--hf-batch 32] [--profile]
                               [--peers hf,hf-generate,llama.cpp] [--llama-cpp-types f32,bf16]
                               [--dtypes float32,bfloat16] [--tensor-parallel-size 2]

(a) prompts uniform in 16-256 tokens, 64 output tokens each; (b) the same prompts, outputs uniform
in 16-256 tokens (HF `generate` runs each static batch to its longest output; only the tokens each
request asked for count); (c) a common 512-token prefix + 32 unique tokens per request, 64 output
tokens: prefill tokens computed and median TTFT, kvpage prefix caching on vs off; (bb) the shape of
llama.cpp's `llama-batched-bench -npp 128 -ntg 64 -npl 32`: 32 prompts of 128 tokens, 64 output
tokens each, with a second table of prefill / decode / overall rates (min and median over the
repeats). `--peers` picks the peers: `hf` (HF generate and generate_batch, the default),
`hf-generate` (HF generate alone) and `llama.cpp` (llama-batched-bench as a subprocess, scenario bb only; see bench/peers/llama_cpp.py,
built once into ~/.cache/kvpage-bench on first use). Every table row
gives useful output tokens/s, the ratio against both HF peers, achieved GFLOP/s (useful FLOPs only,
see `useful_flops`) and its share of a plain `torch.mm` measured in the same run. `--profile` adds
a cProfile and a torch.profiler summary of kvpage on each scenario. `--dtypes float32,bfloat16`
adds a `kvpage bf16` row (and `hf generate bf16` with the hf peer) to every scenario; token
agreement is always against fp32 HF `generate`, so bf16 rows show how far bf16 drifts.

Solo mode (`--peers vllm,llama.cpp,hf`, or `--solo`, `--quick`, `--rounds`, `--workloads`; see
bench/solo_rounds.py): kvpage, HF `generate`, vLLM's CPU build and llama.cpp, each in its own
process and alone per round, interleaved over `--rounds` (3), on the workloads of bench/solo.py in
fp32 and bf16; a table of output tok/s min (median), kvpage/peer ratios and token agreement.
`--quick` is its smoke test (small model, 1 round, tiny workloads).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import cProfile
import io
import logging
import pstats
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from peers import llama_cpp
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from kvpage import LLM, SamplingParams

BLOCK_SIZE = 16
MAX_NUM_SEQS = 64
MAX_BATCHED_TOKENS = 2048
INIT_STD = 0.15  # wide init so greedy tokens are not near-ties (see tests/model/hf_models.py)
FIRST_TOKEN_ID = 3  # prompts avoid pad (0), bos (1) and eos (2)
PAD_ID = 0
BF16_MODELS: dict[int, transformers.PreTrainedModel] = {}  # the bf16 copy of each HF model

MODELS = {
    # 4 layers, d=256: ~3.2M layer parameters + 2 x 2.1M embedding / head.
    "small": dict(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
    ),
    # 12 layers, d=768: ~85M layer parameters + 2 x 24.6M untied embedding / head = ~134M.
    "120m": dict(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=12,
    ),
}
# The model of the llama.cpp comparison: the 120m with GQA, 12 heads / 4 KV heads.
MODELS["125m"] = {**MODELS["120m"], "num_key_value_heads": 4}
# Published shapes with random weights (`model_type` picks the transformers config class; the
# rest are that config's fields, as in the model's own config.json). Qwen2 has q/k/v biases.
MODELS["qwen2.5-0.5b"] = dict(  # Qwen/Qwen2.5-0.5B: 494M parameters
    model_type="qwen2",
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
    max_position_embeddings=32768,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
)
MODELS["llama3.2-1b"] = dict(  # meta-llama/Llama-3.2-1B: 1.24B parameters
    model_type="llama",
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
    max_position_embeddings=131072,
    rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
)


BB_PROMPT, BB_OUTPUT, BB_REQUESTS = 128, 64, 32  # llama-batched-bench -npp 128 -ntg 64 -npl 32


# --- workloads ----------------------------------------------------------------------------------
@dataclass(slots=True)
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: list[int]
    prefix_len: int = 0  # (c): tokens every prompt shares
    key: str = ""  # "a", "b", "c" or "bb"


def random_tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(n)]


def make_workloads(scenarios: str, n: int, vocab: int, seed: int) -> list[Workload]:
    rng = random.Random(seed)
    prompts = [random_tokens(rng, rng.randint(16, 256), vocab) for _ in range(n)]
    out_b = [rng.randint(16, 256) for _ in range(n)]
    prefix = random_tokens(rng, 512, vocab)
    shared = [prefix + random_tokens(rng, 32, vocab) for _ in range(n)]
    equal = [random_tokens(rng, BB_PROMPT, vocab) for _ in range(BB_REQUESTS)]
    all_ = {
        "a": Workload("(a) prompts 16-256, 64 out", prompts, [64] * n),
        "b": Workload("(b) prompts 16-256, out 16-256", prompts, out_b),
        "c": Workload("(c) 512 shared + 32 unique, 64 out", shared, [64] * n, prefix_len=512),
        "bb": Workload(
            f"(bb) batched-bench: {BB_REQUESTS} x {BB_PROMPT} prompt, {BB_OUTPUT} out",
            equal,
            [BB_OUTPUT] * BB_REQUESTS,
        ),
    }
    unknown = set(scenarios.split(",")) - set(all_)
    if unknown:
        raise SystemExit(f"unknown scenario(s) {sorted(unknown)}; choose from {sorted(all_)}")
    workloads = [all_[s] for s in scenarios.split(",")]
    for key, wl in all_.items():
        wl.key = key
    return workloads


def blocks_needed(wl: Workload) -> int:
    """A KV pool that holds the whole workload at once (plus warm-up slack): no preemption, so the
    comparison is about compute, not about pool sizing. HF CB gets the same pool."""
    need = sum(
        -(-(len(p) + m) // BLOCK_SIZE) for p, m in zip(wl.prompts, wl.max_tokens, strict=True)
    )
    return need + 64


# --- useful FLOPs -------------------------------------------------------------------------------
@dataclass(slots=True)
class FlopModel:
    """Useful FLOPs of one request of prompt p and o output tokens, counting what a dense, unpadded,
    cache-reusing-within-a-request implementation must do:
      - the n = p + o - 1 tokens that pass through the layers (the last sampled token is never fed
        back), each costing 2 FLOPs per weight of every layer matmul (q, k, v, o, gate, up, down);
      - attention: the token at position t attends to t + 1 keys; QK^T and PV are each
        heads * head_dim multiply-adds per key, so 4 * layers * heads * head_dim * (t + 1), summed
        over t = 0..n-1 gives 4 * L * H * hd * n (n + 1) / 2;
      - the LM head only where a token is sampled: 2 * d * V per output token.
    Norms, RoPE, softmax, SiLU and the embedding lookup are O(d) per token and left out. Padding
    (HF generate) and recomputation are not counted, nor is prefix-cache reuse across requests, so
    in (c) the figure is the effective rate of a workload whose no-reuse cost is fixed."""

    layer_weights: int  # 2-D weights in all decoder layers
    attn_width: int  # layers * heads * head_dim
    head_weights: int  # d * V

    @classmethod
    def of(cls, model: transformers.PreTrainedModel) -> FlopModel:
        cfg = model.config
        layers = sum(p.numel() for p in model.model.layers.parameters() if p.dim() == 2)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        width = cfg.num_hidden_layers * cfg.num_attention_heads * head_dim
        return cls(layers, width, model.lm_head.weight.numel())

    def request(self, prompt_len: int, out_len: int) -> float:
        n = prompt_len + out_len - 1
        return (
            2.0 * self.layer_weights * n
            + 2.0 * self.attn_width * n * (n + 1)
            + (2.0 * self.head_weights * out_len)
        )

    def workload(self, wl: Workload) -> float:
        return sum(self.request(len(p), m) for p, m in zip(wl.prompts, wl.max_tokens, strict=True))


def mm_peak_gflops(size: int = 1024, reps: int = 15) -> float:
    a, b = torch.randn(size, size), torch.randn(size, size)
    for _ in range(3):
        torch.mm(a, b)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t0)
    return 2 * size**3 / statistics.median(times) / 1e9


# --- one run's result ---------------------------------------------------------------------------
@dataclass(slots=True)
class RunOut:
    """What one timed run of an engine reports besides its wall time."""

    tokens: list[list[int]]  # each request's first max_tokens outputs ([] when not available)
    ttfts: list[float] | None = None
    prefill_computed: int | None = None  # prompt tokens computed (None when unknown)
    span: float | None = None  # HF CB: first submission -> last token
    # (prefill s, decode s): until every request has its first token, then to the last token
    phases: tuple[float, float] | None = None
    wall: float | None = None  # the engine's own timing, replacing the caller's (llama.cpp: T)


@dataclass(slots=True)
class RunResult:
    engine: str
    walls: list[float] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)  # each request's first max_tokens outputs
    ttfts: list[float] | None = None
    prefill_computed: int | None = None
    spans: list[float] = field(default_factory=list)  # HF CB: first submit -> last token
    phases: list[tuple[float, float]] = field(default_factory=list)
    error: str | None = None

    @property
    def wall(self) -> float:
        return statistics.median(self.walls)


@dataclass(slots=True)
class Engine:
    """`run` is timed; `setup` (untimed) runs before each repeat."""

    name: str
    run: Callable[[], RunOut]
    setup: Callable[[], None] = lambda: None
    teardown: Callable[[], None] = lambda: None  # after the last repeat


def measure(engine: Engine, res: RunResult) -> None:
    try:
        engine.setup()
        t0 = time.perf_counter()
        out = engine.run()
        wall = time.perf_counter() - t0
        res.walls.append(out.wall if out.wall is not None else wall)
        res.tokens, res.ttfts, res.prefill_computed = out.tokens, out.ttfts, out.prefill_computed
        if out.span is not None:
            res.spans.append(out.span)
        if out.phases is not None:
            res.phases.append(out.phases)
    except Exception as err:  # a peer that cannot run here is reported, not fatal
        res.error = f"{type(err).__name__}: {err}"


# --- kvpage -------------------------------------------------------------------------------------
def kvpage_llm(
    model_dir: str,
    num_blocks: int,
    prefix_caching: bool,
    seed: int,
    dtype: str = "float32",
    tp: int = 1,
    quantization: str = "none",
    quantize_lm_head: bool = False,
) -> LLM:
    llm = LLM(
        model_dir,
        block_size=BLOCK_SIZE,
        num_blocks=num_blocks,
        enable_prefix_caching=prefix_caching,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        dtype=dtype,
        device="cpu",
        seed=seed,
        tensor_parallel_size=tp,
        quantization=quantization,
        quantize_lm_head=quantize_lm_head,
    )
    rng = random.Random(seed + 1)
    warm = [random_tokens(rng, 48, llm.engine.model.config.vocab_size) for _ in range(4)]
    llm.generate(warm, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    return llm


def kvpage_engine(
    name: str,
    model_dir: str,
    wl: Workload,
    prefix_caching: bool,
    seed: int,
    prime: bool = False,
    dtype: str = "float32",
    tp: int = 1,
) -> Engine:
    """A fresh engine per repeat (built and warmed before the clock starts), so one repeat's cache
    cannot serve the next. All requests are added at once: TTFT includes queueing. With `prime`, one
    earlier request has already put the shared prefix in the cache (a warm system prompt)."""
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in wl.max_tokens]
    holder: dict[str, LLM] = {}

    def setup() -> None:
        if "llm" in holder:  # the previous repeat's tensor-parallel workers, if any
            holder.pop("llm").close()
        llm = kvpage_llm(model_dir, blocks_needed(wl), prefix_caching, seed, dtype, tp)
        if prime:
            rng = random.Random(seed + 2)
            vocab = llm.engine.model.config.vocab_size
            first = wl.prompts[0][: wl.prefix_len] + random_tokens(rng, 32, vocab)
            llm.generate([first], SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
        holder["llm"] = llm

    def run() -> RunOut:
        tp_group = holder["llm"].engine.tp and holder["llm"].engine.tp.workers.group
        busy = tp_group.collective_s if tp_group else 0.0
        t0 = time.monotonic()  # the clock of RequestMetrics.first_token_time
        outs = holder["llm"].generate(wl.prompts, params, use_tqdm=False)
        t1 = time.monotonic()
        if tp_group:
            COLLECTIVE_SHARE[name] = (tp_group.collective_s - busy) / (t1 - t0)
        cached = sum(o.metrics.num_cached_tokens for o in outs)
        prefill = sum(len(p) for p in wl.prompts) - cached
        ttfts = [o.metrics.ttft for o in outs]
        firsts = [o.metrics.first_token_time for o in outs]
        phases = None
        if all(f is not None for f in firsts):
            last_first = max(firsts)
            phases = (last_first - t0, t1 - last_first)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        if tp > 1:  # a live worker group holds rank 0 to its core share: never past this run
            holder.pop("llm").close()
        return RunOut(tokens, ttfts, prefill, phases=phases)

    def teardown() -> None:
        if "llm" in holder:
            holder.pop("llm").close()

    return Engine(name, run, setup, teardown)


# --- Hugging Face generate (static, left-padded batches) ----------------------------------------
class _FirstLogits(LogitsProcessor):
    """Records when the batch's first logits exist: the TTFT of every request in a static batch."""

    def __init__(self) -> None:
        self.t: float | None = None

    def __call__(self, input_ids, scores):
        if self.t is None:
            self.t = time.perf_counter()
        return scores


def run_hf_generate(model, wl: Workload, batch_size: int) -> Callable[[], tuple]:
    """Static batches of `batch_size` in prompt order, left-padded, each run to the longest requested
    output in it; EOS is disabled so every row runs to that length."""

    @torch.inference_mode()
    def run() -> RunOut:
        t0 = time.perf_counter()
        tokens: list[list[int]] = []
        ttfts: list[float] = []
        for start in range(0, len(wl.prompts), batch_size):
            prompts = wl.prompts[start : start + batch_size]
            wants = wl.max_tokens[start : start + batch_size]
            width = max(len(p) for p in prompts)
            ids = torch.tensor([[PAD_ID] * (width - len(p)) + p for p in prompts])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            first = _FirstLogits()
            gen = GenerationConfig(
                do_sample=False,
                max_new_tokens=max(wants),
                pad_token_id=PAD_ID,
                eos_token_id=None,
            )
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                generation_config=gen,
                logits_processor=LogitsProcessorList([first]),
            )
            new = out[:, width:].tolist()
            tokens += [row[:want] for row, want in zip(new, wants, strict=True)]
            ttfts += [first.t - t0] * len(prompts)
        phases = None
        if len(wl.prompts) <= batch_size:  # one batch: its first logits end the prefill
            phases = (ttfts[0], time.perf_counter() - t0 - ttfts[0])
        return RunOut(tokens, ttfts, sum(len(p) for p in wl.prompts), phases=phases)

    return run


# --- Hugging Face continuous batching -----------------------------------------------------------
def hf_cb_config(wl: Workload) -> ContinuousBatchingConfig:
    """The same page size, pool, step token budget and batch width as kvpage. Left to itself on CPU
    HF sizes the cache from system memory (tens of seconds of allocation per call)."""
    return ContinuousBatchingConfig(
        page_size=BLOCK_SIZE,
        num_blocks=blocks_needed(wl),
        max_batch_tokens=MAX_BATCHED_TOKENS,
        max_requests_per_batch=MAX_NUM_SEQS,
    )


def run_hf_cb(model, wl: Workload) -> Callable[[], tuple]:
    """`generate_batch` when every request wants the same length. It takes one max_new_tokens for
    all, so for per-request lengths (b) this drives the same manager the way generate_batch does but
    with `add_request(..., max_new_tokens=m)` per request. The timed span includes the manager's
    start and stop (a fresh one per call, as generate_batch does: no cache survives a repeat)."""
    gen = GenerationConfig(do_sample=False, max_new_tokens=max(wl.max_tokens), eos_token_id=-1)
    uniform = len(set(wl.max_tokens)) == 1

    @torch.inference_mode()
    def run() -> RunOut:
        if uniform:
            out = model.generate_batch(
                inputs=wl.prompts,
                generation_config=gen,
                continuous_batching_config=hf_cb_config(wl),
                record_timestamps=True,
                progress_bar=False,
            )
            results = list(out.values())
        else:
            results = _hf_cb_per_request(model, wl, gen)
        if len(results) != len(wl.prompts) or any(r.error for r in results):
            errs = [r.error for r in results if r.error]
            raise RuntimeError(f"{len(results)}/{len(wl.prompts)} results; errors: {errs[:2]}")
        tokens = [list(r.generated_tokens) for r in results]
        ttfts = [r.timestamps[0] - r.created_time for r in results]
        span = max(r.timestamps[-1] for r in results) - min(r.created_time for r in results)
        last_first = max(r.timestamps[0] for r in results)
        phases = (
            last_first - min(r.created_time for r in results),
            max(r.timestamps[-1] for r in results) - last_first,
        )
        return RunOut(tokens, ttfts, None, span, phases)

    return run


def _hf_cb_per_request(model, wl: Workload, gen: GenerationConfig) -> list:
    with model.continuous_batching_context_manager(
        generation_config=gen,
        continuous_batching_config=hf_cb_config(wl),
        block=True,
        timeout=5,
    ) as manager:
        ids = [
            manager.add_request(p, max_new_tokens=m, record_timestamps=True, eos_token_id=-1)
            for p, m in zip(wl.prompts, wl.max_tokens, strict=True)
        ]
        results: dict[str, object] = {}
        while len(results) < len(ids):
            r = manager.get_result(timeout=1)
            if r is not None and r.is_finished():
                results[r.request_id] = r
            elif r is None and not manager.is_running():
                break
    return [results[i] for i in ids if i in results]


# --- llama.cpp (llama-batched-bench, a subprocess) ------------------------------------------------
def llama_cpp_engine(model_dir: str, outtype: str, threads: int) -> Engine:
    """llama-batched-bench on the model as a GGUF of `outtype`, converted (cached) before any clock
    starts. Its wall is batched-bench's own T = T_PP + T_TG: model load and its 16-token warm-up
    are left out, as the other engines' construction and warm-up are. Raises when it cannot run."""
    gguf = llama_cpp.convert(model_dir, outtype)

    def run() -> RunOut:
        r = llama_cpp.run_batched_bench(
            gguf, BB_PROMPT, BB_OUTPUT, BB_REQUESTS, threads, batch=MAX_BATCHED_TOKENS
        )
        return RunOut([], [r.t_pp] * r.pl, r.pl * r.pp, phases=(r.t_pp, r.t_tg), wall=r.t)

    # Untimed: pages the GGUF into memory and fails here rather than in the table.
    warm = llama_cpp.run_batched_bench(
        gguf, BB_PROMPT, BB_OUTPUT, BB_REQUESTS, threads, batch=MAX_BATCHED_TOKENS
    )
    setup = ", ".join(f"{k} {v}" for k, v in warm.setup.items())
    print(f"llama.cpp {outtype}: {gguf.name}, warm-up run {warm.process_wall:.1f}s; {setup}")
    return Engine(f"llama.cpp {outtype}", run)


def llama_cpp_ready(args) -> str | None:
    """None when llama-batched-bench is built (building it now if need be), else why not."""
    try:
        llama_cpp.build()
        bad = set(args.llama_cpp_types.split(",")) - set(llama_cpp.converter_outtypes())
        if bad:
            return f"the converter has no --outtype {sorted(bad)}"
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return None


# --- the model ----------------------------------------------------------------------------------
def model_config(name: str, max_len: int) -> transformers.PretrainedConfig:
    """MODELS[name] as a transformers config (a Llama unless it names its `model_type`); the toy
    shapes take `max_len` positions, the published ones keep their own."""
    if name not in MODELS:
        raise SystemExit(f"unknown model {name!r}; one of: {', '.join(MODELS)}")
    shape = dict(MODELS[name])
    model_type = shape.pop("model_type", "llama")
    shape.setdefault("max_position_embeddings", max_len)
    return transformers.AutoConfig.for_model(
        model_type,
        **shape,
        initializer_range=INIT_STD,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=PAD_ID,
    )


def build_model(name: str, max_len: int, tmpdir: str):
    torch.manual_seed(1234)
    cfg = model_config(name, max_len)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    model = model.float().eval()
    model.save_pretrained(tmpdir)
    model.generation_config.eos_token_id = None  # EOS never ends an HF run; kvpage uses ignore_eos
    return model


def warm_hf(model, vocab: int, seed: int) -> None:
    rng = random.Random(seed + 3)
    wl = Workload("warm", [random_tokens(rng, 48, vocab) for _ in range(4)], [8] * 4)
    run_hf_generate(model, wl, 4)()
    with contextlib.suppress(Exception):  # a failure here shows up, reported, in the timed run
        run_hf_cb(model, wl)()


# --- reporting ----------------------------------------------------------------------------------
def agreement(a: RunResult, b: RunResult) -> str:
    if a.error or b.error or not a.tokens or not b.tokens:
        return "-"
    same = sum(x == y for x, y in zip(a.tokens, b.tokens, strict=True))
    return f"{same}/{len(a.tokens)}"


def print_mismatches(model, wl: Workload, results: list[RunResult]) -> None:
    """Where an fp32 row's greedy tokens leave HF generate's, and HF's own top-2 logit gap at that
    position (teacher-forced on HF's tokens): a gap at the scale HF's logits move by between batch
    sizes is a numeric tie that any other fp32 summation order may flip, not a cache bug."""
    by = {r.engine: r for r in results}
    gen = by.get("hf generate")
    if gen is None or gen.error or not gen.tokens:
        return
    gaps: dict[tuple[int, int], float] = {}
    for r in results:
        if r is gen or r.error or not r.tokens or "bf16" in r.engine:
            continue
        for i, (mine, ref) in enumerate(zip(r.tokens, gen.tokens, strict=True)):
            if mine == ref:
                continue
            t = next(j for j, (x, y) in enumerate(zip(mine, ref, strict=False)) if x != y)
            if (i, t) not in gaps:
                gaps[i, t] = _hf_top2_gap(model, wl.prompts[i] + ref[:t])
            print(
                f"  {r.engine}: request {i} leaves HF generate at output {t}, where HF's own "
                f"top-2 logit gap is {gaps[i, t]:.2e}"
            )


def _hf_top2_gap(model, tokens: list[int]) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def print_table(wl: Workload, results: list[RunResult], flops: float, peak: float) -> None:
    """Median wall over the repeats; `x HF gen` = median vs median, `min/min` = fastest repeat vs
    fastest repeat."""
    useful = sum(wl.max_tokens)
    by = {r.engine: r for r in results}
    gen, cb = by.get("hf generate"), by.get("hf generate_batch")
    ref_gen = gen.wall if gen and not gen.error else None
    ref_cb = cb.wall if cb and not cb.error else None
    fastest_gen = min(gen.walls) if ref_gen else None
    head = (
        f"{'engine':<24} {'wall s':>8} {'out tok/s':>10} {'x HF gen':>9} {'min/min':>8} "
        f"{'x HF CB':>8} "
        f"{'GFLOP/s':>8} {'% mm':>6} {'prefill tok':>11} {'TTFT p50':>9} {'=HF gen':>8}"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        if r.error:
            print(f"{r.engine:<24} FAILED: {r.error[:200]}")
            continue
        gfs = flops / r.wall / 1e9
        ttft = f"{statistics.median(r.ttfts) * 1e3:8.0f}ms" if r.ttfts else f"{'-':>9}"
        prefill = "-" if r.prefill_computed is None else str(r.prefill_computed)
        print(
            f"{r.engine:<24} {r.wall:8.2f} {useful / r.wall:10.1f} "
            f"{_ratio(ref_gen, r.wall):>9} {_ratio(fastest_gen, min(r.walls)):>8} "
            f"{_ratio(ref_cb, r.wall):>8} {gfs:8.1f} "
            f"{100 * gfs / peak:5.1f}% {prefill:>11} {ttft} {agreement(r, gen) if gen else '-':>8}"
        )


def print_cb_span(results: list[RunResult]) -> None:
    """generate_batch starts and stops a manager thread per call; say how much of its wall that is."""
    by = {r.engine: r for r in results}
    cb = by.get("hf generate_batch")
    if cb is None or cb.error or not cb.spans:
        return
    span = statistics.median(cb.spans)
    others = ", ".join(
        f"{r.engine} {span / r.wall:.2f}x"
        for r in results
        if r.engine.startswith("kvpage") and not r.error
    )
    print(
        f"  hf generate_batch: {span:.2f}s from first submit to last token, the other "
        f"{cb.wall - span:.2f}s of its wall is manager start/stop; against that span: {others}"
    )


def _ratio(ref: float | None, wall: float) -> str:
    return "-" if ref is None else f"{ref / wall:.2f}x"


def print_phase_table(
    wl: Workload, results: list[RunResult], flops: float, ceilings: list[float]
) -> None:
    """Scenario bb: prefill, decode and overall rates, each as `min-time / median` over the
    repeats (the first figure comes from the fastest repeat of that quantity); GFLOP/s likewise,
    and its share of the torch.mm ceiling measured at the start of every round (best / median)."""
    prompt = sum(map(len, wl.prompts))
    out = sum(wl.max_tokens)

    def pair(tokens: float, times: list[float]) -> str:
        return f"{tokens / min(times):7.1f} / {tokens / statistics.median(times):7.1f}"

    head = (
        f"{'engine':<24} {'wall s min/med':>15} {'prefill tok/s':>17} {'decode tok/s':>17} "
        f"{'out tok/s':>17} {'GFLOP/s':>13} {'% mm':>11}"
    )
    best_mm, med_mm = max(ceilings), statistics.median(ceilings)
    repeats = max(len(r.walls) for r in results)
    print(f"\n{wl.name}: rates as min-time / median over {repeats} repeats")
    print(head)
    print("-" * len(head))
    for r in results:
        if r.error or not r.walls:
            continue
        walls = f"{min(r.walls):6.2f} / {r.wall:6.2f}"
        if r.phases:
            # Decode-phase tokens: llama.cpp feeds ntg tokens per sequence after the prefill; the
            # others sample their first token in the prefill, so max_tokens - 1 remain.
            dec_tokens = out if r.engine.startswith("llama.cpp") else out - len(wl.prompts)
            pre = pair(prompt, [p for p, _ in r.phases])
            dec = pair(dec_tokens, [d for _, d in r.phases])
        else:
            pre = dec = f"{'-':>17}"
        best, med = flops / min(r.walls) / 1e9, flops / r.wall / 1e9
        print(
            f"{r.engine:<24} {walls:>15} {pre:>17} {dec:>17} {pair(out, r.walls):>17} "
            f"{best:5.1f} / {med:5.1f} {100 * best / best_mm:3.0f}% / {100 * med / med_mm:3.0f}%"
        )
    print(
        f"  torch.mm ceiling, measured before each round: {best_mm:.1f} best / {med_mm:.1f} "
        "median GFLOP/s (% mm: best vs best, median vs median). prefill = start -> every request has "
        "its first token (kvpage: max RequestMetrics.first_token_time; HF generate: first logits; "
        "HF CB: max first timestamp from first submission; llama.cpp: T_PP), decode = from there "
        "to the last token (llama.cpp: T_TG, 64 passes; the others 63 steps after the prefill's "
        "token), out tok/s = useful output tokens / wall (llama.cpp wall = T_PP + T_TG)."
    )


# --- profiling ----------------------------------------------------------------------------------
def profile_kvpage(model_dir: str, wl: Workload, seed: int, top: int = 18) -> None:
    """Where kvpage's time goes on this workload: Python functions (cProfile, by self time) and
    tensor operators (torch.profiler, by CPU self time)."""
    llm = kvpage_llm(model_dir, blocks_needed(wl), True, seed)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in wl.max_tokens]
    prof = cProfile.Profile()
    prof.enable()
    llm.generate(wl.prompts, params, use_tqdm=False)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    print(f"\n[profile] kvpage {wl.name}: cProfile, top {top} by self time")
    print("\n".join(line for line in buf.getvalue().splitlines() if line.strip())[-6000:])
    llm = kvpage_llm(model_dir, blocks_needed(wl), True, seed)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tp:
        llm.generate(wl.prompts, params, use_tqdm=False)
    print(f"\n[profile] kvpage {wl.name}: torch operators, top {top} by self CPU time")
    print(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))


# --- main ---------------------------------------------------------------------------------------
PEERS = {"hf", "hf-generate", "llama.cpp", "vllm"}
COLLECTIVE_SHARE: dict[str, float] = {}  # engine name -> collective time / wall, last repeat


def run_scenario(
    model, model_dir: str, wl: Workload, args, fm: FlopModel, peak: float, llama: str | None
) -> None:
    """`llama`: None to leave llama.cpp out, "" to run it, else why it cannot run."""
    engines = []
    if args.peers & {"hf", "hf-generate"}:
        engines.append(Engine("hf generate", run_hf_generate(model, wl, args.hf_batch)))
    if "hf" in args.peers:
        engines.append(Engine("hf generate_batch", run_hf_cb(model, wl)))
    if wl.prefix_len:
        engines += [
            kvpage_engine("kvpage cache off", model_dir, wl, False, args.seed),
            kvpage_engine("kvpage cache on", model_dir, wl, True, args.seed),
            kvpage_engine("kvpage cache on, warm", model_dir, wl, True, args.seed, prime=True),
        ]
    else:
        engines.append(kvpage_engine("kvpage", model_dir, wl, True, args.seed))
    if args.tensor_parallel_size > 1:  # beside TP=1 on the same workload
        tp = args.tensor_parallel_size
        name = f"kvpage tp={tp}"
        engines.append(kvpage_engine(name, model_dir, wl, True, args.seed, tp=tp))
    if "bfloat16" in args.dtypes:  # beside llama.cpp's bf16 GGUF and HF generate in bf16
        bf16 = BF16_MODELS.setdefault(id(model), copy.deepcopy(model).to(torch.bfloat16))
        engines.append(
            kvpage_engine("kvpage bf16", model_dir, wl, True, args.seed, dtype="bfloat16")
        )
        if args.peers & {"hf", "hf-generate"}:
            engines.append(Engine("hf generate bf16", run_hf_generate(bf16, wl, args.hf_batch)))
    failed: list[str] = []
    if llama is not None and wl.key != "bb":
        failed.append("llama.cpp: skipped, it runs scenario bb only (equal prompts)")
    elif llama:
        failed.append(f"llama.cpp: FAILED: {llama}")
    elif llama is not None:
        for outtype in args.llama_cpp_types.split(","):
            try:
                engines.append(llama_cpp_engine(model_dir, outtype, args.threads))
            except Exception as err:  # one GGUF type failing leaves the others
                failed.append(f"llama.cpp {outtype}: FAILED: {type(err).__name__}: {err}")
    results = {e.name: RunResult(e.name) for e in engines}
    ceilings: list[float] = []
    for _ in range(args.repeats):  # interleaved, so drift in machine load hits every engine alike
        if wl.key == "bb":
            ceilings.append(mm_peak_gflops())
        for engine in engines:
            if not results[engine.name].error:
                measure(engine, results[engine.name])
    for engine in engines:
        engine.teardown()
    print(
        f"\n{wl.name}: {len(wl.prompts)} requests, {sum(map(len, wl.prompts))} prompt tokens, "
        f"{sum(wl.max_tokens)} useful output tokens, {fm.workload(wl) / 1e9:.1f} useful GFLOP"
    )
    print_table(wl, list(results.values()), fm.workload(wl), peak)
    print_mismatches(model, wl, list(results.values()))
    for name, share in COLLECTIVE_SHARE.items():
        print(
            f"{name}: {share:.0%} of the wall in collectives on rank 0 (step broadcast + "
            "all-reduces, waiting for the workers included); the last repeat"
        )
    COLLECTIVE_SHARE.clear()
    for line in failed:
        print(line)
    print_cb_span(list(results.values()))
    if wl.key == "bb":
        print_phase_table(wl, list(results.values()), fm.workload(wl), ceilings or [peak])
    if args.profile:
        profile_kvpage(model_dir, wl, args.seed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--models",
        default=None,
        help="legacy: small,120m; solo: 125m (quick: small); solo also NAME:DTYPE+DTYPE (that "
        "model's dtypes), e.g. llama3.2-1b:bfloat16+int8",
    )
    ap.add_argument("--scenarios", default="a,b,c")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hf-batch", type=int, default=32, help="static batch size of HF generate")
    ap.add_argument("--profile", action="store_true", help="profile kvpage on each scenario")
    ap.add_argument(
        "--peers",
        default=None,
        help="comma-separated: hf (generate and generate_batch; solo: generate), hf-generate "
        "(generate only), llama.cpp, vllm (solo mode only); default hf (solo: hf,vllm,llama.cpp)",
    )
    ap.add_argument(
        "--llama-cpp-types", default="f32,bf16", help="GGUF types llama.cpp runs (f32, bf16, ...)"
    )
    ap.add_argument(
        "--dtypes",
        default=None,
        help="kvpage (and peer) dtypes: float32,bfloat16; default float32 (solo: both; solo "
        "also takes int8 and int8-bf16: int8 weights and LM head against llama.cpp's Q8_0)",
    )
    ap.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="also run kvpage split over N processes (gloo) on the same workload",
    )
    add_solo_args(ap)
    args = ap.parse_args()
    solo_mode = is_solo(args)
    args.peers = set(_default(args.peers, "hf,vllm,llama.cpp" if solo_mode else "hf").split(","))
    args.peers -= {""}
    args.dtypes = set(
        _default(args.dtypes, "float32,bfloat16" if solo_mode else "float32").split(",")
    )
    args.dtypes -= {""}
    known = {"float32", "bfloat16"} | ({"int8", "int8-bf16"} if solo_mode else set())
    if args.dtypes - known:
        raise SystemExit(f"unknown dtype(s) {sorted(args.dtypes - known)}; choose from {known}")
    if args.peers - PEERS:
        raise SystemExit(f"unknown peer(s) {sorted(args.peers - PEERS)}; choose from {PEERS}")
    torch.set_num_threads(args.threads)
    if solo_mode:
        return solo_main(args)
    if "vllm" in args.peers:
        raise SystemExit("the vllm peer runs in solo mode only (--solo, --rounds or --workloads)")
    args.models = args.models or "small,120m"
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    # On CPU the CB manager logs, per call, that psutil is missing; its failures still reach the table.
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
    started = time.perf_counter()
    peak = mm_peak_gflops()
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{args.threads} threads, fp32, block_size {BLOCK_SIZE}, max_num_seqs {MAX_NUM_SEQS}, "
        f"max_num_batched_tokens {MAX_BATCHED_TOKENS}, HF generate static batch {args.hf_batch}, "
        f"repeats {args.repeats} (median wall), peers {','.join(sorted(args.peers)) or 'none'}"
    )
    print(f"torch.mm 1024x1024 @ 1024x1024: {peak:.1f} GFLOP/s (the '% mm' reference)")
    llama = None
    if "llama.cpp" in args.peers:
        llama = llama_cpp_ready(args) or ""
        if not llama:
            print(
                f"llama.cpp: {llama_cpp.binary_path()} (llama-cpp-python {llama_cpp.VERSION}), "
                f"types {args.llama_cpp_types}, {args.threads} threads, scenario bb only"
            )
    for name in args.models.split(","):
        with tempfile.TemporaryDirectory() as tmpdir:
            model = build_model(name, 1024, tmpdir)
            fm = FlopModel.of(model)
            total = sum(p.numel() for p in model.parameters())
            print(
                f"\n=== model {name}: {total / 1e6:.1f}M parameters "
                f"({fm.layer_weights / 1e6:.1f}M in layer matmuls, head {fm.head_weights / 1e6:.1f}M)"
            )
            if args.peers & {"hf", "hf-generate"}:
                warm_hf(model, model.config.vocab_size, args.seed)
            for wl in make_workloads(
                args.scenarios, args.requests, model.config.vocab_size, args.seed
            ):
                run_scenario(model, tmpdir, wl, args, fm, peak, llama)
    print(f"\ntotal wall {time.perf_counter() - started:.0f}s")


# --- solo mode: every engine in its own process, alone, once per round (bench/solo_rounds.py) ---
def add_solo_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("solo mode (on with --solo, --quick, --rounds, --workloads or vllm)")
    g.add_argument("--solo", action="store_true", help="run the solo-mode harness")
    g.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3)")
    g.add_argument(
        "--workloads", default=None, help="batched,single,prefix,varied (the default: all)"
    )
    g.add_argument(
        "--quick", action="store_true", help="smoke test: small model, 1 round, tiny workloads"
    )
    g.add_argument("--vllm-eager", action="store_true", help="vLLM with enforce_eager=True")
    g.add_argument(
        "--base-tree",
        default=None,
        help="a checkout of another commit (git worktree add DIR REV): its kvpage runs as the "
        "peer kvpage-base, for before/after ratios",
    )
    g.add_argument("--vllm-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE (GiB)")


def is_solo(args) -> bool:
    asked = args.solo or args.quick or args.rounds is not None or args.workloads is not None
    asked = asked or args.base_tree is not None
    return asked or "vllm" in (args.peers or "").split(",")


def _default(value: str | None, default: str) -> str:
    return default if value is None else value


def solo_main(args) -> None:
    import solo_rounds  # bench/: imported here so the legacy mode does not need it

    args.rounds = args.rounds or (1 if args.quick else 3)
    args.models = args.models or ("small" if args.quick else "125m")
    args.workloads = (args.workloads or ",".join(solo_rounds.solo.WORKLOADS)).split(",")
    args.dtypes = [d for d in solo_rounds.solo.PRECISIONS if d in args.dtypes]
    args.vllm_eager = args.vllm_eager or args.quick  # torch.compile warm-up costs minutes
    if args.peers - {"hf", "hf-generate", "vllm", "llama.cpp"}:
        raise SystemExit(f"solo mode peers: hf, vllm, llama.cpp (not {sorted(args.peers)})")
    args.peers = {"hf" if p == "hf-generate" else p for p in args.peers}
    if args.rounds < 3 and not args.quick:
        print(f"warning: {args.rounds} round(s); use at least 3 for numbers worth quoting")
    logs = Path(tempfile.mkdtemp(prefix="kvpage-solo-"))
    print(
        f"solo mode: torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{args.threads} threads per engine, rounds {args.rounds}, dtypes {','.join(args.dtypes)}, "
        f"peers {','.join(sorted(args.peers))}, vLLM eager {args.vllm_eager}; logs in {logs}"
    )
    for spec in args.models.split(","):
        name, model_args = spec.partition(":")[0], model_dtypes(spec, args)
        with tempfile.TemporaryDirectory() as tmpdir:
            model_dir = Path(tmpdir) / "model"
            model = build_model(name, solo_rounds.MAX_MODEL_LEN, str(model_dir))
            total = sum(p.numel() for p in model.parameters())
            vocab = model.config.vocab_size
            cfg = model.config
            del model  # the parent holds no engine while the rounds run
            print(
                f"\n=== model {name}: {total / 1e6:.1f}M parameters, d {cfg.hidden_size}, "
                f"{cfg.num_hidden_layers} layers, {cfg.num_attention_heads} heads / "
                f"{cfg.num_key_value_heads} KV heads, vocab {vocab}; dtypes "
                f"{','.join(model_args.dtypes)}"
            )
            solo_rounds.run_rounds(model_args, model_dir, vocab, logs)


def model_dtypes(spec: str, args):
    """Solo mode's `--models NAME[:DTYPE+DTYPE...]`: `args` with that model's dtypes (default
    `--dtypes`), e.g. `qwen2.5-0.5b:float32+bfloat16,llama3.2-1b:bfloat16+int8`."""
    import solo  # bench/

    wanted = spec.partition(":")[2]
    if not wanted:
        return args
    unknown = set(wanted.split("+")) - set(solo.PRECISIONS)
    if unknown:
        raise SystemExit(f"unknown dtype(s) {sorted(unknown)} in --models {spec}")
    own = copy.copy(args)
    own.dtypes = [d for d in solo.PRECISIONS if d in wanted.split("+")]
    return own


if __name__ == "__main__":
    main()

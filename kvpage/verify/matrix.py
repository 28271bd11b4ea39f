"""The verification matrix: the gate over models x compute dtypes x KV formats x tensor-parallel
sizes, one report for all of it.

A cell is one configuration (model, dtype, KV format, TP size) and the parts of the gate that run
in it (suites, mutants). The user's engine flags (`kvpage verify --block-size ...`) are the base
of every cell's engine; the cell's own dimensions win over them, and a case's own fields win over
both (kvpage.verify.suites.Runtime says why).

Where mutants run. A mutant is a bug planted in the cache, scheduler or sampler seams; whether a
suite catches it depends on what the engine decides, not on the model's width or the dtype its
matmuls round in, so the whole list runs once, on the main cell, where its score and attribution
have always been measured. Running it again on another model or dtype would repeat the same
verdicts at the cost of minutes. The exception is a bug bound to a KV format (its `kv_cache_dtype`):
it exists only where the pool is in that format, so it runs where that format is exercised —
the main cell's int8 copies by default, and in the full matrix also the cell whose whole pool is
in that format ("format" below). A bug bound to int8 weights (Mutant.weights: the LoRA delta
scaled by the weight scales) runs likewise on the int8-weights cell, the only one whose
projections have scales. The other cells are there for what mutants cannot show: code
paths that exist only at head_dim 64, with biases, in 16-bit compute, in another KV format or
split over two ranks, each checked against the contiguous reference by every case.

DEFAULT (`make run`) runs these cells, two at a time (`--jobs 2`: two processes, since every cell
is single-threaded Python and `make run` is sized for a 2-core machine); the main cell starts
first and the others fill the second lane beside it. Seconds per cell from `time make run` on a
2-core machine shared with three other agents' jobs (load average 1.8-2.6 while it ran):

  cell                                 suites                                    mutants  seconds
  tiny-llama/float32/kv-auto+int8/tp1  all ten, + prefix/batching/preemption     all 45      54.3
                                       and a CoW case in int8
  tiny-qwen2/float32/kv-auto/tp1       prefix, batching, preemption, parallel    none        18.5
  tiny-llama/bfloat16/kv-auto/tp1      prefix, batching, sampling, parallel      none        15.3
  tiny-llama/float32/kv-fp8_e4m3/tp1   prefix, batching                          none         4.4
  tiny-llama/float32/kv-bfloat16/tp1   batching, preemption                      none         3.3
  tiny-qwen2/float32/kv-auto/tp2       batching, parallel, lora                  none         8.1
                                       (lora added later: 16 s alone at load ~5)
  tiny-qwen2/float32/kv-int8/tp1       prefix, batching, preemption, parallel    none        10.6
  tiny-qwen2/float32/kv-int8/tp2       batching                                  none         5.7
  tiny-qwen2/float32/w-int8/kv-auto/tp1  batching, preemption                    none         4.9
                                       (added later, timed alone at load ~1.7, not in the total)
                                       + lora, with its int8 mutant ("format"): about +11 s
                                       at load 3.5-7, most of it the model stage's 4 adapter
                                       cases on int8 (7-8 s); the lora suite 2.8-3.9 s and the
                                       mutant 0.4 s (the cell's 37-65 s wall at load ~3.5 is
                                       mostly batching and preemption, which vary 2x run to run)
  tiny-qwen2/float32/w-int8/kv-auto/tp2  lora                                    int8's 1     9.8
                                       (added with LoRA on int8 weights: 9.8 and 10.4 s alone
                                       at load 4-7, workers' start included; not in the total)
  tiny-hybrid/float32/kv-auto/tp1      layer_groups                              the 4       4.5
                                       (added with per-layer-group KV: 4 cases and its 4 mutants,
                                       each caught by the first case; from a `time make run` at
                                       load 4-5, which took 5m31s in all: not in the total)
  total wall (two lanes)                                                                     65.2
                                                        (`time make run`: 1m07s, under 3 min)

Timings move with the load: at load 3.3-4.4 the same run took 1m37s (main cell 63 s, 37
mutants then), at ~4.5 2m03s.
At load average ~13 the first six of these cells took 326 s: the budget holds on an idle or lightly
shared 2-core machine, not on a saturated one.

`--matrix full` runs every combination of MODELS x DTYPES x KV_DTYPES x TP_SIZES (a 16-bit model
with bfloat16 KV is its own auto cell, so dropped), every suite in each, mutants as above: 28
cells, plus the int8-weights cells (TP 1 and 2, the widened tiles, the int8 head) with every
suite. Not timed end to end; from the per-suite times above (every suite of a cell ~30-60 s,
int8 and TP 2 cells up to twice that), expect 10-30 minutes on two cores, by load.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from multiprocessing import get_context

from kvpage.config import KV_CACHE_DTYPES
from kvpage.verify.cases import ALL_SUITES, SUITES
from kvpage.verify.gate import MODEL_CHECKS, run_gate
from kvpage.verify.generated.stage import GeneratedStage
from kvpage.verify.mutants import MUTANTS
from kvpage.verify.mutants.layer_groups import LAYER_GROUP_MUTANTS

MODELS = ("builtin:tiny-llama", "builtin:tiny-qwen2")
DTYPES = ("float32", "bfloat16")
KV_DTYPES = KV_CACHE_DTYPES  # every KV format the engine stores
TP_SIZES = (1, 2)
MUTANT_PARTS = ("all", "format", "groups", "none")
# Scenarios of the default generated stage: the generality figure is measured over the same
# ones on every machine (a time budget alone would make it depend on the machine's speed).
DEFAULT_SCENARIOS = 60


@dataclass(frozen=True, slots=True)
class Cell:
    """One configuration and the parts of the gate run in it. `mutants`: "all" (every mutant
    the cell's formats allow), "format" (only those bound to the cell's KV formats or its
    weight format), "none".
    `kv_copies`: quantized formats the prefix, batching and preemption suites run in again
    (the pool itself stays in `kv_cache_dtype`)."""

    model: str
    dtype: str = "float32"
    kv_cache_dtype: str | None = "auto"  # None: each case's own (generated scenarios draw it)
    tensor_parallel_size: int = 1
    suites: tuple[str, ...] = SUITES
    mutants: str = "none"
    kv_copies: tuple[str, ...] = ()
    generated: bool = False  # the generated stage (and, with mutants, the generality figure)
    stack: bool = False  # the whole-stack suite: server and router (and their mutants)
    quantization: str = "none"  # the weights (EngineConfig.quantization); the reference's too
    quantize_lm_head: bool = False  # the LM head in int8 too (EngineConfig.quantize_lm_head)
    # The model stage (kvpage.verify.gate.MODEL_CHECKS): transformers on the cell's model, in
    # its dtype and weight format ("served"); "full" adds every family and the stage's mutants.
    model_check: str = "served"
    # Fast paths (kvpage.model.kernels.FAST_PATHS) the cell keeps off, so the paths behind them
    # run: int8's widened tiles where the weight GEMV takes every row count (AVX-512).
    paths_off: tuple[str, ...] = ()
    # Speculative decoding (SPECULATIVE_CONFIGS): every case's engine speculates, and every
    # greedy token must still equal the reference's plain decoding ("": plain decoding).
    speculative: str = ""

    def __post_init__(self) -> None:
        if self.speculative and self.speculative not in SPECULATIVE_CONFIGS:
            raise ValueError(f"speculative must be one of {sorted(SPECULATIVE_CONFIGS)}")
        if self.mutants not in MUTANT_PARTS:
            raise ValueError(f"mutants must be one of {MUTANT_PARTS}, got {self.mutants!r}")
        if self.model_check not in MODEL_CHECKS:
            raise ValueError(f"model_check must be one of {MODEL_CHECKS}")

    @property
    def name(self) -> str:
        model = self.model.removeprefix("builtin:")
        copies = "".join(f"+{d}" for d in self.kv_copies)
        parts = "".join(
            f"+{p}" for p, on in (("generated", self.generated), ("stack", self.stack)) if on
        )
        kv = self.kv_cache_dtype or "drawn"
        weights = "" if self.quantization == "none" else f"/w-{self.quantization}"
        weights += "+head" if self.quantize_lm_head else ""
        dims = f"{self.dtype}{weights}/kv-{kv}{copies}/tp{self.tensor_parallel_size}"
        off = "".join(f"/off-{p}" for p in self.paths_off)
        spec = f"/spec-{self.speculative}" if self.speculative else ""
        return f"{model}/{dims}{off}{spec}{parts}"

    def engine(self, base: dict) -> dict:
        """The user's engine fields with the cell's dimensions over them (a KV format of None
        is left to the cases: the generated scenarios draw theirs)."""
        kv = {} if self.kv_cache_dtype is None else {"kv_cache_dtype": self.kv_cache_dtype}
        weights = {} if self.quantization == "none" else {"quantization": self.quantization}
        weights |= {"quantize_lm_head": True} if self.quantize_lm_head else {}
        spec = {}
        if self.speculative:
            spec = {"speculative_config": SPECULATIVE_CONFIGS[self.speculative]}
        return {
            **base,
            "dtype": self.dtype,
            **kv,
            **weights,
            **spec,
            "tensor_parallel_size": self.tensor_parallel_size,
        }

    def mutant_names(self) -> bool | tuple[str, ...]:
        if self.mutants == "none":
            return False
        if self.mutants == "all":
            return True
        if self.mutants == "groups":
            return tuple(m.name for m in LAYER_GROUP_MUTANTS)
        formats = (self.kv_cache_dtype, *self.kv_copies)
        return tuple(
            m.name for m in MUTANTS if m.kv_cache_dtype in formats or m.weights == self.quantization
        )


MAIN = Cell("builtin:tiny-llama", mutants="all", kv_copies=("int8",), model_check="full")
# Generated scenarios draw their own engine configurations (block size, pool, budget, KV format,
# preemption); the stack drives the server in-process. Each is a cell of its own, so the two
# lanes of `make run` stay even.
GENERATED = Cell(
    "builtin:tiny-llama",
    kv_cache_dtype=None,
    suites=(),
    mutants="all",
    generated=True,
    model_check="none",
)
STACK = Cell("builtin:tiny-llama", suites=(), mutants="all", stack=True, model_check="none")
# Speculative cells' configurations: n-gram lookup (drafts cost nothing, rejections common) and
# the target's own int8 copy as its draft model (most drafts kept, the bonus row often drawn).
SPECULATIVE_CONFIGS = {
    "ngram": {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
    },
    "self-int8": {
        "method": "draft_model",
        "model": None,
        "quantization": "int8",
        "num_speculative_tokens": 3,
    },
}
# Every hand-written suite with speculation on: the cases' greedy tokens are the reference's
# plain decoding's, and the sampled ones are judged by the rejection-rule oracle
# (kvpage.verify.speculative). The speculative suite itself runs on the main cell (its cases
# speculate by their own config), where the speculative mutants run.
SPECULATIVE = Cell(
    "builtin:tiny-llama",
    suites=tuple(s for s in SUITES if s != "speculative"),
    speculative="ngram",
    model_check="none",
)
SPECULATIVE_INT8 = Cell(
    "builtin:tiny-qwen2",
    suites=("prefix", "batching", "preemption", "sampling", "parallel"),
    speculative="self-int8",
    model_check="none",
)

# What `--suite` may name besides the hand-written suites.
PARTS = ("generated", "stack", "model")
QWEN2 = "builtin:tiny-qwen2"
# Global and sliding-window layers (kvpage.cache.groups): the layer-group suite and mutants,
# which cannot be expressed on the other models (they are "not applicable" on the main cell).
HYBRID = Cell("builtin:tiny-hybrid", suites=("layer_groups",), mutants="groups")

# Int8 weights (EngineConfig.quantization): the engine's fused int8 matmul against the
# reference's own dequantise-then-float32-matmul of the same codes (kvpage.reference
# .weight_oracle). Qwen2's shape for its q/k/v biases (added after the fused product) and its
# non-square q/o; the suites whose steps pack many rows (prefill chunks beside decodes, re-prefill
# after preemption) through the same weights. Not prefix: 12 cases, 15 of the cell's 20 s (the
# float32 int8 kernel is slow at more than one row), and a prefix hit reads KV, not weights.
# LoRA on int8 weights: the lora suite against the reference's merge on the dequantised weights
# (kvpage.reference.lora_merge), and the mutants bound to int8 weights ("format").
INT8_WEIGHTS = Cell(
    QWEN2, quantization="int8", suites=("batching", "preemption", "lora"), mutants="format"
)
# Int8 weights under tensor parallelism (quantized on rank 0, then sharded: each rank's codes and
# scales are TP 1's rows or columns) with LoRA on them: every rank's shard of the slot tables
# beside its int8 shard, the row-parallel delta inside the all-reduce; the int8 mutant again,
# its factors sharded to every rank. The model stage is INT8_WEIGHTS' (the same weights).
INT8_WEIGHTS_TP2 = Cell(
    QWEN2,
    quantization="int8",
    tensor_parallel_size=2,
    suites=("lora",),
    mutants="format",
    model_check="none",
)
# The same weights with the weight GEMV off: where it takes every row count (AVX-512), the
# widened int8 tiles (kvpage.model.widened) would otherwise never run in the gate.
INT8_WIDENED = Cell(
    QWEN2, quantization="int8", suites=("batching",), paths_off=("gemv",), model_check="none"
)
# The LM head in int8 too (EngineConfig.quantize_lm_head) on a tied model: the embedding stays
# float, the head is an int8 copy, dequantised by the reference's own code like the other layers.
# One suite: the decoder layers' int8 path is INT8_WEIGHTS' to cover; this cell adds the head.
INT8_HEAD = Cell(
    "builtin:tiny-gpt2", quantization="int8", quantize_lm_head=True, suites=("batching",)
)

# Suites per cell: those whose cases exercise what the cell varies. Head_dim 64 and biases live
# in the KV layout and the attention read (prefix hits at offsets, packed batches, preempted and
# restored KV, forked blocks); 16-bit compute also changes sampling (near-ties on sampled steps);
# a KV format lives in the pool's writes, reads and copies; TP in the sharded pool and the
# broadcast step. The scheduler-only suites (failure, stop, resources, namespaces, policy) run on
# the main cell: they test decisions no model dimension changes.
DEFAULT: tuple[Cell, ...] = (
    MAIN,
    # The generated cell is the longest on a slow CPU (152 s of a 219 s gate on an AVX2 machine
    # when it started last): it starts beside the main cell, and the short ones fill after.
    GENERATED,
    Cell(QWEN2, suites=("prefix", "batching", "preemption", "parallel")),
    Cell(
        "builtin:tiny-llama",
        dtype="bfloat16",
        suites=("prefix", "batching", "sampling", "parallel"),
    ),
    # tiny-qwen2 in bfloat16: head_dim 64 and its biases under 16-bit ties (forks sampled at
    # a top-p boundary, prompt-logprob rows, LoRA's float32 delta); 34 s alone
    Cell(QWEN2, dtype="bfloat16", suites=("batching", "parallel", "prompt_logprobs", "lora")),
    Cell("builtin:tiny-llama", kv_cache_dtype="fp8_e4m3", suites=("prefix", "batching")),
    Cell("builtin:tiny-llama", kv_cache_dtype="bfloat16", suites=("batching", "preemption")),
    Cell(QWEN2, tensor_parallel_size=2, suites=("batching", "parallel", "lora")),
    Cell(QWEN2, kv_cache_dtype="int8", suites=("prefix", "batching", "preemption", "parallel")),
    Cell(QWEN2, kv_cache_dtype="int8", tensor_parallel_size=2, suites=("batching",)),
    INT8_WEIGHTS,
    INT8_WEIGHTS_TP2,
    INT8_WIDENED,
    INT8_HEAD,
    HYBRID,
    SPECULATIVE,
    SPECULATIVE_INT8,
    STACK,
)


def full_cells() -> tuple[Cell, ...]:
    """Every combination, each with every suite; mutants where they add information."""
    cells = [MAIN]
    for model in MODELS:
        for dtype in DTYPES:
            for kv in KV_DTYPES:
                if dtype != "float32" and kv == "bfloat16":
                    continue  # the model's own dtype: the auto cell
                for tp in TP_SIZES:
                    cell = Cell(model, dtype, kv, tp, mutants=_full_mutants(model, dtype, kv, tp))
                    if _key(cell) != _key(MAIN):
                        cells.append(cell)
    weights = (
        replace(INT8_WEIGHTS, suites=SUITES),
        replace(INT8_WEIGHTS_TP2, suites=SUITES),
        replace(INT8_WIDENED, suites=SUITES),
        replace(INT8_HEAD, suites=SUITES),
    )
    return (*cells, *weights, HYBRID, SPECULATIVE, SPECULATIVE_INT8, GENERATED, STACK)


def _full_mutants(model: str, dtype: str, kv: str, tp: int) -> str:
    main = (model, dtype, tp) == (MAIN.model, MAIN.dtype, MAIN.tensor_parallel_size)
    return "format" if main and kv != "auto" else "none"


def _key(cell: Cell) -> tuple:
    return (
        cell.model,
        cell.dtype,
        cell.kv_cache_dtype,
        cell.tensor_parallel_size,
        cell.quantization,
        cell.quantize_lm_head,
        cell.generated,
        cell.stack,
        cell.paths_off,
        cell.speculative,
    )


MATRICES = {"default": lambda: DEFAULT, "full": full_cells}


def matrix_cells(name: str) -> tuple[Cell, ...]:
    return MATRICES[name]()


def pin(
    cells: Iterable[Cell], dims: dict, suites: tuple[str, ...] = ALL_SUITES, mutants: bool = True
) -> list[Cell]:
    """The cells with `dims` (Cell fields: the user's --model, --dtype, ...) fixed, narrowed
    to `suites`, without mutants when `mutants` is False. A cell left with no suite, or that
    became an earlier cell's configuration, is dropped (the earlier one runs at least as much:
    the main cell comes first)."""
    out, seen = [], set()
    for cell in cells:
        kept = tuple(s for s in cell.suites if s in suites)
        generated, stack = (
            cell.generated and "generated" in suites,
            cell.stack and "stack" in suites,
        )
        mode = cell.mutants if mutants else "none"
        check = cell.model_check if "model" in suites else "none"
        cell = replace(
            cell,
            **dims,
            suites=kept,
            kv_copies=cell.kv_copies if kept else (),
            mutants=mode,
            generated=generated,
            stack=stack,
            model_check=check,
        )
        if _refused(cell):
            continue
        if (kept or generated or stack or check != "none") and _key(cell) not in seen:
            seen.add(_key(cell))
            out.append(cell)
    return out


def _refused(cell: Cell) -> bool:
    """A configuration the engine refuses by name: a draft model under tensor parallelism
    (kvpage.engine.speculation runs the draft in one process)."""
    spec = SPECULATIVE_CONFIGS.get(cell.speculative, {})
    return spec.get("method") == "draft_model" and cell.tensor_parallel_size > 1


def single_cell(model: str, engine: dict, suites: tuple[str, ...], mutants: bool) -> Cell:
    """The one configuration a user names (`kvpage verify --model ...`): every part of the gate
    runs on it, in its own pool format only."""
    return Cell(
        model,
        dtype=engine.get("dtype", "float32"),
        kv_cache_dtype=engine.get("kv_cache_dtype", "auto"),
        tensor_parallel_size=engine.get("tensor_parallel_size", 1),
        quantization=engine.get("quantization", "none"),
        quantize_lm_head=engine.get("quantize_lm_head", False),
        suites=tuple(s for s in suites if s not in PARTS),
        mutants="all" if mutants else "none",
        generated="generated" in suites,
        stack="stack" in suites,
        model_check="full" if "model" in suites else "none",
    )


# --- running -------------------------------------------------------------------------------
@dataclass(slots=True)
class MatrixResult:
    """Each cell's GateResult.to_dict(), in the matrix's order; cells[0] is the main cell."""

    cells: list[Cell]
    results: list[dict]
    seconds: float
    engine: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(r["passed"] for r in self.results)

    def to_dict(self) -> dict:
        """The main cell's fields at the top level (what single-configuration readers know),
        with `passed`, `seconds` and the scores over the whole matrix, and `cells`."""
        main = self.results[0]
        mutants = _all_mutants(self.cells, self.results)
        run = [m for m in mutants.values() if m.get("not_applicable") is None]
        ran = any(r["mutation_check"] == "run" for r in self.results)
        return {
            **main,
            "passed": self.passed,
            "seconds": round(self.seconds, 2),
            "engine": self.engine,
            "mutation_score": _share(run, "caught") if ran and run else None,
            "attribution_score": _share(run, "attribution_ok") if ran and run else None,
            "mutation_check": "run" if ran else "skipped",
            "mutants": mutants,
            # the generated stage runs in one cell (the generated cell, or a --model run)
            "generated": next((r["generated"] for r in self.results if r.get("generated")), None),
            "cells": [_cell_dict(c, r) for c, r in zip(self.cells, self.results, strict=True)],
            "fast_paths": fast_path_cover(self.cells, self.results),
        }


def fast_path_cover(cells: list[Cell], results: list[dict]) -> dict[str, dict]:
    """Each fast path: available on this machine, and the cells whose honest engine took it
    (kvpage.verify.path_coverage); a path available and in no cell was checked by none."""
    cover: dict[str, dict] = {}
    for cell, result in zip(cells, results, strict=True):
        for path, seen in result.get("fast_paths", {}).items():
            entry = cover.setdefault(path, {"available": seen["available"], "cells": []})
            if seen["calls"]:
                entry["cells"].append(cell.name)
    return cover


def _share(mutants: list[dict], key: str) -> float:
    return sum(bool(m[key]) for m in mutants) / len(mutants)


def _all_mutants(cells: list[Cell], results: list[dict]) -> dict:
    """Every cell's mutants; the main cell's under their names, another cell's as name@cell."""
    merged = dict(results[0]["mutants"])
    for cell, result in zip(cells[1:], results[1:], strict=True):
        merged.update({f"{n}@{cell.name}": m for n, m in result["mutants"].items()})
    return merged


def _cell_dict(cell: Cell, result: dict) -> dict:
    suites = result["suites"]
    return {
        "cell": cell.name,
        "model": cell.model,
        "dtype": cell.dtype,
        "kv_cache_dtype": cell.kv_cache_dtype,
        "kv_copies": list(cell.kv_copies),
        "tensor_parallel_size": cell.tensor_parallel_size,
        "quantization": cell.quantization,
        "quantize_lm_head": cell.quantize_lm_head,
        "parts": {
            "suites": list(cell.suites),
            "mutants": cell.mutants,
            "generated": cell.generated,
            "stack": cell.stack,
            "model": cell.model_check,
            "paths_off": list(cell.paths_off),
        },
        "fast_paths": result.get("fast_paths", {}),
        "scenarios": (result.get("generated") or {}).get("scenarios", 0),
        "passed": result["passed"],
        "cases": sum(s["cases"] for s in suites.values()),
        "case_failures": sum(s["failures"] for s in suites.values()),
        "mutants_run": sum(m.get("not_applicable") is None for m in result["mutants"].values()),
        "mutation_score": result["mutation_score"],
        "attribution_score": result["attribution_score"],
        "seconds": result["seconds"],
        "suites": suites,
        "mutants": result["mutants"],
    }


def run_cell(
    cell: Cell,
    engine: dict,
    progress: bool = False,
    generated: GeneratedStage | None = None,
    report_dir: str | None = None,
) -> dict:
    """One cell's gate, as the report's dict (what crosses a process boundary). `generated`:
    the stage a generated cell runs (the default seed, count and budget when None)."""
    stage = (generated or GeneratedStage(count=DEFAULT_SCENARIOS)) if cell.generated else None
    result = run_gate(
        cell.model,
        cell.suites,
        mutants=cell.mutant_names(),
        progress=progress,
        kv_cache_dtypes=cell.kv_copies,
        engine=cell.engine(engine),
        generated=stage,
        stack=cell.stack,
        report_dir=report_dir,
        model_check=cell.model_check,
        paths_off=cell.paths_off,
    )
    return result.to_dict()


def run_matrix(
    cells: Iterable[Cell],
    engine: dict | None = None,
    jobs: int = 1,
    progress: bool = True,
    generated: GeneratedStage | None = None,
    report_dir: str | None = None,
) -> MatrixResult:
    """Every cell, `jobs` at a time (separate processes when > 1: each cell is single-threaded
    Python, so two cores run two cells in the time of one). Cells start in the given order,
    the longest first, so the short ones fill whichever lane frees first. `generated`: the
    stage of the generated cells; `report_dir`: where their reproducers go."""
    cells, engine = list(cells), dict(engine or {})
    start = time.perf_counter()
    extra = dict(generated=generated, report_dir=report_dir)
    if jobs <= 1 or len(cells) == 1:
        results = [_announce(c, run_cell(c, engine, progress, **extra), progress) for c in cells]
    else:
        results = _in_processes(cells, engine, jobs, progress, extra)
    return MatrixResult(cells, results, time.perf_counter() - start, engine)


def _in_processes(
    cells: list[Cell], engine: dict, jobs: int, progress: bool, extra: dict
) -> list[dict]:
    threads = max(1, (os.cpu_count() or 1) // jobs)
    with ProcessPoolExecutor(
        jobs, mp_context=get_context("spawn"), initializer=_limit_threads, initargs=(threads,)
    ) as pool:
        # The main cell's progress bar only: one bar on the terminal, the others print a line
        # each when done.
        futures = [
            pool.submit(run_cell, c, engine, progress and i == 0, **extra)
            for i, c in enumerate(cells)
        ]
        return [_announce(c, f.result(), progress) for c, f in zip(cells, futures, strict=True)]


def _limit_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)  # two cells on two cores: no oversubscription


def _announce(cell: Cell, result: dict, progress: bool) -> dict:
    if progress:
        verdict = "passed" if result["passed"] else "FAILED"
        print(f"cell {cell.name}: {verdict} ({result['seconds']:.1f}s)", file=sys.stderr)
    return result

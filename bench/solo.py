"""The workloads, statistics and table of `throughput.py`'s solo mode (bench/solo_rounds.py runs
it): every engine in its own process, alone, once per round. Pure Python, no third-party imports,
so tests/bench can check it without any engine.

Workloads (full / `--quick`):
  batched  32 x 128-token prompts, 64 out           (quick: 4 x 32, 16 out)
  single   1 x 128, 128 out                         (quick: 1 x 32, 32 out)
  prefix   32 x (512 shared + 32 unique), 32 out    (quick: 4 x (64 + 16), 16 out)
  varied   64 prompts of 16-256, outputs 16-256     (quick: 8 prompts of 16-64, outputs 8-32)
All tokens are random ids >= 3 (clear of pad/bos/eos), drawn from one seeded generator.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field

FIRST_TOKEN_ID = 3  # prompts avoid pad (0), bos (1) and eos (2)
WORKLOADS = ("batched", "single", "prefix", "varied")
# The precisions a row runs in: name -> (kvpage's model dtype, int8 weights with an int8 LM head).
# The int8 rows are kvpage's int8 against llama.cpp's Q8_0 (the peers without one are n/a).
PRECISIONS = {
    "float32": ("float32", False),
    "bfloat16": ("bfloat16", False),
    "int8": ("float32", True),
    "int8-bf16": ("bfloat16", True),
}
DTYPE_SHORT = {"float32": "fp32", "bfloat16": "bf16", "int8": "int8", "int8-bf16": "i8bf16"}


@dataclass(frozen=True, slots=True)
class BatchedBench:
    """The `llama-batched-bench` run that has this workload's shape: npl sequences of npp
    prompt tokens (one prompt shared by all with `shared`, its -pps), ntg decode passes each."""

    npp: int
    ntg: int
    npl: int
    shared: bool = False
    note: str = ""


@dataclass(slots=True)
class SoloWorkload:
    name: str
    title: str
    prompts: list[list[int]]
    max_tokens: list[int]
    llama_cpp: BatchedBench | None  # None: llama.cpp has no tool for this shape ("n/a")

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)

    def as_json(self) -> dict:
        return {"name": self.name, "prompts": self.prompts, "max_tokens": self.max_tokens}


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(n)]


def make_workloads(names: list[str], vocab: int, seed: int, quick: bool) -> list[SoloWorkload]:
    """The named workloads, in the order given; each from its own seeded generator, so one
    workload's tokens do not depend on which others are picked."""
    unknown = set(names) - set(WORKLOADS)
    if unknown:
        raise SystemExit(f"unknown workload(s) {sorted(unknown)}; choose from {list(WORKLOADS)}")
    makers = {"batched": _batched, "single": _single, "prefix": _prefix, "varied": _varied}
    return [makers[n](random.Random(f"{seed}:{n}"), vocab, quick) for n in names]


def _batched(rng: random.Random, vocab: int, quick: bool) -> SoloWorkload:
    n, p, o = (4, 32, 16) if quick else (32, 128, 64)
    prompts = [_tokens(rng, p, vocab) for _ in range(n)]
    bb = BatchedBench(p, o, n, note=f"-npp {p} -ntg {o} -npl {n}")
    return SoloWorkload("batched", f"{n} x {p} + {o} out", prompts, [o] * n, bb)


def _single(rng: random.Random, vocab: int, quick: bool) -> SoloWorkload:
    p, o = (32, 32) if quick else (128, 128)
    bb = BatchedBench(p, o, 1, note=f"-npp {p} -ntg {o} -npl 1")
    return SoloWorkload("single", f"1 x {p} + {o} out", [_tokens(rng, p, vocab)], [o], bb)


def _prefix(rng: random.Random, vocab: int, quick: bool) -> SoloWorkload:
    n, shared, unique, o = (4, 64, 16, 16) if quick else (32, 512, 32, 32)
    prefix = _tokens(rng, shared, vocab)
    prompts = [prefix + _tokens(rng, unique, vocab) for _ in range(n)]
    # batched-bench -pps shares one whole prompt: the shared part, without the unique tails.
    note = f"-pps -npp {shared} -ntg {o} -npl {n}: no {unique}-token unique tails"
    bb = BatchedBench(shared, o, n, shared=True, note=note)
    title = f"{n} x ({shared} shared + {unique}) + {o} out"
    return SoloWorkload("prefix", title, prompts, [o] * n, bb)


def _varied(rng: random.Random, vocab: int, quick: bool) -> SoloWorkload:
    n, lo, hi, out_lo, out_hi = (8, 16, 64, 8, 32) if quick else (64, 16, 256, 16, 256)
    prompts = [_tokens(rng, rng.randint(lo, hi), vocab) for _ in range(n)]
    outs = [rng.randint(out_lo, out_hi) for _ in range(n)]
    title = f"{n} prompts {lo}-{hi}, out {out_lo}-{out_hi}"
    return SoloWorkload("varied", title, prompts, outs, None)


# --- results ------------------------------------------------------------------------------------
@dataclass(slots=True)
class Cell:
    """One engine on one workload in one dtype, over the rounds."""

    walls: list[float] = field(default_factory=list)
    tokens: list[list[int]] | None = None  # the last round's outputs (None: engine gives none)
    error: str | None = None
    na: str | None = None  # why this engine cannot run this workload (printed as n/a)

    def rates(self, output_tokens: int) -> tuple[float, float]:
        """(tok/s at the fastest round, tok/s at the median round)."""
        return output_tokens / min(self.walls), output_tokens / statistics.median(self.walls)


@dataclass(frozen=True, slots=True)
class Agreement:
    same: int
    total: int
    first_diff: tuple[int, int] | None  # (request, output position) of the first mismatch

    def __str__(self) -> str:
        text = f"{self.same}/{self.total}"
        if self.first_diff is not None:
            req, pos = self.first_diff
            text += f", first diff: request {req} at output {pos}"
        return text


def agreement(mine: list[list[int]], ref: list[list[int]]) -> Agreement:
    """How many requests produced exactly `ref`'s tokens, and where the first one that did not
    leaves it (a length mismatch counts at the shorter length)."""
    same, first = 0, None
    for i, (a, b) in enumerate(zip(mine, ref, strict=True)):
        if a == b:
            same += 1
        elif first is None:
            pos = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
            first = (i, min(len(a), len(b)) if pos is None else pos)
    return Agreement(same, len(ref), first)


# --- the table ----------------------------------------------------------------------------------
def rate_text(cell: Cell, output_tokens: int) -> str:
    if cell.na:
        return "n/a"
    if cell.error or not cell.walls:
        return "FAILED"
    best, med = cell.rates(output_tokens)
    return f"{best:.1f} ({med:.1f})"


def ratio_text(mine: Cell, peer: Cell, output_tokens: int) -> str:
    if mine.na or mine.error or peer.na or peer.error or not mine.walls or not peer.walls:
        return "-"
    (mb, mm), (pb, pm) = mine.rates(output_tokens), peer.rates(output_tokens)
    return f"{mb / pb:.2f}x ({mm / pm:.2f}x)"


def agree_text(mine: Cell, peer: Cell) -> str:
    if peer.na or peer.error or mine.error:
        return "-"
    if peer.tokens is None or mine.tokens is None:
        return "no tokens"
    return str(agreement(mine.tokens, peer.tokens))


def roofline_text(cell: Cell, floor) -> str:
    """The row's floor (bench/roofline.py's Floor: `seconds`, `bound`) as a share of its fastest
    (median) wall, and which bound the floor is: `mem` (bytes / bandwidth) or `mm` (FLOPs / the
    matmul peak)."""
    if floor is None or cell.na or cell.error or not cell.walls:
        return "-"
    best, med = floor.seconds / min(cell.walls), floor.seconds / statistics.median(cell.walls)
    return f"{best:.0%} ({med:.0%}) {floor.bound}"


def table(
    workloads: list[SoloWorkload],
    dtypes: list[str],
    engines: list[str],
    cells: dict[tuple[str, str, str], Cell],
    me: str = "kvpage",
    floors: dict | None = None,
) -> list[str]:
    """One row per workload x dtype x engine: output tok/s at the fastest (median) round, the
    ratio kvpage / engine (fastest vs fastest, median vs median), the roofline fraction (the
    row's floor in `floors`, keyed like `cells`, over its fastest (median) wall), and how many
    requests gave exactly that engine's tokens (kvpage's vs the engine's)."""
    floors = floors or {}
    head = (
        f"{'workload':<44} {'dtype':<6} {'engine':<10} {'out tok/s best (med)':>22} "
        f"{'kvpage/engine':>17} {'roofline':>15}  kvpage tokens = engine's"
    )
    lines = [head, "-" * len(head)]
    for wl in workloads:
        for dtype in dtypes:
            mine = cells[(wl.name, dtype, me)]
            label = f"{wl.name}: {wl.title}"
            for engine in engines:
                cell = cells[(wl.name, dtype, engine)]
                ratio = "-" if engine == me else ratio_text(mine, cell, wl.output_tokens)
                agree = "" if engine == me else agree_text(mine, cell)
                if cell.error:
                    agree = f"FAILED: {cell.error[:120]}"
                elif cell.na:
                    agree = f"n/a: {cell.na}"
                roof = roofline_text(cell, floors.get((wl.name, dtype, engine)))
                lines.append(
                    f"{label:<44.44} {DTYPE_SHORT.get(dtype, dtype):<6} {engine:<10} "
                    f"{rate_text(cell, wl.output_tokens):>22} {ratio:>17} {roof:>15}  {agree}"
                )
                label = ""
    return lines

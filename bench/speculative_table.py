"""The rows, statistics and table of bench/speculative.py. Pure Python: the tests import it.

A row is one engine on one workload in one dtype; each round adds one Run to it. Rates:
  decode tok/s  tokens after the first / the time after the first token (kvpage: generate's end
                minus the request's first_token_time; llama-speculative: its `decoded` loop;
                llama-completion: its eval runs / eval time)
  e2e tok/s     output tokens / the whole request (kvpage: the generate call; llama.cpp: prompt
                + generation as the tool times them, model load excluded)
Speculation counters: kvpage's LLM.stats() spec_decode_* (the timed request only), llama.cpp's
n_drafted / n_accept. acceptance = accepted / drafted tokens; mean accepted length = 1 +
accepted / draft rounds (tokens per target pass).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

# engine -> its plain-decoding baseline (the "x plain" column)
BASELINE = {"kvpage-draft": "kvpage", "kvpage-ngram": "kvpage", "llama.cpp-draft": "llama.cpp"}
# kvpage engine -> llama.cpp's engine doing the same (the "x llama.cpp" column)
PEER = {"kvpage": "llama.cpp", "kvpage-draft": "llama.cpp-draft"}


@dataclass(frozen=True, slots=True)
class Run:
    """One round of one row."""

    output_tokens: int
    decode_tokens: int  # tokens after the first
    decode_s: float
    total_s: float
    tokens: list[int] | None = None
    drafted: int | None = None  # draft tokens proposed (None: no speculation)
    accepted: int | None = None
    rounds: int | None = None  # draft rounds (kvpage's spec_decode_num_drafts)

    @property
    def decode_rate(self) -> float:
        return self.decode_tokens / self.decode_s

    @property
    def e2e_rate(self) -> float:
        return self.output_tokens / self.total_s


@dataclass(slots=True)
class Row:
    workload: str
    dtype: str
    engine: str
    runs: list[Run] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.runs)

    def rates(self, kind: str) -> tuple[float, float]:
        """(best, median) over the rounds of `kind` "decode" or "e2e" tok/s."""
        values = [r.decode_rate if kind == "decode" else r.e2e_rate for r in self.runs]
        return max(values), statistics.median(values)

    @property
    def speculative(self) -> bool:
        return any(r.drafted is not None for r in self.runs)

    def acceptance(self) -> float | None:
        """Accepted / drafted tokens over every round (None: no speculation or no drafts)."""
        drafted = sum(r.drafted or 0 for r in self.runs)
        return sum(r.accepted or 0 for r in self.runs) / drafted if drafted else None

    def mean_accepted_length(self) -> float | None:
        rounds = sum(r.rounds or 0 for r in self.runs)
        return 1 + sum(r.accepted or 0 for r in self.runs) / rounds if rounds else None

    @property
    def tokens(self) -> list[int] | None:
        return self.runs[-1].tokens if self.runs else None


def kvpage_run(result: dict) -> Run:
    """A kvpage worker's result for one workload (bench/speculative_worker.py)."""
    tokens = result["tokens"]
    stats = result.get("spec")
    return Run(
        len(tokens), len(tokens) - 1, result["decode_s"], result["wall"], tokens,
        *(None, None, None) if stats is None else (
            stats["spec_decode_num_draft_tokens"],
            stats["spec_decode_num_accepted_tokens"],
            stats["spec_decode_num_drafts"],
        ),
    )  # fmt: skip


def first_diff(mine: list[int], ref: list[int]) -> int | None:
    """The first output position where `mine` leaves `ref` (None: equal); a length mismatch
    counts at the shorter length."""
    pos = next((i for i, (a, b) in enumerate(zip(mine, ref, strict=False)) if a != b), None)
    if pos is None and len(mine) != len(ref):
        return min(len(mine), len(ref))
    return pos


def agreement_text(mine: list[int] | None, ref: list[int] | None, n: int) -> str:
    """Whether the first n tokens agree: "same", "DIFFER at k", or "-" when one is missing."""
    if mine is None or ref is None:
        return "-"
    pos = first_diff(mine[:n], ref[:n])
    return "same" if pos is None else f"DIFFER at {pos}"


def token_checks(rows: dict[tuple[str, str, str], Row], n: int) -> tuple[list[str], bool]:
    """kvpage's speculative tokens against its plain tokens (its first round's), every round,
    first n compared: (one line per speculative row, whether all are equal). Greedy speculation
    is lossless only if these are equal; a row that did not run is listed as not checked."""
    lines, ok = [], True
    for (wl, dtype, engine), row in rows.items():
        if engine not in ("kvpage-draft", "kvpage-ngram"):
            continue
        plain = rows[(wl, dtype, "kvpage")]
        if not (row.ok and plain.ok):
            lines.append(
                f"token check {dtype} {wl}: {engine} vs kvpage: NOT CHECKED (a row failed)"
            )
            continue
        ref = plain.runs[0].tokens[:n]
        diffs = [(i, first_diff(r.tokens[:n], ref)) for i, r in enumerate(row.runs)]
        bad = [(i, pos) for i, pos in diffs if pos is not None]
        if bad:
            ok = False
            i, pos = bad[0]
            lines.append(
                f"*** TOKEN MISMATCH *** {dtype} {wl}: {engine} leaves plain kvpage's greedy "
                f"tokens at output {pos} in round {i + 1} ({len(bad)}/{len(diffs)} rounds differ)"
            )
        else:
            lines.append(
                f"token check {dtype} {wl}: {engine} == kvpage plain, {n} tokens, "
                f"{len(diffs)}/{len(diffs)} rounds"
            )
    return lines, ok


# --- the table ----------------------------------------------------------------------------------
def pair_text(best: float, median: float, fmt: str = "{:.1f}") -> str:
    return f"{fmt.format(best)} ({fmt.format(median)})"


def rate_text(row: Row, kind: str) -> str:
    if row.error:
        return "FAILED"
    return pair_text(*row.rates(kind)) if row.runs else "-"


def ratio_text(mine: Row | None, other: Row | None, kind: str = "decode") -> str:
    """mine / other, best over best (median over median)."""
    if mine is None or other is None or not (mine.ok and other.ok):
        return "-"
    (mb, mm), (ob, om) = mine.rates(kind), other.rates(kind)
    return pair_text(mb / ob, mm / om, "{:.2f}x")


def acceptance_text(row: Row) -> str:
    acc, length = row.acceptance(), row.mean_accepted_length()
    if not row.speculative:
        return ""
    if acc is None:
        return "no drafts"
    return f"{acc:.1%}, {length:.2f}" if length is not None else f"{acc:.1%}"


def table(rows: dict[tuple[str, str, str], Row], output_tokens: int) -> list[str]:
    """One line per row, in `rows`' order: decode and e2e tok/s best (median), the ratios to its
    plain baseline and to llama.cpp's same method (decode, then e2e; best / best (median /
    median)), the acceptance (accepted / drafted, mean accepted length), and whether its tokens
    equal its plain baseline's (kvpage rows) or kvpage's plain ones (llama.cpp rows), first
    `output_tokens` compared."""
    head = (
        f"{'workload':<9} {'dtype':<5} {'engine':<16} {'decode tok/s':>14} {'e2e tok/s':>14} "
        f"{'x plain dec':>14} {'x plain e2e':>14} {'x llama.cpp dec':>15} {'x llama.cpp e2e':>15} "
        f"{'accept, len':>13}  tokens"
    )
    lines = [head, "-" * len(head)]
    for (wl, dtype, engine), row in rows.items():
        base = rows.get((wl, dtype, BASELINE.get(engine, "")))
        peer = rows.get((wl, dtype, PEER.get(engine, "")))
        ref = base if base is not None else rows.get((wl, dtype, "kvpage"))
        same = ""
        if ref is not None and ref is not row:
            same = agreement_text(row.tokens, ref.tokens, output_tokens)
        if row.error:
            same = f"FAILED: {row.error[:100]}"
        lines.append(
            f"{wl:<9} {dtype:<5} {engine:<16} {rate_text(row, 'decode'):>14} "
            f"{rate_text(row, 'e2e'):>14} {ratio_text(row, base):>14} "
            f"{ratio_text(row, base, 'e2e'):>14} {ratio_text(row, peer):>15} "
            f"{ratio_text(row, peer, 'e2e'):>15} {acceptance_text(row):>13}  {same}"
        )
    return lines

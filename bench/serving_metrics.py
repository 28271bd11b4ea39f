"""The numbers of `serving.py`, from per-request client-side timestamps, as `vllm bench serve`
defines them:

    TTFT   first token-carrying chunk - request sent
    E2E    end of the stream - request sent
    TPOT   (E2E - TTFT) / (output tokens - 1), per request with more than one output token
    ITL    gaps between consecutive token-carrying chunks of a request, pooled over requests
           (a chunk that carries several tokens is one gap, as in vLLM's bench)
    request throughput  completed requests / duration
    output throughput   output tokens of completed requests / duration
    goodput             completed requests within the SLO (TTFT and TPOT) / duration
    sustains            every request completed and p99 TTFT within the SLO's TTFT

where duration runs from the stream's start to the end of its last request. Percentiles are
numpy's default (linear interpolation between the closest ranks). Pure Python, no third-party
imports (tests/bench checks it against numpy).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_ms: float = 2000.0
    tpot_ms: float = 200.0

    def __str__(self) -> str:
        return f"TTFT <= {self.ttft_ms:g} ms and TPOT <= {self.tpot_ms:g} ms"


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it; times in seconds on one monotonic clock."""

    sent: float
    token_times: list[float] = field(default_factory=list)  # token-carrying chunks' arrivals
    done: float = math.nan  # the stream's end
    output_tokens: int = 0
    prompt_tokens: int | None = None  # the server's usage, when it sends one
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.token_times)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent

    @property
    def e2e(self) -> float:
        return self.done - self.sent

    @property
    def tpot(self) -> float | None:
        """None with a single output token (no decode to time)."""
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]

    def meets(self, slo: Slo) -> bool:
        tpot = self.tpot
        return self.ttft * 1e3 <= slo.ttft_ms and (tpot is None or tpot * 1e3 <= slo.tpot_ms)


def percentile(values: list[float], q: float) -> float:
    """numpy.percentile(values, q) (method "linear"); NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


LATENCIES = ("ttft", "tpot", "itl", "e2e")
QUANTILES = (50, 99)


@dataclass(frozen=True, slots=True)
class RunSummary:
    """One server at one rate in one round."""

    completed: int
    failed: int
    duration_s: float
    request_per_s: float
    output_tok_per_s: float
    goodput_per_s: float
    latency_ms: dict[str, dict[int, float]]  # LATENCIES -> QUANTILES -> ms
    prompt_mismatches: int  # completed requests whose server-counted prompt length differs


def summarize(
    records: list[RequestRecord], start: float, slo: Slo, prompt_lengths: list[int]
) -> RunSummary:
    """The run's numbers; `start` is the stream's start on the records' clock, `prompt_lengths`
    the sent prompts' lengths (in the records' order), checked against the servers' usage."""
    done = [r for r in records if r.ok]
    end = max((r.done for r in done), default=start)
    duration = end - start
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: math.nan)
    series = {
        "ttft": [r.ttft for r in done],
        "tpot": [t for r in done if (t := r.tpot) is not None],
        "itl": [g for r in done for g in r.itls()],
        "e2e": [r.e2e for r in done],
    }
    latency = {k: {q: 1e3 * percentile(v, q) for q in QUANTILES} for k, v in series.items()}
    mismatched = sum(
        r.ok and r.prompt_tokens is not None and r.prompt_tokens != n
        for r, n in zip(records, prompt_lengths, strict=True)
    )
    return RunSummary(
        completed=len(done),
        failed=len(records) - len(done),
        duration_s=duration,
        request_per_s=per_s(len(done)),
        output_tok_per_s=per_s(sum(r.output_tokens for r in done)),
        goodput_per_s=per_s(sum(r.meets(slo) for r in done)),
        latency_ms=latency,
        prompt_mismatches=mismatched,
    )


def sustains(run: RunSummary, slo: Slo) -> bool:
    """The server kept up with the rate: every request completed and the queue did not grow
    past the SLO (p99 TTFT within it); a rate it cannot keep up with piles requests up, and
    TTFT grows with the stream's length."""
    return run.completed > 0 and run.failed == 0 and run.latency_ms["ttft"][99] <= slo.ttft_ms


# --- over rounds --------------------------------------------------------------------------------
def best_and_median(values: list[float], lower_is_better: bool) -> tuple[float, float]:
    """(the best round's value, the median round's); NaN rounds (nothing completed) left out."""
    xs = [v for v in values if not math.isnan(v)]
    if not xs:
        return math.nan, math.nan
    return (min(xs) if lower_is_better else max(xs)), statistics.median(xs)


def over_rounds(runs: list[RunSummary]) -> dict[str, tuple[float, float]]:
    """Per quantity, (best, median) over the rounds: latencies at their lowest, rates at their
    highest. Keys: req/s, out tok/s, goodput/s and `<latency> p<q>` in ms."""
    out = {
        "req/s": best_and_median([r.request_per_s for r in runs], False),
        "out tok/s": best_and_median([r.output_tok_per_s for r in runs], False),
        "goodput/s": best_and_median([r.goodput_per_s for r in runs], False),
    }
    for name in LATENCIES:
        for q in QUANTILES:
            xs = [r.latency_ms[name][q] for r in runs]
            out[f"{name} p{q}"] = best_and_median(xs, True)
    return out

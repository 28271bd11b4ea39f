"""An independent sampling oracle: exact float64 probabilities of vLLM's sampling semantics, checks
of single draws and of reported logprobs, and a statistical test that many draws follow them.

The engine and the contiguous reference both sample through kvpage.sampling, so a bug there draws
the same wrong token on both sides and the token-by-token diff cannot see it. This module imports
neither kvpage.sampling nor kvpage.engine (a test walks its imports) and computes the semantics
another way: float64, one descending sort and an explicit walk over it.

Semantics: temperature 0 is greedy argmax. Otherwise logits / temperature, then top-k (keep every
token whose tempered logit is >= the k-th largest: ties at the cut stay; -1 = off), then top-p over
the renormalised top-k distribution (walking down the sorted tokens, keep a token while the mass
strictly before it is < top_p, so the top token always stays), renormalise, draw. Reported
logprobs are the k most likely tokens of the RAW (untempered, unfiltered) log_softmax.

Structured outputs: a constrained draw comes from the masked, renormalised distribution: every
id the grammar refuses (`allowed` False) is removed before anything else, so greedy is the argmax
over the allowed ids, and temperature, top-k and top-p act on the allowed ids alone; a draw
outside the mask is impossible. The mask is the caller's (the verifier's own matcher walked over
the drawn tokens, kvpage.reference.grammar), never the engine's.

Ties: top-p's walk orders tokens of one logit value in some order, and which of them the cut keeps
depends on it (the oracle's sort is stable, by token id; the engine's is not). In 16-bit models a
logit value is shared by many tokens, so a tie group often straddles the top-p cut. How many of
the group are kept does not depend on the order, only which: so a single draw is possible when the
mass of the tokens strictly above it is < top_p (it could have come first in its group), and the
uniformity test counts a tie group as one outcome of its total mass."""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvpage.sampling_params import SamplingParams

SAMPLING_P_THRESHOLD = 1e-4  # a sampling case fails when its uniformity p-value is below this
LOGPROB_ATOL = 1e-4
# The engine filters in float32: a token this close to a cut-off may legitimately fall on either
# side of it, so check_draw does not call it impossible.
BOUNDARY_SLACK = 1e-6
SUPPORT_CAP = 32
CHI2_BINS = 20


# --- exact probabilities -------------------------------------------------------------------------
def oracle_probs(
    logits: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits: (V,) -> (V,) float64 probabilities; exactly zero outside the filtered support
    (and outside `allowed`, a (V,) bool grammar mask, when given)."""
    x = _masked(logits, allowed)
    if temperature == 0.0:
        return _one_hot(int(torch.argmax(x)), x.shape[0])
    scaled = x / temperature
    return _renormalised(scaled, _kept(scaled, top_k, top_p, slack=0.0))


def _as_f64(logits: torch.Tensor) -> torch.Tensor:
    return logits.detach().to("cpu", torch.float64).reshape(-1)


def _masked(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """float64 logits with the ids a grammar refuses at -inf: they take no part in any rule."""
    x = _as_f64(logits)
    if allowed is None:
        return x
    return x.masked_fill(~allowed.detach().to("cpu", torch.bool).reshape(-1), float("-inf"))


def _one_hot(index: int, size: int) -> torch.Tensor:
    probs = torch.zeros(size, dtype=torch.float64)
    probs[index] = 1.0
    return probs


def _kept(scaled: torch.Tensor, top_k: int, top_p: float, slack: float) -> torch.Tensor:
    """Boolean (V,) mask of the filtered support of tempered logits. `slack` widens both cut-offs
    (for checks that must tolerate float32 rounding in the engine)."""
    values, order = torch.sort(scaled, descending=True, stable=True)
    cut = int(torch.isfinite(values).sum())  # masked ids (-inf) are never kept
    if 0 < top_k < cut:
        kth = float(values[top_k - 1])
        cut = int((values >= kth - slack * max(1.0, abs(kth))).sum())  # ties at the k-th stay
    cut = _top_p_cut(values[:cut], top_p, slack)
    keep = torch.zeros(scaled.shape[0], dtype=torch.bool)
    keep[order[:cut]] = True
    return keep


def _top_p_cut(sorted_scaled: torch.Tensor, top_p: float, slack: float) -> int:
    """How many of the (descending) tokens top-p keeps: walk down, stop at the first token whose
    preceding mass already reaches top_p."""
    if top_p >= 1.0:
        return len(sorted_scaled)
    weights = torch.exp(sorted_scaled - sorted_scaled[0]).tolist()
    total = math.fsum(weights)
    before = 0.0
    for i, w in enumerate(weights):
        if before / total >= top_p + slack:
            return i
        before += w
    return len(weights)


def _drawable(scaled: torch.Tensor, token: int, top_k: int, top_p: float, slack: float) -> bool:
    """Whether some order of tied tokens lets the filters keep `token`: top-k keeps every tie at
    the k-th value anyway; top-p keeps it when the mass of the tokens clearly above it (by more
    than float32 rounding of the tempered logits) is < top_p, i.e. when it could have come first
    in its tie group. `slack` widens both cut-offs as in _kept."""
    value = float(scaled[token])
    keep = torch.isfinite(scaled)  # a grammar's masked ids are never kept
    if 0 < top_k < int(keep.sum()):
        kth = float(torch.sort(scaled, descending=True).values[top_k - 1])
        keep = keep & (scaled >= kth - slack * max(1.0, abs(kth)))
        if not keep[token]:
            return False
    if top_p >= 1.0:
        return True
    top = float(scaled[keep].max())
    weights = torch.where(keep, torch.exp(scaled - top), 0.0)
    tie = slack * max(1.0, abs(value), abs(top))
    above = math.fsum(weights[scaled > value + tie].tolist())
    return above / math.fsum(weights.tolist()) < top_p + slack


def _renormalised(scaled: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    weights = torch.where(keep, torch.exp(scaled - scaled[keep].max()), 0.0)
    return weights / weights.sum()


# --- single draws and logprobs -------------------------------------------------------------------
def check_draw(
    logits: torch.Tensor, params: SamplingParams, token: int, allowed: torch.Tensor | None = None
) -> str | None:
    """A message when `token` cannot have been drawn from `logits` under `params` (masked by
    `allowed`, a constrained step's grammar mask), else None."""
    x = _masked(logits, allowed)
    if not 0 <= token < x.shape[0]:
        return f"token {token} is outside the vocabulary [0, {x.shape[0]})"
    if allowed is not None and not bool(allowed.reshape(-1)[token]):
        return (
            f"drew token {token}, which the grammar does not allow here ({int(allowed.sum())} "
            "ids allowed)"
        )
    if params.temperature == 0.0:
        best = int(torch.argmax(x))
        if x[token] < x[best]:  # a tie with the maximum is a legitimate argmax
            return (
                f"greedy drew token {token} (logit {float(x[token]):.4f}) but the argmax is "
                f"{best} (logit {float(x[best]):.4f})"
            )
        return None
    scaled = x / params.temperature
    if _drawable(scaled, token, params.top_k, params.top_p, BOUNDARY_SLACK):
        return None
    rank = int((scaled > scaled[token]).sum())
    support = int(_kept(scaled, params.top_k, params.top_p, slack=0.0).sum())
    return (
        f"drew token {token} (rank {rank} of the tempered logits) outside the filtered support of "
        f"{support} tokens (T={params.temperature}, top_k={params.top_k}, top_p={params.top_p})"
    )


def check_logprobs(logits: torch.Tensor, reported: dict[int, float], k: int) -> str | None:
    """`reported` must hold the k most likely tokens of the raw log_softmax, each within
    LOGPROB_ATOL of its float64 value. A message on the first problem, else None."""
    exact = torch.log_softmax(_as_f64(logits), dim=-1)
    want = min(k, exact.shape[0])
    if len(reported) != want:
        return f"{len(reported)} logprobs reported, {want} expected"
    if want == 0:
        return None
    kth = float(torch.sort(exact, descending=True).values[want - 1])
    for token, value in reported.items():
        if not 0 <= token < exact.shape[0]:
            return f"logprob reported for token {token}, outside the vocabulary"
        true = float(exact[token])
        if abs(value - true) > LOGPROB_ATOL:
            return (
                f"token {token}: reported logprob {value:.6f}, raw log_softmax {true:.6f} "
                "(tempered or filtered logprobs?)"
            )
        if true < kth - LOGPROB_ATOL:
            rank = int((exact > exact[token]).sum())
            return f"token {token} (rank {rank}) is not among the {want} most likely raw tokens"
    return None


# --- many draws: randomized probability integral transform ---------------------------------------
@dataclass(frozen=True, slots=True)
class DrawSample:
    logits: torch.Tensor  # (V,) the logits the token was drawn from
    params: SamplingParams
    token: int
    allowed: torch.Tensor | None = None  # (V,) bool: a constrained step's grammar mask


@dataclass(frozen=True, slots=True)
class StatResult:
    n: int  # non-greedy draws tested
    statistic: float  # Kolmogorov–Smirnov D of the PIT values against Uniform(0, 1)
    p_value: float  # the smaller of the KS and chi-square p-values
    ks_p_value: float
    chi2_statistic: float | None = None  # None when too few draws for CHI2_BINS bins
    chi2_p_value: float | None = None

    @property
    def passed(self) -> bool:
        return self.p_value >= SAMPLING_P_THRESHOLD


def uniformity_test(draws: Iterable[DrawSample], seed: int = 0) -> StatResult:
    """Randomized probability integral transform: u = F(token-) + U * p(token), F the oracle CDF
    and U ~ Uniform(0, 1), is exactly Uniform(0, 1) and independent of the past when every draw
    follows the oracle, whatever the logits of each step; so one test covers draws from any mix
    of requests and steps.

    F runs over the tokens in descending oracle probability (tokens of one tempered logit as one
    outcome: _pit), not token-id order: any order fixed by the oracle keeps u uniform, but token ids are unrelated to
    probability, so in id order a too-sharp, too-flat or wrongly cut distribution moves mass in
    scattered slivers that KS and chi-square barely see (tempering by multiplication: p 5e-6 in
    id order vs 1e-71 here; top-p dropping its crossing token: 0.2 vs 3e-7). Sorted, every such
    bug shifts mass between the head (u near 0) and the tail (u near 1), and a draw outside the
    support lands on u = 1."""
    rng = random.Random(seed)  # fixed: the verdict is deterministic, never flaky
    us = sorted(_pit(d, rng) for d in draws if d.params.temperature != 0.0)
    if not us:
        return StatResult(0, 0.0, 1.0, 1.0)
    d = ks_statistic(us)
    n = len(us)
    ks_p = kolmogorov_q((math.sqrt(n) + 0.12 + 0.11 / math.sqrt(n)) * d)  # Stephens' correction
    if n < 5 * CHI2_BINS:  # chi-square needs about 5 expected per bin
        return StatResult(n, d, ks_p, ks_p)
    chi2 = chi2_statistic(us, CHI2_BINS)
    chi2_p = chi2_sf(chi2, CHI2_BINS - 1)
    return StatResult(n, d, min(ks_p, chi2_p), ks_p, chi2, chi2_p)


def _pit(draw: DrawSample, rng: random.Random) -> float:
    """The outcomes are the tie groups of the tempered logits (one token each but where logits
    tie), in descending order: which members of a group straddling the top-p cut are kept is the
    sort's choice, how much mass the group keeps is not."""
    p = draw.params
    probs = oracle_probs(draw.logits, p.temperature, p.top_k, p.top_p, draw.allowed)
    scaled = _masked(draw.logits, draw.allowed) / p.temperature
    value = scaled[draw.token]
    below = math.fsum(probs[scaled > value].tolist())  # F(group-)
    mass = math.fsum(probs[scaled == value].tolist())  # the group's kept mass
    return min(1.0, below + rng.random() * mass)


def ks_statistic(sorted_us: list[float]) -> float:
    """sup |F_n - F| against Uniform(0, 1), for sorted values."""
    n = len(sorted_us)
    return max(max((i + 1) / n - u, u - i / n) for i, u in enumerate(sorted_us))


def kolmogorov_q(lam: float) -> float:
    """P(K > lam) for the Kolmogorov distribution. Two series of the same function: the theta-
    function form converges fast for small lam, the alternating one for large lam."""
    if lam <= 0.0:
        return 1.0
    if lam < 1.18:
        s = sum(math.exp(-((2 * j - 1) ** 2) * math.pi**2 / (8 * lam * lam)) for j in range(1, 12))
        return min(1.0, max(0.0, 1.0 - math.sqrt(2 * math.pi) / lam * s))
    s = sum((-1) ** (j - 1) * math.exp(-2 * j * j * lam * lam) for j in range(1, 101))
    return min(1.0, max(0.0, 2.0 * s))


def chi2_statistic(us: list[float], bins: int) -> float:
    counts = [0] * bins
    for u in us:
        counts[min(int(u * bins), bins - 1)] += 1
    expected = len(us) / bins
    return sum((c - expected) ** 2 for c in counts) / expected


def chi2_sf(x: float, dof: int) -> float:
    """P(X > x) for chi-square with `dof` degrees of freedom: the upper regularized gamma
    Q(dof/2, x/2), a finite sum for integer and half-integer shapes."""
    y = x / 2.0
    if y <= 0.0:
        return 1.0
    if dof % 2 == 0:  # Q(m, y) = e^-y sum_{k<m} y^k / k!
        terms = (math.exp(-y + k * math.log(y) - math.lgamma(k + 1)) for k in range(dof // 2))
        return min(1.0, math.fsum(terms))
    # Q(m + 1/2, y) = erfc(sqrt y) + e^-y sum_{k=1..m} y^(k-1/2) / Gamma(k + 1/2)
    terms = (
        math.exp(-y + (k - 0.5) * math.log(y) - math.lgamma(k + 0.5))
        for k in range(1, dof // 2 + 1)
    )
    return min(1.0, math.erfc(math.sqrt(y)) + math.fsum(terms))


# --- attribution ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Support:
    ids: tuple[int, ...]  # most probable first, at most SUPPORT_CAP of them
    size: int  # the whole support's size


def filtered_support(
    logits: torch.Tensor, params: SamplingParams, allowed: torch.Tensor | None = None
) -> Support:
    """The tokens the oracle gives nonzero probability, most probable first."""
    probs = oracle_probs(logits, params.temperature, params.top_k, params.top_p, allowed)
    size = int((probs > 0).sum())
    order = torch.sort(probs, descending=True, stable=True).indices[: min(size, SUPPORT_CAP)]
    return Support(tuple(order.tolist()), size)


def describe_sampler_state(
    params: SamplingParams,
    generator: torch.Generator | None,
    num_draws: int,
    logits: torch.Tensor | None = None,
) -> dict:
    """What a `sampling` attribution reports about one request's sampler at one step: enough to
    tell a reseeded or shared generator (seed, offset, state digest) from a filtering bug
    (the parameters and, given the step's logits, the support the draw should have come from)."""
    state = {
        "seed": params.seed,
        "generator_seed": None if generator is None else generator.initial_seed(),
        "generator_offset": num_draws,
        "generator_state": None if generator is None else generator_digest(generator),
        "temperature": params.temperature,
        "top_k": params.top_k,
        "top_p": params.top_p,
    }
    if logits is not None:
        support = filtered_support(logits, params)
        state["support"] = list(support.ids)
        state["support_size"] = support.size
    return state


def generator_digest(generator: torch.Generator) -> str:
    """First 16 hex digits of the sha256 of the generator's state bytes."""
    raw = generator.get_state().cpu().numpy().tobytes()
    return hashlib.sha256(raw).hexdigest()[:16]

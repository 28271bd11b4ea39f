"""The verification rule (kvpage.speculative.rejection): greedy prefix matching, and the sampled
rejection rule checked for losslessness by chi-square tests against the target's distribution —
tests that the planted bugs of issue 44 (accept always, resample from p, bonus after a rejection,
acceptance ignoring q) must fail, which proves they have power."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

import kvpage.speculative.rejection as rejection
from kvpage.sampling import filtered_probs, sample_token
from kvpage.sampling_params import SamplingParams
from kvpage.speculative.rejection import Verification, verify_drafts
from kvpage.verify.sampling_oracle import chi2_sf

V = 6  # toy vocabulary
TRIALS = 20_000
BUG_TRIALS = 5_000  # a planted bug is caught with a quarter of the draws (p-values < 1e-24)
# The honest rule must pass at this level, a planted bug must fail far below it.
PASS_LEVEL = 1e-3
FAIL_LEVEL = 1e-9
SAMPLED = SamplingParams(temperature=1.0, seed=7)

Verify = Callable[..., Verification]


# --- greedy -------------------------------------------------------------------------------------
def _greedy_logits(targets: list[int], vocab: int = 8) -> torch.Tensor:
    """(len(targets), vocab) rows whose argmax is the given target (random elsewhere, below it)."""
    gen = torch.Generator().manual_seed(len(targets))
    logits = torch.rand(len(targets), vocab, generator=gen)
    logits[torch.arange(len(targets)), torch.tensor(targets)] = 2.0
    return logits


@pytest.mark.parametrize(
    ("drafts", "targets", "tokens", "accepted"),
    [
        ([3, 1, 4], [3, 1, 4, 5], [3, 1, 4, 5], 3),  # all kept, plus the bonus
        ([2, 1, 4], [3, 1, 4, 5], [3], 0),  # rejected at the first draft
        ([3, 1, 6], [3, 1, 4, 5], [3, 1, 4], 2),  # rejected at the last draft
        ([], [7], [7], 0),  # no drafts: plain greedy decoding
    ],
)
def test_greedy_keeps_the_matching_prefix_then_the_targets_token(
    drafts: list[int], targets: list[int], tokens: list[int], accepted: int
) -> None:
    result = verify_drafts(_greedy_logits(targets), drafts, SamplingParams(), None)
    assert result.tokens == tokens
    assert result.num_accepted == accepted
    assert result.greedy_targets == targets
    assert result.draws is None


def test_greedy_ties_go_to_the_first_maximum_as_the_plain_sampler() -> None:
    logits = torch.zeros(3, 8)
    logits[:, 2] = logits[:, 5] = 1.0  # tokens 2 and 5 tie at every position
    expected = [int(np.argmax(row)) for row in logits.numpy()]  # numpy: first maximum
    assert expected == [2, 2, 2]
    assert verify_drafts(logits, [2, 2], SamplingParams(), None).tokens == [2, 2, 2]
    rejected = verify_drafts(logits, [2, 5], SamplingParams(), None)
    assert (rejected.tokens, rejected.num_accepted) == ([2, 2], 1)


def test_rows_must_be_one_more_than_the_drafts() -> None:
    with pytest.raises(ValueError, match="2 drafts need 3"):
        verify_drafts(torch.zeros(2, 8), [1, 2], SamplingParams(), None)


# --- a toy autoregressive target and draft ------------------------------------------------------
class Toy:
    """Markov target and draft over V tokens: position 1 from p1 (q1), later positions from a
    table row picked by the previous token. The draft differs from the target on purpose."""

    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.p1 = _spread(rng.dirichlet(np.ones(V)))
        self.p2 = np.stack([_spread(rng.dirichlet(np.ones(V))) for _ in range(V)])  # (V, V)
        self.p3 = np.stack([_spread(rng.dirichlet(np.ones(V))) for _ in range(V)])
        self.q1 = _spread(rng.dirichlet(np.ones(V)))
        self.q2 = np.stack([_spread(rng.dirichlet(np.ones(V))) for _ in range(V)])

    def joint12(self) -> np.ndarray:
        return self.p1[:, None] * self.p2  # (V, V) P(t1, t2)

    def marginal3(self) -> np.ndarray:
        return self.joint12().sum(axis=0) @ self.p3  # (V,) P(t3)


def _spread(p: np.ndarray) -> np.ndarray:
    """Keep every probability >= 0.03 so each chi-square cell expects enough draws."""
    p = 0.03 + (1 - 0.03 * len(p)) * p
    return p / p.sum()


def _run_toy(toy: Toy, verify: Verify, trials: int = TRIALS) -> np.ndarray:
    """(trials, 3): the first three generated tokens. Drafts x1 ~ q1, x2 ~ q2[x1]; the target's
    rows are p1, p2[x1], p3[x2]; tokens the verification did not produce come from plain
    sampling of the target (what the next engine steps would do)."""
    rng = np.random.default_rng(1)
    generator = torch.Generator().manual_seed(2)
    out = np.empty((trials, 3), dtype=np.int64)
    for t in range(trials):
        x1 = rng.choice(V, p=toy.q1)
        x2 = rng.choice(V, p=toy.q2[x1])
        logits = torch.tensor(np.log(np.stack([toy.p1, toy.p2[x1], toy.p3[x2]])))
        q = torch.tensor(np.stack([toy.q1, toy.q2[x1]]), dtype=torch.float32)
        tokens = verify(logits, [int(x1), int(x2)], SAMPLED, generator, q).tokens
        if len(tokens) < 2:
            tokens.append(rng.choice(V, p=toy.p2[tokens[0]]))
        if len(tokens) < 3:
            tokens.append(rng.choice(V, p=toy.p3[tokens[1]]))
        out[t] = tokens
    return out


def _chi2_pvalue(observed: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's chi-square over the cells p gives mass; a draw in a zero cell is a certain fail."""
    observed, probs = observed.ravel(), probs.ravel()
    if observed[probs == 0].sum() > 0:
        return 0.0
    expected = probs[probs > 0] * observed.sum()
    stat = float(((observed[probs > 0] - expected) ** 2 / expected).sum())
    return chi2_sf(stat, int((probs > 0).sum()) - 1)


def _toy_pvalues(toy: Toy, out: np.ndarray) -> tuple[float, float]:
    """(p-value of the (t1, t2) joint, p-value of t3's marginal)."""
    joint = np.zeros((V, V))
    np.add.at(joint, (out[:, 0], out[:, 1]), 1)
    third = np.bincount(out[:, 2], minlength=V)
    return _chi2_pvalue(joint, toy.joint12()), _chi2_pvalue(third, toy.marginal3())


# --- sampled: losslessness and the planted bugs -------------------------------------------------
@pytest.fixture(scope="module")
def toy() -> Toy:
    return Toy(seed=3)


def test_sampled_output_follows_the_target(toy: Toy) -> None:
    joint, third = _toy_pvalues(toy, _run_toy(toy, verify_drafts))
    assert joint > PASS_LEVEL and third > PASS_LEVEL, (joint, third)


def _bonus_after_rejection(*args, **kwargs) -> Verification:
    """Bug: after a rejection the bonus row is sampled too, for a context that no longer holds."""
    result = verify_drafts(*args, **kwargs)
    if result.num_accepted == len(result.draft_tokens):
        return result
    bonus = int(torch.multinomial(result.draws.target_probs[-1], 1, generator=args[3]))
    return Verification(
        result.tokens + [bonus], result.num_accepted, result.draft_tokens, draws=result.draws
    )


PLANTED = {
    "accept always": ("acceptance_probs", lambda p, q, drafts: torch.ones(len(drafts))),
    "accept with p, ignoring q": (
        "acceptance_probs",
        lambda p, q, drafts: p[torch.arange(len(drafts)), torch.tensor(drafts)],
    ),
    "resample from p": ("residual_probs", lambda p, q: p),
    "bonus after a rejection": None,
}


@pytest.mark.parametrize("bug", list(PLANTED))
def test_the_chi_square_catches_a_planted_bug(
    bug: str, toy: Toy, monkeypatch: pytest.MonkeyPatch
) -> None:
    verify: Verify = verify_drafts
    if PLANTED[bug] is None:
        verify = _bonus_after_rejection
    else:
        name, replacement = PLANTED[bug]
        monkeypatch.setattr(rejection, name, replacement)
    joint, third = _toy_pvalues(toy, _run_toy(toy, verify, BUG_TRIALS))
    assert min(joint, third) < FAIL_LEVEL, (bug, joint, third)


# --- sampled: temperature, top-k, top-p; n-gram drafts ------------------------------------------
@pytest.mark.parametrize("ngram", [False, True])
def test_first_token_follows_the_filtered_distribution(ngram: bool) -> None:
    """q gives mass to tokens top-k/top-p remove: such drafts must always be rejected, and the
    output still follows filtered_probs of the tempered logits (sample_token's distribution)."""
    vocab, k, trials = 8, 3, 12_000
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=11)
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(k + 1, vocab, generator=gen) * 2  # (k+1, V)
    q = torch.softmax(torch.randn(k, vocab, generator=gen), dim=-1)  # (k, V) full support
    p1 = filtered_probs((logits[0] - logits[0].max()) / params.temperature, 5, 0.9).numpy()
    assert (p1 == 0).sum() >= 3  # the filters really remove tokens
    drafts = torch.multinomial(q, trials, replacement=True, generator=gen).T.tolist()  # (N, k)
    generator = torch.Generator().manual_seed(6)
    draft_probs = None if ngram else q
    first = [verify_drafts(logits, d, params, generator, draft_probs).tokens[0] for d in drafts]
    assert _chi2_pvalue(np.bincount(first, minlength=vocab), p1) > PASS_LEVEL


# --- sampled: the recorded draws replay each decision -------------------------------------------
def _replay(result: Verification, logits: torch.Tensor, temperature: float) -> None:
    """Re-derive every decision from the record with numpy (no code from the module under test)."""
    draws = result.draws
    z = logits.double().numpy() / temperature
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(draws.target_probs.numpy(), p, rtol=1e-5, atol=1e-7)
    q, drafts = draws.draft_probs.double().numpy(), result.draft_tokens
    accept = [min(1.0, p[i, x] / q[i, x]) for i, x in enumerate(drafts)]
    np.testing.assert_allclose(draws.accept_probs.numpy(), accept, rtol=1e-5)
    kept = [u < a for u, a in zip(draws.uniforms.tolist(), accept, strict=True)]
    n = kept.index(False) if False in kept else len(kept)
    assert result.num_accepted == n and result.tokens[:n] == drafts[:n]
    final = p[n] if n == len(drafts) else np.maximum(p[n] - q[n], 0)
    np.testing.assert_allclose(draws.final_probs.numpy(), final / final.sum(), rtol=1e-4)
    race = draws.final_probs.numpy() / draws.race.numpy()
    assert result.tokens[-1] == int(np.argmax(race)) and len(result.tokens) == n + 1


def test_recorded_draws_replay_every_decision() -> None:
    gen = torch.Generator().manual_seed(9)
    outcomes = set()
    for _ in range(200):
        logits = torch.randn(4, 8, generator=gen)  # (k+1, V)
        q = torch.softmax(torch.randn(3, 8, generator=gen) * 2, dim=-1)  # (k, V)
        drafts = torch.multinomial(q, 1, generator=gen).squeeze(1).tolist()
        result = verify_drafts(logits, drafts, SamplingParams(temperature=1.3), gen, q)
        _replay(result, logits, 1.3)
        outcomes.add(result.num_accepted)
    assert outcomes == {0, 1, 2, 3}  # every path taken: rejections at each draft and the bonus


def test_the_replay_catches_acceptance_without_the_min(monkeypatch: pytest.MonkeyPatch) -> None:
    """p/q without the min keeps the same drafts (u < 1 either way), so no distribution test can
    see it; the recorded acceptance probabilities can."""

    def no_min(p: torch.Tensor, q: torch.Tensor, drafts: list[int]) -> torch.Tensor:
        rows, index = torch.arange(len(drafts)), torch.tensor(drafts)
        return p[rows, index] / q[rows, index]

    monkeypatch.setattr(rejection, "acceptance_probs", no_min)
    gen = torch.Generator().manual_seed(10)
    logits = torch.zeros(2, 4)
    logits[0, 1] = 3.0  # p(1) ~ 0.87 > q(1) = 0.25: the ratio exceeds 1
    q = torch.full((1, 4), 0.25)
    result = verify_drafts(logits, [1], SamplingParams(temperature=1.0), gen, q)
    with pytest.raises(AssertionError):
        _replay(result, logits, 1.0)


def test_draft_probs_must_be_k_by_v() -> None:
    with pytest.raises(ValueError, match="not \\(k, V\\)"):
        verify_drafts(torch.zeros(2, 8), [1], SAMPLED, None, torch.ones(1, 7) / 7)


def test_without_drafts_it_is_plain_sampling() -> None:
    """k = 0 takes exactly sample_token's draw from the same generator state."""
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(4))
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.95, seed=3)
    for seed in range(20):
        spec = verify_drafts(logits, [], params, torch.Generator().manual_seed(seed))
        plain = sample_token(logits[0], params, torch.Generator().manual_seed(seed))
        assert spec.tokens == [plain]


def test_a_seeded_request_replays_its_tokens() -> None:
    gen = torch.Generator().manual_seed(12)
    logits = torch.randn(5, 16, generator=gen)  # (k+1, V)
    q = torch.softmax(torch.randn(4, 16, generator=gen), dim=-1)  # (k, V)
    drafts = [3, 1, 4, 1]

    def run(seed: int) -> list[list[int]]:
        generator = torch.Generator().manual_seed(seed)
        return [verify_drafts(logits, drafts, SAMPLED, generator, q).tokens for _ in range(30)]

    assert run(21) == run(21)
    assert run(21) != run(22)  # the generator, not a global stream, decides

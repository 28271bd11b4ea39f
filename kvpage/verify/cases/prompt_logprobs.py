"""Prompt logprobs under sharing, chunking, preemption and eviction, checked against the
reference's logits over the whole prompt (kvpage.reference.generator.prompt_logprobs).

The token-by-token diff of the gate sees only the outputs; `check_prompt_logprobs` compares each
finished request's prompt rows (length, the top-k set, every logprob) with the reference, and
`run_prompt_logprob_case` runs a case through the test driver and applies that check.

The tolerance is the logits' (kvpage.verify.diff.logit_atol: the compute dtype's and the KV
format's rounding, relative to the reference's largest prompt logit): the rows are the same logits
as a decode step's, and a logprob differs from its logit by the row's logsumexp, which moves no
more than the logits do. In 16-bit models logits tie or nearly tie, so the top k of a row may
legitimately swap a token at the k-th place for one the reference scores within that tolerance of
it; a token further below the k-th is a wrong row."""

from __future__ import annotations

import torch

from kvpage.engine.engine import LLMEngine
from kvpage.engine.outputs import RequestOutput
from kvpage.reference.generator import prompt_logits, prompt_logprobs
from kvpage.sampling_params import SamplingParams
from kvpage.verify.case import Case, RequestSpec, Tokens, preempt_at_step
from kvpage.verify.checks import Failure, finding
from kvpage.verify.diff import logit_atol
from kvpage.verify.driver import StepDriver

SUITE = "prompt_logprobs"


def _scored(n: int, k: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, prompt_logprobs=k)


def prompt_logprob_cases(vocab: int) -> list[Case]:
    t = Tokens(vocab, seed=2300)
    shared = t.take(40)
    tails = [t.take(9), t.take(13), t.take(5)]
    plain = SamplingParams(max_tokens=3, ignore_eos=True)
    sharing = Case(
        SUITE,
        "cached prefix: warmed by a plain request, then scored twice and hit by a plain one",
        [
            RequestSpec("warm", shared + tails[0], plain),
            RequestSpec("A", shared + tails[1], _scored(3, 4), arrive_step=8),
            RequestSpec("B", shared + tails[0], _scored(2, 0), arrive_step=16),
            RequestSpec("after", shared + tails[2], plain, arrive_step=24),
        ],
        engine={"block_size": 8, "num_blocks": 48},
        # The warm request kept no rows, so A computes every position; A kept its rows, so B's
        # hit over the shared blocks is served them.
        expect_hit=("after", "B"),
        expect_hit_tokens={"A": 0},
    )
    prompt = t.take(35)
    kept = Case(
        SUITE,
        "kept rows per tenant and per block incarnation: another tenant, then a reused pool",
        [
            RequestSpec("X", prompt, _scored(2, 2), cache_salt="t1"),
            RequestSpec("W", prompt, plain, arrive_step=6, cache_salt="t2"),
            RequestSpec("Y", prompt, _scored(2, 2), arrive_step=12, cache_salt="t2"),
            RequestSpec("Z", prompt, _scored(2, 1), arrive_step=18, cache_salt="t1"),
            *(RequestSpec(f"F{i}", t.take(40), plain, arrive_step=24 + 4 * i) for i in range(4)),
            RequestSpec("V", prompt, plain, arrive_step=42, cache_salt="t1"),
            RequestSpec("T", prompt, _scored(2, 1), arrive_step=48, cache_salt="t1"),
        ],
        engine={"block_size": 8, "num_blocks": 12},
        # t2's blocks were computed by a plain request: no rows kept for them, no hit for Y.
        # Z is served X's rows. The fillers evict the prompt's blocks; V caches it again in
        # other blocks, without rows: T computes every position.
        expect_hit=("Z",),
        expect_hit_tokens={"Y": 0, "T": 0},
    )
    chunked = Case(
        SUITE,
        "chunked prefill, preempted mid-prompt (recompute and swap), same prompt in one step",
        [
            RequestSpec("R", shared + tails[1], _scored(4, 3)),
            RequestSpec("S", shared + tails[2], _scored(4, 2)),
            RequestSpec("R2", shared + tails[1], _scored(2, 3)),
        ],
        engine={"block_size": 8, "num_blocks": 48, "max_num_batched_tokens": 16},
        actions=[
            preempt_at_step("preempt R", 0, "R", 0, 2),
            preempt_at_step("swap S", 0, "S", 0, 3, "swap"),
        ],
        expect_preemption=True,
    )
    evicting = Case(
        SUITE,
        "small pool: the scored prefix evicted and recomputed between requests",
        [
            RequestSpec(
                f"E{i}",
                t.take(30) if i % 2 else shared + tails[i % 3],
                _scored(2, 1),
                arrive_step=4 * i,
            )
            for i in range(5)
        ],
        engine={"block_size": 8, "num_blocks": 10},
    )
    return [sharing, kept, chunked, evicting]


def check_prompt_logprobs(
    case: Case,
    model,
    finished: dict[str, RequestOutput],
    kv_cache_dtype: str = "auto",
    model_for=None,
) -> list[Failure]:
    """Every request that asked for prompt logprobs against the reference: one row per prompt
    token, None first, the top-k set (up to ties within the tolerance), and each logprob within
    the logit tolerance of a run in the model's dtype with its pool in `kv_cache_dtype`. The
    first bad row of each request is reported. `model_for(spec)`: the reference model of a
    request (its adapter merged), the base `model` when not given."""
    failures = []
    for spec in case.requests:
        k = spec.params.prompt_logprobs
        if k is None or spec.request_id not in finished:
            continue
        out = finished[spec.request_id]
        if any(c.finish_reason not in ("stop", "length") for c in out.outputs):
            continue  # aborted, timed out or failed: its prompt may never have been scored
        ref_model = model if model_for is None else model_for(spec)
        expected = prompt_logprobs(ref_model, spec.prompt, k, kv_cache_dtype)
        exact, scale = reference_prompt_logprobs(ref_model, spec.prompt, kv_cache_dtype)
        atol = logit_atol(kv_cache_dtype, model.dtype, scale, spec.lora is not None)
        problem = _first_difference(expected, out.prompt_logprobs, spec.prompt, exact, k, atol)
        if problem is not None:
            position, reason, want, got = problem
            if ref_model is not model and _rows_match(model, spec, out, kv_cache_dtype):
                reason += "; the rows are the base model's: the adapter left out of the prompt pass"
            fields = {
                "position": position,
                "token": spec.prompt[position] if position < len(spec.prompt) else -1,
                "expected": want,
                "actual": got,
                "num_cached_tokens": out.metrics.num_cached_tokens,
                "atol": atol,
            }
            div = finding(SUITE, "prompt_logprobs", reason, fields, spec.request_id, position)
            message = f"{spec.request_id} prompt position {position}: {reason}"
            failures.append(Failure("divergence", message, spec.request_id, div))
    return failures


def _rows_match(model, spec, out: RequestOutput, kv_cache_dtype: str) -> bool:
    """Whether an adapter request's rows pass as `model`'s (the base model's) rows."""
    k = spec.params.prompt_logprobs
    expected = prompt_logprobs(model, spec.prompt, k, kv_cache_dtype)
    exact, scale = reference_prompt_logprobs(model, spec.prompt, kv_cache_dtype)
    atol = logit_atol(kv_cache_dtype, model.dtype, scale)
    got = out.prompt_logprobs
    return _first_difference(expected, got, spec.prompt, exact, k, atol) is None


def reference_prompt_logprobs(
    model, prompt: list[int], kv_cache_dtype: str = "auto"
) -> tuple[torch.Tensor, float]:
    """The whole log_softmax of the reference's pass over the prompt (the pass
    reference.generator.prompt_logprobs takes its rows from): (L - 1, V) float32, row p scoring
    prompt[p + 1]; and the largest |logit| of those rows (at least 1), the tolerance's scale."""
    logits = prompt_logits(model, prompt, kv_cache_dtype)[:-1].float()
    scale = max(1.0, float(logits.abs().max())) if logits.numel() else 1.0
    return torch.log_softmax(logits, dim=-1), scale


def _first_difference(expected, got, prompt, exact: torch.Tensor, k: int, atol: float):
    if got is None or len(got) != len(expected):
        n = None if got is None else len(got)
        return (
            min(n or 0, len(prompt) - 1),
            f"{n} rows for {len(expected)} prompt tokens",
            len(expected),
            n,
        )
    if got[0] is not None:
        return 0, "the first prompt token has a row (nothing precedes it)", None, got[0]
    for p in range(1, len(expected)):
        problem = _row_difference(expected[p], got[p], prompt[p], exact[p - 1], k, atol)
        if problem is not None:
            return (p, *problem)
    return None


def _row_difference(want: dict, row: dict | None, token: int, exact: torch.Tensor, k: int, atol):
    """(reason, expected, actual) for a row that is not the reference's, else None. The row's top
    set must be a top k of the reference's up to a tie: no token left out may score more than
    `atol` above one kept (drift of `atol` on each logit can swap such a pair, and no other)."""
    vocab = exact.shape[0]
    if row is None or token not in row or any(not 0 <= t < vocab for t in row):
        return (
            "top-k set differs (no row, or the prompt token or the vocabulary missed)",
            sorted(want),
            row and sorted(row),
        )
    top = set(row) - {token} if len(row) == min(k, vocab) + 1 else set(row)
    if len(top) != min(k, vocab):
        return f"{len(row)} entries in a row of top {k}", sorted(want), sorted(row)
    worst = max(row, key=lambda t: abs(row[t] - float(exact[t])))
    off = abs(row[worst] - float(exact[worst]))
    if off > atol:
        return (
            f"logprob of token {worst} off by {off:.3g} (atol {atol:.3g})",
            want.get(worst, float(exact[worst])),
            row[worst],
        )
    if set(row) != set(want):
        left_out = torch.ones(vocab, dtype=torch.bool)
        left_out[list(top)] = False
        lowest_kept = min((float(exact[t]) for t in top), default=float("inf"))
        highest_left = float(exact[left_out].max()) if bool(left_out.any()) else float("-inf")
        if highest_left - lowest_kept > atol:
            swapped = sorted(set(want) ^ set(row))
            return (
                f"top-k set differs (tokens {swapped}; a token left out scores "
                f"{highest_left - lowest_kept:.3g} above one kept, atol {atol:.3g})",
                sorted(want),
                sorted(row),
            )
    return None


def run_prompt_logprob_case(case: Case, engine: LLMEngine, model) -> list[Failure]:
    """Run the case's requests and actions through the test driver, then check the rows."""
    driver = StepDriver(engine)
    pending = sorted(case.requests, key=lambda r: r.arrive_step)
    actions, finished, steps = list(case.actions), {}, 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0].arrive_step <= steps:
            spec = pending.pop(0)
            engine.add_request(spec.request_id, spec.prompt, spec.params, spec.cache_salt)
        for action in [a for a in actions if a.when(driver, steps)]:
            action.do(driver)
            actions.remove(action)
        finished.update({o.request_id: o for o in driver.step() if o.finished})
        steps += 1
    return check_prompt_logprobs(case, model, finished, engine.config.kv_cache_dtype)

"""Prompt logprobs under sharing, chunking, preemption and eviction, checked against the
reference's logits over the whole prompt (kvpage.reference.generator.prompt_logprobs).

The token-by-token diff of the gate sees only the outputs; `check_prompt_logprobs` compares each
finished request's prompt rows (length, the top-k set, every logprob) with the reference, and
`run_prompt_logprob_case` runs a case through the test driver and applies that check."""

from __future__ import annotations

from kvpage.engine.engine import LLMEngine
from kvpage.engine.outputs import RequestOutput
from kvpage.reference.generator import prompt_logprobs
from kvpage.sampling_params import SamplingParams
from kvpage.verify.case import Action, Case, RequestSpec, Tokens
from kvpage.verify.checks import Failure, finding
from kvpage.verify.driver import StepDriver

SUITE = "prompt_logprobs"
ATOL = 1e-4  # fp32: the paged pass and the whole-prompt pass differ by rounding only


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
            Action("preempt R", lambda e, s: s == 0, lambda e: e.force_preempt("R", 0, 2)),
            Action(
                "swap S", lambda e, s: s == 0, lambda e: e.force_preempt("S", 0, 3, mode="swap")
            ),
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


def check_prompt_logprobs(case: Case, model, finished: dict[str, RequestOutput]) -> list[Failure]:
    """Every request that asked for prompt logprobs against the reference: one row per prompt
    token, None first, the top-k set, and each logprob within ATOL. The first bad row of each
    request is reported."""
    failures = []
    for spec in case.requests:
        k = spec.params.prompt_logprobs
        if k is None or spec.request_id not in finished:
            continue
        out = finished[spec.request_id]
        if any(c.finish_reason not in ("stop", "length") for c in out.outputs):
            continue  # aborted, timed out or failed: its prompt may never have been scored
        expected = prompt_logprobs(model, spec.prompt, k)
        problem = _first_difference(expected, out.prompt_logprobs, spec.prompt)
        if problem is not None:
            position, reason, want, got = problem
            fields = {
                "position": position,
                "token": spec.prompt[position] if position < len(spec.prompt) else -1,
                "expected": want,
                "actual": got,
                "num_cached_tokens": out.metrics.num_cached_tokens,
            }
            div = finding(SUITE, "prompt_logprobs", reason, fields, spec.request_id, position)
            message = f"{spec.request_id} prompt position {position}: {reason}"
            failures.append(Failure("divergence", message, spec.request_id, div))
    return failures


def _first_difference(expected, got, prompt):
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
        want, row = expected[p], got[p]
        if row is None or set(row) != set(want):
            missing = None if row is None else sorted(set(want) ^ set(row))
            return p, f"top-k set differs (tokens {missing})", sorted(want), row and sorted(row)
        worst = max(want, key=lambda t: abs(want[t] - row[t]))
        if abs(want[worst] - row[worst]) > ATOL:
            return (
                p,
                f"logprob of token {worst} off by {abs(want[worst] - row[worst]):.3g}",
                (want[worst]),
                row[worst],
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
    return check_prompt_logprobs(case, model, finished)

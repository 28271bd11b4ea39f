"""Speculative decoding (kvpage.engine.speculation): each case runs its engine speculating, and
every greedy token must equal the reference's plain decoding; a sampled request's logits are
diffed at every position and each decision of the rejection rule is re-checked against p and q
(kvpage.verify.speculative), its draws tested against the sampling oracle.

- drafts crossing block boundaries: blocks of 4 tokens and k = 3 (n-gram drafts on prompts that
  repeat, so most steps carry drafts), greedy and sampled side by side in one batch;
- rejections at the first and at the last draft: a draft model of other weights (tiny-qwen2
  drafting for tiny-llama: most drafts fail at once) and the target's own int8 copy (most are
  kept, some fail late), greedy and seeded sampling, n = 2;
- a hit on a prefix a speculating request wrote: B's prompt is A's prompt and A's output (as
  the reference decodes it), so B's hit takes blocks A's speculative steps filled and published;
- preemption mid-speculation: forced swap-outs and recomputes between speculative steps, and a
  pool tight enough to preempt on its own, with the draft model's KV rolled back each time."""

from __future__ import annotations

from kvpage.sampling_params import SamplingParams
from kvpage.verify.case import (
    Case,
    RequestSpec,
    Tokens,
    greedy,
    preempt_at_step,
    with_canaries,
)

B = 4
K = 3
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1}
SELF_INT8 = {
    "method": "draft_model",
    "model": None,
    "quantization": "int8",
    "num_speculative_tokens": K,
}
OTHER_DRAFT = {"method": "draft_model", "model": "builtin:tiny-qwen2", "num_speculative_tokens": K}


def speculative_cases(vocab: int) -> list[Case]:
    t = Tokens(vocab, seed=909)
    return [
        _block_crossing(t),
        _rejections(t, "other_draft", OTHER_DRAFT),
        _rejections(t, "self_int8", SELF_INT8),
        _hit_on_speculated_prefix(t),
        *(_preempted_mid_speculation(t, mode) for mode in ("swap", "recompute")),
    ]


def _sampled(i: int, max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(
        temperature=(0.8, 1.0, 1.3)[i % 3],
        top_p=(1.0, 0.95, 1.0)[i % 3],
        top_k=(-1, -1, 40)[i % 3],
        max_tokens=max_tokens,
        seed=900 + i,
        n=n,
        ignore_eos=True,
    )


def _repeating(t: Tokens, period: int, length: int) -> list[int]:
    """A prompt that repeats a phrase: its own tail has earlier occurrences (n-gram drafts)."""
    phrase = t.take(period)
    return (phrase * (length // period + 1))[:length]


def _block_crossing(t: Tokens) -> Case:
    specs = [
        RequestSpec(f"g{i}", _repeating(t, 3 + i, 9 + 2 * i), greedy(24), arrive_step=i // 2)
        for i in range(4)
    ]
    specs += [
        RequestSpec(f"s{i}", _repeating(t, 2 + i, 11 + i), _sampled(i, 24), arrive_step=i)
        for i in range(3)
    ]
    return Case(
        "speculative",
        "block_crossing",
        with_canaries(specs, 256, seed=91),
        dict(block_size=B, num_blocks=96, speculative_config=NGRAM),
        check_sampling=True,
    )


def _rejections(t: Tokens, name: str, spec: dict) -> Case:
    specs = [RequestSpec(f"g{i}", t.take(5 + 3 * i), greedy(28), arrive_step=i) for i in range(4)]
    specs += [
        RequestSpec(f"s{i}", t.take(6 + 2 * i), _sampled(i, 28, n=1 + i % 2), arrive_step=i)
        for i in range(4)
    ]
    return Case(
        "speculative",
        f"rejections_{name}",
        specs,
        dict(block_size=B, num_blocks=128, speculative_config=spec),
        check_sampling=True,
    )


def _hit_on_speculated_prefix(t: Tokens) -> Case:
    """A decodes 3 * B + 2 tokens past its prompt; B arrives after A finished with A's prompt
    and A's first 2 * B + 1 output tokens: every full block of B's prompt but the last is in
    the cache, those past A's prompt filled by A's speculative steps."""
    prompt = _repeating(t, 3, 2 * B + 1)
    a = RequestSpec("A", prompt, greedy(3 * B + 2))
    b = RequestSpec("B", [], greedy(8), arrive_step=12, continues=("A", 2 * B + 1))
    hit = (len(prompt) + 2 * B + 1 - 1) // B * B  # a prompt's last token is always computed
    return Case(
        "speculative",
        "hit_on_speculated_prefix",
        [a, b],
        dict(block_size=B, num_blocks=64, speculative_config=SELF_INT8),
        expect_hit_tokens={"A": 0, "B": hit},
    )


def _preempted_mid_speculation(t: Tokens, mode: str) -> Case:
    specs = [
        RequestSpec(f"p{i}", _repeating(t, 2 + i % 3, 7 + i), greedy(20), arrive_step=i // 3)
        for i in range(6)
    ]
    specs.append(RequestSpec("s0", _repeating(t, 3, 9), _sampled(1, 20), arrive_step=1))
    plan = [("p0", 0, 5, 2), ("p2", 1, 9, 1), ("p4", 2, 14, 3), ("s0", 2, 7, 1)]
    actions = [
        preempt_at_step(f"preempt {r} after {k}", step, r, k, n, mode) for r, step, k, n in plan
    ]
    return Case(
        "speculative",
        f"preempted_mid_speculation_{mode}",
        with_canaries(specs, 256, seed=92),
        dict(
            block_size=B,
            num_blocks=40,
            preemption_mode=mode,
            swap_space_blocks=64,
            speculative_config=SELF_INT8,
        ),
        actions=actions,
        expect_preemption=True,
        hold_steps=7,
    )

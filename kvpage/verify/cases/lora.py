"""LoRA adapters: base and two adapters on the same prompt in one step (each equals its
reference, the reference merging the adapter in its own code; no block shared across adapters,
the same adapter shares), a reload under the same name, an adapter named like a tenant's salt,
and adapters under preemption (recompute and swap) with a parallel request. Every request states
how many cached tokens it must get: an adapter left out of the key would share KV silently where
two adapters agree on a token."""

from __future__ import annotations

from kvpage.sampling_params import SamplingParams
from kvpage.verify.case import Action, Case, RequestSpec, Tokens, greedy
from kvpage.verify.lora_adapters import LoraSpec

SUITE = "lora"
B = 8
A = LoraSpec("a", seed=101)
BB = LoraSpec("b", seed=102, targets=("q_proj", "v_proj", "down_proj"), rank=8, alpha=8.0)
A_RELOADED = LoraSpec("a", seed=103)  # the same name, other weights


def lora_cases(vocab: int) -> list[Case]:
    t = Tokens(vocab, seed=2500)
    return [_mixed(t), _reload(t), _named_like_a_salt(t), _preempted(t)]


def _mixed(t: Tokens) -> Case:
    prompt, full = t.take(3 * B + 2), 3 * B
    order = [
        ("base.1", None, 0, 0),
        ("a.1", A, 0, 0),
        ("b.1", BB, 0, 0),
        ("a.2", A, 16, full),
        ("b.2", BB, 16, full),
        ("base.2", None, 16, full),
    ]
    specs = [RequestSpec(rid, prompt, greedy(5), at, lora=lora) for rid, lora, at, _ in order]
    specs.append(RequestSpec("a.other", t.take(2 * B + 3), greedy(5), 0, lora=A))
    return Case(
        SUITE,
        "base and two adapters in one batch, then each again",
        specs,
        dict(block_size=B, num_blocks=64),
        expect_hit_tokens={rid: hits for rid, _, _, hits in order},
    )


def _reload(t: Tokens) -> Case:
    prompt, full = t.take(3 * B + 1), 3 * B
    specs = [
        RequestSpec("old", prompt, greedy(4), 0, lora=A),
        RequestSpec("reloaded", prompt, greedy(4), 8, lora=A_RELOADED),
        RequestSpec("reloaded.2", prompt, greedy(4), 16, lora=A_RELOADED),
    ]
    return Case(
        SUITE,
        "an adapter reloaded under its name with other weights",
        specs,
        dict(block_size=B, num_blocks=64),
        expect_hit_tokens={"old": 0, "reloaded": 0, "reloaded.2": full},
    )


def _named_like_a_salt(t: Tokens) -> Case:
    prompt = t.take(3 * B + 1)
    specs = [
        RequestSpec("salted", prompt, greedy(4), 0, cache_salt="a"),
        RequestSpec("adapter", prompt, greedy(4), 8, lora=A),
    ]
    return Case(
        SUITE,
        "adapter 'a' against the tenant salt 'a'",
        specs,
        dict(block_size=B, num_blocks=64),
        expect_hit_tokens={"salted": 0, "adapter": 0},
    )


def _preempted(t: Tokens) -> Case:
    shared = t.take(2 * B + 2)
    sampled = SamplingParams(max_tokens=6, n=2, temperature=1.0, seed=7, ignore_eos=True)
    specs = [
        RequestSpec("r", shared + t.take(5), greedy(8), lora=A),
        RequestSpec("s", shared + t.take(7), greedy(8), lora=BB),
        RequestSpec("n", shared + t.take(3), sampled, lora=A),
        RequestSpec("base", shared + t.take(4), greedy(8)),
    ]
    return Case(
        SUITE,
        "adapters preempted by recompute and swap, a parallel request with an adapter",
        specs,
        dict(block_size=B, num_blocks=64, max_num_batched_tokens=16),
        actions=[
            Action("preempt r", lambda e, s: s == 3, lambda e: e.force_preempt("r", 0, 2)),
            Action(
                "swap s", lambda e, s: s == 4, lambda e: e.force_preempt("s", 0, 2, mode="swap")
            ),
        ],
        expect_preemption=True,
    )

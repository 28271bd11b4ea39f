"""Stop rules and length: stop token ids hit at chosen steps (on and off block boundaries,
at the very first token), EOS reached by sampled requests, max_tokens ending exactly on a block
boundary. A candidate that stops early or late diverges with the stop_rule class."""

from __future__ import annotations

from kvpage.sampling_params import SamplingParams
from kvpage.verify.case import Case, RequestSpec, Tokens, greedy

B = 8


def stop_cases(vocab: int) -> list[Case]:
    return [_stop_tokens(vocab), _eos(vocab), _length_boundaries(vocab), _stop_at_max_tokens(vocab)]


def _stop_tokens(vocab: int) -> Case:
    """Greedy and sampled requests whose stop token is the one the reference draws at step k."""
    t = Tokens(vocab, seed=404)
    specs = []
    for i, k in enumerate((0, 1, 5, 6, 7, 12)):
        prompt = t.take(B + i + 2)
        specs.append(RequestSpec(f"greedy.k{k}", prompt, greedy(24), stop_at_ref_step=k))
        sampled = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=24, seed=40 + i)
        specs.append(
            RequestSpec(f"sampled.k{k}", prompt, sampled, arrive_step=1, stop_at_ref_step=k)
        )
    # Stop ids the model never draws must not end anything.
    never = SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=(vocab - 3,))
    specs.append(RequestSpec("never-stops", t.take(11), never, arrive_step=2))
    return Case(
        "stop",
        "stop_token_ids",
        specs,
        dict(block_size=B, num_blocks=96),
        expect_finish={"greedy.k0": "stop", "never-stops": "length"},
    )


def _eos(vocab: int) -> Case:
    """Hot sampled requests that honour EOS: the reference ends some of them with EOS (checked
    in the tests for the shipped model); ignore_eos twins run to max_tokens."""
    t = Tokens(vocab, seed=405)
    specs = []
    for i in range(16):
        prompt = t.take(6 + i % 5)
        hot = SamplingParams(temperature=2.5, max_tokens=40, seed=500 + i)
        specs.append(RequestSpec(f"eos{i}", prompt, hot, arrive_step=i // 4))
    return Case("stop", "eos_sampled", specs, dict(block_size=B, num_blocks=128))


def _length_boundaries(vocab: int) -> Case:
    """max_tokens that end a request one before, on and one after a block boundary."""
    t = Tokens(vocab, seed=406)
    specs = []
    prompt_len = B + 3
    for name, total in (("minus1", 2 * B - 1), ("exact", 2 * B), ("plus1", 2 * B + 1)):
        specs.append(RequestSpec(f"len.{name}", t.take(prompt_len), greedy(total - prompt_len)))
    specs.append(RequestSpec("len.one", t.take(5), greedy(1)))
    return Case(
        "stop",
        "max_tokens_boundaries",
        specs,
        dict(block_size=B, num_blocks=32),
        expect_finish={s.request_id: "length" for s in specs},
    )


def _stop_at_max_tokens(vocab: int) -> Case:
    """The stop token is the one the reference draws as the last token max_tokens allows (the
    first, on a block boundary, inside a block): both rules end the request there, and the
    finish reason must be "stop"."""
    t = Tokens(vocab, seed=407)
    specs = []
    for i, k in enumerate((0, B - 4, B - 1, 2 * B - 3)):
        prompt = t.take(B + 3 + i)
        specs.append(RequestSpec(f"greedy.max{k + 1}", prompt, greedy(k + 1), stop_at_ref_step=k))
        sampled = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=k + 1, seed=60 + i)
        specs.append(RequestSpec(f"sampled.max{k + 1}", prompt, sampled, stop_at_ref_step=k))
    return Case(
        "stop",
        "stop_at_max_tokens",
        specs,
        dict(block_size=B, num_blocks=64),
        expect_finish={s.request_id: "stop" for s in specs},
    )

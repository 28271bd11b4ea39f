"""The whole-stack suite in 16-bit models: logprobs within the gate's dtype rule, a top k that
swaps tied tokens, and the reference followed through the engine's numeric ties (and only
through ties: another token where the reference is sure is still a difference)."""

from __future__ import annotations

import pytest
import torch

from kvpage.model import load_model
from kvpage.reference.generator import generate
from kvpage.sampling_params import SamplingParams
from kvpage.verify.stack.compare import _top
from kvpage.verify.stack.suite import run_server_suite
from kvpage.verify.stack.text_oracle import TokenEntry
from kvpage.verify.stack.ties import EngineDraw, StepRecorder, follow_ties

ATOL = 0.05


def _entry(top: dict[str, float], band: dict[str, float]) -> TokenEntry:
    band_values = {n: (v, n.encode()) for n, v in band.items()}
    return TokenEntry(
        token_id=1,
        text="c",
        piece=b"c",
        logprob=-3.0,
        top=top,
        top_bytes={n: n.encode() for n in top},
        offset=0,
        band=band_values,
        key="c",  # no two tokens here share a spelling: completions' keys are the spellings
        keyed_top={**top, "c": -3.0},
        keyed_band=band_values,
    )


# Reference: "a" first, "b" and "t" tied at the 2nd place (topk kept "b"), "u" within ATOL below,
# "w" further below; the chosen token "c" is outside the top 2.
TOP = {"a": -0.5, "b": -1.0}
BAND = {"a": -0.5, "b": -1.0, "t": -1.0, "u": -1.0 - ATOL / 2}
WANT = _entry(TOP, BAND)


def _have(names: dict[str, float], chat: bool) -> dict:
    top = dict(names) if chat else {"c": -3.0, **names}
    return {"top": top, "top_bytes": {n: list(n.encode()) for n in top}}


@pytest.mark.parametrize("chat", [False, True])
def test_a_tied_token_may_take_the_kth_place(chat):
    for names in ({"a": -0.5, "b": -1.0}, {"a": -0.5, "t": -1.0}, {"a": -0.5, "u": -1.02}):
        assert _top(WANT, _have(names, chat), chat, ATOL) is None, names


@pytest.mark.parametrize("chat", [False, True])
def test_a_token_below_the_band_or_a_top_token_left_out_is_a_difference(chat):
    for names in ({"a": -0.5, "w": -2.0}, {"b": -1.0, "t": -1.0}):
        problem = _top(WANT, _have(names, chat), chat, ATOL)
        assert problem is not None and problem[0] == "top_logprobs", names


def test_a_tied_token_with_a_value_off_is_a_difference():
    problem = _top(WANT, _have({"a": -0.5, "t": -1.2}, False), False, ATOL)
    assert problem is not None and problem[0] == "top_logprobs[t]"


@pytest.fixture(scope="module")
def tiny():
    return load_model("builtin:tiny-llama")


def _draws(ref, tokens=None) -> list[EngineDraw]:
    tokens = ref.token_ids if tokens is None else tokens
    return [EngineDraw(t, lg, None) for t, lg in zip(tokens, ref.step_logits, strict=False)]


def test_follow_ties_takes_the_engines_token_only_at_a_tie(tiny):
    model, _ = tiny
    prompt, params = list(range(5, 17)), SamplingParams(max_tokens=8, ignore_eos=True)
    ref = generate(model, prompt, params)
    assert follow_ties(model, prompt, params, _draws(ref), ATOL) is None  # nothing differs
    step = 3
    logits = ref.step_logits[step]
    second = int(torch.topk(logits, 2).indices[1])
    gap = float(logits[ref.token_ids[step]] - logits[second])
    tokens = [*ref.token_ids[:step], second]
    # The runner-up within the tolerance of the reference's choice: followed.
    path = follow_ties(model, prompt, params, _draws(ref, tokens), gap + 1e-6)
    assert path is not None and path.token_ids[: step + 1] == tokens
    assert len(path.token_ids) == params.max_tokens
    assert path.step_logits[step].equal(ref.step_logits[step])
    # Further apart than the tolerance: not a tie, the reference keeps its own token.
    assert follow_ties(model, prompt, params, _draws(ref, tokens), gap / 2) is None
    # The same gap but the engine's logits moved by more than the tolerance: not a tie either.
    moved = _draws(ref, tokens)
    moved[step] = EngineDraw(second, logits + 2 * (gap + 1e-6), None)
    assert follow_ties(model, prompt, params, moved, gap + 1e-6) is None


def test_a_sampled_tie_needs_the_same_generator_state(tiny):
    model, _ = tiny
    prompt = list(range(5, 17))
    params = SamplingParams(temperature=0.8, max_tokens=4, seed=3, ignore_eos=True)
    ref = generate(model, prompt, params)
    other = (ref.token_ids[0] + 1) % model.config.vocab_size
    draws = [EngineDraw(other, ref.step_logits[0], {"seed": 3, "generator_state": "elsewhere"})]
    assert follow_ties(model, prompt, params, draws, 10.0) is None


def test_the_recorder_hands_out_one_request_at_a_time():
    recorder = StepRecorder()

    class Seq:
        def __init__(self, rid, sid):
            self.request_id, self.sample_id, self.generator, self.num_draws = rid, sid, None, 1

    logits = torch.zeros(4)
    recorder.on_forked(None, Seq("r1", "r1#1"), logits, 2)
    recorder.on_forked(None, Seq("r1", "r1#0"), logits, 1)
    assert sorted(recorder.take()) == [0, 1]
    recorder.on_forked(None, Seq("r1", "r1#0"), logits, 3)  # r1 still stepping: not r2's
    recorder.on_forked(None, Seq("r2", "r2"), logits, 3)
    assert list(recorder.take()) == [0]
    assert recorder.take() is None


def test_the_honest_bf16_stack_passes_through_its_ties():
    """builtin:tiny-qwen2 in bfloat16: three of its generated requests take another token than
    the reference at a numeric tie (a float32 logprob constant failed most of the rest)."""
    model, tok = load_model("builtin:tiny-qwen2", torch.bfloat16)
    cases = run_server_suite(model, tok, "builtin:tiny-qwen2", seed=0, budget_s=120)
    assert [f.message for c in cases for f in c.failures] == []
    servers = [c for c in cases if c.suite == "server"]
    assert sum(c.stats["coverage"].get("numeric tie followed", 0) for c in servers) > 0

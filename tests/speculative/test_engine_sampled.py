"""The sampled speculative path, end to end: every token a speculating engine emits for a
sampled request follows the target's own distribution at its position (the sampling oracle's
randomized-PIT uniformity test over all of them, with the target's logits of each position),
with a draft model of other weights (most drafts rejected: the residual draws) and with the
target's int8 copy (most kept: the bonus rows); seeded requests repeat exactly. The same test
fails on an engine with a planted bias (the token after a rejection drawn from p, not from
norm(max(0, p - q))), so it can fail."""

from __future__ import annotations

import pytest

from kvpage import LLMEngine, SamplingParams
from kvpage.config import EngineConfig
from kvpage.engine.events import EngineObserver
from kvpage.verify.mutants.speculative import resample_from_p
from kvpage.verify.sampling_oracle import DrawSample, uniformity_test

OTHER_DRAFT = {"method": "draft_model", "model": "builtin:tiny-qwen2", "num_speculative_tokens": 3}
SELF_INT8 = {**OTHER_DRAFT, "model": None, "quantization": "int8"}
MAX_TOKENS = 40
PARAMS = [  # 4,800 draws: clean p = 0.41 (other draft), 0.17 (int8); the planted bias 1.6e-7
    SamplingParams(temperature=t, top_p=p, max_tokens=MAX_TOKENS, seed=s, ignore_eos=True)
    for s, (t, p) in enumerate([(1.0, 1.0), (0.7, 1.0), (1.3, 0.95)] * 40)
]


class _Draws(EngineObserver):
    """Each emitted token with the logits row it was chosen from."""

    def __init__(self) -> None:
        self.samples: list[DrawSample] = []

    def on_sampled(self, batch, logits, tokens) -> None:
        for row, (item, token) in enumerate(zip(batch.sample_seqs, tokens, strict=True)):
            self.samples.append(DrawSample(logits[row].clone(), item.seq.params, token))

    def on_verified(self, batch, spec_logits, verified) -> None:
        for v in verified:
            for draw in v.draws[: v.appended]:
                self.samples.append(
                    DrawSample(spec_logits[draw.row].clone(), v.item.seq.params, draw.token)
                )


def _run(spec: dict, plant=None):
    engine = LLMEngine(EngineConfig(block_size=8, num_blocks=512, speculative_config=spec))
    if plant is not None:
        plant(engine)
    draws = _Draws()
    engine.add_observer(draws)
    for i, params in enumerate(PARAMS):
        engine.add_request(str(i), [3 + i, 40 + i, 7, 90 + i], params)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    return draws.samples, outputs, engine.stats()


@pytest.mark.parametrize("spec", [OTHER_DRAFT, SELF_INT8], ids=["other_draft", "self_int8"])
def test_sampled_speculation_follows_the_target(spec):
    samples, outputs, stats = _run(spec)
    assert len(samples) == MAX_TOKENS * len(PARAMS)
    assert stats["spec_decode_num_drafts"] > 0
    result = uniformity_test(samples)
    assert result.passed, result
    again = _run(spec)[1]
    assert again == outputs  # seeded: the same tokens, draft and target draws alike


def test_a_planted_bias_fails_the_distribution_test():
    samples, _, stats = _run(OTHER_DRAFT, plant=resample_from_p)
    assert stats["spec_decode_num_draft_tokens"] > 2 * stats["spec_decode_num_accepted_tokens"]
    result = uniformity_test(samples)
    assert not result.passed, result

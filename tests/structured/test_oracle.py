"""Greedy constrained tokens equal an independent oracle: transformers' logits of the same
random-weight Llama, masked by a matcher this test builds itself (llguidance's LLTokenizer from
the transformers tokenizer, the grammar compiled here, the bitmask unpacked with numpy), argmax
step by step. For a SentencePiece-style and a byte-level BPE tokenizer, both with merges across
JSON punctuation, so tokens straddle grammar boundaries."""

from __future__ import annotations

import json

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np
import pytest
import torch
import transformers

from kvpage import LLM, SamplingParams, StructuredOutputsParams

from .constraints import json_schemas, valid
from .hf_checkpoints import TOKENIZERS, build

MAX_TOKENS = 48
CONSTRAINTS = [
    *(StructuredOutputsParams(json=s, disable_any_whitespace=True) for s in json_schemas(3, 21)),
    StructuredOutputsParams(regex=r"[a-z]{2,6}(-[0-9]{1,3})?"),
    StructuredOutputsParams(regex=r"(north|south|red) [0-9]{1,4}"),
    StructuredOutputsParams(choice=["north", "south", "alpha beta", "42"]),
]


def _grammar(constraint: StructuredOutputsParams) -> str:
    if constraint.kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(
            json.loads(constraint.json), {"whitespace_flexible": False}
        )
    if constraint.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(constraint.regex)
    alternatives = " | ".join(json.dumps(c) for c in constraint.choice)
    return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")


def oracle_tokens(model, lltok, prompt: list[int], constraint, eos: int) -> list[int]:
    """Masked greedy decoding, the whole sequence through the model at every step."""
    matcher = llguidance.LLMatcher(lltok, _grammar(constraint))
    assert not matcher.is_error(), matcher.get_error()
    bitmask = llguidance.numpy.allocate_token_bitmask(1, lltok.vocab_size)
    ids, out = list(prompt), []
    while len(out) < MAX_TOKENS and not matcher.is_stopped():
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].double().numpy()
        llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, 0)
        allowed = np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")[: len(logits)]
        token = int(np.argmax(np.where(allowed.astype(bool), logits, -np.inf)))
        assert matcher.consume_token(token), matcher.get_error()
        ids.append(token)
        out.append(token)
        if token == eos:
            break
    return out


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def checkpoint(request, tmp_path_factory):
    return build(request.param, tmp_path_factory.mktemp(request.param))


def test_greedy_tokens_equal_the_oracle(checkpoint):
    hf_tok = transformers.AutoTokenizer.from_pretrained(checkpoint)
    model = transformers.LlamaForCausalLM.from_pretrained(checkpoint).float().eval()
    vocab, eos = model.config.vocab_size, model.config.eos_token_id
    lltok = llguidance.hf.from_tokenizer(hf_tok, n_vocab=vocab, eos_token=eos)
    prompts = [
        hf_tok(f"request {i}: give the answer", add_special_tokens=True)["input_ids"]
        for i in range(len(CONSTRAINTS))
    ]
    params = [SamplingParams(max_tokens=MAX_TOKENS, structured_outputs=c) for c in CONSTRAINTS]
    with LLM(model=str(checkpoint), debug_checks=True) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    stopped = 0
    for prompt, constraint, out in zip(prompts, CONSTRAINTS, outputs, strict=True):
        (sample,) = out.outputs
        expected = oracle_tokens(model, lltok, prompt, constraint, eos)
        assert sample.token_ids == expected, (constraint, sample.text, hf_tok.decode(expected))
        if sample.finish_reason == "stop":
            stopped += 1
            assert valid(constraint, sample.text), (constraint, sample.text)
    assert stopped >= len(CONSTRAINTS) - 1

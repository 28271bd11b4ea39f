"""The whole-stack suite on Hugging Face directories with real tokenizers (issues 39.5, 40.5): a
SentencePiece-style BPE with byte fallback and a byte-level BPE, each trained here on a random
Llama (kvpage.verify.stack.tokenizer_dirs). Clean code passes over 200 generated requests on
each, every text field compared with the tokenizer's own decode (through transformers); each
server text mutant is caught on each tokenizer that can show it, with its class; the gate's
stage runs them all and catches the SentencePiece-only one though the served model's byte
tokenizer cannot show it."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from kvpage.model import load_model
from kvpage.verify.stack import TextTarget, run_stack_stage
from kvpage.verify.stack.mutants import STACK_MUTANTS
from kvpage.verify.stack.suite import run_server_mutant, run_server_suite

from .stack_dirs import build

TEXT_MUTANTS = [m for m in STACK_MUTANTS if m.expected_class in ("server_text", "server_logprobs")]
WANTED_REQUESTS = 200
# What the 200 requests must have exercised, each at least this often.
COVERED = {
    "stream": 20,
    "sampled": 20,
    "n>1": 20,
    "echo": 5,
    "echo with logprobs": 3,
    "chat with the model's template": 10,
    "logprobs": 20,
    "stop string hit": 20,
    "list of prompts": 3,
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("stack-dirs")
    return {kind: str(build(root / kind, kind)) for kind in ("spm", "bpe")}


@pytest.mark.parametrize("kind", ["spm", "bpe"])
def test_the_honest_stack_passes_200_requests_on_a_real_tokenizer(dirs, kind):
    model, tok = load_model(dirs[kind], torch.float32)
    coverage, seed = Counter(), 0
    while coverage["requests"] < WANTED_REQUESTS:
        cases = run_server_suite(model, tok, dirs[kind], seed=seed, budget_s=120)
        servers = [c for c in cases if c.suite == "server"]
        assert [c.case for c in servers] == ["server-tenants", "server-open"]
        assert [f.message for c in cases for f in c.failures] == [], f"seed {seed}"
        for c in servers:
            coverage.update(c.stats["coverage"])
        seed += 1
    short = {k: coverage[k] for k, least in COVERED.items() if coverage[k] < least}
    assert short == {}, coverage


@pytest.mark.parametrize("kind", ["spm", "bpe"])
@pytest.mark.parametrize("mutant", TEXT_MUTANTS, ids=lambda m: m.name)
def test_each_text_mutant_is_caught_on_each_tokenizer_that_can_show_it(dirs, kind, mutant):
    model, tok = load_model(dirs[kind], torch.float32)
    result = run_server_mutant(mutant, model, tok, dirs[kind], budget_s=60)
    if mutant.name == "completion_decoded_without_prompt" and kind == "bpe":
        # byte-level BPE spells a token the same at a text's start and inside it
        assert result.not_applicable is not None and not result.caught
        return
    assert result.caught, mutant.name
    assert result.attribution_ok, result.first_failure


def test_the_gate_stage_catches_a_sentencepiece_bug_the_served_tokenizer_cannot_show():
    mutant = next(m for m in STACK_MUTANTS if m.name == "completion_decoded_without_prompt")
    model, tok = load_model("builtin:tiny-llama", torch.float32)
    served = TextTarget(model, tok, "builtin:tiny-llama")
    cases, (result,) = run_stack_stage(served, [mutant])
    names = [c.case for c in cases if c.suite == "server"]
    assert names == [
        "server-tenants",
        "server-open",
        "server-tenants[spm]",
        "server-open[spm]",
        "server-tenants[bpe]",
        "server-open[bpe]",
    ]
    assert all(c.passed for c in cases)
    assert result.caught and result.attribution_ok and result.caught_by == ["server-tenants[spm]"]

"""The whole-stack suite on Hugging Face directories with real tokenizers (issue 39.5): a
SentencePiece-style BPE with byte fallback and a byte-level BPE, each trained here on a random
Llama (tests/verify/stack_dirs.py). Clean code passes every case; on the SentencePiece one the
mutant that decodes a completion without its prompt is caught (the byte-level tokenizer spells a
token the same at a text's start: not applicable there)."""

from __future__ import annotations

import pytest
import torch

from kvpage.model import load_model
from kvpage.verify.stack.mutants import STACK_MUTANTS
from kvpage.verify.stack.suite import run_server_mutant, run_server_suite

from .stack_dirs import build


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("stack-dirs")
    return {kind: str(build(root / kind, kind)) for kind in ("spm", "bpe")}


@pytest.mark.parametrize("kind", ["spm", "bpe"])
def test_the_honest_stack_passes_on_a_real_tokenizer(dirs, kind):
    model, tok = load_model(dirs[kind], torch.float32)
    cases = run_server_suite(model, tok, dirs[kind], budget_s=60)
    assert [c.case for c in cases if c.suite == "server"] == ["server-tenants", "server-open"]
    assert [f.message for c in cases for f in c.failures] == []


def test_the_sentencepiece_directory_catches_a_completion_decoded_without_its_prompt(dirs):
    mutant = next(m for m in STACK_MUTANTS if m.name == "completion_decoded_without_prompt")
    model, tok = load_model(dirs["spm"], torch.float32)
    result = run_server_mutant(mutant, model, tok, dirs["spm"], budget_s=60)
    assert result.caught and result.attribution_ok, result.first_failure
    model, tok = load_model(dirs["bpe"], torch.float32)
    assert run_server_mutant(mutant, model, tok, dirs["bpe"]).not_applicable is not None

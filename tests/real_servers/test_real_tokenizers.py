"""The whole-stack suite on real tokenizers: the vocabularies llama.cpp ships as GGUF files in the
llama-cpp-python sdist (the one bench/peers/llama_cpp.py downloads), loaded by transformers
(`gguf_file=`, the `gguf` package of the bench extra) and saved as tokenizer.json, each on a
random-weight Llama of its vocabulary size. Every text field of 44 generated requests (stream,
sampled, n > 1, echo, stop strings cut from the reference's own text, chat through the GGUF's
template where it has one) equals the tokenizer's own decode, read through transformers.
SentencePiece (Llama 2, 32000 pieces with byte fallback) and byte-level BPE (Llama 3, Qwen2,
GPT-2) both; Phi-3's SentencePiece too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from bench.peers import llama_cpp as peer
from kvpage.model import load_model
from kvpage.verify.stack.suite import run_server_suite

VOCABS = ["llama-spm", "llama-bpe", "qwen2", "phi-3", "gpt-2"]


def _directory(vocab: str, root: Path) -> Path:
    models = peer.fetch_source() / "models"  # the vendored llama.cpp
    tok = transformers.AutoTokenizer.from_pretrained(models, gguf_file=f"ggml-vocab-{vocab}.gguf")
    directory = root / vocab
    tok.save_pretrained(directory)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=512,
        initializer_range=0.15,  # logits far from ties: the comparison is about text
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return directory


@pytest.mark.parametrize("vocab", VOCABS)
def test_every_text_field_equals_the_real_tokenizers_decode(vocab, tmp_path):
    directory = str(_directory(vocab, tmp_path))
    model, tokenizer = load_model(directory, torch.float32)
    cases = run_server_suite(model, tokenizer, directory, budget_s=240)
    servers = [c for c in cases if c.suite == "server"]
    assert [c.case for c in servers] == ["server-tenants", "server-open"]
    assert sum(c.requests for c in servers) == 44  # none left out for time
    assert [f.message for c in cases for f in c.failures] == []

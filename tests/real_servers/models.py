"""The model the real servers serve: a small random-weight Llama (head_dim 64, as vLLM's CPU
attention needs >= 32) with a real tokenizer built here — the bench peer's byte-fallback BPE
(bench/peers/llama_cpp.py's `write_tokenizer`), which both vLLM (as a fast tokenizer) and
llama.cpp's converter load. Saved with `save_pretrained`, so the same folder is the checkpoint
`kvpage audit --reference-model` reads."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bench.peers.llama_cpp import write_tokenizer


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str = "audit-tiny"
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 2
    num_attention_heads: int = 4  # head_dim 64
    num_key_value_heads: int = 2
    max_position_embeddings: int = 4096
    init_std: float = 0.05  # close logits: the near-ties a bf16 server flips on
    seed: int = 26


# A small Llama with a real BPE tokenizer, for the tests of clients that decode text (openai,
# lm-eval, echo logprobs, LoRA serving); wide init for clear argmaxes.
CLIENT_TINY = ModelSpec(
    name="client-tiny",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    max_position_embeddings=512,
    init_std=0.15,
)

# The 125M-class model of the measurements (bench/throughput.py's "125m": 12 layers,
# d=768, 12 heads / 4 KV heads, a 32000-token vocabulary), too slow for CI on 2 cores.
SPECS = {
    "tiny": ModelSpec(),
    "125m": ModelSpec(
        name="audit-125m",
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        init_std=0.02,
    ),
}


def build(directory: Path, spec: ModelSpec = ModelSpec()) -> Path:
    """The checkpoint (config.json, model.safetensors, tokenizer) in `directory`, in float32."""
    import torch
    import transformers

    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(spec.seed)
    cfg = transformers.LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.init_std,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    model.save_pretrained(directory)
    write_tokenizer(directory, spec.vocab_size)
    return directory

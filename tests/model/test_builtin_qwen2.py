"""builtin:tiny-qwen2 against transformers' Qwen2ForCausalLM: its weights, saved as a Qwen2
checkpoint, must give transformers' logits, and loading that checkpoint back through our loader
(the qwen2 config dialect) must give the built-in model's."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import save_file

from kvpage.model import load_model

ATOL = 1e-4  # float32, 2 layers: the attention kernels differ by ~1e-6


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    """builtin:tiny-qwen2 written as a Hugging Face Qwen2 directory."""
    model, _ = load_model("builtin:tiny-qwen2")
    cfg = model.config
    hf_cfg = transformers.Qwen2Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope.theta,
        tie_word_embeddings=False,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_ids[0],
    )
    directory = tmp_path_factory.mktemp("tiny-qwen2")
    (directory / "config.json").write_text(json.dumps(hf_cfg.to_dict()))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(directory / "model.safetensors"))
    return model, hf_cfg, directory


def _ids(length: int) -> list[int]:
    g = torch.Generator().manual_seed(length)
    return torch.randint(0, 256, (length,), generator=g).tolist()


def test_shape_is_the_one_the_matrix_needs():
    model, _ = load_model("builtin:tiny-qwen2")
    cfg = model.config
    assert cfg.head_dim == 64 and cfg.qkv_bias and not cfg.o_bias
    assert cfg.num_heads * cfg.head_dim != cfg.hidden_size  # q/o projections not square
    biases = [p for n, p in model.named_parameters() if n.endswith("_proj.bias")]
    assert biases and min(float(b.detach().std()) for b in biases) > 0.1  # large enough to matter


@pytest.mark.parametrize("length", [1, 19, 90])
def test_logits_match_transformers_qwen2(qwen2_dir, length):
    model, hf_cfg, directory = qwen2_dir
    hf = transformers.Qwen2ForCausalLM.from_pretrained(str(directory), attn_implementation="sdpa")
    ids = _ids(length)
    with torch.no_grad():
        expected = hf.float().eval()(torch.tensor([ids])).logits[0]
    err = (model.forward_full(ids) - expected).abs().max().item()
    assert err <= ATOL, f"max-abs logit error {err:.3g} at prompt length {length}"


def test_bias_is_part_of_the_parity(qwen2_dir):
    """The oracle can fail: transformers without the k bias disagrees with our model."""
    model, _, directory = qwen2_dir
    hf = transformers.Qwen2ForCausalLM.from_pretrained(str(directory)).float().eval()
    with torch.no_grad():
        hf.model.layers[0].self_attn.k_proj.bias.zero_()
        expected = hf(torch.tensor([_ids(19)])).logits[0]
    assert (model.forward_full(_ids(19)) - expected).abs().max().item() > 100 * ATOL


def test_loads_back_through_the_qwen2_dialect(qwen2_dir):
    model, _, directory = qwen2_dir
    loaded, _ = load_model(str(directory))
    assert loaded.config.qkv_bias and not loaded.config.o_bias
    ids = _ids(33)
    assert torch.equal(loaded.forward_full(ids), model.forward_full(ids))

"""The LM head in int8 (EngineConfig.quantize_lm_head): which layer becomes int8 (an untied
head in place; a tied model's int8 copy, its embedding untouched), the config and the engine
refusing what does not fit, and the verifier's reference dequantising the head with its own
code."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvpage import LLM
from kvpage.config import EngineConfig
from kvpage.engine.engine import LLMEngine
from kvpage.errors import InvalidConfig
from kvpage.model import load_model
from kvpage.model.int8 import Int8Linear, quantize_per_channel
from kvpage.model.quantize import TIED_HEAD, head_quantized, state_quantization
from kvpage.reference.weight_oracle import DequantizedLinear, reference_model


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_untied_head_becomes_int8_in_place(dtype):
    plain, _ = load_model("builtin:tiny-llama", dtype)
    model, _ = load_model("builtin:tiny-llama", dtype, quantization="int8", quantize_lm_head=True)
    head = model.logits.linears[0]
    assert isinstance(head, Int8Linear) and head is model.lm_head and head_quantized(model)
    codes, scales = quantize_per_channel(plain.lm_head.weight, plain.lm_head.weight.dtype)
    assert torch.equal(head.weight_int8, codes) and torch.equal(head.scales, scales)
    assert head.scales.dtype == plain.dtype  # the kernel takes its scales in the x dtype
    assert not any(type(m) is nn.Linear for m in model.modules())  # no float head kept
    assert state_quantization(model.state_dict()) == ("int8", True)
    default, _ = load_model("builtin:tiny-llama", dtype, quantization="int8")
    assert not head_quantized(default) and type(default.logits.linears[0]) is nn.Linear
    assert state_quantization(default.state_dict()) == ("int8", False)


def test_tied_head_is_an_int8_copy_and_the_embedding_stays_float():
    plain, _ = load_model("builtin:tiny-gpt2")
    model, _ = load_model("builtin:tiny-gpt2", quantization="int8", quantize_lm_head=True)
    head = model.logits.linears[0]
    assert isinstance(head, Int8Linear) and head is getattr(model, TIED_HEAD)
    wte = model.transformer.wte
    assert type(wte) is nn.Embedding and wte.weight.dtype == torch.float32
    assert torch.equal(wte.weight, plain.transformer.wte.weight)  # the lookup is not rounded
    codes, scales = quantize_per_channel(plain.transformer.wte.weight, torch.float32)
    assert torch.equal(head.weight_int8, codes) and torch.equal(head.scales, scales)
    ids = torch.tensor([3, 70, 200])
    assert torch.equal(wte(ids), plain.transformer.wte(ids))
    assert state_quantization(model.state_dict()) == ("int8", True)


def test_quantize_lm_head_needs_int8_weights():
    with pytest.raises(
        InvalidConfig, match="quantize_lm_head must be False unless quantization is 'int8'"
    ):
        EngineConfig(quantize_lm_head=True)
    for bad in (1, "yes", None):
        with pytest.raises(InvalidConfig, match="quantize_lm_head"):
            EngineConfig(quantization="int8", quantize_lm_head=bad)
    with pytest.raises(InvalidConfig, match="quantize_lm_head"):
        load_model("builtin:tiny-llama", quantize_lm_head=True)
    with pytest.raises(InvalidConfig, match="quantize_lm_head"):
        LLM("builtin:tiny-llama", quantize_lm_head=True)
    assert EngineConfig().quantize_lm_head is False
    assert EngineConfig(quantization="int8", quantize_lm_head=True).quantize_lm_head


def test_engine_refuses_a_head_that_is_not_what_the_config_says():
    head, tok = load_model("builtin:tiny-llama", quantization="int8", quantize_lm_head=True)
    with pytest.raises(InvalidConfig, match="an int8 LM head"):
        LLMEngine(EngineConfig(quantization="int8", num_blocks=8), head, tok)
    body, _ = load_model("builtin:tiny-llama", quantization="int8")
    config = EngineConfig(quantization="int8", quantize_lm_head=True, num_blocks=8)
    with pytest.raises(InvalidConfig, match="a float LM head"):
        LLMEngine(config, body, tok)
    LLMEngine(config, head, tok).shutdown()


@pytest.mark.parametrize("model_name", ["builtin:tiny-llama", "builtin:tiny-gpt2"])
def test_reference_dequantises_the_head_with_its_own_code(model_name):
    model, _ = load_model(model_name, quantization="int8", quantize_lm_head=True)
    twin = reference_model(model)
    (head,) = twin.logits.layers  # the twin's plain projection over its own layers
    assert isinstance(head, DequantizedLinear)
    engine_head = model.logits.linears[0]
    expected = engine_head.weight_int8.float() * engine_head.scales.float()[:, None]
    assert torch.equal(head.weight32, expected)
    if model_name == "builtin:tiny-gpt2":  # the twin's lookup is still the float embedding
        assert torch.equal(twin.transformer.wte.weight, model.transformer.wte.weight)

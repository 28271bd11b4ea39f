"""Every way a model directory can be wrong gets its own typed error naming the culprit."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvpage.cli import main as cli_main
from kvpage.errors import (
    ConfigNotFound,
    MissingWeight,
    ModelLoadError,
    TokenizerNotFound,
    UnsupportedModel,
    WeightShapeMismatch,
)
from kvpage.model import load_model
from kvpage.model.tokenizer import encode_text

from .hf_models import save_hf

WEIGHTS = "model.safetensors"


@pytest.fixture()
def llama_dir(tmp_path):
    save_hf("llama-gqa-8q-2kv", tmp_path)
    return tmp_path


def _edit_config(directory, **changes):
    path = directory / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def _edit_weights(directory, edit):
    path = directory / WEIGHTS
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def test_no_config(tmp_path):
    with pytest.raises(ConfigNotFound, match="no config.json"):
        load_model(str(tmp_path))


def test_not_a_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="not a directory"):
        load_model(str(tmp_path / "nope"))


def test_unknown_builtin():
    with pytest.raises(ModelLoadError, match="unknown builtin model 'nope'"):
        load_model("builtin:nope")


def test_unsupported_model_type(llama_dir):
    _edit_config(llama_dir, model_type="bert")
    with pytest.raises(UnsupportedModel, match="model_type 'bert'"):
        load_model(str(llama_dir))


def test_unsupported_rope_type(llama_dir):
    _edit_config(llama_dir, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4})
    with pytest.raises(UnsupportedModel, match="rope type 'yarn'"):
        load_model(str(llama_dir))


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"layer_types": ["chunked_attention", "full_attention"]}, "chunked_attention"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "no sliding_window"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
    ],
)
def test_fields_that_change_the_computation_are_refused_by_name(llama_dir, changes, named):
    _edit_config(llama_dir, **changes)
    with pytest.raises(UnsupportedModel, match=re.escape(named)):
        load_model(str(llama_dir))


def test_a_window_no_prompt_can_reach_is_accepted(llama_dir):
    """Mistral's window at or past max_position_embeddings never masks anything."""
    cfg = json.loads((llama_dir / "config.json").read_text())
    _edit_config(llama_dir, model_type="mistral", sliding_window=cfg["max_position_embeddings"])
    load_model(str(llama_dir))


def test_a_fused_tensor_too_small_for_its_parts_names_it(tmp_path):
    save_hf("phi3", tmp_path)
    name = "model.layers.0.self_attn.qkv_proj.weight"
    _edit_weights(tmp_path, lambda t: t.update({name: t[name][:-8]}))
    with pytest.raises(WeightShapeMismatch, match=re.escape(name)):
        load_model(str(tmp_path))


def test_missing_tensor(llama_dir):
    name = "model.layers.1.self_attn.k_proj.weight"
    _edit_weights(llama_dir, lambda t: t.pop(name))
    with pytest.raises(MissingWeight, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(str(llama_dir))


def test_misshaped_tensor_names_both_shapes(llama_dir):
    name = "model.layers.0.mlp.up_proj.weight"

    def shrink(tensors):
        tensors[name] = torch.zeros(127, 128)

    _edit_weights(llama_dir, shrink)
    with pytest.raises(WeightShapeMismatch) as err:
        load_model(str(llama_dir))
    msg = str(err.value)
    assert name in msg and "(127, 128)" in msg and "(128, 128)" in msg


def test_gpt2_conv1d_shape_checked_in_checkpoint_layout(tmp_path):
    save_hf("gpt2", tmp_path)
    name = "transformer.h.0.attn.c_attn.weight"

    def transpose(tensors):  # a Linear-layout tensor where a Conv1D one belongs
        tensors[name] = tensors[name].T.contiguous()

    _edit_weights(tmp_path, transpose)
    with pytest.raises(WeightShapeMismatch) as err:
        load_model(str(tmp_path))
    assert "(192, 64)" in str(err.value) and "(64, 192)" in str(err.value)


def test_no_weights(llama_dir):
    (llama_dir / WEIGHTS).unlink()
    with pytest.raises(MissingWeight, match="no \\*.safetensors"):
        load_model(str(llama_dir))


def test_text_prompt_without_tokenizer(llama_dir, capsys):
    model, tokenizer = load_model(str(llama_dir))
    assert tokenizer is None
    with pytest.raises(TokenizerNotFound, match="no tokenizer.json"):
        encode_text(tokenizer, "hello", str(llama_dir))
    assert cli_main(["generate", "--model", str(llama_dir), "--prompt", "hi"]) == 2
    assert "TokenizerNotFound" in capsys.readouterr().err
    # Token ids work without a tokenizer.
    assert (
        cli_main(
            ["generate", "--model", str(llama_dir), "--prompt-ids", "5,6,7", "--max-tokens", "3"]
        )
        == 0
    )


def test_bad_dtype():
    with pytest.raises(ModelLoadError, match="dtype 'float8'"):
        load_model("builtin:tiny-llama", dtype="float8")

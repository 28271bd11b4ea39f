"""bench/throughput.py's published shapes: built on the meta device, Qwen2.5-0.5B and
Llama-3.2-1B have the published checkpoints' parameter counts and layouts; and solo mode's
per-model dtypes (`--models NAME:DTYPE+DTYPE`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch
import transformers

# throughput.py imports its bench/ neighbours by bare name; appended, so it shadows nothing
sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))
import throughput  # noqa: E402

# The total parameter counts of the published checkpoints (their safetensors' metadata): the
# shapes in throughput.MODELS must reproduce them.
PUBLISHED = {"qwen2.5-0.5b": 494_032_768, "llama3.2-1b": 1_235_814_400}


def meta_model(name: str) -> transformers.PreTrainedModel:
    cfg = throughput.model_config(name, 1024)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_shapes_have_the_published_parameter_counts(name):
    model = meta_model(name)
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED[name]
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied


def test_published_shapes_have_their_layouts():
    qwen, llama = meta_model("qwen2.5-0.5b"), meta_model("llama3.2-1b")
    attn = qwen.model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.k_proj.bias is not None
    assert attn.o_proj.bias is None  # Qwen2: q/k/v biases only
    assert (attn.q_proj.out_features, attn.k_proj.out_features) == (14 * 64, 2 * 64)
    rope = llama.config.rope_parameters
    assert rope["rope_type"] == "llama3" and rope["factor"] == 32.0
    assert llama.model.layers[0].self_attn.k_proj.out_features == 8 * 64
    assert qwen.config.rope_parameters["rope_theta"] == 1e6


def test_models_name_their_own_dtypes():
    args = argparse.Namespace(dtypes=["float32", "bfloat16"], rounds=3)
    assert throughput.model_dtypes("125m", args) is args
    own = throughput.model_dtypes("llama3.2-1b:int8+bfloat16", args)
    assert own.dtypes == ["bfloat16", "int8"] and own.rounds == 3  # PRECISIONS order
    assert args.dtypes == ["float32", "bfloat16"]  # the others keep theirs
    with pytest.raises(SystemExit, match="fp16"):
        throughput.model_dtypes("125m:fp16", args)

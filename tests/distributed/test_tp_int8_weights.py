"""Int8 weights under tensor parallelism: quantized once on rank 0 and then sharded, so TP=2
computes with the very codes and scales of TP=1 — same greedy tokens, logits within the
float32 bound of the float TP test — through prefix hits, chunked prefill, swap and recompute
preemption and a CoW fork. A row-parallel shard keeps every output channel's scale: the
all-reduced partial products are the unsharded product."""

from __future__ import annotations

import copy

import pytest
import torch

from kvpage.config import EngineConfig
from kvpage.model import load_model
from kvpage.model.int8 import Int8Linear
from kvpage.parallel.sharding import shard_model, shard_plan
from tests.engine.workload import prefix_prompts

from .test_tp_differential import BLOCK, _assert_same_tokens, _config, _run


@pytest.mark.parametrize(
    ("name", "head"), [("llama-gqa-8q-2kv", False), ("gpt2", False), ("gpt2", True)]
)
def test_tp2_int8_weights_equals_tp1_int8_weights(name, head, hf_dirs):
    """`head`: the LM head in int8 too (tied in GPT-2: the ranks receive the int8 copy)."""
    hf_model, directory = hf_dirs[name]
    prompts = prefix_prompts(BLOCK, hf_model.config.vocab_size, n=10, seed=3)
    config = _config(directory, quantization="int8", quantize_lm_head=head)
    ref_out, ref_logits, _ = _run(EngineConfig(**config), prompts)
    tp_out, tp_logits, stats = _run(EngineConfig(**config, tensor_parallel_size=2), prompts)
    _assert_same_tokens(name, tp_out, ref_out, stats)
    assert tp_logits.keys() == ref_logits.keys()
    diff = max((tp_logits[k] - ref_logits[k]).abs().max().item() for k in ref_logits)
    assert diff <= 1e-4, f"{name}: logits differ by {diff}"


@torch.inference_mode()
def test_row_parallel_int8_shards_keep_every_scale_and_sum_to_the_whole():
    model, _ = load_model("builtin:tiny-qwen2", quantization="int8")
    whole = model.model.layers[0].self_attn.o_proj
    x = torch.randn(5, whole.in_features, generator=torch.Generator().manual_seed(0))
    parts, q_rows = [], []
    for rank in range(2):
        plan = shard_plan(model.config, rank, 2)
        shard = shard_model(copy.deepcopy(model), plan, all_reduce=lambda t: t)
        attn = shard.model.layers[0].self_attn
        assert isinstance(attn.o_proj, Int8Linear) and isinstance(attn.q_proj, Int8Linear)
        assert torch.equal(attn.o_proj.scales, whole.scales)  # row-parallel: all of them
        q = model.model.layers[0].self_attn.q_proj
        assert torch.equal(attn.q_proj.scales, q.scales[plan.q_rows])  # column: its rows'
        q_rows.append(plan.q_rows)
        parts.append(attn.out(x[:, plan.q_rows].contiguous())[0])
    assert q_rows[0] != q_rows[1]
    total = parts[0] + parts[1]  # what the all-reduce computes
    torch.testing.assert_close(total, whole(x), rtol=1e-5, atol=1e-5)

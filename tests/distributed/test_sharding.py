"""Sharding math without processes: N threads each run one rank's shard of the model, with an
all-reduce over a barrier, and the sum must equal the whole model (the one-process logits).
Covers TP=4 on a 2-KV-head model, where each KV head is replicated on two ranks."""

from __future__ import annotations

import threading

import pytest
import torch

from kvpage.config import ModelConfig
from kvpage.errors import TensorParallelError
from kvpage.model import load_model
from kvpage.model.loader import build_model
from kvpage.parallel.sharding import shard_model, shard_plan


class BarrierAllReduce:
    """all_reduce for threads standing in for ranks: every rank's tensor, summed in rank order."""

    def __init__(self, world_size: int) -> None:
        self.barrier = threading.Barrier(world_size, timeout=30)
        self.parts: list[torch.Tensor | None] = [None] * world_size

    def for_rank(self, rank: int):
        def all_reduce(t: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = t.clone()
            self.barrier.wait()
            total = torch.stack(self.parts).sum(0)
            self.barrier.wait()  # nobody overwrites a part before every rank has summed
            return t.copy_(total)

        return all_reduce


def _sharded_logits(model, world_size: int, ids: list[int]) -> list[torch.Tensor]:
    reduce, out, errors = BarrierAllReduce(world_size), [None] * world_size, []

    def rank_main(rank: int) -> None:
        try:
            shard = build_model(model.config)
            shard.load_state_dict(model.state_dict())
            shard.tie_weights()
            plan = shard_plan(model.config, rank, world_size)
            out[rank] = shard_model(shard.eval(), plan, reduce.for_rank(rank)).forward_full(ids)
        except BaseException as err:  # surfaced below, not lost in the thread
            errors.append(err)
            reduce.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return out


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("name", ["builtin:tiny-llama", "builtin:tiny-gpt2"])
def test_shards_sum_to_the_whole_model(name, world_size):
    model, tokenizer = load_model(name)
    ids = tokenizer.encode("tensor parallel shards, summed, are the model")
    expected = model.forward_full(ids)
    for rank, logits in enumerate(_sharded_logits(model, world_size, ids)):
        assert (logits - expected).abs().max().item() <= 1e-4, f"rank {rank}"
        assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_plan_replicates_kv_heads_when_fewer_than_ranks():
    cfg = load_model("builtin:tiny-llama")[0].config  # 4 q heads, 2 kv heads
    plans = [shard_plan(cfg, r, 4) for r in range(4)]
    assert [(p.num_heads, p.num_kv_heads, p.kv_head_start) for p in plans] == [
        (1, 1, 0),
        (1, 1, 0),
        (1, 1, 1),
        (1, 1, 1),
    ]
    plans = [shard_plan(cfg, r, 2) for r in range(2)]
    assert [(p.num_heads, p.num_kv_heads, p.kv_head_start) for p in plans] == [(2, 1, 0), (2, 1, 1)]


def _cfg(**kw) -> ModelConfig:
    base = dict(
        model_type="llama",
        vocab_size=32,
        hidden_size=48,
        num_layers=1,
        num_heads=6,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=96,
        max_position_embeddings=64,
        norm_eps=1e-6,
    )
    return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize(
    "kw, world_size, named",
    [
        ({}, 4, "num_attention_heads (6)"),  # 6 q heads over 4 ranks
        ({"num_heads": 6, "num_kv_heads": 3}, 2, "num_key_value_heads (3)"),  # 3 kv over 2
        ({"num_heads": 4, "intermediate_size": 90}, 4, "intermediate_size (90)"),
    ],
)
def test_indivisible_models_are_refused_by_name(kw, world_size, named):
    with pytest.raises(TensorParallelError, match=rf"tensor_parallel_size={world_size}.*") as err:
        shard_plan(_cfg(**kw), 0, world_size)
    assert named in str(err.value)

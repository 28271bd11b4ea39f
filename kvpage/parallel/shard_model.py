"""A rank's model: a fresh copy of the full model, loaded with the full weights, then sharded.
Rank 0 keeps its unsharded model too (the engine's own, which the verifier's reference uses)."""

from __future__ import annotations

import torch

from kvpage.config import ModelConfig
from kvpage.model.base import CausalLM
from kvpage.model.loader import build_model
from kvpage.parallel.group import TPGroup
from kvpage.parallel.sharding import ShardPlan, shard_model, shard_plan


def build_shard(
    cfg: ModelConfig, state: dict[str, torch.Tensor], group: TPGroup
) -> tuple[CausalLM, ShardPlan]:
    plan = shard_plan(cfg, group.rank, group.world_size)
    dtype = next(iter(state.values())).dtype
    model = build_model(cfg).to(dtype)
    model.load_state_dict(state)
    model.tie_weights()
    return shard_model(model.eval(), plan, group.all_reduce), plan

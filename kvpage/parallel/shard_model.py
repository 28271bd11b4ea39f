"""A rank's model: a fresh copy of the full model, loaded with the full weights, then sharded.
Rank 0 keeps its unsharded model too (the engine's own, which the verifier's reference uses).
Sharding comes before finalize (kvpage.model.kernels): each rank binds its kernels to its own
shard's tensors.

An int8 model (its state holds `weight_int8` codes) is quantized *before* it is sharded, on rank
0, once: every rank receives the same codes and per-output-channel scales and slices them, so
TP=N computes with the very weights of TP=1 (quantizing each shard would give a row-parallel
shard scales of its own input slice, other weights). A quantized LM head (replicated, like the
float one) comes with its codes too."""

from __future__ import annotations

import torch

from kvpage.config import ModelConfig
from kvpage.model.base import CausalLM
from kvpage.model.kernels import KernelChoice, finalize
from kvpage.model.loader import build_model
from kvpage.model.quantize import quantize_model_, state_quantization
from kvpage.parallel.group import TPGroup
from kvpage.parallel.sharding import ShardPlan, shard_model, shard_plan


def build_shard(
    cfg: ModelConfig, state: dict[str, torch.Tensor], group: TPGroup, kernels: KernelChoice
) -> tuple[CausalLM, ShardPlan]:
    """This rank's shard, bound with `kernels` (the choice the engine's own model was bound
    with: every rank runs the same paths)."""
    plan = shard_plan(cfg, group.rank, group.world_size)
    dtype = next(t.dtype for t in state.values() if t.is_floating_point())
    model = build_model(cfg).to(dtype)
    # The structure of an int8 model (its random init's codes are overwritten just below).
    quantize_model_(model, *state_quantization(state))
    model.load_state_dict(state)
    model.tie_weights()
    # Bound after sharding, to the shards' own tensors (kvpage.model.kernels).
    return finalize(shard_model(model.eval(), plan, group.all_reduce), kernels), plan

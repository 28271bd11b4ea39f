"""Megatron-style sharding of a loaded model for one rank, in place.

Column-parallel (each rank keeps a slice of the output features): q/k/v, gate/up, GPT-2's c_attn
and c_fc. Row-parallel (a slice of the input features, then one all-reduce): o_proj, down_proj,
GPT-2's c_proj (attention and MLP). Embeddings and the LM head stay replicated and only rank 0
computes logits: no collective at all. bench/tp_lm_head.py measures the alternative; on a
loaded 2-core CPU the runs were noisy: at the byte-level vocab (259) the head is a microsecond
matmul and the gather costs milliseconds, at 32k-128k vocab the two were within noise of each
other in one run and vocab-parallel 2x faster at 32 rows in another. So: replicated for the
small-vocab models this project runs; a large-vocab model may want vocab-parallel (not built).

Int8 layers (kvpage.model.int8) shard the same way: a column-parallel rank keeps its rows'
codes and scales; a row-parallel rank keeps its columns' codes and every row's scale (per
output channel, so (x_r @ codes_r^T) * scale summed over ranks is the unsharded product).

LoRA factors shard with their projection (`shard_lora_factors`): a column-parallel rank keeps
the whole A and its output rows of B; a row-parallel rank keeps its input columns of A and the
whole B, and adds its partial delta before the all-reduce (RowParallel.lora), so the sum over
ranks is x A^T B^T, the unsharded delta.

KV heads are divided across ranks; with fewer KV heads than ranks each is replicated (as vLLM
does), so rank r keeps KV head r // (world / KVH)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

import kvpage.model.native_build as native_build
from kvpage.config import ModelConfig
from kvpage.errors import TensorParallelError
from kvpage.lora.apply import LoraContext, attach
from kvpage.lora.tables import Factors, SlotTables
from kvpage.model.base import CausalLM
from kvpage.model.int8 import Int8Linear
from kvpage.model.kernels import KernelChoice
from kvpage.model.projection import Projection


@dataclass(frozen=True, slots=True)
class ShardPlan:
    rank: int
    world_size: int
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank (its KV pool shard's KVH)
    kv_head_start: int  # first of this rank's KV heads in the full model
    head_dim: int

    @property
    def q_rows(self) -> slice:
        start = self.rank * self.num_heads * self.head_dim
        return slice(start, start + self.num_heads * self.head_dim)

    @property
    def kv_rows(self) -> slice:
        start = self.kv_head_start * self.head_dim
        return slice(start, start + self.num_kv_heads * self.head_dim)


def shard_plan(cfg: ModelConfig, rank: int, world_size: int) -> ShardPlan:
    """What rank `rank` keeps; TensorParallelError when the model cannot be split `world_size` ways."""
    check_divisible(cfg, world_size)
    heads = cfg.num_heads // world_size
    if cfg.num_kv_heads >= world_size:
        kv_heads = cfg.num_kv_heads // world_size
        return ShardPlan(rank, world_size, heads, kv_heads, rank * kv_heads, cfg.head_dim)
    return ShardPlan(
        rank, world_size, heads, 1, rank // (world_size // cfg.num_kv_heads), cfg.head_dim
    )


def check_divisible(cfg: ModelConfig, world_size: int) -> None:
    problems = []
    if cfg.num_heads % world_size:
        problems.append(f"num_attention_heads ({cfg.num_heads})")
    kvh = cfg.num_kv_heads
    if kvh % world_size and world_size % kvh:
        problems.append(f"num_key_value_heads ({kvh}) (nor does it divide {world_size})")
    if cfg.intermediate_size % world_size:
        problems.append(f"intermediate_size ({cfg.intermediate_size})")
    if problems:
        raise TensorParallelError(
            f"tensor_parallel_size={world_size} does not divide "
            + ", ".join(problems)
            + f" of model {cfg.revision or cfg.model_type!r}"
        )


class RowParallel:
    """A row-parallel Projection: each rank's partial product, summed over ranks by one
    all-reduce. Called like a Projection (returns a 1-tuple). `lora`, when set, adds the
    rank's partial adapter delta (x_r, y_r) -> y_r before the all-reduce."""

    def __init__(self, proj: Projection, all_reduce) -> None:
        self.proj, self.all_reduce = proj, all_reduce
        self.lora: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def bind_kernels(self, choice: KernelChoice) -> None:
        """Its shard's kernels (kvpage.model.kernels.finalize, after sharding)."""
        self.proj.bind_kernels(choice)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        y = self.proj(x)[0]
        if self.lora is not None:
            y = self.lora(x, y)
        y = y.contiguous()
        # In place, through native_build.call: a decode tape records the collective with the
        # kernels around it and replays it between them (every rank replays the same calls).
        native_build.call(self.all_reduce, y)
        return (y,)


COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


def shard_lora_factors(factors: Factors, plan: ShardPlan) -> Factors:
    """Full (A^T (in, r), scale B^T (r, out)) per (layer, module) -> this rank's shard of each."""
    shards = {}
    for (layer, module), (a_t, b_t) in factors.items():
        if module in COLUMN_PARALLEL:
            rows = {"q_proj": plan.q_rows, "k_proj": plan.kv_rows, "v_proj": plan.kv_rows}.get(
                module, _split(b_t.shape[1], plan)
            )
            shards[layer, module] = (a_t, b_t[:, rows].contiguous())
        else:  # o_proj, down_proj: row-parallel
            cols = plan.q_rows if module == "o_proj" else _split(a_t.shape[0], plan)
            shards[layer, module] = (a_t[cols].contiguous(), b_t)
    return shards


def attach_lora(model: CausalLM, tables: SlotTables) -> LoraContext:
    """A sharded Llama-shaped model's projections routed through a LoraContext over `tables`
    (this rank's shards): column-parallel deltas after their projection, row-parallel ones
    inside it, before the all-reduce."""
    context = LoraContext(tables, inside=frozenset(ROW_PARALLEL))
    attach(model, context)
    for index, layer in enumerate(model.model.layers):
        layer.self_attn.out.lora = functools.partial(context.delta, index, "o_proj")
        layer.mlp.down.lora = functools.partial(context.delta, index, "down_proj")
    return context


def shard_model(model: CausalLM, plan: ShardPlan, all_reduce) -> CausalLM:
    """Slice `model`'s parameters to `plan` in place and route its row-parallel outputs
    through `all_reduce`. `model.config` keeps describing the whole model."""
    with torch.no_grad():
        if model.config.model_type == "gpt2":
            _shard_gpt2(model, plan, all_reduce)
        else:
            _shard_llama(model, plan, all_reduce)
    return model


def _shard_llama(model, plan: ShardPlan, all_reduce) -> None:
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.q_proj = _rows(attn.q_proj, plan.q_rows)
        attn.k_proj = _rows(attn.k_proj, plan.kv_rows)
        attn.v_proj = _rows(attn.v_proj, plan.kv_rows)
        attn.o_proj = _cols(attn.o_proj, plan.q_rows, plan.rank)
        attn.num_heads, attn.num_kv_heads = plan.num_heads, plan.num_kv_heads
        attn.qkv = Projection(attn.q_proj, attn.k_proj, attn.v_proj)
        attn.out = RowParallel(Projection(attn.o_proj), all_reduce)
        ff = _split(mlp.gate_proj.out_features, plan)
        mlp.gate_proj, mlp.up_proj = _rows(mlp.gate_proj, ff), _rows(mlp.up_proj, ff)
        mlp.down_proj = _cols(mlp.down_proj, ff, plan.rank)
        mlp.gate_up = Projection(mlp.gate_proj, mlp.up_proj)
        mlp.down = RowParallel(Projection(mlp.down_proj), all_reduce)


def _shard_gpt2(model, plan: ShardPlan, all_reduce) -> None:
    width = model.config.hidden_size
    for block in model.transformer.h:
        attn, mlp = block.attn, block.mlp
        # c_attn's rows are [q; k; v]: take this rank's heads from each third.
        qkv = [range(i * width + plan.q_rows.start, i * width + plan.q_rows.stop) for i in range(3)]
        attn.c_attn = _rows(attn.c_attn, [r for part in qkv for r in part])
        attn.c_proj = _cols(attn.c_proj, plan.q_rows, plan.rank)
        attn.num_heads = plan.num_heads
        attn.qkv = Projection(attn.c_attn)
        attn.out = RowParallel(Projection(attn.c_proj), all_reduce)
        ff = _split(mlp.c_fc.out_features, plan)
        mlp.c_fc = _rows(mlp.c_fc, ff)
        mlp.c_proj = _cols(mlp.c_proj, ff, plan.rank)
        mlp.fc = Projection(mlp.c_fc)
        mlp.proj = RowParallel(Projection(mlp.c_proj), all_reduce)


def _split(n: int, plan: ShardPlan) -> slice:
    size = n // plan.world_size
    return slice(plan.rank * size, (plan.rank + 1) * size)


def _rows(lin: nn.Module, rows) -> nn.Module:
    """Column-parallel: the output features `rows` (a slice or a list of indices)."""
    index = rows if isinstance(rows, slice) else list(rows)
    bias = None if lin.bias is None else lin.bias[index]
    if isinstance(lin, Int8Linear):
        return _int8_linear(lin.weight_int8[index], lin.scales[index], bias)
    return _linear(lin.weight[index], bias)


def _cols(lin: nn.Module, cols: slice, rank: int) -> nn.Module:
    """Row-parallel: the input features `cols`; the bias is added once, on rank 0 (the
    all-reduce sums the ranks' partial products)."""
    bias = lin.bias if rank == 0 else None
    if isinstance(lin, Int8Linear):  # every output channel's scale: it scales the sum
        return _int8_linear(lin.weight_int8[:, cols], lin.scales, bias)
    return _linear(lin.weight[:, cols], bias)


def _int8_linear(codes: torch.Tensor, scales: torch.Tensor, bias) -> Int8Linear:
    out = Int8Linear(codes.shape[1], codes.shape[0], bias is not None, scales.dtype)
    out.weight_int8 = codes.detach().clone().contiguous()
    out.scales = scales.detach().clone().contiguous()
    if bias is not None:
        out.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
    return out


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    with torch.device("meta"):  # no init of weights about to be replaced
        out = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    out.weight = nn.Parameter(weight.detach().clone().contiguous(), requires_grad=False)
    if bias is not None:
        out.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
    return out

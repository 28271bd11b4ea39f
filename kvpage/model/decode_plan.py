"""A Llama-family decode step as a fixed sequence of native calls on buffers kept between steps.

Why: at batch 1 a 125M decode step spent ~5 ms of its ~19 outside the linear layers
(bench/decode_profile.py, bfloat16, 2 threads): ~200 torch operators a step for views, splits,
the KV writes' index_copy_, silu, the residual adds and their allocations, each dispatched from
Python. A decode-only step whose every op has a native kernel needs none of them: per layer ten
calls (RMSNorm, q/k/v GEMV, rotary, KV write, paged attention, o GEMV, residual add + RMSNorm,
gate/up GEMV, silu * up, down GEMV) into buffers allocated once per row count.

Numerics: the module path's kernels, rounding where it rounds. The residual add after the MLP is
done inside the next RMSNorm call (as RMSNorm.add_forward does after attention), and silu * up by
native/small_ops.cpp as torch computes it; the verifier compares the engine on this path with the
contiguous reference, which never takes it.

`LlamaDecodePlan.build(model)` is None for a model whose layers this does not cover (sliding
windows, q/k norms, NoPE layers, partial rotary, other families, tensor-parallel layers, a head
size the attention kernel lacks); `takes(x, attn)` says per step whether it runs: a decode-only
paged step, one KV group in the model's dtype, no adapter rows, no module hooks, no autograd.
Otherwise the modules run. A projection the weight GEMV does not take at the step's rows runs
its Projection's own path into the plan's buffer."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

import kvpage.model.native_attention as native_attention
import kvpage.model.native_small_ops as native_small_ops
from kvpage.model.layers import RMSNorm, SwiGLU
from kvpage.model.native_gemv import WeightGemv
from kvpage.model.paged_attention import PagedAttention
from kvpage.model.projection import Projection


@dataclass(slots=True)
class _Buffers:
    """One row count's activations, views of a few tensors reused from step to step."""

    qkv: torch.Tensor  # (M, H*D + 2*KVH*D)
    q: torch.Tensor  # (M, H, D) views of qkv
    k: torch.Tensor  # (M, KVH, D)
    v: torch.Tensor
    attn: torch.Tensor  # (M, H, D)
    attn_rows: torch.Tensor  # (M, H*D) the same
    o: torch.Tensor  # (M, C)
    h: torch.Tensor  # (M, C) the normalised input of the next projection
    gate_up: torch.Tensor  # (M, 2I)
    gate: torch.Tensor  # (M, I) views of gate_up
    up: torch.Tensor
    act: torch.Tensor  # (M, I)
    down: torch.Tensor  # (M, C)
    ptr: _Addresses | None = None

    def __post_init__(self) -> None:
        self.ptr = _Addresses(*(getattr(self, f).data_ptr() for f in _Addresses.__slots__))


@dataclass(frozen=True, slots=True)
class _Addresses:
    """Where each buffer starts: the per-layer calls pass integers."""

    qkv: int
    q: int
    k: int
    v: int
    attn: int
    o: int
    h: int
    gate_up: int
    gate: int
    up: int
    act: int
    down: int


@dataclass(slots=True)
class _Layer:
    input_norm: RMSNorm
    post_norm: RMSNorm
    qkv: Projection
    out: Projection
    gate_up: Projection
    down: Projection
    attention: nn.Module
    mlp: SwiGLU


class LlamaDecodePlan:
    def __init__(self, model: nn.Module) -> None:
        cfg = model.config
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.intermediate = cfg.intermediate_size
        self.scale = cfg.head_dim**-0.5
        self.final_norm: RMSNorm = model.model.norm
        self.blocks = list(model.model.layers)
        self.layers = [_layer(block) for block in self.blocks]
        self.modules = [m for block in model.model.layers for m in block.modules()]
        self.modules.append(self.final_norm)
        self._buffers: dict[tuple[int, torch.dtype], _Buffers] = {}
        self._pools: tuple[tuple, native_attention.PoolLayout] | None = None

    @classmethod
    def build(
        cls, model: nn.Module, layer_type: type, attention_type: type
    ) -> LlamaDecodePlan | None:
        """The plan for this model, or None where its layers are not all plain Llama layers
        (exactly `layer_type` holding `attention_type`, not a subclass: those change the math)."""
        cfg = model.config
        if cfg.head_dim not in native_attention.HEAD_DIMS or model.model.rotary.dim != cfg.head_dim:
            return None
        if type(model.model.norm) is not RMSNorm:
            return None
        for i, block in enumerate(model.model.layers):
            attn, mlp = block.self_attn, block.mlp
            if type(block) is not layer_type or type(attn) is not attention_type:
                return None
            if type(mlp) is not SwiGLU or attn.qk_norm or not attn.rope_on:
                return None
            norms = (block.input_layernorm, block.post_attention_layernorm)
            if any(type(n) is not RMSNorm for n in norms) or cfg.window_of(i) is not None:
                return None
            projections = (attn.qkv, attn.out, mlp.gate_up, mlp.down)
            if any(type(p) is not Projection for p in projections):  # e.g. tensor parallel
                return None
        return cls(model)

    def takes(self, x: torch.Tensor, attn: object) -> bool:
        """Whether this step can run on the plan (see the module docstring)."""
        if type(attn) is not PagedAttention or torch.is_grad_enabled():
            return False
        meta, storage = attn.meta, attn.storage
        if not meta.decode_only or meta.decode_lens is None or meta.groups:
            return False
        if not storage.use_native or not native_small_ops.supports(x):
            return False
        if x.dim() != 2 or not native_attention.supports(x.dtype, x.device, self.head_dim):
            return False
        if not self._intact() or self._hooked() or self._adapters():
            return False
        return self._norms_fit(x.dtype)

    def run(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attn: PagedAttention
    ) -> torch.Tensor | None:
        """x: (M, C) the embedded tokens (overwritten: the residual stream) -> hidden (M, C), or
        None (nothing computed) where x or the rotary tables are not laid out as the calls need.
        The buffers, the pool and the kernels' shapes are checked when first met; per step the
        slots, block tables and lengths; the calls then pass addresses."""
        m, c = x.shape
        buf = self._buffers_for(m, x.dtype)
        kernels = self._kernels(buf)
        if not x.is_contiguous():
            return None
        meta, storage = attn.meta, attn.storage
        pools = self._pools_of(storage.data, x.dtype)
        slots = meta.slot_mapping.contiguous()
        native_attention.check_slots(slots, storage.num_blocks, storage.block_size)
        decode = attn.native_decode(buf.q)
        cos, sin = (t.contiguous() for t in rope)
        if cos.shape != (m, 1, self.head_dim) or cos.dtype != x.dtype:
            return None
        ops, dt, threads = native_small_ops.library(), pools.dtype_code, torch.get_num_threads()
        rms, xp, p = ops.kvpage_rms_norm, x.data_ptr(), buf.ptr
        h, kvh, d, width = self.heads, self.kv_heads, self.head_dim, buf.qkv.shape[1]
        first = self.layers[0].input_norm
        rms(dt, xp, c, None, 0, first.weight.data_ptr(), first.eps, m, c, None, p.h, threads)
        for i, (layer, (qkv, out, gate_up, down)) in enumerate(
            zip(self.layers, kernels, strict=True)
        ):
            qkv.run_unchecked(p.h, c, m, p.qkv, threads)
            ops.kvpage_rotary(
                dt, p.q, width, h, p.k, width, kvh, d, cos.data_ptr(), sin.data_ptr(), m, threads
            )
            pools.write_unchecked(i, p.k, p.v, width, slots.data_ptr(), m)
            decode.run_unchecked(p.q, width, pools, i, p.attn, h * d, h, self.scale, threads)
            out.run_unchecked(p.attn, h * d, m, p.o, threads)
            post = layer.post_norm
            rms(dt, xp, c, p.o, c, post.weight.data_ptr(), post.eps, m, c, xp, p.h, threads)
            gate_up.run_unchecked(p.h, c, m, p.gate_up, threads)
            ops.kvpage_silu_mul(dt, p.gate, p.up, 2 * self.intermediate, self.intermediate,
                                p.act, m, threads)  # fmt: skip
            down.run_unchecked(p.act, self.intermediate, m, p.down, threads)
            if i + 1 < len(self.layers):
                nxt = self.layers[i + 1].input_norm
                rms(dt, xp, c, p.down, c, nxt.weight.data_ptr(), nxt.eps, m, c, xp, p.h, threads)
        final, hidden = self.final_norm, torch.empty_like(x)
        rms(dt, xp, c, p.down, c, final.weight.data_ptr(), final.eps, m, c, xp,
            hidden.data_ptr(), threads)  # fmt: skip
        return hidden

    def _pools_of(self, data: torch.Tensor, dtype: torch.dtype) -> native_attention.PoolLayout:
        key = (data.data_ptr(), data.shape, data.stride(), data.dtype)
        if self._pools is None or self._pools[0] != key:
            layout = native_attention.PoolLayout.of(data)
            if (layout.kv_heads, layout.head_dim) != (self.kv_heads, self.head_dim):
                raise ValueError(f"a KV pool {tuple(data.shape)} for {self.kv_heads} KV heads")
            if data.shape[0] < len(self.layers) or data.dtype != dtype:
                raise ValueError(f"a KV pool {tuple(data.shape)} {data.dtype} for this model")
            self._pools = (key, layout)
        return self._pools[1]

    def _kernels(self, buf: _Buffers) -> list[tuple[WeightGemv | _ProjectionInto, ...]]:
        """Per layer the kernels of q/k/v, o, gate/up and down over the current weights: the
        weight GEMV where it takes these rows, else the Projection's own path into the buffer."""
        pairs = (
            (buf.h, buf.qkv),
            (buf.attn_rows, buf.o),
            (buf.h, buf.gate_up),
            (buf.act, buf.down),
        )
        kernels = []
        for layer in self.layers:
            projections = (layer.qkv, layer.out, layer.gate_up, layer.down)
            kernels.append(
                tuple(
                    proj.gemv_for(x) or _ProjectionInto(proj, x, y)
                    for proj, (x, y) in zip(projections, pairs, strict=True)
                )
            )
        return kernels

    def _buffers_for(self, m: int, dtype: torch.dtype) -> _Buffers:
        buf = self._buffers.get((m, dtype))
        if buf is None:
            buf = self._buffers[(m, dtype)] = self._allocate(m, dtype)
        return buf

    def _allocate(self, m: int, dtype: torch.dtype) -> _Buffers:
        h, kvh, d, inter = self.heads, self.kv_heads, self.head_dim, self.intermediate
        c = self.final_norm.weight.shape[0]
        qkv = torch.empty(m, (h + 2 * kvh) * d, dtype=dtype)
        attn = torch.empty(m, h, d, dtype=dtype)
        gate_up = torch.empty(m, 2 * inter, dtype=dtype)
        return _Buffers(
            qkv=qkv,
            q=qkv[:, : h * d].view(m, h, d),
            k=qkv[:, h * d : (h + kvh) * d].view(m, kvh, d),
            v=qkv[:, (h + kvh) * d :].view(m, kvh, d),
            attn=attn,
            attn_rows=attn.view(m, h * d),
            o=torch.empty(m, c, dtype=dtype),
            h=torch.empty(m, c, dtype=dtype),
            gate_up=gate_up,
            gate=gate_up[:, :inter],
            up=gate_up[:, inter:],
            act=torch.empty(m, inter, dtype=dtype),
            down=torch.empty(m, c, dtype=dtype),
        )

    def _intact(self) -> bool:
        """The layers still hold the modules the plan was built on (tensor parallelism, for
        one, replaces o_proj's and down_proj's Projections after the model is built)."""
        return all(
            layer == _layer(block) for layer, block in zip(self.layers, self.blocks, strict=True)
        )

    def _hooked(self) -> bool:
        if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
            return True
        return any(m._forward_hooks or m._forward_pre_hooks for m in self.modules)

    def _adapters(self) -> bool:
        for layer in self.layers:
            for module in (layer.attention, layer.mlp):
                lora = module.lora
                if lora is not None and lora.batch is not None:
                    return True
        return False

    def _norms_fit(self, dtype: torch.dtype) -> bool:
        norms = [n for layer in self.layers for n in (layer.input_norm, layer.post_norm)]
        return all(n.weight.dtype == dtype for n in (*norms, self.final_norm))


class _ProjectionInto:
    """A projection the weight GEMV does not take at these rows (float32 above its row limit,
    on AVX2 16): the Projection's own path (oneDNN's packed GEMM, widened int8), its output
    written into the plan's buffer. Called like WeightGemv.run_unchecked; the addresses are
    the buffers'."""

    def __init__(self, proj: Projection, x: torch.Tensor, out: torch.Tensor) -> None:
        self.proj, self.x, self.out = proj, x, out

    def run_unchecked(self, x: int, ldx: int, m: int, y: int, threads: int) -> None:
        outs = self.proj(self.x)
        if len(outs) == 1:
            self.out.copy_(outs[0])
        else:
            torch.cat(outs, dim=-1, out=self.out)


def _layer(block: nn.Module) -> _Layer:
    attn, mlp = block.self_attn, block.mlp
    return _Layer(
        input_norm=block.input_layernorm,
        post_norm=block.post_attention_layernorm,
        qkv=attn.qkv,
        out=attn.out,
        gate_up=mlp.gate_up,
        down=mlp.down,
        attention=attn,
        mlp=mlp,
    )

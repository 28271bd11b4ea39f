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
size the attention kernel lacks); finalize (kvpage.model.kernels) builds it over the layers'
bound kernels, with every fast path on, and builds it again when the weights change. `takes(x,
attn)` says per step whether it runs: a decode-only paged step, one KV group in the model's
dtype, no adapter rows, no module hooks, no autograd.
Otherwise the modules run. A projection the weight GEMV does not take at the step's rows runs
its Projection's own path into the plan's buffer. Where every projection is a native kernel
(the weight GEMV, or the AMX kernel), the per-layer calls are made from one native call
(kvpage.model.native_decode_step: the same kernels in the same order, ~1.1x at batch 1 in
bfloat16); `one_call = False` keeps the Python loop."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

import kvpage.model.native_attention as native_attention
import kvpage.model.native_small_ops as native_small_ops
from kvpage.model.layers import RMSNorm, SwiGLU
from kvpage.model.native_decode_step import FusedStep
from kvpage.model.native_gemv import WeightGemv
from kvpage.model.paged_attention import PagedAttention
from kvpage.model.projection import Projection


@dataclass(slots=True)
class _Buffers:
    """One row count's activations, views of a few tensors reused from step to step."""

    qkv: torch.Tensor  # (M, H*D + 2*KVH*D)
    q: torch.Tensor  # (M, H, D) a view of qkv
    attn: torch.Tensor  # (M, H, D)
    attn_rows: torch.Tensor  # (M, H*D) the same
    o: torch.Tensor  # (M, C)
    h: torch.Tensor  # (M, C) the normalised input of the next projection
    gate_up: torch.Tensor  # (M, 2I)
    act: torch.Tensor  # (M, I)
    down: torch.Tensor  # (M, C)
    ptr: _Addresses | None = None

    def __post_init__(self) -> None:
        self.ptr = _Addresses(*(getattr(self, f).data_ptr() for f in _Addresses.__slots__))


@dataclass(frozen=True, slots=True)
class _Addresses:
    """Where each buffer starts: the per-layer calls pass integers."""

    qkv: int
    attn: int
    o: int
    h: int
    gate_up: int
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

    def projections(self) -> tuple[Projection, Projection, Projection, Projection]:
        return self.qkv, self.out, self.gate_up, self.down


class LlamaDecodePlan:
    def __init__(self, model: nn.Module) -> None:
        cfg = model.config
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.intermediate = cfg.intermediate_size
        self.scale = cfg.head_dim**-0.5
        self.final_norm: RMSNorm = model.model.norm
        self.blocks = list(model.model.layers)
        self.layers = [_layer(block) for block in self.blocks]
        modules = [m for block in self.blocks for m in block.modules()] + [self.final_norm]
        self._hook_dicts = [d for m in modules for d in (m._forward_hooks, m._forward_pre_hooks)]
        # Every norm's weight, in call order: input norms, post norms, the final norm.
        self._norm_weights = [n.weight.detach() for n in self._norms()]
        self.norm_addresses = [w.data_ptr() for w in self._norm_weights]
        self.norm_eps = [n.eps for n in self._norms()]
        self._kernel_cache: dict[tuple[int, torch.dtype], list] = {}
        self._buffers: dict[tuple[int, torch.dtype], _Buffers] = {}
        self._pools: tuple[tuple, native_attention.PoolLayout] | None = None
        self._fused: dict[tuple[int, torch.dtype], tuple[tuple, FusedStep | None]] = {}
        self.one_call = True  # the layers' calls from one native call where FusedStep takes them

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
        if self._hooked() or self._adapters():
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
        threads = torch.get_num_threads()
        w = self.norm_addresses  # inputs, posts, final
        hidden = torch.empty_like(x)
        fused = self._fused_step(buf, kernels, pools, w) if self.one_call else None
        if fused is not None and decode.tables.shape[0] == m:
            fused.run(x, cos, sin, slots, decode, hidden, threads)
        else:
            self._run_loop(x, buf, kernels, pools, (cos, sin, slots), decode, w, hidden, threads)
        return hidden

    def _run_loop(self, x, buf, kernels, pools, rows, decode, w, hidden, threads) -> None:
        """run's calls from Python, one per kernel: where a projection takes torch's path
        (_ProjectionInto), or one_call is off. rows: the step's (cos, sin, slots)."""
        m, c = x.shape
        ops, dt = native_small_ops.library(), pools.dtype_code
        rms, xp, p = ops.kvpage_rms_norm, x.data_ptr(), buf.ptr
        h, kvh, d, inter = self.heads, self.kv_heads, self.head_dim, self.intermediate
        width, n, eps = buf.qkv.shape[1], len(self.layers), self.norm_eps
        # Byte offsets of k and v in a q/k/v row, of up in a gate/up row: each projection
        # returns where its rows start (the plan's buffer, or a _ProjectionInto's own output).
        elem = x.element_size()
        k_at, v_at, up_at = h * d * elem, (h + kvh) * d * elem, inter * elem
        cos_p, sin_p, slots_p = (t.data_ptr() for t in rows)
        rms(dt, xp, c, None, 0, w[0], eps[0], m, c, None, p.h, threads)
        for i, (qkv, out, gate_up, down) in enumerate(kernels):
            q = qkv.run_unchecked(p.h, c, m, p.qkv, threads)
            ops.kvpage_rotary(dt, q, width, h, q + k_at, width, kvh, d, cos_p, sin_p, m, threads)
            pools.write_unchecked(i, q + k_at, q + v_at, width, slots_p, m)
            decode.run_unchecked(q, width, pools, i, p.attn, h * d, h, self.scale, threads)
            o = out.run_unchecked(p.attn, h * d, m, p.o, threads)
            rms(dt, xp, c, o, c, w[n + i], eps[n + i], m, c, xp, p.h, threads)  # x += o
            gate = gate_up.run_unchecked(p.h, c, m, p.gate_up, threads)
            ops.kvpage_silu_mul(dt, gate, gate + up_at, 2 * inter, inter, p.act, m, threads)
            mlp = down.run_unchecked(p.act, inter, m, p.down, threads)
            # x += down, then the next layer's input norm (the last: the final norm)
            last = i + 1 == n
            out_p = hidden.data_ptr() if last else p.h
            rms(dt, xp, c, mlp, c, w[-1 if last else i + 1], eps[-1 if last else i + 1], m, c,
                xp, out_p, threads)  # fmt: skip

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

    def _fused_step(
        self, buf: _Buffers, kernels: list, pools: native_attention.PoolLayout, norms: list[int]
    ) -> FusedStep | None:
        """The one-call step over these buffers, kernels, pool and norm weights, built per row
        count and rebuilt when the pool changes."""
        key = (buf.h.shape[0], buf.h.dtype)
        cached = self._fused.get(key)
        if cached is None or cached[0] is not pools:
            cached = self._fused[key] = (pools, FusedStep.of(self, buf, kernels, pools, norms))
        return cached[1]

    def _kernels(self, buf: _Buffers) -> list[tuple[WeightGemv | _ProjectionInto, ...]]:
        """Per layer the kernels of q/k/v, o, gate/up and down the Projections were bound to:
        the native one where it takes these rows, else the Projection's own path into the
        buffer. Made once per row count."""
        cached = self._kernel_cache.get((buf.h.shape[0], buf.h.dtype))
        if cached is not None:
            return cached
        pairs = (
            (buf.h, buf.qkv),
            (buf.attn_rows, buf.o),
            (buf.h, buf.gate_up),
            (buf.act, buf.down),
        )
        kernels = []
        for layer in self.layers:
            projections = layer.projections()
            kernels.append(
                tuple(
                    proj.gemv_for(x) or _ProjectionInto(proj, x, y)
                    for proj, (x, y) in zip(projections, pairs, strict=True)
                )
            )
        self._kernel_cache[(buf.h.shape[0], buf.h.dtype)] = kernels
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
            attn=attn,
            attn_rows=attn.view(m, h * d),
            o=torch.empty(m, c, dtype=dtype),
            h=torch.empty(m, c, dtype=dtype),
            gate_up=gate_up,
            act=torch.empty(m, inter, dtype=dtype),
            down=torch.empty(m, c, dtype=dtype),
        )

    def _hooked(self) -> bool:
        if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
            return True
        return any(self._hook_dicts)

    def _adapters(self) -> bool:
        for layer in self.layers:
            for module in (layer.attention, layer.mlp):
                lora = module.lora
                if lora is not None and lora.batch is not None:
                    return True
        return False

    def _norms(self) -> list[RMSNorm]:
        inputs = [layer.input_norm for layer in self.layers]
        return [*inputs, *(layer.post_norm for layer in self.layers), self.final_norm]

    def _norms_fit(self, dtype: torch.dtype) -> bool:
        return all(w.dtype == dtype for w in self._norm_weights)


class _ProjectionInto:
    """A projection neither native kernel takes at these rows (float32 above the GEMV's row
    limit, bfloat16 above the AMX kernel's 32): oneDNN's packed matmul, else the Projection's
    own path (widened int8, unpacked bfloat16), on the plan's input buffer. Called like
    WeightGemv.run_unchecked (the addresses passed are those of the buffers it was built on);
    returns where its output rows start: the matmul's own output, kept until the next call,
    where it is one (M, N) tensor, else a copy of the layers' outputs into the plan's buffer
    (`out`)."""

    def __init__(self, proj: Projection, x: torch.Tensor, out: torch.Tensor) -> None:
        self.proj, self.x, self.out = proj, x, out
        self._kept: torch.Tensor | None = None

    def run_unchecked(self, x: int, ldx: int, m: int, y: int, threads: int) -> int:
        packed = self.proj.packed_unchecked(self.x)
        outs = (packed,) if packed is not None else self.proj(self.x)
        if len(outs) == 1 and _rows_like(outs[0], self.out):
            self._kept = outs[0]
            return self._kept.data_ptr()
        torch.cat(outs, dim=-1, out=self.out)
        return y


def _rows_like(t: torch.Tensor, buffer: torch.Tensor) -> bool:
    """Whether t lies in memory as the (M, N) contiguous buffer does."""
    return t.shape == buffer.shape and t.dtype == buffer.dtype and t.is_contiguous()


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

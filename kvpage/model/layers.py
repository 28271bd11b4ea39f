"""Building blocks shared by the model families: norms, rotary embedding, MLPs.
Tokens are packed: activations are (N, C) for N tokens of possibly several sequences."""

from __future__ import annotations

import math

import torch
from torch import nn

import kvpage.model.native_small_ops as native_small_ops  # not `from kvpage.model`: a cycle
from kvpage.config import RopeConfig
from kvpage.model.kernels import KernelChoice
from kvpage.model.projection import Projection


def small_ops_on(choice: KernelChoice, module: nn.Module) -> bool:
    """Whether `module` binds kvpage's native small ops (RMSNorm, rotary, silu * up) under
    `choice`: on, built, and the module's tensors on the CPU."""
    tensor = next(iter((*module.parameters(), *module.buffers())))
    return choice.on("small_ops") and native_small_ops.available() and tensor.is_cpu


class RMSNorm(nn.Module):
    native = False  # kvpage's native kernel (bound by kvpage.model.kernels.finalize)

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def bind_kernels(self, choice: KernelChoice) -> None:
        self.native = small_ops_on(choice, self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native and x.dim() == 2 and self._native_fits(x):
            return native_small_ops.rms_norm(x, self._kernel_weight(), self.eps)[1]
        return self._torch_forward(x)

    def add_forward(
        self, x: torch.Tensor, delta: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, RMSNorm(x + delta)): the residual add and the next norm in one pass."""
        if self.native and x.dim() == 2 and self._native_fits(x):
            return native_small_ops.rms_norm(x, self._kernel_weight(), self.eps, delta)
        x = x + delta
        return x, self._torch_forward(x)

    def heads_(self, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm over each head of x (N, H, D): in place where the native kernel takes x
        (each row's heads contiguous: a view of the caller's own fresh projection, as Qwen3's
        q/k norm), else a new tensor."""
        n, h, d = x.shape
        if not (self.native and self._native_fits(x) and x.stride()[1:] == (d, 1)):
            return self(x)
        weight = self._kernel_weight()
        for rows in (x.view(n * h, d),) if n == 1 or x.stride(0) == h * d else x.unbind(0):
            native_small_ops.rms_norm(rows, weight, self.eps, out=rows)
        return x

    def _kernel_weight(self) -> torch.Tensor:
        """The weight the native kernel multiplies by."""
        return self.weight

    def _native_fits(self, x: torch.Tensor) -> bool:
        w = self.weight
        return (
            w.dtype == x.dtype
            and native_small_ops.supports(x)
            and not (w.requires_grad and torch.is_grad_enabled())
        )

    def _torch_forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the activation dtype, as the HF reference does.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies (head_dim/2,) with the scaling of `rope.rope_type` applied."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scale(inv_freq, rope)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotary_dim(rope: RopeConfig, head_dim: int) -> int:
    """How many leading dims of each head RoPE rotates (all but with a partial rotary factor)."""
    return int(head_dim * rope.partial_rotary_factor)


class RotaryEmbedding(nn.Module):
    def __init__(self, rope: RopeConfig, head_dim: int) -> None:
        super().__init__()
        self.rope, self.dim = rope, rotary_dim(rope, head_dim)
        self.register_buffer("inv_freq", self.fresh_inv_freq(), persistent=False)

    def fresh_inv_freq(self) -> torch.Tensor:
        """The inverse frequencies from the config (to_empty() leaves the buffer uninitialised)."""
        return rope_inv_freq(self.rope, self.dim)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, 1, D) cos and sin for the positions; computed once per forward, used by every layer."""
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]  # (N, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (N, D)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, native: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: (N, H, D), k: (N, KVH, D); cos, sin: (N, 1, R) for the first R <= D dims (R < D with
    a partial rotary factor: the other dims pass through). `native` (the caller's bound
    choice): the native kernel, which rotates q and k in place (callers pass their own fresh
    projections and use only what is returned)."""
    r = cos.shape[-1]
    if native and native_small_ops.supports(q) and _rows_of_heads(q, k) and cos.is_contiguous():
        native_small_ops.rotary_(q, k, cos, sin)  # in place: q and k are this layer's own
        return q, k
    if r < q.shape[-1]:
        q_rot, k_rot = apply_rotary(q[..., :r], k[..., :r], cos, sin)
        return torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rows_of_heads(q: torch.Tensor, k: torch.Tensor) -> bool:
    d = q.shape[-1]
    return q.stride()[1:] == (d, 1) and k.stride()[1:] == (d, 1) and k.dtype == q.dtype


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


NATIVE_F32_ROWS = 32  # float32 silu * up natively up to this many rows (SwiGLU._gated_mul)


class SwiGLU(nn.Module):
    lora = None  # a kvpage.lora.apply.LoraContext when the engine serves adapters
    layer = -1  # the decoder layer, for the adapters' weights
    native = False  # activation(gate) * up by kvpage's native kernel (bound by finalize)
    # That kernel's name in native_small_ops, looked up per call as every native small op is
    # (kvpage.verify.path_coverage counts their calls by wrapping them).
    native_mul: str | None = None

    def __init__(self, hidden: int, intermediate: int, bias: bool) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.gate_up = Projection(self.gate_proj, self.up_proj)
        self.down = Projection(self.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        lora = self.lora
        if lora is None or lora.batch is None:
            return self.down(self._gated_mul(gate, up))[0]
        gate = lora.apply(self.layer, "gate_proj", x, gate)
        up = lora.apply(self.layer, "up_proj", x, up)
        hidden = self._gated_mul(gate, up)  # its native pass too: a decode tape records it
        return lora.apply(self.layer, "down_proj", hidden, self.down(hidden)[0])

    def bind_kernels(self, choice: KernelChoice) -> None:
        # By the activation itself: a subclass with another one keeps torch's.
        kernel = _GATED_KERNELS.get(type(self).activation)
        self.native = kernel is not None and small_ops_on(choice, self)
        self.native_mul = kernel if self.native else None

    @staticmethod
    def activation(gate: torch.Tensor) -> torch.Tensor:
        return nn.functional.silu(gate)

    def _gated_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """activation(gate) * up (native_mul: SiLU's or GELU-tanh's); for bfloat16 in one
        native pass where it runs (torch's bfloat16 silu and mul took 5.8 ms of a 2048-token prefill chunk's 125M layer, the
        native pass ~1). float32 keeps torch's above NATIVE_F32_ROWS (as fast there, and its
        exp's last bit is HF's); at decode's few rows the native pass (within one rounding of
        torch's), so that a decode step is native kernels only (kvpage.model.decode_tape)."""
        f32 = gate.dtype is torch.float32 and gate.shape[0] <= NATIVE_F32_ROWS
        native = self.native and (gate.dtype is torch.bfloat16 or f32) and gate.dim() == 2
        native = native and gate.stride(1) == 1 and gate.stride() == up.stride()
        if native and native_small_ops.supports(gate) and up.dtype == gate.dtype:
            return getattr(native_small_ops, self.native_mul)(gate, up)
        return self.activation(gate) * up


class GeGLU(SwiGLU):
    """down(gelu_tanh(gate(x)) * up(x)): Gemma's MLP."""

    @staticmethod
    def activation(gate: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(gate, approximate="tanh")


# Each gated MLP's activation -> its native activation(gate) * up in native_small_ops.
_GATED_KERNELS = {SwiGLU.activation: "silu_mul", GeGLU.activation: "gelu_tanh_mul"}


class LayerNorm(nn.LayerNorm):
    """torch's LayerNorm (GPT-2's), with RMSNorm's native forward and fused residual add."""

    native = False  # kvpage's native kernel (bound by kvpage.model.kernels.finalize)

    def bind_kernels(self, choice: KernelChoice) -> None:
        self.native = self.bias is not None and small_ops_on(choice, self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._native_fits(x):
            return native_small_ops.layer_norm(x, self.weight, self.bias, self.eps)[1]
        return super().forward(x)

    def add_forward(
        self, x: torch.Tensor, delta: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, LayerNorm(x + delta)): the residual add and the next norm in one pass."""
        if self._native_fits(x):
            return native_small_ops.layer_norm(x, self.weight, self.bias, self.eps, delta)
        x = x + delta
        return x, super().forward(x)

    def _native_fits(self, x: torch.Tensor) -> bool:
        w = self.weight
        return (
            self.native
            and x.dim() == 2
            and w.dtype == x.dtype
            and native_small_ops.supports(x)
            and not (w.requires_grad and torch.is_grad_enabled())
        )


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's tanh approximation of GELU."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


class GPT2MLP(nn.Module):
    native = False  # gelu_new by kvpage's native kernel (bound by finalize)

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(hidden, intermediate)
        self.c_proj = nn.Linear(intermediate, hidden)
        self.fc = Projection(self.c_fc)
        self.proj = Projection(self.c_proj)

    def bind_kernels(self, choice: KernelChoice) -> None:
        self.native = small_ops_on(choice, self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self._gelu_new(self.fc(x)[0]))[0]

    def _gelu_new(self, h: torch.Tensor) -> torch.Tensor:
        """Natively as SwiGLU's silu * up: bfloat16 always, float32 at decode's few rows."""
        rows = h.dtype is torch.bfloat16 or h.shape[0] <= NATIVE_F32_ROWS
        if self.native and rows and h.dim() == 2 and native_small_ops.supports(h):
            return native_small_ops.gelu_new(h)
        return gelu_new(h)

"""Gemma 3 text decoder: the embedding scaled by sqrt(hidden), RMSNorm with (1 + w) computed in
float32, norms before and after both attention and MLP, per-head q/k norms, a GELU-tanh gated
MLP, scores scaled by query_pre_attn_scalar ** -0.5, and local (sliding-window) layers with
their own RoPE base between the global ones. The projections have Llama's names and shapes, so
tensor parallelism shards them the same way (kvpage.parallel.sharding). The layers are written
in Llama's (hidden, residual) shape with the residual adds fused into the norms, so a decode
step is the bound kernels only and takes the decode tape (kvpage.model.decode_tape)."""

from __future__ import annotations

import torch
from torch import nn

import kvpage.model.native_small_ops as native_small_ops
from kvpage.config import ModelConfig
from kvpage.model.attention import AttentionBackend
from kvpage.model.decode_tape import decoder_forward
from kvpage.model.kernels import KernelChoice
from kvpage.model.layers import GeGLU, RMSNorm, RotaryEmbedding
from kvpage.model.llama import LlamaAttention, LlamaForCausalLM

Rope = tuple[torch.Tensor, torch.Tensor]


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + w), multiplied in float32 and then cast (Llama's casts first). The
    native kernel multiplies by 1 + w in float32 and rounds once, as this does: finalize binds
    that float32 weight (`offset_weight`) once, from the loaded w."""

    offset_weight: torch.Tensor | None = None

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps)
        self.weight = nn.Parameter(torch.zeros(dim))

    def bind_kernels(self, choice: KernelChoice) -> None:
        super().bind_kernels(choice)
        self.offset_weight = (1.0 + self.weight.detach().float()) if self.native else None

    def _kernel_weight(self) -> torch.Tensor:
        return self.offset_weight

    def _native_fits(self, x: torch.Tensor) -> bool:
        w = self.weight
        return native_small_ops.supports(x) and not (w.requires_grad and torch.is_grad_enabled())

    def _torch_forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).type_as(x)


class Gemma3Attention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__(cfg, layer)
        self.scale = cfg.query_pre_attn_scalar**-0.5
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.norm_eps)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.norm_eps)
        self.qk_norm = True


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        size, eps = cfg.hidden_size, cfg.norm_eps
        self.is_local = cfg.window_of(layer) is not None
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.self_attn = Gemma3Attention(cfg, layer)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.mlp = GeGLU(size, cfg.intermediate_size, cfg.mlp_bias)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        ropes: tuple[Rope, Rope],
        attn: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Llama's (hidden, residual) shape (kvpage.model.llama.LlamaDecoderLayer): the
        residual stream is residual + hidden, each add fused into the norm after it: the
        input norm's, the pre-feedforward norm's, and the last the final norm's. ropes: the
        global layers' tables and the local ones'."""
        rope = ropes[1] if self.is_local else ropes[0]
        if residual is None:
            residual, h = hidden, self.input_layernorm(hidden)
        else:
            residual, h = self.input_layernorm.add_forward(residual, hidden)
        attn_out = self.post_attention_layernorm(self.self_attn(h, rope, attn))
        residual, h = self.pre_feedforward_layernorm.add_forward(residual, attn_out)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma3Model(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim)
        self.local_rotary = RotaryEmbedding(cfg.local_rope or cfg.rope, cfg.head_dim)


class Gemma3ForCausalLM(LlamaForCausalLM):
    body = Gemma3Model

    def __init__(self, cfg: ModelConfig) -> None:
        if cfg.query_pre_attn_scalar is None:
            raise ValueError("a Gemma 3 model needs query_pre_attn_scalar")
        super().__init__(cfg)
        self.embed_scale = cfg.hidden_size**0.5

    def forward(self, input_ids, positions, attn) -> torch.Tensor:
        attn = self.bound_attention(attn)
        x = self.model.embed_tokens(input_ids)  # (N, C)
        # The scale is rounded to the weights' dtype first, as transformers does.
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype, device=x.device)
        ropes = (
            self.model.rotary.cos_sin(positions, x.dtype),
            self.model.local_rotary.cos_sin(positions, x.dtype),
        )
        return decoder_forward(self, x, ropes, attn)  # (N, C)

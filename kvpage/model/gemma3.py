"""Gemma 3 text decoder: the embedding scaled by sqrt(hidden), RMSNorm with (1 + w) computed in
float32, norms before and after both attention and MLP, per-head q/k norms, a GELU-tanh gated
MLP, scores scaled by query_pre_attn_scalar ** -0.5, and local (sliding-window) layers with
their own RoPE base between the global ones. The projections have Llama's names and shapes, so
tensor parallelism shards them the same way (kvpage.parallel.sharding)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvpage.config import ModelConfig
from kvpage.model.attention import AttentionBackend
from kvpage.model.kernels import KernelChoice
from kvpage.model.layers import RotaryEmbedding, SwiGLU
from kvpage.model.llama import LlamaAttention, LlamaForCausalLM

Rope = tuple[torch.Tensor, torch.Tensor]


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + w), multiplied in float32 and then cast (Llama's casts first)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).type_as(x)

    def heads_(self, x: torch.Tensor) -> torch.Tensor:
        """Per head of x (N, H, D), as RMSNorm.heads_ is called: a new tensor."""
        return self(x)


class GeGLU(SwiGLU):
    """down(gelu_tanh(gate(x)) * up(x))."""

    @staticmethod
    def activation(gate: torch.Tensor) -> torch.Tensor:
        return F.gelu(gate, approximate="tanh")


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

    def forward(self, x, ropes: tuple[Rope, Rope], attn: AttentionBackend) -> torch.Tensor:
        rope = ropes[1] if self.is_local else ropes[0]
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, attn))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


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

    def bind_kernels(self, choice: KernelChoice) -> None:
        """No decode tape: the layers are Gemma's (torch norms and GeGLU, no native kernels)."""
        self._plan.plan = None

    def forward(self, input_ids, positions, attn) -> torch.Tensor:
        attn = self.bound_attention(attn)
        x = self.model.embed_tokens(input_ids)  # (N, C)
        # The scale is rounded to the weights' dtype first, as transformers does.
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype, device=x.device)
        ropes = (
            self.model.rotary.cos_sin(positions, x.dtype),
            self.model.local_rotary.cos_sin(positions, x.dtype),
        )
        for layer in self.model.layers:
            x = layer(x, ropes, attn)
        return self.model.norm(x)  # (N, C)

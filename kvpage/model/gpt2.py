"""GPT-2: learned absolute positions, LayerNorm, gelu_new. The checkpoint stores its projections
as Conv1D (in, out); the loader transposes them into these nn.Linear (out, in) weights."""

from __future__ import annotations

import torch
from torch import nn

from kvpage.config import ModelConfig
from kvpage.model.attention import AttentionBackend
from kvpage.model.base import CausalLM
from kvpage.model.layers import GPT2MLP
from kvpage.model.projection import Projection

# Parameters stored as Conv1D in HF checkpoints: their checkpoint tensor is our weight transposed.
CONV1D_SUFFIXES = (
    "attn.c_attn.weight",
    "attn.c_proj.weight",
    "mlp.c_fc.weight",
    "mlp.c_proj.weight",
)


class GPT2Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        if cfg.scale_attn_by_inverse_layer_idx:
            self.scale /= layer + 1
        self.c_attn = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.c_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.qkv = Projection(self.c_attn)
        self.out = Projection(self.c_proj)

    def forward(self, x: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = (
            self.qkv(x)[0].view(n, 3, self.num_heads, self.head_dim).unbind(1)
        )  # 3 x (N, H, D)
        out = attn.attend(self.layer, q, k, v, self.scale)  # (N, H, D)
        return self.out(out.reshape(n, -1))[0]


class GPT2Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.attn = GPT2Attention(cfg, layer)
        self.ln_2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.mlp = GPT2MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), attn)
        return x + self.mlp(self.ln_2(x))


class GPT2Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.wpe = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.h = nn.ModuleList(GPT2Block(cfg, i) for i in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)


class GPT2LMHeadModel(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.transformer = GPT2Transformer(cfg)
        self.logits = Projection(self.transformer.wte)

    def forward(self, input_ids, positions, attn) -> torch.Tensor:
        attn = self.bound_attention(attn)
        x = self.transformer.wte(input_ids) + self.transformer.wpe(positions)  # (N, C)
        for block in self.transformer.h:
            x = block(x, attn)
        return self.transformer.ln_f(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits(hidden)[0]  # tied head: (M, V)

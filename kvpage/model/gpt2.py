"""GPT-2: learned absolute positions, LayerNorm, gelu_new. The checkpoint stores its projections
as Conv1D (in, out); the loader transposes them into these nn.Linear (out, in) weights. The
blocks are written in Llama's (hidden, residual) shape with the residual adds fused into the
LayerNorms, so a decode step is the bound kernels only and takes the decode tape
(kvpage.model.decode_tape)."""

from __future__ import annotations

import torch
from torch import nn

from kvpage.config import ModelConfig
from kvpage.model.attention import AttentionBackend
from kvpage.model.base import CausalLM
from kvpage.model.decode_tape import DecodeTape, decoder_forward
from kvpage.model.kernels import KernelChoice
from kvpage.model.layers import GPT2MLP, LayerNorm
from kvpage.model.llama import PlanSlot
from kvpage.model.projection import Projection

# Parameters stored as Conv1D in HF checkpoints: their checkpoint tensor is our weight transposed.
CONV1D_SUFFIXES = (
    "attn.c_attn.weight",
    "attn.c_proj.weight",
    "mlp.c_fc.weight",
    "mlp.c_proj.weight",
)
NO_ROPE = ()  # what the blocks take for the rotary tables (the decode tape hands it over)


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
        self.ln_1 = LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.attn = GPT2Attention(cfg, layer)
        self.ln_2 = LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.mlp = GPT2MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, rope, attn: AttentionBackend
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Llama's (hidden, residual) shape (kvpage.model.llama.LlamaDecoderLayer): the stream
        is residual + hidden, each add fused into the LayerNorm after it, the last into ln_f.
        rope: NO_ROPE (positions are in the embedding)."""
        if residual is None:
            residual, h = hidden, self.ln_1(hidden)
        else:
            residual, h = self.ln_1.add_forward(residual, hidden)
        residual, h = self.ln_2.add_forward(residual, self.attn(h, attn))
        return self.mlp(h), residual


class GPT2Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.wpe = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.h = nn.ModuleList(GPT2Block(cfg, i) for i in range(cfg.num_layers))
        self.ln_f = LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)

    @property
    def layers(self) -> nn.ModuleList:
        """The blocks under the Llama family's name (what the decode tape records)."""
        return self.h

    @property
    def norm(self) -> LayerNorm:
        """The final norm under the Llama family's name (what the decode tape records)."""
        return self.ln_f


class GPT2LMHeadModel(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.transformer = GPT2Transformer(cfg)
        self.logits = Projection(self.transformer.wte)
        self._plan = PlanSlot()

    @property
    def model(self) -> GPT2Transformer:
        """The decoder under the Llama family's name (what the decode tape records)."""
        return self.transformer

    def forward(self, input_ids, positions, attn) -> torch.Tensor:
        attn = self.bound_attention(attn)
        x = self.transformer.wte(input_ids) + self.transformer.wpe(positions)  # (N, C)
        return decoder_forward(self, x, NO_ROPE, attn)  # (N, C)

    def bind_kernels(self, choice: KernelChoice) -> None:
        """The decode tape over the blocks' bound kernels, where every fast path is on."""
        self._plan.plan = DecodeTape.build(self) if choice.all_on else None

    def decode_plan(self) -> DecodeTape | None:
        """Decode steps replayed from the module forward's recorded kernel calls; None with
        the decode_plan path off (kvpage.model.llama.LlamaForCausalLM.decode_plan)."""
        return self._plan.plan

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits(hidden)[0]  # tied head: (M, V)

"""Llama-family decoder (Llama 2/3, Qwen2, Qwen3, Phi-3, Mistral, SmolLM3): RMSNorm, RoPE, SwiGLU,
MHA/GQA/MQA, Qwen3's per-head q/k norm, a sliding window per layer, SmolLM3's NoPE layers. Parameter names mirror the Hugging Face checkpoint so loading is a name lookup."""

from __future__ import annotations

import torch
from torch import nn

from kvpage.config import ModelConfig
from kvpage.model.attention import AttentionBackend
from kvpage.model.base import CausalLM
from kvpage.model.decode_tape import DecodeTape, decoder_forward
from kvpage.model.kernels import KernelChoice
from kvpage.model.layers import RMSNorm, RotaryEmbedding, SwiGLU, apply_rotary, small_ops_on
from kvpage.model.projection import Projection


class PlanSlot:
    """The model's decode tape, bound by finalize. A copy of the model (the reference's twin, a
    pickled worker's) starts without one: the tape holds the original's modules and native
    kernel handles, which are neither its own nor picklable."""

    def __init__(self) -> None:
        self.plan: DecodeTape | None = None

    def __deepcopy__(self, memo) -> PlanSlot:
        return PlanSlot()

    def __reduce__(self):
        return (PlanSlot, ())


class LlamaAttention(nn.Module):
    lora = None  # a kvpage.lora.apply.LoraContext when the engine serves adapters
    native_rotary = False  # kvpage's rotary kernel (bound by finalize)

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.scale = cfg.head_dim**-0.5
        self.window = cfg.window_of(layer)
        self.rope_on = cfg.rope_on(layer)
        q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q_out, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_out, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_out, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q_out, cfg.hidden_size, bias=cfg.o_bias)
        self.qkv = Projection(self.q_proj, self.k_proj, self.v_proj)
        self.out = Projection(self.o_proj)
        if cfg.qk_norm:  # one weight over head_dim, shared by every head (replicated under TP)
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.qk_norm = cfg.qk_norm

    def bind_kernels(self, choice: KernelChoice) -> None:
        self.native_rotary = small_ops_on(choice, self)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attn: AttentionBackend
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x)
        lora = self.lora
        if lora is not None and lora.batch is not None:
            q = lora.apply(self.layer, "q_proj", x, q)
            k = lora.apply(self.layer, "k_proj", x, k)
            v = lora.apply(self.layer, "v_proj", x, v)
        q = q.view(n, self.num_heads, self.head_dim)  # (N, H, D)
        k = k.view(n, self.num_kv_heads, self.head_dim)  # (N, KVH, D)
        v = v.view(n, self.num_kv_heads, self.head_dim)  # (N, KVH, D)
        if self.qk_norm:
            q, k = self.q_norm.heads_(q), self.k_norm.heads_(k)
        if self.rope_on:
            q, k = apply_rotary(q, k, *rope, self.native_rotary)
        out = attn.attend(self.layer, q, k, v, self.scale, self.window)  # (N, H, D)
        out = out.reshape(n, -1)
        y = self.out(out)[0]  # (N, C)
        if lora is not None and lora.batch is not None:
            y = lora.apply(self.layer, "o_proj", out, y)
        return y


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.self_attn = LlamaAttention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, rope, attn
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's shape: (hidden, residual) -> (this layer's MLP output, the residual stream
        before it). The residual stream is residual + hidden (hidden alone at the first layer,
        residual None); each add is fused into the RMSNorm after it, so the layer is the bound
        kernels and views only, and the last add is the final norm's."""
        if residual is None:
            residual, h = hidden, self.input_layernorm(hidden)
        else:
            residual, h = self.input_layernorm.add_forward(residual, hidden)
        attn_out = self.self_attn(h, rope, attn)
        residual, h = self.post_attention_layernorm.add_forward(residual, attn_out)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim)


class LlamaForCausalLM(CausalLM):
    body: type[nn.Module] = LlamaModel  # the decoder stack; the head, tying and logits are shared

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.rope is None:
            raise ValueError("a Llama-family model needs a RoPE config")
        self.config = cfg
        self.model = self.body(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.logits = Projection(self.lm_head)
        self._plan = PlanSlot()
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, attn) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # (N, C)
        rope = self.model.rotary.cos_sin(positions, x.dtype)  # ((N, 1, D), (N, 1, D))
        return decoder_forward(self, x, rope, self.bound_attention(attn))  # (N, C)

    def bind_kernels(self, choice: KernelChoice) -> None:
        """The decode tape over the layers' bound kernels, where every fast path is on
        (kvpage.model.decode_tape); none otherwise."""
        self._plan.plan = DecodeTape.build(self) if choice.all_on else None

    def decode_plan(self) -> DecodeTape | None:
        """Decode steps replayed from the recorded kernel calls of the module forward
        (kvpage.model.decode_tape), bound by finalize; None with the decode_plan path off."""
        return self._plan.plan

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits(hidden)[0]  # (M, V)

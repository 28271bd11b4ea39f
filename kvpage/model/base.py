"""What every model family offers the rest of kvpage."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from kvpage.config import ModelConfig
from kvpage.model.attention import AttentionBackend, NoCacheAttention


class CausalLM(nn.Module, ABC):
    """A decoder over packed tokens. `forward` returns hidden states (N, C); `compute_logits` maps
    the rows that need them to (M, vocab)."""

    config: ModelConfig

    @abstractmethod
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        """input_ids, positions: (N,) -> hidden states (N, C)."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (M, C) -> logits (M, V)."""

    def bound_attention(self, attn: AttentionBackend) -> AttentionBackend:
        """`attn`, told which fast paths this model was bound without where some were
        (kvpage.model.kernels.finalize: the gate's re-runs); the attention backend is made per
        step, so the model hands its choice over."""
        choice = self.__dict__.get("kernels")
        if choice is not None and not choice.all_on:
            off = getattr(attn, "kernels_off", None)
            if off is not None:
                off(choice)
        return attn

    def tie_weights(self) -> None:
        """Re-establish shared parameters (moving to a device can split them)."""

    @torch.inference_mode()
    def forward_full(self, input_ids: torch.Tensor | list[int]) -> torch.Tensor:
        """Logits (T, vocab) for one whole sequence, no cache."""
        ids = torch.as_tensor(input_ids, dtype=torch.long, device=self.device)
        positions = torch.arange(ids.shape[0], device=self.device)
        return self.compute_logits(self.forward(ids, positions, NoCacheAttention()))

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

"""Attention over a KV store. The model computes q/k/v for a packed batch of tokens and hands them to
an `AttentionBackend`, which owns where the keys and values live: nowhere (one whole sequence), a
contiguous per-request tensor (the reference), or the paged pool (the engine)."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class AttentionBackend(Protocol):
    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """q: (N, H, D); k, v: (N, KVH, D) for the N new tokens -> (N, H, D). With a sliding
        `window` W, a query at position p sees keys p - W + 1 .. p only."""
        ...


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """(T, H, D) or (n, T, H, D) -> (1 or n, H, T, D): SDPA's layout, a view."""
    x = x.transpose(-3, -2)
    return x if x.dim() == 4 else x.unsqueeze(0)


def _tokens_first(out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """SDPA's (n, H, T, D) back to the layout of the query `like`."""
    out = out.transpose(1, 2)
    return out if like.dim() == 4 else out.squeeze(0)


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """q: (T, H, D); k, v: (S, KVH, D); mask: (T, S) bool, True = may attend -> (T, H, D).
    With a leading batch dim n on q, k and v, n sequences of the same shape share the mask."""
    return _sdpa(q, k, v, scale, attn_mask=mask)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """q: (T, H, D); k, v: (T, KVH, D), the same T tokens -> (T, H, D), causal; a leading
    batch dim as in masked_attention."""
    return _sdpa(q, k, v, scale, is_causal=True)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, **mask) -> torch.Tensor:
    """SDPA over tokens-first q, k, v (GQA where k has fewer heads), back to q's layout."""
    out = F.scaled_dot_product_attention(
        _heads_first(q),
        _heads_first(k),
        _heads_first(v),
        scale=scale,
        enable_gqa=q.shape[-2] != k.shape[-2],
        **mask,
    )
    return _tokens_first(out, q)


def causal_mask(
    num_queries: int, num_keys: int, device: torch.device, window: int | None = None
) -> torch.Tensor:
    """(T, S) mask for T new tokens that are the last T of S: query i sees keys 0..S-T+i, or
    with a sliding window W only the last W of them."""
    q_idx = torch.arange(num_keys - num_queries, num_keys, device=device)
    k_idx = torch.arange(num_keys, device=device)
    mask = k_idx[None, :] <= q_idx[:, None]
    if window is not None:
        mask &= k_idx[None, :] > q_idx[:, None] - window
    return mask


def windowed_causal_attention(q, k, v, scale: float, window: int | None) -> torch.Tensor:
    """causal_attention over one fresh sequence, within a sliding window when it is shorter."""
    t = q.shape[-3]
    if window is None or window >= t:
        return causal_attention(q, k, v, scale)
    return masked_attention(q, k, v, causal_mask(t, k.shape[-3], q.device, window), scale)


class NoCacheAttention:
    """One whole sequence, causal, nothing kept: `forward_full`."""

    def attend(self, layer: int, q, k, v, scale: float, window: int | None = None) -> torch.Tensor:
        mask = causal_mask(q.shape[0], k.shape[0], q.device, window)
        return masked_attention(q, k, v, mask, scale)


class ContiguousKVCache:
    """One request's KV as plain per-layer tensors grown by concatenation: the oracle.
    Deliberately shares nothing with paging, prefix lookup or preemption."""

    def __init__(self, num_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers  # each (S, KVH, D)
        self.values: list[torch.Tensor | None] = [None] * num_layers

    @property
    def length(self) -> int:
        k = self.keys[-1]
        return 0 if k is None else k.shape[0]

    def attend(self, layer: int, q, k, v, scale: float, window: int | None = None) -> torch.Tensor:
        if self.keys[layer] is not None:
            k = torch.cat((self.keys[layer], k), dim=0)
            v = torch.cat((self.values[layer], v), dim=0)
        self.keys[layer], self.values[layer] = k, v
        # The oracle keeps every key and masks the window itself, sharing nothing with the
        # paged path's window handling.
        mask = causal_mask(q.shape[0], k.shape[0], q.device, window)
        return masked_attention(q, k, v, mask, scale)

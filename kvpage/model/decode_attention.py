"""Attention for decode tokens (one query per sequence) over gathered, padded contexts.

For 16-bit models: two batched matmuls around a float32 softmax. With one query row, the CPU
`scaled_dot_product_attention` kernel in bfloat16 spends its time on tiling meant for long query
blocks: at batch 32, 12 heads over 4 KV heads, 176 keys gathered from the pool (the shape of
bench/decode_profile.py), one thread, it took 9.2 ms a layer; this path 1.1 ms, the copy of the
gathered K/V into contiguous (S, KVH, C, D) included. In float32 SDPA wins (1.56 ms against
2.8 ms with that copy), so float32 keeps it. Grouped-query heads are handled by viewing the G
query heads of one KV head as G rows of one matmul: K and V are never repeated."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """q: (S, H, D); k, v: (S, KVH, C, D), any strides; mask: (S, 1, 1, C) bool, True = real
    context -> (S, H, D)."""
    if q.dtype == torch.float32:
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )  # (S, H, 1, D)
        return out.squeeze(2)
    return grouped_matmul_attention(q, k.contiguous(), v.contiguous(), mask, scale)


def grouped_matmul_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """q: (S, H, D); k, v: (S, KVH, C, D); mask: (S, 1, 1, C) bool, True = real context.
    Returns (S, H, D) in q's dtype. Scores and softmax are float32 whatever the model dtype, as
    SDPA's CPU kernels accumulate; the weights are rounded to v's dtype for the second matmul."""
    s, h, d = q.shape
    kvh = k.shape[1]
    grouped = q.view(s, kvh, h // kvh, d)  # (S, KVH, G, D)
    scores = torch.matmul(grouped, k.transpose(-1, -2)).float()  # (S, KVH, G, C)
    scores = scores.mul_(scale).masked_fill_(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(weights, v).view(s, h, d)

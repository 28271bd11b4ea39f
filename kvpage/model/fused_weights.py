"""Checkpoints that store several of kvpage's linear layers as one tensor (Phi-3's `qkv_proj` and
`gate_up_proj`): which rows of which checkpoint tensor fill one of kvpage's parameters. The
model keeps separate q/k/v and gate/up layers either way (kvpage.model.projection fuses them
again for the matmul), so tensor parallelism and the checkpoint names of the other families
stay as they are."""

from __future__ import annotations

from dataclasses import dataclass

from kvpage.config import ModelConfig


@dataclass(frozen=True, slots=True)
class FusedRows:
    name: str  # the checkpoint tensor
    start: int  # its rows [start, stop) are the parameter
    stop: int


# model_type -> (fused module, the modules it holds, in row order)
FUSED_MODULES: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "phi3": (
        ("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
    ),
}


def fused_source(cfg: ModelConfig, name: str) -> FusedRows | None:
    """Where parameter `name` (e.g. model.layers.3.self_attn.k_proj.weight) lives in a fused
    checkpoint of cfg's family, or None if that family does not fuse it."""
    head, _, leaf = name.rpartition(".")  # leaf: weight or bias
    for fused, parts in FUSED_MODULES.get(cfg.checkpoint_family, ()):
        for i, part in enumerate(parts):
            if not head.endswith("." + part):
                continue
            prefix = head[: -len(part)]
            sizes = [_rows(cfg, p) for p in parts]
            start = sum(sizes[:i])
            return FusedRows(f"{prefix}{fused}.{leaf}", start, start + sizes[i])
    return None


def _rows(cfg: ModelConfig, part: str) -> int:
    if part.endswith("q_proj"):
        return cfg.num_heads * cfg.head_dim
    if part.endswith(("k_proj", "v_proj")):
        return cfg.num_kv_heads * cfg.head_dim
    return cfg.intermediate_size  # gate_proj, up_proj

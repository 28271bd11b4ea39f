"""The cache namespace a model + tokenizer + block size imply (R5). The verifier computes the same
thing independently of an engine instance to check which namespace a request was keyed in."""

from __future__ import annotations

from kvpage.cache.namespace import CacheNamespace
from kvpage.model.base import CausalLM

KV_LAYOUT_VERSION = 1


def base_namespace(
    model: CausalLM, tokenizer, block_size: int, model_name: str = ""
) -> CacheNamespace:
    cfg = model.config
    return CacheNamespace(
        model_revision=cfg.revision or model_name,
        tokenizer_revision=getattr(tokenizer, "revision", "none"),
        adapter=None,
        rope_config=cfg.position_signature(),
        kv_dtype=str(model.dtype).removeprefix("torch."),
        kv_layout_version=KV_LAYOUT_VERSION,
        block_size=block_size,
    )

"""The cache namespace a model + tokenizer + block size imply. The verifier computes the same
thing independently of an engine instance to check which namespace a request was keyed in."""

from __future__ import annotations

from kvpage.cache.namespace import CacheNamespace
from kvpage.kv.format import KVFormat, kv_format
from kvpage.model.base import CausalLM
from kvpage.model.quantize import weight_quantization


def base_namespace(
    model: CausalLM,
    tokenizer,
    block_size: int,
    model_name: str = "",
    fmt: KVFormat | None = None,
) -> CacheNamespace:
    """`fmt`: how the pool stores K/V (None: the model dtype as computed). Its stored dtype and
    layout version are key fields, so a block of one KV format is never served to another."""
    cfg = model.config
    fmt = fmt if fmt is not None else kv_format("auto", model.dtype)
    # Quantized weights compute other K/V: part of the weights' identity, so of the namespace
    # (unquantized models keep the revision they always had).
    quant = weight_quantization(model)
    revision = cfg.revision or model_name
    return CacheNamespace(
        model_revision=revision if quant == "none" else f"{revision}+weights-{quant}",
        tokenizer_revision=getattr(tokenizer, "revision", "none"),
        adapter=None,
        rope_config=cfg.position_signature(),
        kv_dtype=fmt.name,
        kv_layout_version=fmt.layout_version,
        block_size=block_size,
    )

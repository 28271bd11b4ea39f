"""The LoRA adapters an engine serves (enable_lora): its adapter slots, the context that routes
every layer's projections through them, and the adapter a LoRARequest names."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpage.config import EngineConfig, ModelConfig
from kvpage.engine.sequence import Sequence
from kvpage.errors import InvalidRequest, LoRAError
from kvpage.lora.adapter import LoraAdapter
from kvpage.lora.apply import LoraContext, attach
from kvpage.lora.request import LoRARequest
from kvpage.lora.slots import LoraSlots
from kvpage.model.base import CausalLM

if TYPE_CHECKING:
    from kvpage.parallel.executor import TensorParallelExecutor


# Model types whose attention and MLP modules add adapter deltas (kvpage.lora.apply.attach).
LORA_MODEL_TYPES = ("llama", "gemma3")


def serve_adapters(
    config: EngineConfig, model: CausalLM, tp: TensorParallelExecutor | None
) -> tuple[LoraSlots | None, LoraContext | None]:
    """With enable_lora: the adapter slots, and every layer's projections routed through one
    LoraContext that the runner fills per step (under tensor parallelism: on every rank, each
    computing from its shard of the slot tables). Without: (None, None)."""
    if not config.enable_lora:
        return None, None
    if model.config.model_type not in LORA_MODEL_TYPES:
        raise LoRAError(
            f"LoRA adapters are served on Llama-shaped models ({', '.join(LORA_MODEL_TYPES)}), "
            f"not {model.config.model_type!r}: its layers have no adapter hook (enable_lora)"
        )
    if tp is None:
        slots = LoraSlots(config.max_loras, config.max_lora_rank, model.dtype, model.device)
        context = LoraContext(slots.tables)
        attach(model, context)
        return slots, context
    slots = LoraSlots(
        config.max_loras,
        config.max_lora_rank,
        model.dtype,
        model.device,
        shard=tp.shard_lora_factors,
        on_write=tp.write_lora_slot,
    )
    return slots, tp.serve_lora(slots.tables)


def named_adapter(
    slots: LoraSlots | None,
    lora_request: LoRARequest,
    model_config: ModelConfig,
    max_rank: int,
    reload: bool = False,
) -> LoraAdapter:
    """The adapter `lora_request` names: the registered one under that name and path, else
    loaded from its PEFT directory and registered (`reload`: loaded again in any case, so
    changed weights become a new adapter)."""
    if slots is None:
        raise InvalidRequest("a LoRA request needs an engine made with enable_lora=True")
    if not isinstance(lora_request, LoRARequest):
        raise InvalidRequest(f"lora_request must be a LoRARequest, got {type(lora_request)}")
    known = slots.registered.get(lora_request.lora_name)
    if known is not None and known.path == lora_request.lora_path and not reload:
        return known
    adapter = slots.reader.read(
        lora_request.lora_name, lora_request.lora_path, model_config, max_rank
    )
    return slots.register(adapter)


class AdapterHolds:
    """From its first admission to its finish a sequence holds its adapter's slot, so the
    adapter stays resident while any of its requests can run."""

    def __init__(self, slots: LoraSlots | None) -> None:
        self.slots = slots

    def fits(self, seq: Sequence) -> bool:
        return seq.lora is None or seq.lora_held or self.slots.can_hold(seq.lora)

    def hold(self, seq: Sequence) -> None:
        if seq.lora is not None and not seq.lora_held:
            self.slots.hold(seq.lora)
            seq.lora_held = True

    def release(self, seq: Sequence) -> None:
        if seq.lora_held:
            self.slots.release(seq.lora)
            seq.lora_held = False

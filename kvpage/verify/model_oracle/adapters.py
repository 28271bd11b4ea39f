"""The model stage's LoRA part: PEFT, loading the same adapter directory onto transformers' model,
against the reference's merged model (kvpage.reference.lora_merge: its own read of the
directory, W + scale * B @ A). The lora suite then holds the engine to that reference; this
holds the reference to PEFT, which reads r, lora_alpha, use_rslora and the target modules
itself."""

from __future__ import annotations

from pathlib import Path

import peft
from torch import nn

from kvpage.verify.cases.lora import BB, QV, RS, A
from kvpage.verify.lora_adapters import LoraSpec

# The lora suite's adapters: every target, three targets at rank 8, rsLoRA with alpha != rank,
# two targets at rank 2.
STAGE_SPECS: tuple[LoraSpec, ...] = (A, BB, RS, QV)


def with_adapter(theirs: nn.Module, directory: Path) -> nn.Module:
    """transformers' model with the PEFT adapter in `directory` loaded by PEFT (not merged:
    PEFT's own LoRA layers run)."""
    return peft.PeftModel.from_pretrained(theirs, str(directory)).eval()

"""LoRA adapters: loading PEFT directories, the bounded table of resident adapters, and the
low-rank products a mixed batch adds to the base projections."""

from kvpage.lora.adapter import LoraAdapter, load_peft_adapter
from kvpage.lora.request import LoRARequest

__all__ = ["LoRARequest", "LoraAdapter", "load_peft_adapter"]

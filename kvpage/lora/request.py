"""LoRARequest: which adapter a request runs with (vLLM's name and fields)."""

from __future__ import annotations

from dataclasses import dataclass

from kvpage.errors import LoRAError


@dataclass(frozen=True, slots=True, init=False)
class LoRARequest:
    """LoRARequest(name, path) or vLLM's LoRARequest(name, int_id, path). The name selects the
    adapter; the path is where its PEFT directory is. The integer id is kept for callers that
    pass one and plays no part in identity: the cache tells adapters apart by name and by a
    digest of their weights and config."""

    lora_name: str
    lora_path: str
    lora_int_id: int | None

    def __init__(self, lora_name: str, *args, lora_path: str | None = None, lora_int_id=None):
        if len(args) == 1 and lora_path is None:
            (lora_path,) = args
        elif len(args) == 2 and lora_path is None and lora_int_id is None:
            lora_int_id, lora_path = args
        elif args:
            raise LoRAError("LoRARequest(name, path) or LoRARequest(name, int_id, path)")
        if not isinstance(lora_name, str):
            raise LoRAError(f"lora_name must be a str, got {type(lora_name).__name__}")
        if not isinstance(lora_path, str) or not lora_path:
            raise LoRAError(f"lora_path must be a non-empty str, got {lora_path!r}")
        if lora_int_id is not None and (not isinstance(lora_int_id, int) or lora_int_id < 1):
            raise LoRAError(f"lora_int_id must be an int >= 1, got {lora_int_id!r}")
        object.__setattr__(self, "lora_name", lora_name)
        object.__setattr__(self, "lora_path", lora_path)
        object.__setattr__(self, "lora_int_id", lora_int_id)

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

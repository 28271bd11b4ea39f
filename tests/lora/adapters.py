"""Random PEFT adapters over the random-weight HF models of tests/model (PEFT is the oracle)."""

from __future__ import annotations

import json
from pathlib import Path

import peft
import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_adapter(base, directory: Path, seed: int, targets=ALL_TARGETS, **config) -> Path:
    """A LoRA of `base` (an HF model) with random A and B (PEFT's default B = 0 would be a
    no-op adapter), saved as a PEFT directory. `base` is left unchanged."""
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(
        r=config.pop("r", 4),
        lora_alpha=config.pop("lora_alpha", 8),
        target_modules=targets,
        init_lora_weights=False,  # random B too
        **config,
    )
    model = peft.get_peft_model(_copy(base), cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(4.0)  # big enough to change greedy tokens
    model.save_pretrained(str(directory))
    return directory


def peft_model(base, directory: Path):
    return peft.PeftModel.from_pretrained(_copy(base), str(directory)).eval()


def edit_config(directory: Path, **changes) -> None:
    path = directory / "adapter_config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def _copy(model):
    import copy

    return copy.deepcopy(model)

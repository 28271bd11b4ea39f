"""Random-weight Hugging Face reference models (our models' oracle): the families the gate's model
stage runs (kvpage.verify.model_oracle.families), under the names the tests use."""

from __future__ import annotations

from kvpage.verify.model_oracle.families import FAMILY_CONFIGS as HF_CONFIGS
from kvpage.verify.model_oracle.families import VOCAB
from kvpage.verify.model_oracle.families import save_family as save_hf

__all__ = ["HF_CONFIGS", "VOCAB", "save_hf"]

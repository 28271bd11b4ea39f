"""How a request speculates: vLLM's `speculative_config` shape (method, num_speculative_tokens,
model, quantization, prompt_lookup_min/max), validated where it is made."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from kvpage.config import QUANTIZATIONS
from kvpage.errors import InvalidConfig

METHODS = ("ngram", "draft_model")
# vLLM's default when neither prompt_lookup bound is given (its own comment: arbitrarily chosen).
DEFAULT_PROMPT_LOOKUP = 5
# vLLM spells the n-gram method as a model name too (`"model": "[ngram]"` in its older form).
NGRAM_MODEL_ALIASES = ("ngram", "[ngram]")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """One speculative setting for the engine.

    method "ngram": drafts are looked up in the request's own history (prompt lookup);
    prompt_lookup_min/max bound the n-gram length and default as in vLLM (both absent: 5 and 5;
    one absent: equal to the other). `model` must be None and `quantization` "none".

    method "draft_model": a draft model sharing the target's tokenizer proposes. `model` names
    it (a builtin name or a directory), loaded with `quantization` ("none" | "int8"). `model=None`
    with `quantization="int8"` is the target's own int8-weight copy, loaded once from the
    target's weights: it needs no second checkpoint, and None says "no other model" the way
    vLLM's field does. `model=None` with "none" is refused: a draft identical to the target costs
    a full target step per draft token and can never be faster.
    """

    method: str
    num_speculative_tokens: int  # k: drafts proposed per step, each verified by the target
    model: str | None = None
    quantization: str = "none"  # one of kvpage.config.QUANTIZATIONS: the draft's linear weights
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InvalidConfig(f"speculative method must be one of {METHODS}, got {self.method!r}")
        _check_positive_int("num_speculative_tokens", self.num_speculative_tokens)
        if self.quantization not in QUANTIZATIONS:
            raise InvalidConfig(
                f"speculative quantization must be one of {QUANTIZATIONS}, "
                f"got {self.quantization!r}"
            )
        if self.method == "ngram":
            self._check_ngram()
        else:
            self._check_draft_model()

    @property
    def is_self_draft(self) -> bool:
        """The draft is the target's own int8-weight copy."""
        return self.method == "draft_model" and self.model is None

    def _check_ngram(self) -> None:
        if self.model is not None:
            raise InvalidConfig(
                f"speculative model must be None for method 'ngram', got {self.model!r}"
            )
        if self.quantization != "none":
            raise InvalidConfig(
                f"speculative quantization must be 'none' for method 'ngram' (it loads no "
                f"model), got {self.quantization!r}"
            )
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        for name, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            if value is not None:  # checked as given, before one stands in for the other
                _check_positive_int(name, value)
        low = high if low is None else low
        high = low if high is None else high
        low = DEFAULT_PROMPT_LOOKUP if low is None else low
        high = DEFAULT_PROMPT_LOOKUP if high is None else high
        if low > high:
            raise InvalidConfig(f"prompt_lookup_min ({low}) must be <= prompt_lookup_max ({high})")
        object.__setattr__(self, "prompt_lookup_min", low)  # the resolved bounds, as vLLM keeps
        object.__setattr__(self, "prompt_lookup_max", high)

    def _check_draft_model(self) -> None:
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            if getattr(self, name) is not None:  # refused, not silently ignored
                raise InvalidConfig(f"{name} applies to method 'ngram' only, not 'draft_model'")
        if self.model is not None and (not isinstance(self.model, str) or not self.model.strip()):
            raise InvalidConfig(
                f"speculative model must be None or a non-empty string, got {self.model!r}"
            )
        if self.model is None and self.quantization != "int8":
            raise InvalidConfig(
                "speculative model=None means the target's own int8 copy and needs "
                f"quantization 'int8', got {self.quantization!r}"
            )

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> SpeculativeConfig:
        """vLLM's dict form (`LLM(speculative_config={...})`, `--speculative-config JSON`). A key
        kvpage does not implement is refused by name rather than ignored."""
        if not isinstance(config, Mapping):
            raise InvalidConfig(f"speculative_config must be a dict, got {type(config).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(key) for key in config if key not in known)
        if unknown:
            raise InvalidConfig(
                f"speculative_config has unsupported keys {unknown} (supported: {sorted(known)})"
            )
        values = dict(config)
        values["method"] = _method(values)
        if values["method"] == "ngram" and values.get("model") in NGRAM_MODEL_ALIASES:
            values["model"] = None
        if values.get("quantization") is None:  # vLLM's "not quantized"
            values["quantization"] = "none"
        if "num_speculative_tokens" not in values:
            raise InvalidConfig("speculative_config needs num_speculative_tokens")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _method(values: Mapping[str, Any]) -> str:
    """vLLM infers the method when only `model` is given: an n-gram alias or a draft model."""
    method = values.get("method")
    if method is not None:
        return "ngram" if method in NGRAM_MODEL_ALIASES else method
    model = values.get("model")
    if model is None:
        raise InvalidConfig(
            "speculative_config needs a method ('ngram' or 'draft_model') or a model"
        )
    return "ngram" if model in NGRAM_MODEL_ALIASES else "draft_model"


def _check_positive_int(name: str, value: object) -> None:
    """An int >= 1 (a bool or a float is a mistake, not a count)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidConfig(f"{name} must be an int >= 1, got {value!r}")

"""SpeculativeConfig: vLLM's defaults, validation that names the field, the dict form."""

from __future__ import annotations

import pytest

from kvpage.errors import InvalidConfig
from kvpage.speculative.config import SpeculativeConfig


def test_ngram_prompt_lookup_defaults_follow_vllm() -> None:
    both = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    assert (both.prompt_lookup_min, both.prompt_lookup_max) == (5, 5)
    only_max = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=4)
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (4, 4)
    only_min = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=2)
    assert (only_min.prompt_lookup_min, only_min.prompt_lookup_max) == (2, 2)


def test_self_draft_and_named_draft() -> None:
    own = SpeculativeConfig(method="draft_model", num_speculative_tokens=4, quantization="int8")
    assert own.is_self_draft
    named = SpeculativeConfig(method="draft_model", num_speculative_tokens=4, model="tiny-llama")
    assert not named.is_self_draft
    assert not SpeculativeConfig(method="ngram", num_speculative_tokens=2).is_self_draft


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2.0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
            "prompt_lookup_min",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": -1},
            "prompt_lookup_max",
        ),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 3,
            },
            "prompt_lookup_min",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "model"),
        ({"method": "ngram", "num_speculative_tokens": 2, "quantization": "int8"}, "quantization"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "int8"),  # self-draft at full size
        ({"method": "draft_model", "num_speculative_tokens": 2, "model": " "}, "model"),
        (
            {
                "method": "draft_model",
                "num_speculative_tokens": 2,
                "model": "m",
                "quantization": "fp4",
            },
            "quantization",
        ),
        (
            {
                "method": "draft_model",
                "num_speculative_tokens": 2,
                "model": "m",
                "prompt_lookup_max": 3,
            },
            "prompt_lookup_max",
        ),
    ],
)
def test_invalid_settings_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidConfig, match=field):
        SpeculativeConfig(**kwargs)


@pytest.mark.parametrize(
    "config",
    [
        SpeculativeConfig(
            method="ngram", num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=4
        ),
        SpeculativeConfig(method="draft_model", num_speculative_tokens=5, quantization="int8"),
        SpeculativeConfig(
            method="draft_model", num_speculative_tokens=2, model="/m", quantization="int8"
        ),
        SpeculativeConfig(method="draft_model", num_speculative_tokens=1, model="tiny-llama"),
    ],
)
def test_dict_round_trip(config: SpeculativeConfig) -> None:
    assert SpeculativeConfig.from_dict(config.to_dict()) == config


def test_from_dict_reads_vllm_forms() -> None:
    plain = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    )
    assert plain == SpeculativeConfig(
        method="ngram", num_speculative_tokens=3, prompt_lookup_min=4, prompt_lookup_max=4
    )
    legacy = SpeculativeConfig.from_dict({"model": "[ngram]", "num_speculative_tokens": 3})
    assert legacy == SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    inferred = SpeculativeConfig.from_dict(
        {"model": "tiny-llama", "num_speculative_tokens": 2, "quantization": None}
    )
    assert inferred == SpeculativeConfig(
        method="draft_model", num_speculative_tokens=2, model="tiny-llama"
    )


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1},
            "draft_tensor_parallel_size",
        ),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 2}, "method"),
        ([("method", "ngram")], "dict"),
    ],
)
def test_from_dict_refuses_by_name(config: object, message: str) -> None:
    with pytest.raises(InvalidConfig, match=message):
        SpeculativeConfig.from_dict(config)  # type: ignore[arg-type]

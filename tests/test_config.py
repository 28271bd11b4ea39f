"""EngineConfig checks every field where it is made: a bad value raises
InvalidConfig naming the field and the value, `None` is the only way to ask for a derived value,
and 0 is an error, never a silent default."""

from __future__ import annotations

import argparse
import math
from dataclasses import fields

import pytest

from kvpage.config import (
    KV_CACHE_DTYPES,
    MODEL_DTYPES,
    PREEMPTION_MODES,
    QUANTIZATIONS,
    EngineConfig,
)
from kvpage.errors import InvalidConfig

# Per field, values that must be refused: 0 and negatives where a count or a duration is meant,
# bools and floats where an int is, strings where a number is, and None where nothing is derived.
BAD = {
    "model": ["", "   ", None, 3, b"builtin:tiny-llama"],
    "block_size": [0, -1, 16.0, True, "16", None],
    "num_blocks": [0, -1, 2.5, True, "8"],
    "kv_cache_memory": [0, -1, 1.5, False, "1GB"],
    "enable_prefix_caching": [0, 1, "yes", None],
    "preemption_mode": ["", "Swap", "recompute ", None, 0],
    "swap_space_blocks": [-1, 1.0, True, None, "256"],
    "max_num_seqs": [0, -1, 1.0, True, None],
    "max_num_batched_tokens": [0, -5, 2048.0, False, None],
    "max_model_len": [0, -1, 128.0, True, "128"],
    "dtype": ["fp32", "float64", "int8", "", None],
    "kv_cache_dtype": ["int4", "INT8", "", None],
    "quantization": ["int4", "INT8", "fp8", "", None, 8],
    "device": ["", "gpu", "cuda:", "cuda:x", "cpu:0", "CUDA", " cpu", "mps", None, 0],
    "seed": [1.0, "0", None, True, 2**64, -(2**63) - 1],
    "debug_checks": [1, "false", None],
    "request_timeout_s": [0, 0.0, -1, -0.5, math.nan, True, "5"],
    "fast_key_bits": [0, 65, -1, 8.0, True, None],
    "tensor_parallel_size": [0, -1, 2.0, True, None],
    "tensor_parallel_timeout_s": [0, 0.0, -1.0, math.nan, None, True, "20"],
    "enable_lora": [1, "yes", None],
    "quantize_lm_head": [1, "yes", None, True],  # True: only with quantization "int8"
    "kv_layer_groups": [1, "no", None],
    "fast_paths_off": ["gemv", None, (1,), ("gemv", None)],  # names: kvpage.model.kernels
    # its keys and values: kvpage.speculative.config, checked when the engine is built
    "speculative_config": ["ngram", 3, ["ngram"]],
    "max_loras": [0, -1, None, True, 1.5],
    "max_lora_rank": [0, -2, None, False, "16"],
}

# Per field, the edges that must still construct (with the defaults for the rest).
GOOD = {
    "model": ["builtin:tiny-llama", "/models/llama-3.2-1b"],
    "block_size": [1, 16],
    "num_blocks": [None, 1],
    "kv_cache_memory": [None, 1, 512 * 2**20],
    "enable_prefix_caching": [True, False],
    "preemption_mode": list(PREEMPTION_MODES),
    "swap_space_blocks": [0, 1],
    "max_num_seqs": [1],
    "max_num_batched_tokens": [1],
    "max_model_len": [None, 1],
    "dtype": list(MODEL_DTYPES),
    "kv_cache_dtype": list(KV_CACHE_DTYPES),
    "quantization": list(QUANTIZATIONS),
    "device": ["cpu", "cuda", "cuda:0", "cuda:12"],  # syntax only: no CUDA needed here
    "seed": [0, -1, -(2**63), 2**64 - 1],
    "debug_checks": [True, False],
    "request_timeout_s": [None, 1e-3, 5, math.inf],
    "fast_key_bits": [1, 64],
    "tensor_parallel_size": [1, 2],
    "tensor_parallel_timeout_s": [1e-3, 3],
    "enable_lora": [True, False],
    "quantize_lm_head": [False],  # True needs quantization "int8" (tests/model/test_int8_head.py)
    "kv_layer_groups": [True, False],
    "fast_paths_off": [(), ("gemv",), ("gemv", "onednn")],
    "speculative_config": [None, {"method": "ngram", "num_speculative_tokens": 2}],
    "max_loras": [1, 8],
    "max_lora_rank": [1, 64],
}

# Fields whose None means "derive it": 0 must not slip through as a second way of saying that.
DERIVED = ["num_blocks", "kv_cache_memory", "max_model_len", "request_timeout_s"]


def test_the_tables_cover_every_field():
    """A new field without a bad value here is a field nobody checked."""
    names = {f.name for f in fields(EngineConfig)}
    assert set(BAD) == names and set(GOOD) == names


@pytest.mark.parametrize(
    "name, value", [(name, value) for name, values in BAD.items() for value in values]
)
def test_a_bad_value_is_refused_naming_the_field_and_the_value(name, value):
    with pytest.raises(InvalidConfig) as err:
        EngineConfig(**{name: value})
    message = str(err.value)
    assert message.startswith(f"{name} must be "), message
    assert repr(value) in message, message


@pytest.mark.parametrize(
    "name, value", [(name, value) for name, values in GOOD.items() for value in values]
)
def test_a_good_value_constructs(name, value):
    assert getattr(EngineConfig(**{name: value}), name) == value


@pytest.mark.parametrize("name", DERIVED)
def test_zero_is_an_error_never_the_default(name):
    assert getattr(EngineConfig(), name) is None  # the default is "derive it"
    with pytest.raises(InvalidConfig, match=f"{name} must be None or"):
        EngineConfig(**{name: 0})


def test_invalid_config_is_still_a_value_error():
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(block_size=0)


def test_tensor_parallelism_off_cpu_names_both_fields():
    with pytest.raises(InvalidConfig, match="tensor_parallel_size 2 needs device 'cpu'.*'cuda'"):
        EngineConfig(tensor_parallel_size=2, device="cuda")


def test_the_loader_takes_every_config_dtype():
    """The names live in the config; the model package maps exactly those to torch dtypes."""
    from kvpage.model import DTYPES, resolve_dtype

    assert tuple(DTYPES) == MODEL_DTYPES
    assert [str(resolve_dtype(name)) for name in MODEL_DTYPES] == [
        f"torch.{name}" for name in MODEL_DTYPES
    ]


@pytest.mark.parametrize("text", ["cpu:0", "gpu", "cuda:x", "mps"])
def test_the_cli_refuses_what_the_config_refuses(text):
    """--device is parsed by torch, which takes more than EngineConfig does (`cpu:0`): the flag
    is refused on the command line, not by the config after the parser said yes."""
    from kvpage.cli.common import device

    with pytest.raises(argparse.ArgumentTypeError, match="only cpu, cuda and cuda:N"):
        device(text)
    with pytest.raises(InvalidConfig, match="device"):
        EngineConfig(device=text)


def test_every_gate_case_and_mutant_config_is_valid():
    """The gate counts a crash as a caught mutant: a config the checks now refuse would make a
    mutant 'caught' without any suite seeing its bug."""
    from kvpage.verify.cases import build_suites
    from kvpage.verify.mutants import MUTANTS

    cases = build_suites(256, kv_cache_dtypes=("int8", "fp8_e4m3"))
    assert cases and MUTANTS
    for case in cases:
        for mutant in [None, *MUTANTS]:
            overrides = {**case.engine, **(mutant.config if mutant else {})}
            EngineConfig(model="builtin:tiny-llama", debug_checks=False, **overrides)

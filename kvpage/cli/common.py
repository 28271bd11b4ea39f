"""What every command's parser shares: one-line usage errors, checked argument types, the model
and tensor-parallel flags, and the engine flags `serve` and `verify` both take (defined once
here, so the configuration a user verifies is spelled exactly as the one they serve)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

from kvpage.config import (
    DEVICE_SYNTAX,
    KV_CACHE_DTYPES,
    MODEL_DTYPES,
    PREEMPTION_MODES,
    QUANTIZATIONS,
)
from kvpage.errors import InvalidConfig, KVPageError
from kvpage.speculative.config import SpeculativeConfig

ADMIN_TOKEN_ENV = "KVPAGE_ADMIN_TOKEN"


class CliError(KVPageError):
    """A bad command line: printed as one `error:` line, exit status 2 (`main` catches it before
    other KVPageErrors, so its line has no class name: the message names the flag)."""


class Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in --help, except None and flags (nothing useful to show)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or isinstance(action.default, bool):
            return action.help or ""
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """Usage errors become one line in `main` instead of usage text and a SystemExit."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise CliError(f"{self.prog}: {message} (see {self.prog} --help)")


# --- argument types: checked while parsing, so before anything loads ------------------------
def number(kind: type, low: float | None = None, high: float | None = None) -> Callable:
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None
        if (low is not None and value < low) or (high is not None and value > high):
            bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {text}")
        return value

    return parse


count = number(int, 1)

port = number(int, 1, 65535)

fraction = number(float, 0.0, 1.0)


def token_ids(text: str) -> list[int]:
    ids = []
    for part in text.split(","):
        if part.strip():
            if not part.strip().isdigit():
                raise argparse.ArgumentTypeError(f"{part.strip()!r} is not a token id")
            ids.append(int(part))
    if not ids:
        raise argparse.ArgumentTypeError("no token ids")
    return ids


def speculative_config(text: str) -> dict:
    """vLLM's --speculative-config: a JSON object, checked as the engine will check it, so a bad
    key or value stops the command before the model loads."""
    try:
        config = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not valid JSON ({err}): {text!r}") from None
    if not isinstance(config, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    try:
        SpeculativeConfig.from_dict(config)
    except InvalidConfig as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return config


def device(text: str) -> str:
    """A device this machine has: `--device cuda` without CUDA fails here, not in the loader."""
    if not DEVICE_SYNTAX.fullmatch(text):  # what EngineConfig takes (torch takes more: cpu:0)
        raise argparse.ArgumentTypeError(f"{text}: only cpu, cuda and cuda:N devices are supported")
    if text == "cpu":
        return text
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise argparse.ArgumentTypeError(f"{text}: CUDA is not available on this machine")
    index = torch.device(text).index
    if index is not None and index >= count:
        raise argparse.ArgumentTypeError(f"{text}: this machine has {count} CUDA device(s)")
    return text


def add_model_args(
    p: argparse.ArgumentParser,
    model: str | None = "builtin:tiny-llama",
    dtype: str | None = "float32",
    device_name: str | None = "cpu",
) -> None:
    p.add_argument("--model", default=model, help="builtin:NAME or a Hugging Face directory")
    p.add_argument("--dtype", default=dtype, choices=MODEL_DTYPES, help="weights and KV")
    p.add_argument("--device", type=device, default=device_name, help="cpu, cuda or cuda:N")


def add_tensor_parallel(p: argparse.ArgumentParser, default: int | None = 1) -> None:
    p.add_argument(
        "--tensor-parallel-size",
        type=count,
        default=default,
        help="processes the model is split across (gloo; 1: this process only)",
    )


# --- the engine flags of `serve` and `verify` ----------------------------------------------
@dataclass(frozen=True, slots=True)
class EngineFlag:
    """One engine flag, named by its dest (`--block-size`: block_size, the EngineConfig field it
    sets unless it `negates` one)."""

    default: object  # serve's (the engine's); `verify` leaves every flag unset unless given
    options: dict  # add_argument's; empty where add_model_args or add_tensor_parallel adds it
    negates: str | None = None  # the field the flag sets to its negation


def _flag(default: object, negates: str | None = None, **options) -> EngineFlag:
    return EngineFlag(default, options, negates)


ENGINE_FLAGS: dict[str, EngineFlag] = {
    "model": _flag("builtin:tiny-llama"),
    "dtype": _flag("float32"),
    "device": _flag("cpu"),
    "tensor_parallel_size": _flag(1),
    "block_size": _flag(16, type=count, help="tokens per KV block"),
    "num_blocks": _flag(
        None, type=count, help="KV pool blocks (default: sized from the model and --max-num-seqs)"
    ),
    "max_num_seqs": _flag(64, type=count, help="requests per step"),
    "max_num_batched_tokens": _flag(2048, type=count, help="per step"),
    "no_prefix_caching": _flag(
        False, "enable_prefix_caching", action="store_true", help="never share KV blocks"
    ),
    "kv_cache_dtype": _flag(
        "auto",
        choices=KV_CACHE_DTYPES,
        help="how the KV pool stores K/V (auto: the model dtype; int8/fp8_e4m3: quantized)",
    ),
    "quantization": _flag(
        "none",
        choices=QUANTIZATIONS,
        help="the linear layers' weights (none: the model dtype; int8: per-output-channel "
        "weight-only int8, CPU)",
    ),
    "quantize_lm_head": _flag(
        False,
        action="store_true",
        help="the LM head in int8 too (needs --quantization int8; a tied embedding stays float)",
    ),
    "preemption_mode": _flag(
        "recompute", choices=PREEMPTION_MODES, help="what happens to a preempted request's KV"
    ),
    "enable_lora": _flag(False, action="store_true", help="serve LoRA adapters (vLLM's flag)"),
    "max_loras": _flag(1, type=count, help="adapters resident at once"),
    "max_lora_rank": _flag(16, type=count, help="the largest adapter rank served"),
    "speculative_config": _flag(
        None,
        type=speculative_config,
        metavar="JSON",
        help='speculative decoding, vLLM\'s JSON object: {"method": "ngram", '
        '"num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4} or '
        '{"method": "draft_model", "num_speculative_tokens": 3, "model": null, '
        '"quantization": "int8"} (the target\'s own int8 copy as its draft)',
    ),
}


def add_engine_args(p: argparse.ArgumentParser, defaults: bool = True) -> None:
    """The flags that shape the engine. `defaults=False`: every flag defaults to None, so the
    command can tell what the user gave (`verify` verifies that and chooses the rest)."""

    def default(dest: str):
        return ENGINE_FLAGS[dest].default if defaults else None

    add_model_args(p, default("model"), default("dtype"), default("device"))
    add_tensor_parallel(p, default("tensor_parallel_size"))
    for dest, flag in ENGINE_FLAGS.items():
        if flag.options:
            add_engine_flag(p, dest, default=default(dest))


def add_engine_flag(p: argparse.ArgumentParser, dest: str, **options) -> None:
    """Engine flag `dest` as serve takes it, `options` (default, help, ...) over its own."""
    flag = ENGINE_FLAGS[dest]
    options = {"default": flag.default, **flag.options, **options}
    p.add_argument("--" + dest.replace("_", "-"), **options)


def engine_fields(args: argparse.Namespace) -> dict:
    """The EngineConfig fields the engine flags set (an unset flag, None, sets nothing)."""
    fields = {}
    for dest, flag in ENGINE_FLAGS.items():
        value = getattr(args, dest)
        if value is not None:
            fields[flag.negates or dest] = not value if flag.negates else value
    return fields


def reason(err: Exception) -> str:
    return err.strerror if isinstance(err, OSError) and err.strerror else type(err).__name__

"""What every command's parser shares: one-line usage errors, checked argument types, the model
and tensor-parallel flags."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import NoReturn

from kvpage.config import DEVICE_SYNTAX, MODEL_DTYPES
from kvpage.errors import KVPageError

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


def add_model_args(p: argparse.ArgumentParser, model: str = "builtin:tiny-llama") -> None:
    p.add_argument("--model", default=model, help="builtin:NAME or a Hugging Face directory")
    p.add_argument("--dtype", default="float32", choices=MODEL_DTYPES, help="weights and KV")
    p.add_argument("--device", type=device, default="cpu", help="cpu, cuda or cuda:N")


def add_tensor_parallel(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tensor-parallel-size",
        type=count,
        default=1,
        help="processes the model is split across (gloo; 1: this process only)",
    )


def reason(err: Exception) -> str:
    return err.strerror if isinstance(err, OSError) and err.strerror else type(err).__name__

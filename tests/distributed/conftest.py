"""Fixtures for tensor-parallel tests: HF random-weight checkpoints (wide init, the oracle of
tests/model) and engines that are always shut down, so no worker process outlives a test."""

from __future__ import annotations

import contextlib

import pytest

from kvpage.config import EngineConfig
from kvpage.engine.engine import LLMEngine
from tests.model.hf_models import save_hf

TP_MODELS = (
    "llama-gqa-8q-2kv",
    "llama-mha",
    "gpt2",
    "qwen3",
    "phi3-partial-tied",
    "mistral-window",
    "qwen2-window",
    "gemma3",
    "smollm3",
    "llama3.2",
)


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory):
    """name -> (HF model, directory of its save_pretrained output)."""
    out = {}
    for name in TP_MODELS:
        directory = tmp_path_factory.mktemp(name)
        out[name] = (save_hf(name, directory), directory)
    return out


@contextlib.contextmanager
def engine_for(config: EngineConfig):
    engine = LLMEngine(config)
    try:
        yield engine
    finally:
        engine.shutdown()


def children_alive(pids: list[int]) -> list[int]:
    """The pids that still name a running (not zombie) process."""
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            continue
        if state != "Z":
            alive.append(pid)
    return alive

"""The server over a tensor-parallel engine: the banner says how the model is split, and a
greedy completion gives the one-process engine's tokens."""

from __future__ import annotations

import httpx

from kvpage import EngineConfig, LLMEngine
from kvpage.server import ServerOptions, create_app
from kvpage.server.background import BackgroundServer

MODEL = "builtin:tiny-llama"
PROMPT = [5, 17, 99, 3, 42, 7, 250, 11]


def _serve_tokens(tensor_parallel_size: int) -> tuple[list[str], list[int]]:
    engine = LLMEngine(
        EngineConfig(model=MODEL, num_blocks=64, tensor_parallel_size=tensor_parallel_size)
    )
    app = create_app(engine, ServerOptions(model_name=MODEL))
    try:
        with BackgroundServer(app) as bg:
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                    "ignore_eos": True, "logprobs": 1}  # fmt: skip
            r = httpx.post(f"{bg.url}/v1/completions", json=body, timeout=60)
            r.raise_for_status()
            tokens = r.json()["choices"][0]["logprobs"]["tokens"]
        return app.state.server.describe(), tokens
    finally:
        engine.shutdown()


def test_tp2_server_describes_the_split_and_serves_the_one_process_tokens():
    banner1, tokens1 = _serve_tokens(1)
    banner2, tokens2 = _serve_tokens(2)
    assert "tensor parallel" not in banner1[0]
    assert banner2[0].endswith(", tensor parallel over 2 processes (gloo))")
    assert len(tokens1) == 12
    assert tokens2 == tokens1

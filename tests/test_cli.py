from __future__ import annotations

import subprocess
import sys

from kvpage import SamplingParams
from kvpage.model import load_model
from kvpage.verify.reference import generate


def test_cli_generate_prints_text_and_ids():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvpage.cli",
            "generate",
            "--model",
            "builtin:tiny-llama",
            "--prompt",
            "hello",
            "--max-tokens",
            "8",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    model, tok = load_model("builtin:tiny-llama")
    expected = generate(model, tok.encode("hello"), SamplingParams(max_tokens=8)).token_ids
    assert f"token_ids: {expected}" in proc.stdout
    assert "text: " in proc.stdout

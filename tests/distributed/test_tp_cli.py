"""`--tensor-parallel-size` on the CLI: `generate` through a TP=2 engine prints what the
one-process path (the contiguous reference) prints."""

from __future__ import annotations

from kvpage.cli import main


def _generate(capsys, *extra: str) -> str:
    argv = ["generate", "--model", "builtin:tiny-gpt2", "--prompt", "tensor parallel"]
    assert main([*argv, "--max-tokens", "16", "--ignore-eos", *extra]) == 0
    return capsys.readouterr().out


def test_generate_tp2_prints_the_same_tokens(capsys):
    one = _generate(capsys)
    two = _generate(capsys, "--tensor-parallel-size", "2")
    assert "token_ids: [" in one
    assert two == one

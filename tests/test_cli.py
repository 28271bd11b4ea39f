from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import torch

from kvpage import SamplingParams
from kvpage.cli import main
from kvpage.model import load_model
from kvpage.reference.generator import generate


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


# --- command-line honesty: one `error:` line, exit status 2, before the model loads ---------
@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if the command gets as far as loading a model."""

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the command line was checked")

    monkeypatch.setattr("kvpage.model.load_model", load)
    monkeypatch.setattr("kvpage.engine.engine.LLMEngine", load)


def _fails(capsys, argv: list[str], *expected: str) -> str:
    assert main(argv) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


def test_missing_api_keys_file(capsys, no_model, tmp_path):
    _fails(capsys, ["serve", "--api-keys", str(tmp_path / "nope")], "--api-keys", "nope")


@pytest.mark.parametrize(
    "text", ["k1 alice extra\n", "{not json", '{"k1": 3}', "", '{"k": "a", "k": "b"}']
)
def test_malformed_api_keys_file(capsys, no_model, tmp_path, text):
    keys = tmp_path / "keys"
    keys.write_text(text)
    line = _fails(capsys, ["serve", "--api-keys", str(keys)], "--api-keys", str(keys))
    assert "k1" not in line  # a key is never echoed


def test_unwritable_audit_log(capsys, no_model, tmp_path):
    path = tmp_path / "no-such-dir" / "audit.jsonl"
    _fails(capsys, ["serve", "--audit-log", str(path)], "--audit-log", "cannot write")
    _fails(capsys, ["serve", "--audit-log", str(tmp_path)], "--audit-log")  # a directory


@pytest.mark.parametrize("port", ["99999", "0", "http", "-1"])
def test_bad_port(capsys, no_model, port):
    _fails(capsys, ["serve", "--port", port], "--port")


def test_port_in_use(capsys, no_model):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = str(taken.getsockname()[1])
        _fails(capsys, ["serve", "--port", port], "--port", port, "cannot listen")


@pytest.mark.parametrize("command", [["generate", "--prompt-ids", "1"], ["serve"]])
def test_cuda_without_cuda(capsys, no_model, monkeypatch, command):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _fails(capsys, [*command, "--device", "cuda"], "--device", "CUDA is not available")
    _fails(capsys, [*command, "--device", "tpu"], "--device")


@pytest.mark.parametrize("ids", ["1,a", "", "1,,-2", "1.5"])
def test_bad_prompt_ids(capsys, no_model, ids):
    _fails(capsys, ["generate", "--prompt-ids", ids], "--prompt-ids")


def test_bad_values_name_their_flag(capsys, no_model):
    _fails(capsys, ["generate", "--prompt-ids", "1", "--max-tokens", "0"], "--max-tokens")
    _fails(capsys, ["serve", "--dtype", "float8"], "--dtype", "float32")
    _fails(capsys, ["serve", "--shadow-rate", "2"], "--shadow-rate")
    _fails(capsys, ["serve", "--max-body-bytes", "0"], "--max-body-bytes")
    _fails(capsys, ["serve", "--shutdown-timeout", "-1"], "--shutdown-timeout")
    _fails(capsys, ["serve", "--bogus"], "unrecognized arguments")
    _fails(capsys, ["serve", "--admin-token", "a", "--admin-token-file", "f"], "not allowed")


def test_help_shows_defaults_and_choices(capsys):
    with pytest.raises(SystemExit) as done:
        main(["serve", "--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for shown in (
        "(default: 8000)",
        "(default: 4194304)",
        "(default: 10.0)",
        "{float32,float16,bfloat16}",
        "{recompute,swap}",
        "KVPAGE_ADMIN_TOKEN",
    ):
        assert shown in text, shown


# --- kvpage serve: what it says it serves, and where the admin token comes from --------------
@pytest.fixture
def served(monkeypatch, tmp_path) -> list:
    """Apps `kvpage serve` would have served (the server itself is not started), from a scratch
    working directory: the default audit log is written there."""
    monkeypatch.chdir(tmp_path)
    apps: list = []
    monkeypatch.setattr("kvpage.server.background.serve", lambda app, *a, **k: apps.append(app))
    monkeypatch.delenv("KVPAGE_ADMIN_TOKEN", raising=False)
    return apps


def _serve(argv: list[str]) -> list[str]:
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = str(s.getsockname()[1])
    return ["serve", "--num-blocks", "32", "--port", port, *argv]


def test_serve_prints_what_it_serves(capsys, served, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("sk-alpha alice\nsk-beta bob\nsk-gamma bob\n")
    token = tmp_path / "token"
    token.write_text("tok-secret\n")
    argv = _serve(["--api-keys", str(keys), "--admin-token-file", str(token)])
    assert main([*argv, "--no-prefix-caching"]) == 0
    out = capsys.readouterr().out
    for shown in (
        "builtin:tiny-llama",
        "float32",
        "32 blocks x 16 tokens",
        "MiB",
        "prefix caching: off",
        "auth: on",
        "2 tenants: alice, bob",
        "admin API: on",
        "audit log: kvpage-audit.jsonl",
    ):
        assert shown in out, (shown, out)
    assert not any(secret in out for secret in ("sk-alpha", "sk-beta", "sk-gamma", "tok-secret"))
    assert served[0].state.server.options.admin_token == "tok-secret"


def test_serve_open_server_summary_and_token_from_env(capsys, served, monkeypatch):
    monkeypatch.setenv("KVPAGE_ADMIN_TOKEN", "from-env")
    assert main(_serve([])) == 0
    out = capsys.readouterr().out
    assert "auth: off" in out and "prefix caching: on" in out and "from-env" not in out
    assert served[0].state.server.options.admin_token == "from-env"
    assert main(_serve(["--admin-token", "flag"])) == 0  # the flag wins over the environment
    assert served[1].state.server.options.admin_token == "flag"
    monkeypatch.setenv("KVPAGE_ADMIN_TOKEN", "")
    assert main(_serve([])) == 0
    assert served[2].state.server.options.admin_token is None


def test_admin_token_file_problems(capsys, no_model, tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    _fails(capsys, ["serve", "--admin-token-file", str(empty)], "empty")
    _fails(capsys, ["serve", "--admin-token-file", str(tmp_path / "nope")], "cannot read")

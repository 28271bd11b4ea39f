"""`--speculative-config JSON` (vLLM's flag) on `kvpage serve` and `kvpage generate`: a bad one
is one `error:` line naming the flag and the problem, before the model loads; a good one reaches
the engine (serve's, and the replicas' config built from the same flags), and `generate`'s
speculating engine prints the reference's greedy tokens."""

from __future__ import annotations

import json
import socket

import pytest

from kvpage import SamplingParams
from kvpage.cli import build_parser, main
from kvpage.cli import serve as serve_cli
from kvpage.model import load_model
from kvpage.reference.generator import generate

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
FLAG = "--speculative-config"


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if the command gets as far as loading a model."""

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the command line was checked")

    monkeypatch.setattr("kvpage.model.load_model", load)
    monkeypatch.setattr("kvpage.engine.engine.LLMEngine", load)


def _error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert FLAG in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("command", [["serve"], ["generate", "--prompt-ids", "1,2"]])
@pytest.mark.parametrize(
    ("config", "problem"),
    [
        ('{"method": "ngram",', "not valid JSON"),
        ('["ngram", 3]', "expected a JSON object"),
        ('{"method": "eagle", "num_speculative_tokens": 3}', "'eagle'"),
        ('{"method": "ngram"}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "draft_tp": 1}', "draft_tp"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
            '"prompt_lookup_max": 2}',
            "prompt_lookup_min",
        ),
    ],
)
def test_a_bad_config_names_the_flag_and_the_problem(capsys, no_model, command, config, problem):
    line = _error(capsys, [*command, FLAG, config])
    assert problem in line, line


def test_serve_passes_the_config_to_its_engine(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # the default audit log is written here
    apps: list = []
    monkeypatch.setattr("kvpage.server.background.serve", lambda app, *a, **k: apps.append(app))
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = str(s.getsockname()[1])
    argv = ["serve", "--num-blocks", "32", "--port", port, FLAG, json.dumps(SPEC)]
    assert main(argv) == 0
    engine = apps[0].state.server.loop.engine
    assert engine.config.speculative_config == SPEC
    assert engine.speculation is not None and engine.speculation.k == 3
    assert engine.speculation.config.prompt_lookup_min == 1
    assert "speculative decoding: " in capsys.readouterr().out
    # --replicas N builds each replica's EngineConfig from the same flags
    assert serve_cli._engine_config(build_parser().parse_args(argv)).speculative_config == SPEC
    assert serve_cli._engine_config(build_parser().parse_args(argv[:5])).speculative_config is None


def test_generate_speculates_and_prints_the_references_greedy_tokens(capsys):
    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]
    argv = ["generate", "--prompt-ids", ",".join(map(str, prompt)), "--max-tokens", "20"]
    assert main([*argv, "--ignore-eos", FLAG, json.dumps(SPEC)]) == 0
    out = capsys.readouterr().out
    model, _ = load_model("builtin:tiny-llama")
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    expected = generate(model, prompt, params).token_ids
    assert f"token_ids: {expected}" in out
    (line,) = [line for line in out.splitlines() if line.startswith("speculative: ")]
    accepted, _, drafted = line.removeprefix("speculative: ").split()[:3]
    assert 0 < int(accepted) <= int(drafted)

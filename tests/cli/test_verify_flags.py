"""`kvpage verify` takes `kvpage serve`'s engine flags, and turns them into the configuration
the gate runs: one cell with --model, the matrix with the given dimensions fixed without it."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from kvpage.cli import build_parser, main
from kvpage.cli import serve as serve_cli
from kvpage.cli import verify as verify_cli
from kvpage.cli.common import ENGINE_FLAGS, engine_fields
from kvpage.config import EngineConfig
from kvpage.verify import matrix
from kvpage.verify.cases import ALL_SUITES

ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}


def _subparser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _engine_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Actions that set an EngineConfig field: by name, or through ENGINE_FLAGS."""
    return {a.dest: a for a in parser._actions if a.dest in ENGINE_FIELDS or a.dest in ENGINE_FLAGS}


def test_every_engine_flag_of_serve_is_a_verify_flag_spelled_the_same():
    served, verified = _engine_actions(_subparser("serve")), _engine_actions(_subparser("verify"))
    assert set(served) >= {"model", "dtype", "kv_cache_dtype", "block_size", "num_blocks"}
    assert set(served) >= {"tensor_parallel_size", "preemption_mode", "max_num_seqs"}
    missing = set(served) - set(verified)
    assert not missing, f"serve shapes the engine with {missing}; verify does not take them"
    for dest, action in served.items():
        other = verified[dest]
        assert other.option_strings == action.option_strings, dest
        assert other.choices == action.choices and other.type == action.type, dest
        assert other.default is None, f"verify --{dest}: unset must mean 'not given'"


def test_serve_builds_its_engine_config_from_the_shared_fields():
    argv = ["serve", "--block-size", "8", "--num-blocks", "40", "--no-prefix-caching"]
    argv += ["--kv-cache-dtype", "int8", "--preemption-mode", "swap", "--max-num-seqs", "3"]
    args = build_parser().parse_args(argv)
    cfg = serve_cli._engine_config(args)
    assert (cfg.block_size, cfg.num_blocks, cfg.enable_prefix_caching) == (8, 40, False)
    assert (cfg.kv_cache_dtype, cfg.preemption_mode, cfg.max_num_seqs) == ("int8", "swap", 3)
    assert serve_cli._engine_config(build_parser().parse_args(["serve"])) == EngineConfig()


def _planned(monkeypatch, argv: list[str]) -> tuple[list, dict]:
    """What `kvpage verify ARGV` would run: its cells and the base engine (nothing runs)."""
    seen = {}

    def fake_run(cells, base, jobs, progress, **stages):
        seen.update(cells=list(cells), base=base)
        raise SystemExit(0)

    monkeypatch.setattr(matrix, "run_matrix", fake_run)
    with pytest.raises(SystemExit):
        main(["verify", "--quiet", *argv])
    return seen["cells"], seen["base"]


def test_no_model_runs_the_default_matrix(monkeypatch):
    cells, base = _planned(monkeypatch, [])
    assert cells == list(matrix.DEFAULT) and base == {}


def test_a_model_is_one_cell_with_the_users_configuration(monkeypatch):
    argv = ["--model", "builtin:passphrase-mini", "--dtype", "bfloat16", "--kv-cache-dtype"]
    argv += ["fp8_e4m3", "--block-size", "32", "--no-prefix-caching", "--no-mutants"]
    cells, base = _planned(monkeypatch, argv)
    (cell,) = cells
    assert (cell.model, cell.dtype, cell.kv_cache_dtype) == (
        "builtin:passphrase-mini",
        "bfloat16",
        "fp8_e4m3",
    )
    assert cell.suites == ALL_SUITES and cell.mutants == "none" and cell.kv_copies == ()
    assert base == {"block_size": 32, "enable_prefix_caching": False}  # the rest is the cell's
    engine = cell.engine(base)
    assert engine["kv_cache_dtype"] == "fp8_e4m3" and engine["block_size"] == 32


def test_a_dimension_given_without_model_is_fixed_in_every_cell(monkeypatch):
    cells, _ = _planned(monkeypatch, ["--tensor-parallel-size", "2", "--suite", "batching"])
    assert cells and all(c.tensor_parallel_size == 2 for c in cells)
    assert all(c.suites == ("batching",) for c in cells)
    keys = [
        (c.model, c.dtype, c.kv_cache_dtype, c.quantization, c.paths_off, c.speculative)
        for c in cells
    ]
    assert len(keys) == len(set(keys))
    # a draft model runs in one process: the self-draft cell is dropped under TP 2
    assert "self-int8" not in {c.speculative for c in cells}


def test_quantization_is_a_cell_dimension_and_an_engine_flag(monkeypatch):
    cells, _ = _planned(monkeypatch, ["--quantization", "int8", "--suite", "batching"])
    assert cells and all(c.quantization == "int8" for c in cells)
    assert all(c.engine({})["quantization"] == "int8" for c in cells)
    (one,), _ = _planned(monkeypatch, ["--model", "builtin:tiny-qwen2", "--quantization", "int8"])
    assert one.quantization == "int8" and "/w-int8/" in one.name
    args = build_parser().parse_args(["serve", "--quantization", "int8"])
    assert engine_fields(args)["quantization"] == "int8"


def test_model_with_matrix_runs_the_matrix_on_that_model(monkeypatch):
    cells, _ = _planned(monkeypatch, ["--model", "builtin:tiny-gpt2", "--matrix", "full"])
    assert len(cells) > 1 and {c.model for c in cells} == {"builtin:tiny-gpt2"}


def test_engine_fields_sets_only_what_was_given():
    args = build_parser().parse_args(["verify", "--max-num-batched-tokens", "64"])
    assert engine_fields(args) == {"max_num_batched_tokens": 64}
    assert verify_cli.CELL_FIELDS == (
        "dtype",
        "kv_cache_dtype",
        "quantization",
        "quantize_lm_head",
        "tensor_parallel_size",
    )

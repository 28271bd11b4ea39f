"""The verification matrix: which cells exist, what runs where, and one report for all of it."""

from __future__ import annotations

import itertools
import json

import pytest

from kvpage.verify import matrix
from kvpage.verify.cases import SUITES
from kvpage.verify.gate import GatePlan
from kvpage.verify.matrix import DEFAULT, MAIN, Cell, MatrixResult, full_cells, pin, run_matrix
from kvpage.verify.mutants import MUTANTS
from kvpage.verify.mutants.layer_groups import LAYER_GROUP_MUTANTS
from kvpage.verify.report import summary_table, write_reports
from kvpage.verify.suites import Runtime

FORMAT_BOUND = {m.name for m in MUTANTS if m.kv_cache_dtype == "int8"}


def _formats(cell: Cell) -> set[str]:
    return {cell.kv_cache_dtype, *cell.kv_copies} - {None}


def test_default_matrix_covers_every_value_of_every_dimension():
    assert DEFAULT[0] == MAIN and MAIN.mutants == "all" and MAIN.suites == SUITES
    # tiny-gpt2 in the int8-head cell alone: its tied head is the int8 copy beside the embedding
    extra = {matrix.HYBRID.model, matrix.INT8_HEAD.model}
    assert {c.model for c in DEFAULT} == {*matrix.MODELS, *extra}
    # the layer-group suite and mutants, on the one model that has global and window layers
    assert [c for c in DEFAULT if c.mutants == "groups"] == [matrix.HYBRID]
    assert matrix.HYBRID.mutant_names() == tuple(m.name for m in LAYER_GROUP_MUTANTS)
    assert {c.dtype for c in DEFAULT} == set(matrix.DTYPES)
    assert set().union(*map(_formats, DEFAULT)) == set(matrix.KV_DTYPES)
    assert {c.tensor_parallel_size for c in DEFAULT} == set(matrix.TP_SIZES)
    qwen = [c for c in DEFAULT if c.model == "builtin:tiny-qwen2"]
    assert {c.tensor_parallel_size for c in qwen} == {1, 2}  # biases sharded, not only local
    # the hand-written mutation check runs once; the generated and stack cells run their own
    assert [c.mutants for c in DEFAULT if c.suites].count("all") == 1
    assert [c for c in DEFAULT if not c.suites] == [matrix.GENERATED, matrix.STACK]
    assert matrix.GENERATED.generated and matrix.STACK.stack
    int8 = [c for c in DEFAULT if c.quantization == "int8"]
    assert int8 == [
        matrix.INT8_WEIGHTS,
        matrix.INT8_WEIGHTS_TP2,
        matrix.INT8_WIDENED,
        matrix.INT8_HEAD,
    ]
    assert matrix.INT8_WEIGHTS_TP2.tensor_parallel_size == 2  # int8 shards, LoRA on them
    assert "lora" in matrix.INT8_WEIGHTS_TP2.suites
    assert 2 <= len(int8[0].suites) <= 3
    assert matrix.INT8_WIDENED.paths_off == ("gemv",) and "/off-gemv" in matrix.INT8_WIDENED.name
    assert "/w-int8/" in int8[0].name and int8[0].engine({})["quantization"] == "int8"
    assert "quantize_lm_head" not in int8[0].engine({})  # the head stays float by default
    head = matrix.INT8_HEAD
    assert head.quantize_lm_head and len(head.suites) == 1 and "/w-int8+head/" in head.name
    assert head.engine({})["quantize_lm_head"] is True
    assert "quantization" not in MAIN.engine({})  # unquantized cells' engines are unchanged


def test_pin_keeps_the_generated_and_stack_cells_only_when_their_part_is_asked_for():
    names = [c.name for c in pin(DEFAULT, {}, (*SUITES, *matrix.PARTS))]
    assert any(n.endswith("+generated") for n in names) and any(n.endswith("+stack") for n in names)
    only = pin(DEFAULT, {}, ("generated",))
    assert [(c.generated, c.stack, c.suites) for c in only] == [(True, False, ())]
    assert not any(c.generated or c.stack for c in pin(DEFAULT, {}, SUITES))


def test_full_matrix_is_every_combination_once():
    weights = [c for c in full_cells() if c.quantization != "none"]
    assert [(c.quantization, c.quantize_lm_head, c.paths_off, c.suites) for c in weights] == [
        ("int8", False, (), SUITES),
        ("int8", False, (), SUITES),  # TP 2
        ("int8", False, ("gemv",), SUITES),
        ("int8", True, (), SUITES),
    ]
    hybrid = [c for c in full_cells() if c.model == matrix.HYBRID.model]
    assert hybrid == [matrix.HYBRID]
    speculative = [c for c in full_cells() if c.speculative]
    assert speculative == [matrix.SPECULATIVE, matrix.SPECULATIVE_INT8]
    others = (*weights, *hybrid, *speculative)
    cells = [c for c in full_cells() if not (c.generated or c.stack or c in others)]
    assert full_cells()[-2:] == (matrix.GENERATED, matrix.STACK)
    keys = [(c.model, c.dtype, c.kv_cache_dtype, c.tensor_parallel_size) for c in cells]
    assert len(keys) == len(set(keys))
    expected = {
        k
        for k in itertools.product(matrix.MODELS, matrix.DTYPES, matrix.KV_DTYPES, matrix.TP_SIZES)
        if not (k[1] == "bfloat16" and k[2] == "bfloat16")  # that cast is the auto cell
    }
    assert set(keys) == expected and len(cells) == 28
    assert all(c.suites == SUITES for c in cells)
    assert [c for c in cells if c.mutants == "all"] == [MAIN]


def test_format_mutants_run_only_where_their_format_is_the_pool():
    cells = full_cells()
    fmt = [c for c in cells if c.mutants == "format" and c.quantization == "none"]
    assert {c.kv_cache_dtype for c in fmt} == {"bfloat16", "int8", "fp8_e4m3"}
    int8 = next(c for c in fmt if c.kv_cache_dtype == "int8")
    assert set(int8.mutant_names()) == FORMAT_BOUND and FORMAT_BOUND
    fp8 = next(c for c in fmt if c.kv_cache_dtype == "fp8_e4m3")
    assert fp8.mutant_names() == ()  # no mutant is bound to fp8: nothing to run there
    assert Cell("m").mutant_names() is False and MAIN.mutant_names() is True
    with pytest.raises(ValueError):
        Cell("m", mutants="some")


def test_weight_bound_mutants_run_on_the_int8_weights_cell_only():
    bound = {m.name for m in MUTANTS if m.weights == "int8"}
    assert bound == {"lora_int8_delta_times_scales"}
    assert set(matrix.INT8_WEIGHTS.mutant_names()) == bound and "lora" in matrix.INT8_WEIGHTS.suites
    full = [c for c in full_cells() if c.mutants == "format" and c.quantization == "int8"]
    assert [set(c.mutant_names()) for c in full] == [bound, bound]  # TP 1 and TP 2
    kv_int8 = next(c for c in full_cells() if c.mutants == "format" and c.kv_cache_dtype == "int8")
    assert not bound & set(kv_int8.mutant_names())
    mutant = next(m for m in MUTANTS if m.weights == "int8")

    def plan(engine):
        return GatePlan("m", SUITES, True, (), "float32", 1, engine)

    assert plan({"quantization": "int8"}).wants(mutant) and not plan({}).wants(mutant)
    assert not plan({"quantization": "none", "kv_cache_dtype": "int8"}).wants(mutant)


def test_gate_plan_selects_format_mutants_by_the_pool_or_its_copies():
    bound = next(m for m in MUTANTS if m.kv_cache_dtype == "int8")
    free = next(m for m in MUTANTS if m.kv_cache_dtype is None)

    def plan(mutants=True, copies=(), engine=None):
        return GatePlan("m", SUITES, mutants, copies, "float32", 1, engine or {})

    assert plan(copies=("int8",)).wants(bound) and plan(copies=("int8",)).wants(free)
    assert plan(engine={"kv_cache_dtype": "int8"}).wants(bound)
    assert not plan().wants(bound) and not plan(engine={"kv_cache_dtype": "fp8_e4m3"}).wants(bound)
    assert not plan(mutants=False).wants(free)
    assert plan(mutants=(free.name,)).wants(free) and not plan(mutants=(free.name,)).wants(bound)


def test_pin_fixes_dimensions_narrows_suites_and_drops_duplicates():
    cells = pin(DEFAULT, {"dtype": "bfloat16"}, ("batching",), mutants=False)
    assert cells and all(c.dtype == "bfloat16" and c.suites == ("batching",) for c in cells)
    assert all(c.mutants == "none" for c in cells)
    keys = [
        (c.model, c.kv_cache_dtype, c.tensor_parallel_size, c.quantization, c.paths_off)
        + (c.speculative,)
        for c in cells
    ]
    assert len(keys) == len(set(keys))  # tiny-llama/bfloat16 folded into the main cell
    assert pin(DEFAULT, {}, ("namespaces",)) == [
        Cell(
            c.model,
            c.dtype,
            c.kv_cache_dtype,
            c.tensor_parallel_size,
            ("namespaces",),
            c.mutants,
            c.kv_copies,
            model_check="none",  # "model" not among the suites asked for
            speculative=c.speculative,
        )
        for c in DEFAULT
        if "namespaces" in c.suites
    ]
    model_only = pin(DEFAULT, {}, ("model",))
    assert model_only[0].model_check == "full" and not model_only[0].kv_copies
    assert all(not c.suites and c.model_check != "none" for c in model_only)


class _Capture:
    def __init__(self) -> None:
        self.configs = []

    def __call__(self, cfg):
        self.configs.append(cfg)
        return cfg


def test_runtime_base_engine_under_the_cases_own_fields():
    capture = _Capture()
    base = {"block_size": 32, "kv_cache_dtype": "int8", "max_num_seqs": 5, "debug_checks": False}
    rt = Runtime(None, None, "builtin:tiny-llama", engine_factory=capture, engine=base)
    cfg = rt.make_engine({"block_size": 8, "num_blocks": 14})
    assert (cfg.block_size, cfg.num_blocks) == (8, 14)  # the case's own: the point of the case
    assert (cfg.kv_cache_dtype, cfg.max_num_seqs) == ("int8", 5)  # the user's where it set none
    assert cfg.debug_checks is True  # the gate decides that, not the configuration
    assert rt.make_engine({"kv_cache_dtype": "auto"}).kv_cache_dtype == "auto"  # control run


def _cell_result(passed: bool, caught: bool, seconds: float, names=("a",)) -> dict:
    mutant = {
        "caught": caught,
        "attribution_ok": caught,
        "not_applicable": None,
        "first_failure": None if caught else "x",
        "first_divergence": None,
        "attributed_class": "block_table" if caught else None,
        "expected_class": "block_table",
        "bug": "a planted bug",
        "caught_by": [],
    }
    case = {
        "case": "s/c",
        "passed": passed,
        "requests": 1,
        "steps": 1,
        "seconds": 0.1,
        "failures": [] if passed else [{"message": "broke", "divergence": None}],
    }
    return {
        "passed": passed and caught,
        "model": "m",
        "engine": {},
        "environment": {},
        "seconds": seconds,
        "mutation_score": 1.0 if caught else 0.0,
        "attribution_score": 1.0 if caught else 0.0,
        "mutation_check": "run",
        "suites": {"s": {"cases": 1, "failures": int(not passed), "results": [case]}},
        "mutants": {n: dict(mutant) for n in names},
    }


def test_matrix_report_keeps_the_top_level_fields_and_totals_over_cells(tmp_path):
    cells = [MAIN, Cell("builtin:tiny-qwen2", mutants="format", kv_cache_dtype="int8")]
    result = MatrixResult(
        cells, [_cell_result(True, True, 3.0), _cell_result(False, False, 2.0)], 5.5
    )
    data = write_reports(result, tmp_path)
    for key in ("passed", "mutation_score", "attribution_score", "suites", "mutants", "model"):
        assert key in data
    assert data["passed"] is False and data["seconds"] == 5.5
    assert data["mutation_score"] == 0.5  # one caught of the two run, over both cells
    assert set(data["mutants"]) == {"a", f"a@{cells[1].name}"}
    assert [c["seconds"] for c in data["cells"]] == [3.0, 2.0]
    assert [c["passed"] for c in data["cells"]] == [True, False]
    table = summary_table(data)
    assert all(c.name in table for c in cells) and "over 2 cells" in table
    md, page = (tmp_path / "report.md").read_text(), (tmp_path / "report.html").read_text()
    assert "## Cells" in md and "broke" in md and cells[1].name in page
    assert json.loads((tmp_path / "report.json").read_text())["cells"][1]["case_failures"] == 1


@pytest.mark.parametrize("jobs", [1, 2])
def test_run_matrix_runs_each_cell_on_the_real_engine(jobs):
    cells = [
        Cell("builtin:tiny-llama", suites=("failure",)),
        Cell("builtin:tiny-qwen2", kv_cache_dtype="int8", suites=("failure",)),
    ]
    result = run_matrix(cells, {"max_num_seqs": 4}, jobs=jobs, progress=False)
    data = result.to_dict()
    assert data["passed"] is True, [c["suites"] for c in data["cells"]]
    assert [c["cell"] for c in data["cells"]] == [c.name for c in cells]
    assert data["cells"][1]["model"] == "builtin:tiny-qwen2" and data["cells"][1]["cases"] > 0
    assert data["engine"] == {"max_num_seqs": 4}
    assert (
        data["cells"][1]["suites"]["failure"]["cases"]
        == data["cells"][0]["suites"]["failure"]["cases"]
    )

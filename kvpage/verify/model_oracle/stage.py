"""The gate's model stage, before any engine case: transformers on the same weights against the
reference's own forward — the model under test in its served dtype (and int8 weights against
transformers on their dequantised values), then every family's small checkpoint in float32 —
and the stage's mutants, each planted in its family's model and demanded caught as `model`.

The engine cases compare the engine with the contiguous reference, which runs the same model
code: a bug in a family's math or in reading its config is on both sides. This stage is the
part of the gate that sees it."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvpage.model import load_model
from kvpage.model.base import CausalLM
from kvpage.model.int8 import Int8Linear
from kvpage.model.quantize import weight_quantization
from kvpage.reference.lora_merge import merged_model
from kvpage.verify.checks import Failure, finding
from kvpage.verify.lora_adapters import write_peft
from kvpage.verify.model_oracle.adapters import STAGE_SPECS, with_adapter
from kvpage.verify.model_oracle.compare import LayerGap, first_gap
from kvpage.verify.model_oracle.families import FAMILY_CONFIGS, save_family
from kvpage.verify.model_oracle.mutants import MODEL_MUTANTS, ModelMutant
from kvpage.verify.model_oracle.twin import NoTwin, checkpoint_dir, dequantised_into, load_theirs
from kvpage.verify.suites import CaseResult

SUITE = "model"
BASE_LENGTHS = (1, 17, 100)
PROMPT_SEED = 0


@dataclass(slots=True)
class ModelMutantOutcome:
    mutant: ModelMutant
    caught: bool
    caught_by: list[str]
    divergence: dict | None
    seconds: float


@dataclass(slots=True)
class ModelStageResult:
    cases: list[CaseResult] = field(default_factory=list)
    not_applicable: dict[str, str] = field(default_factory=dict)
    mutants: list[ModelMutantOutcome] = field(default_factory=list)


def lengths_for(model: CausalLM) -> list[int]:
    """1, a short prompt, and one past twice the widest window (at least 100), within the
    model's positions: every layer kind sees keys both in and out of its window."""
    cfg = model.config
    windows = [w for w in cfg.layer_windows or () if w is not None]
    longest = max(BASE_LENGTHS[-1], 2 * max(windows, default=0) + 5)
    return sorted({n for n in (*BASE_LENGTHS[:-1], longest) if n <= cfg.max_position_embeddings})


def prompt(length: int, vocab_size: int) -> list[int]:
    g = torch.Generator().manual_seed(PROMPT_SEED + length)
    return torch.randint(0, vocab_size, (length,), generator=g).tolist()


def run_model_stage(
    model: CausalLM,
    model_name: str,
    mutants: bool | Collection[str] = True,
    families: Collection[str] | None = None,
    adapters: bool = False,
) -> ModelStageResult:
    """The served model (as loaded for the gate), with `adapters` also under each of the lora
    suite's adapters through PEFT; then the families' checkpoints, then the stage's mutants
    wanted (all, none, or those named)."""
    result = ModelStageResult()
    families = sorted(FAMILY_CONFIGS) if families is None else sorted(families)
    with tempfile.TemporaryDirectory(prefix="kvpage-model-stage-") as scratch:
        root = Path(scratch)
        served = _served_case(model, model_name, root)
        if isinstance(served, str):
            result.not_applicable[f"{SUITE}/served"] = served
        else:
            result.cases.append(served)
            if adapters:
                result.cases += _adapter_cases(model_name, root, weight_quantization(model))
        dirs = {name: _family_dir(name, root) for name in families}
        for name, directory in dirs.items():
            ours, _ = load_model(str(directory))
            result.cases.append(_family_case(name, ours, directory))
        for mutant in MODEL_MUTANTS:
            if _wanted(mutant, mutants) and mutant.family in dirs:
                result.mutants.append(_run_mutant(mutant, dirs[mutant.family]))
    return result


def _wanted(mutant: ModelMutant, mutants: bool | Collection[str]) -> bool:
    return mutants is True or (mutants is not False and mutant.name in mutants)


def _family_dir(name: str, root: Path) -> Path:
    directory = root / "families" / name
    save_family(name, directory)
    return directory


def _served_case(model: CausalLM, model_name: str, root: Path) -> CaseResult | str:
    """The case, or why transformers cannot run the model on the same weights."""
    try:
        directory = checkpoint_dir(model_name, model, root / "twin")
        theirs = _theirs(model, directory, model.dtype)
    except NoTwin as why:
        return f"no transformers model on the same weights: {why}"
    return _case("served", model, theirs, directory, model.dtype)


def _adapter_cases(model_name: str, root: Path, quantization: str = "none") -> list[CaseResult]:
    """The reference's merge of each adapter against PEFT's on transformers' model, in float32
    whatever the served dtype: what is checked here (how the directory is read, the scale, the
    merge) does not depend on the dtype, and float32's tolerance is the tightest. Int8 weights
    stay int8: PEFT's model is then transformers' on the dequantised weights (dequantised_into),
    the reference's the int8 merge (W' + scale B A, kvpage.reference.lora_merge)."""
    model, _ = load_model(model_name, "float32", quantization=quantization)
    directory = checkpoint_dir(model_name, model, root / "twin32")
    cases = []
    for spec in STAGE_SPECS:
        written = write_peft(spec, model.config, root / "adapters" / spec.name)
        merged = merged_model(model, written.path)
        theirs = with_adapter(_theirs(model, directory, torch.float32), Path(written.path))
        cases.append(_case(f"lora:{spec.name}", merged, theirs, Path(written.path), torch.float32))
    return cases


def _theirs(ours: CausalLM, directory: Path, dtype: torch.dtype):
    theirs = load_theirs(directory, dtype).to(ours.device)
    if any(isinstance(m, Int8Linear) for m in ours.modules()):
        dequantised_into(theirs, ours)
    return theirs


def _case(name: str, ours: CausalLM, theirs, directory: Path, dtype: torch.dtype) -> CaseResult:
    start = time.perf_counter()
    gap = _first_gap_over_lengths(ours, theirs, dtype)
    failures = [] if gap is None else [_failure(name, directory, dtype, gap)]
    lengths = len(lengths_for(ours))
    return CaseResult(name, SUITE, failures, lengths, lengths, time.perf_counter() - start)


def _family_case(name: str, ours: CausalLM, directory: Path) -> CaseResult:
    theirs = _theirs(ours, directory, torch.float32)
    return _case(f"family:{name}", ours, theirs, directory, torch.float32)


def _first_gap_over_lengths(ours: CausalLM, theirs, dtype: torch.dtype):
    for length in lengths_for(ours):
        gap = first_gap(ours, theirs, prompt(length, ours.config.vocab_size), dtype)
        if gap is not None:
            return gap
    return None


def _failure(name: str, directory: Path, dtype: torch.dtype, gap: LayerGap) -> Failure:
    reason = (
        f"{name}: kvpage's forward leaves transformers' at {gap.where} ({gap.layer_kind}) on a "
        f"{gap.length}-token sequence: max |diff| {gap.max_abs_diff:.3g} > {gap.tolerance:.3g}"
    )
    fields = {
        "checkpoint": str(directory),
        "dtype": str(dtype).removeprefix("torch."),
        "length": gap.length,
        "first_layer": gap.where,
        "layer_kind": gap.layer_kind,
        "max_abs_diff": gap.max_abs_diff,
        "tolerance": gap.tolerance,
    }
    return Failure("model", reason, divergence=finding("model", "model", reason, fields))


def _run_mutant(mutant: ModelMutant, directory: Path) -> ModelMutantOutcome:
    start = time.perf_counter()
    ours, _ = load_model(str(directory))
    mutant.apply(ours)
    case = _family_case(mutant.family, ours, directory)
    divergence = case.first_divergence
    return ModelMutantOutcome(
        mutant,
        not case.passed,
        [] if case.passed else [f"{SUITE}/{case.case}"],
        None if divergence is None else divergence.to_dict(),
        time.perf_counter() - start,
    )

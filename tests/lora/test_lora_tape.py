"""LoRA on the decode tape (kvpage.model.decode_tape, kvpage.lora.apply): decode steps with
adapter rows replay the recorded kernel calls, the adapters' deltas among them, and every row
still gets HF + PEFT's tokens and logprobs: with the mix of adapters changing from step to step,
and with a slot rewritten by another adapter while the tapes that read it are kept."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpage import LoRARequest
from kvpage.model import native_build
from kvpage.model.decode_tape import Tape

from .adapters import peft_model, save_adapter
from .test_lora import _check_mixed_batch, _engine, _greedy_hf, _prompt, _run
from .test_lora import setup as setup  # noqa: F401  (the module's fixture, shared)

pytestmark = pytest.mark.skipif(
    native_build.compiler() is None or not native_build.enabled(), reason="needs a C++ compiler"
)


def _count_replays(monkeypatch, engine) -> list[bool]:
    """Per replayed step: whether it had adapter rows."""
    runs: list[bool] = []
    replay = Tape.replay

    def counted(self):
        runs.append(engine.runner.lora.batch is not None)
        return replay(self)

    monkeypatch.setattr(Tape, "replay", counted)
    return runs


def test_mixed_decode_steps_replay_the_tape_and_match_peft(setup, monkeypatch):
    """Base, a and b rows in every decode step, sequences finishing at different steps (their
    prompts differ in length, so rows change adapter mix): replayed, and PEFT's per row."""
    base, root = setup
    engine = _engine(root, dtype="float32")
    replays = _count_replays(monkeypatch, engine)
    _check_mixed_batch(base, root, engine)
    assert sum(replays) >= 3, f"decode steps with adapter rows never replayed: {replays}"
    assert engine.model.decode_plan().refused == {}


def test_a_rewritten_slot_is_read_by_the_kept_tape(setup, tmp_path, monkeypatch):
    """One slot, adapters taking turns in it: a tape recorded with one adapter's tables replays
    with the next one's (they are read when the call runs, not when it was recorded)."""
    base, root = setup
    engine = _engine(root, max_loras=1, dtype="float32")
    replays = _count_replays(monkeypatch, engine)
    c = save_adapter(base, tmp_path / "c", seed=3, targets=["o_proj", "up_proj"])
    loras = [LoRARequest("a", str(root / "a")), LoRARequest("b", str(root / "b"))]
    loras.append(LoRARequest("c", str(c)))
    prompt = _prompt(15, 17)
    done = _run(engine, {str(i): (prompt, lora) for i, lora in enumerate(loras)})
    for i, lora in enumerate(loras):
        oracle = peft_model(base, Path(lora.path))
        assert done[str(i)].outputs[0].token_ids == _greedy_hf(oracle, prompt), lora.lora_name
    assert engine.lora_slots.evictions >= 2
    assert sum(replays) >= 3 * 5, f"the adapters' decode steps did not replay: {replays}"

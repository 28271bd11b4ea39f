"""The adapter slot table and admission with one slot: a slot reused by an adapter with fewer
targets keeps nothing of its previous adapter, and a request waiting for a slot does not hold
back the requests behind it that need none."""

from __future__ import annotations

import torch

from kvpage import EngineConfig, LLMEngine, LoRARequest, SamplingParams
from kvpage.lora.tables import SlotTables
from kvpage.model import load_model
from kvpage.verify.lora_adapters import LoraSpec, write_peft

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MODEL = "builtin:tiny-llama"


def _factors(modules, rank: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return {
        (0, m): (torch.randn(6, rank, generator=g), torch.randn(rank, 5, generator=g))
        for m in modules
    }


def test_a_reused_slot_keeps_nothing_of_its_previous_adapter():
    tables = SlotTables(max_loras=1, max_rank=4, dtype=torch.float32, device="cpu")
    tables.write(0, _factors(ALL, rank=4, seed=1))
    qv = _factors(("q_proj", "v_proj"), rank=2, seed=2)
    tables.write(0, qv)
    for module in ALL:
        a_stack, b_stack = tables.stacks[(0, module)]
        if module in ("q_proj", "v_proj"):
            a_t, b_t = qv[(0, module)]
            assert torch.equal(a_stack[:, :2], a_t) and torch.equal(b_stack[:2], b_t)
            assert not a_stack[:, 2:].any() and not b_stack[2:].any(), module  # rank 4 -> 2
        else:
            assert not a_stack.any() and not b_stack.any(), module


def test_a_request_waiting_for_a_slot_holds_back_no_request_that_needs_none(tmp_path):
    """One slot, held by x's adapter (x running, then preempted and kept out by suspend): y's
    adapter must wait, and the base request and another of x's adapter behind y still run."""
    model, tokenizer = load_model(MODEL)
    a = write_peft(LoraSpec("a", seed=1), model.config, tmp_path / "a")
    b = write_peft(LoraSpec("b", seed=2, targets=("q_proj",)), model.config, tmp_path / "b")
    cfg = EngineConfig(
        model=MODEL, block_size=8, num_blocks=64, enable_lora=True, max_loras=1, max_lora_rank=4
    )
    engine = LLMEngine(cfg, model, tokenizer)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompt = list(range(5, 25))
    engine.add_request("x", prompt, params, lora_request=LoRARequest("a", a.path))
    engine.step()
    engine.add_request("y", prompt, params, lora_request=LoRARequest("b", b.path))
    engine.add_request("base", prompt, params)
    engine.add_request("x2", prompt[:-3], params, lora_request=LoRARequest("a", a.path))
    engine.preempt("x")
    engine.suspend("x")  # the slot's only holder is now outside every step
    engine.step()
    running = {s.request_id for s in engine.scheduler.running}
    assert running == {"base", "x2"}, running
    assert [s.request_id for s in engine.scheduler.waiting] == ["y"]
    engine.resume("x")
    done = set()
    while engine.has_unfinished_requests():
        done |= {o.request_id for o in engine.step() if o.finished}
    assert done == {"x", "y", "base", "x2"}
    assert engine.lora_slots.evictions >= 1

"""LoRA under tensor parallelism (TP=2) against HF + PEFT: each rank computes from its shard of
the stacked slot tables (column-parallel: B's output rows; row-parallel: A's input columns, the
partial delta joining the all-reduce), so a mixed batch's every row equals PEFT's, and slots
rewritten after an eviction reach the workers before the step that reads them."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from kvpage import LoRARequest, SamplingParams

from .adapters import peft_model, save_adapter
from .test_lora import MAX_TOKENS, TOL, _engine, _greedy_hf, _logits_hf, _prompt, _run
from .test_lora import setup as setup  # noqa: F401  (the module's fixture, shared)


@contextlib.contextmanager
def _tp_engine(root, **kw):
    engine = _engine(root, tensor_parallel_size=2, **kw)
    try:
        yield engine
    finally:
        engine.shutdown()


def test_tp2_mixed_batch_matches_peft_for_every_row(setup):  # noqa: F811
    base, root = setup
    la, lb = LoRARequest("a", str(root / "a")), LoRARequest("b", 2, str(root / "b"))
    prompts = {f"p{i}": _prompt(9 + 4 * i, 40 + i) for i in range(3)}
    requests = {
        f"{rid}-{tag}": (prompt, lora)
        for rid, prompt in prompts.items()
        for tag, lora in (("base", None), ("a", la), ("b", lb))
    }
    with _tp_engine(root) as engine:
        done = _run(engine, requests)
    oracles = {"base": base, "a": peft_model(base, root / "a"), "b": peft_model(base, root / "b")}
    for rid, (prompt, _) in requests.items():
        oracle = oracles[rid.split("-")[1]]
        tokens = done[rid].outputs[0].token_ids
        assert tokens == _greedy_hf(oracle, prompt), rid
        want = torch.log_softmax(_logits_hf(oracle, prompt + tokens[:-1])[len(prompt) - 1 :], -1)
        got = done[rid].outputs[0].token_logprobs
        err = max(
            abs(g - want[i, t].item()) for i, (g, t) in enumerate(zip(got, tokens, strict=True))
        )
        assert err <= TOL, f"{rid}: {err}"


def test_tp2_slots_rewritten_after_eviction_reach_the_workers(setup, tmp_path):  # noqa: F811
    """One slot, three adapters taking turns: a worker computing from a stale slot would give
    the previous adapter's tokens."""
    base, root = setup
    c = save_adapter(base, tmp_path / "c", seed=5, targets=["o_proj", "down_proj", "k_proj"])
    loras = [LoRARequest("a", str(root / "a")), LoRARequest("c", str(c))]
    loras += [LoRARequest("b", str(root / "b")), None]
    prompt = _prompt(13, 51)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    with _tp_engine(root, max_loras=1) as engine:
        done = _run(engine, {str(i): (prompt, lora) for i, lora in enumerate(loras)}, params)
        assert engine.lora_slots.evictions >= 2
    for i, lora in enumerate(loras):
        oracle = base if lora is None else peft_model(base, Path(lora.path))
        assert done[str(i)].outputs[0].token_ids == _greedy_hf(oracle, prompt), i

"""LoRA on int8 weights against HF + PEFT on the *dequantised* weights (code * scale, the int8
format's model, written here again from the codes and scales): a mixed batch of the base and
two adapters (on Llama, Qwen2 with biases, Qwen3, Gemma 3; with an int8 LM head; speculating),
prefix hits across adapters, tensor parallelism, bfloat16 activations, and the reference's own
merge (and the gate's model stage that holds it to PEFT).
The engine adds the delta x A^T B^T on the activations beside its int8 product; PEFT adds its
own to a float layer holding the dequantised weight. Bounds are the int8 engine's
(tests/engine/test_int8_weights.py: summation order and output rounding only)."""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import pytest
import torch

from kvpage import EngineConfig, LLMEngine, LoRAError, LoRARequest, SamplingParams
from kvpage.engine.events import EngineObserver
from kvpage.model import load_model
from kvpage.model.int8 import Int8Linear
from kvpage.reference.generator import generate
from kvpage.reference.lora_merge import Int8DeltaLinear, merged_model

from ..engine.test_int8_weights import TOLERANCE
from ..model.hf_models import save_hf
from .adapters import peft_model, save_adapter
from .test_lora import (
    MAX_TOKENS,
    SPECULATIVE,
    _engine,
    _greedy_hf,
    _logits_hf,
    _prompt,
    _run,
)

TOL = TOLERANCE["float32"]  # float32 activations, int8 weights on both sides


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_int8")
    base = save_hf("llama-gqa-8q-2kv", root / "base")
    save_adapter(base, root / "a", seed=1)
    save_adapter(
        base, root / "b", seed=2, targets=["q_proj", "v_proj", "down_proj"], r=8, use_rslora=True
    )
    return base, root


def dequantised_hf(base, directory: Path, head: bool = False):
    """A copy of the HF model whose every int8-quantized linear (and with `head` the LM head)
    holds code * scale (float64 product, as the format defines W'), the codes and scales as
    kvpage quantizes them: the oracle shares the weights, not the engine's int8 kernels or its
    dequantisation."""
    quantized, _ = load_model(str(directory), quantization="int8", quantize_lm_head=head)
    hf = copy.deepcopy(base)
    state = hf.state_dict()
    count = 0
    with torch.no_grad():
        for name, layer in quantized.named_modules():
            if isinstance(layer, Int8Linear):
                weight = layer.weight_int8.double() * layer.scales.double()[:, None]
                state[f"{name}.weight"].copy_(weight.float())
                count += 1
    # every decoder projection is int8, and the (untied) head when asked
    assert count == 7 * base.config.num_hidden_layers + head
    hf.load_state_dict(state)
    return hf.eval()


def _oracles(base, root: Path, head: bool = False) -> dict:
    deq = dequantised_hf(base, root / "base", head)
    return {"base": deq, "a": peft_model(deq, root / "a"), "b": peft_model(deq, root / "b")}


def _int8_engine(root: Path, **kw):
    return _engine(root, quantization="int8", **kw)


class _TapeWatch:
    """Counts the decode tape's replays with and without adapter rows in the step. The tape
    replays recorded kernel calls only: a step with adapter rows either stays off it or
    replays the adapters' deltas among its calls (kvpage.lora.apply); either way the rows
    must be PEFT's, which the test checks per row."""

    def __init__(self, engine) -> None:
        self.with_adapters = self.base_only = 0
        self.plan, self.lora = engine.model.decode_plan(), engine.runner.lora
        if self.plan is not None:
            honest = self.plan.run

            def run(x, rope, attn):
                if self.lora.batch is None:
                    self.base_only += 1
                else:
                    self.with_adapters += 1
                return honest(x, rope, attn)

            self.plan.run = run


def _requests(prompts: dict, loras: dict) -> dict:
    return {
        f"{rid}-{tag}": (prompt, lora)
        for rid, prompt in prompts.items()
        for tag, lora in loras.items()
    }


def _check_against(oracles: dict, requests: dict, done: dict, tol: float) -> None:
    distinct = set()
    for rid, (prompt, _) in requests.items():
        oracle = oracles[rid.split("-")[1]]
        tokens = done[rid].outputs[0].token_ids
        assert tokens == _greedy_hf(oracle, prompt), rid
        want = torch.log_softmax(_logits_hf(oracle, prompt + tokens[:-1])[len(prompt) - 1 :], -1)
        got = done[rid].outputs[0].token_logprobs
        err = max(
            abs(g - want[i, t].item()) for i, (g, t) in enumerate(zip(got, tokens, strict=True))
        )
        assert err <= tol, f"{rid}: {err}"
        distinct.add((rid.split("-")[0], tuple(tokens)))
    prompts = {rid.split("-")[0] for rid in requests}
    assert len(distinct) > len(prompts), "the adapters never changed a token: a weak test"


def test_int8_mixed_batch_matches_peft_on_the_dequantised_weights(setup):
    """Base, adapter a (all seven projections) and b (three, rank 8, rsLoRA) in the same steps
    on int8 weights: each row's greedy tokens and chosen logprobs are PEFT's on the dequantised
    weights, whichever path (module forward or decode tape) each decode step took."""
    base, root = setup
    engine = _int8_engine(root)
    assert engine.config.quantization == "int8" and engine.config.enable_lora
    watch = _TapeWatch(engine)
    la, lb = LoRARequest("a", str(root / "a")), LoRARequest("b", 2, str(root / "b"))
    prompts = {f"p{i}": _prompt(11 + 3 * i, i) for i in range(3)}
    requests = _requests(prompts, {"base": None, "a": la, "b": lb})
    done = _run(engine, requests)
    _check_against(_oracles(base, root), requests, done, TOL)
    # the base model alone takes the tape (where this machine has one), and is still right
    before = watch.with_adapters
    alone = _run(engine, {"solo-base": (prompts["p0"], None)})
    assert alone["solo-base"].outputs[0].token_ids == done["p0-base"].outputs[0].token_ids
    assert watch.plan is None or watch.base_only > 0
    assert watch.with_adapters == before  # no adapter row in that run: none counted


def test_int8_lm_head_with_adapters_matches_peft(setup):
    """quantize_lm_head: the head in int8 too (no adapter targets it), PEFT's model with the
    dequantised head as well."""
    base, root = setup
    assert not base.config.tie_word_embeddings  # the head is its own layer here
    engine = _int8_engine(root, quantize_lm_head=True)
    la, lb = LoRARequest("a", str(root / "a")), LoRARequest("b", 2, str(root / "b"))
    prompts = {f"p{i}": _prompt(12 + 5 * i, 70 + i) for i in range(2)}
    requests = _requests(prompts, {"base": None, "a": la, "b": lb})
    done = _run(engine, requests)
    _check_against(_oracles(base, root, head=True), requests, done, TOL)


@pytest.mark.parametrize("name", sorted(SPECULATIVE))
def test_a_speculating_int8_mixed_batch_matches_peft(setup, name):
    """The same with speculative decoding on int8 weights (n-gram, and the int8 self-draft,
    which knows no adapter): each adapter's 1 + k verification rows get their delta beside the
    int8 product, every row PEFT's on the dequantised weights."""
    base, root = setup
    engine = _int8_engine(root, speculative_config=SPECULATIVE[name])
    la, lb = LoRARequest("a", str(root / "a")), LoRARequest("b", 2, str(root / "b"))
    prompts = {f"p{i}": _prompt(11 + 3 * i, i) for i in range(3)}
    requests = _requests(prompts, {"base": None, "a": la, "b": lb})
    done = _run(engine, requests)
    _check_against(_oracles(base, root), requests, done, TOL)
    assert engine.stats()["spec_decode_num_drafts"] > 0


@pytest.mark.parametrize("family", ["gemma3", "qwen3"])
def test_int8_mixed_batch_on_other_families_matches_peft(tmp_path, family):
    """Gemma 3 (GeGLU, its own norms and windows) and Qwen3 (q/k norm after the adapted q/k
    projections) on int8 weights: base and two adapters in one batch, each row PEFT's on the
    dequantised weights."""
    base = save_hf(family, tmp_path / "base")
    save_adapter(base, tmp_path / "a", seed=1)
    save_adapter(base, tmp_path / "b", seed=2, targets=["q_proj", "v_proj", "down_proj"], r=8)
    engine = _int8_engine(tmp_path)
    la, lb = LoRARequest("a", str(tmp_path / "a")), LoRARequest("b", 2, str(tmp_path / "b"))
    prompts = {f"p{i}": _prompt(11 + 3 * i, i) for i in range(2)}
    requests = _requests(prompts, {"base": None, "a": la, "b": lb})
    _check_against(_oracles(base, tmp_path), requests, _run(engine, requests), TOL)


def test_the_weights_really_are_int8(setup):
    """The float weights' PEFT model is another model: its logits leave the int8 engine's by
    far more than the bound, so the tests above tell the two apart."""
    base, root = setup
    engine = _int8_engine(root)
    la = LoRARequest("a", str(root / "a"))
    prompt = _prompt(14, 5)
    done = _run(engine, {"x": (prompt, la)})
    tokens = done["x"].outputs[0].token_ids
    got = torch.tensor(done["x"].outputs[0].token_logprobs)
    apart = []
    for oracle in (peft_model(base, root / "a"), _oracles(base, root)["a"]):
        logits = _logits_hf(oracle, prompt + tokens[:-1])[len(prompt) - 1 :]
        want = torch.log_softmax(logits, -1)[torch.arange(len(tokens)), torch.tensor(tokens)]
        apart.append(float((got - want).abs().max()))
    assert apart[1] <= TOL < 10 * TOL < apart[0], apart


@pytest.mark.parametrize("base_name", ["llama-gqa-8q-2kv", "qwen2-bias"])
def test_int8_prefix_hits_across_adapters_match_peft(tmp_path, base_name):
    """No adapter hits another's (or the base's) blocks on int8 weights, a second wave of the
    same adapters hits its own, and every step's logits, first wave and second, are PEFT's on
    the dequantised weights (qwen2-bias: q/k/v biases added after the fused int8 product)."""
    base = save_hf(base_name, tmp_path / "base")
    save_adapter(base, tmp_path / "a", seed=11)
    save_adapter(base, tmp_path / "b", seed=12, targets=["k_proj", "o_proj", "up_proj"], r=2)
    engine = _int8_engine(tmp_path)
    rows = _Logits()
    engine.add_observer(rows)
    loras = {"base": None, "a": LoRARequest("a", str(tmp_path / "a"))}
    loras["b"] = LoRARequest("b", str(tmp_path / "b"))
    prompt = _prompt(25, 41)
    first = _run(engine, {f"{tag}.1": (prompt, lora) for tag, lora in loras.items()})
    assert all(first[f"{tag}.1"].metrics.num_cached_tokens == 0 for tag in loras)
    second = _run(engine, {f"{tag}.2": (prompt, lora) for tag, lora in loras.items()})
    assert all(second[f"{tag}.2"].metrics.num_cached_tokens == 24 for tag in loras)
    oracles = _oracles(base, tmp_path)
    worst = 0.0
    for rid, out in {**first, **second}.items():
        tokens = out.outputs[0].token_ids
        oracle = oracles[rid.split(".")[0]]
        assert tokens == _greedy_hf(oracle, prompt), rid
        want = _logits_hf(oracle, prompt + tokens[:-1])[len(prompt) - 1 :]
        for i in range(len(tokens)):
            worst = max(worst, (rows.rows[(rid, i)] - want[i]).abs().max().item())
    assert worst <= TOL, worst


def test_the_reference_merges_int8_as_peft_on_the_dequantised_weights(setup):
    """merged_model of an int8 model: its own read of the adapter, the dequantised layers with
    the dense delta (no int8 layer left), PEFT's tokens and logits; the engine's model is left
    as it was."""
    base, root = setup
    model, _ = load_model(str(root / "base"), quantization="int8")
    merged = merged_model(model, root / "b")
    assert not any(isinstance(m, Int8Linear) for m in merged.modules())
    adapted = [m for m in merged.modules() if isinstance(m, Int8DeltaLinear)]
    assert len(adapted) == 3 * model.config.num_layers  # q, v, down of every layer
    oracles = _oracles(base, root)
    prompt = _prompt(20, 7)
    ours = generate(merged, prompt, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert ours.token_ids == _greedy_hf(oracles["b"], prompt)
    want = _logits_hf(oracles["b"], prompt + ours.token_ids[:-1])[len(prompt) - 1 :]
    assert float((torch.stack(ours.step_logits) - want).abs().max()) <= TOL
    plain = generate(model, prompt, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert plain.token_ids == _greedy_hf(oracles["base"], prompt)


def test_the_gate_model_stage_holds_the_int8_merge_to_peft(monkeypatch):
    """The gate's model stage on int8 weights with adapters: the reference's int8 merge of each
    of the lora suite's adapters against PEFT on transformers' dequantised weights; a wrong
    scale in the reference's read (rsLoRA dropped) fails the rsLoRA adapter's case only."""
    import kvpage.reference.lora_merge as lora_merge
    from kvpage.verify.model_oracle.stage import run_model_stage

    model, _ = load_model("builtin:tiny-llama", quantization="int8")
    clean = run_model_stage(model, "builtin:tiny-llama", mutants=False, families=(), adapters=True)
    assert [c.case for c in clean.cases] == ["served", "lora:a", "lora:b", "lora:rs", "lora:qv"]
    assert all(c.passed for c in clean.cases), [c.failures[0].message for c in clean.cases]

    def no_rslora(config: dict) -> float:
        return config.get("lora_alpha", config["r"]) / config["r"]

    monkeypatch.setattr(lora_merge, "adapter_scale", no_rslora)
    broken = run_model_stage(model, "builtin:tiny-llama", mutants=False, families=(), adapters=True)
    assert [c.case for c in broken.cases if not c.passed] == ["lora:rs"]


def test_int8_in_bfloat16_matches_the_reference_merged_on_the_dequantised_weights(setup):
    """bfloat16 activations on int8 weights: each row within the int8 engine's bfloat16 bound
    of the reference's merged model in bfloat16 (the test above holds that model to PEFT in
    float32; PEFT has no bfloat16 model of these weights: code * scale is not a bfloat16 value),
    up to an exact numeric tie as tests/engine/test_int8_weights.py allows."""
    _, root = setup
    engine = _int8_engine(root, dtype="bfloat16")
    rows = _Logits()
    engine.add_observer(rows)
    la, lb = LoRARequest("a", str(root / "a")), LoRARequest("b", 2, str(root / "b"))
    prompts = {f"p{i}": _prompt(11 + 3 * i, 60 + i) for i in range(2)}
    loras = {"base": None, "a": la, "b": lb}
    done = _run(engine, _requests(prompts, loras))
    references = {"base": engine.model} | {t: merged_model(engine.model, root / t) for t in "ab"}
    tol, distinct = TOLERANCE["bfloat16"], set()
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    for rid, out in done.items():
        key, tag = rid.split("-")
        ref = generate(references[tag], prompts[key], params)
        tokens = out.outputs[0].token_ids
        for k, (got, want) in enumerate(zip(tokens, ref.token_ids, strict=True)):
            row, ref_row = rows.rows[(rid, k)], ref.step_logits[k].float()
            assert float((row - ref_row).abs().max()) <= tol, f"{rid} step {k}"
            if got != want:  # a tie on both sides: the contexts differ after it
                for logits in (row, ref_row):
                    assert abs(float(logits[got] - logits[want])) <= tol, f"{rid} step {k}"
                break
        distinct.add((key, tuple(tokens)))
    assert len(distinct) > len(prompts), "the adapters never changed a token: a weak test"


@contextlib.contextmanager
def _tp_engine(root, **kw):
    engine = _int8_engine(root, tensor_parallel_size=2, **kw)
    try:
        yield engine
    finally:
        engine.shutdown()


def test_tp2_int8_mixed_batch_matches_peft_on_the_dequantised_weights(setup):
    """TP=2 on int8 weights (quantized before sharding: every rank's codes are TP=1's): each
    rank's shard of the slot tables beside its int8 shard, the row-parallel delta inside the
    all-reduce; every row equals PEFT's on the dequantised weights."""
    base, root = setup
    la, lb = LoRARequest("a", str(root / "a")), LoRARequest("b", 2, str(root / "b"))
    prompts = {f"p{i}": _prompt(9 + 4 * i, 40 + i) for i in range(2)}
    requests = _requests(prompts, {"base": None, "a": la, "b": lb})
    with _tp_engine(root) as engine:
        done = _run(engine, requests)
    _check_against(_oracles(base, root), requests, done, TOL)


def test_lora_on_int8_weights_is_accepted_by_the_config():
    config = EngineConfig(quantization="int8", enable_lora=True, quantize_lm_head=True)
    assert (config.quantization, config.enable_lora) == ("int8", True)


def test_what_stays_refused_is_named_with_why():
    """int8 is not the refusal any more; a model without adapter hooks is, by its type."""
    config = EngineConfig(model="builtin:tiny-gpt2", quantization="int8", enable_lora=True)
    with pytest.raises(LoRAError, match=r"Llama-shaped models \(llama, gemma3\), not 'gpt2'"):
        LLMEngine(config)


class _Logits(EngineObserver):
    """Every sampled row's logits (float32), by (request, output position)."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, int], torch.Tensor] = {}

    def on_sampled(self, batch, logits, tokens) -> None:
        for row, item in enumerate(batch.sample_seqs):
            key = (item.seq.request_id, len(item.seq.output_ids) - 1)
            self.rows[key] = logits[row].float().clone()

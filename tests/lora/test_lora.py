"""LoRA adapters against Hugging Face + PEFT on random adapters over a random base: mixed
batches (base and two adapters in one step), the cache namespace per adapter, reloads, the
bounded slot table, and the refusals."""

from __future__ import annotations

import shutil

import pytest
import torch

from kvpage import LLM, EngineConfig, LLMEngine, LoRAError, LoRARequest, SamplingParams
from kvpage.errors import InvalidRequest
from kvpage.reference.generator import generate
from kvpage.reference.lora_merge import merged_model

from ..model.hf_models import VOCAB, save_hf
from .adapters import edit_config, peft_model, save_adapter

TOL = 1e-4  # fp32 on both sides
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = save_hf("llama-gqa-8q-2kv", root / "base")
    save_adapter(base, root / "a", seed=1)
    save_adapter(
        base, root / "b", seed=2, targets=["q_proj", "v_proj", "down_proj"], r=8, use_rslora=True
    )
    return base, root


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


def _greedy_hf(model, prompt: list[int]) -> list[int]:
    """Argmax over the whole vocabulary, EOS included (as ignore_eos does; HF generate's
    min_new_tokens would forbid EOS instead)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def _logits_hf(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _engine(root, **kw) -> LLMEngine:
    cfg = dict(model=str(root / "base"), block_size=8, num_blocks=64, debug_checks=True)
    cfg.update(enable_lora=True, max_loras=2, max_lora_rank=8)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg))


def _run(engine, requests: dict[str, tuple[list[int], LoRARequest | None]], params=None):
    params = params or SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    for rid, (prompt, lora) in requests.items():
        engine.add_request(rid, prompt, params, lora_request=lora)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return done


def test_a_mixed_batch_matches_peft_for_every_row(setup):
    """Base, adapter a (all seven projections) and adapter b (three, rank 8, rsLoRA) in the
    same steps: each request's greedy tokens and chosen logprobs equal HF + PEFT's."""
    base, root = setup
    _check_mixed_batch(base, root, _engine(root))


SPECULATIVE = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
    "self_int8": {"method": "draft_model", "quantization": "int8", "num_speculative_tokens": 3},
}


@pytest.mark.parametrize("name", sorted(SPECULATIVE))
def test_a_speculating_mixed_batch_matches_peft_for_every_row(setup, name):
    """The same with speculative decoding: each adapter's 1 + k verification rows run with its
    own factors beside the base rows (the int8 self-draft knows no adapter: it drafts worse,
    never wrongly), and every token's logprob is its own row's."""
    base, root = setup
    engine = _engine(root, speculative_config=SPECULATIVE[name])
    _check_mixed_batch(base, root, engine)
    stats = engine.stats()
    assert stats["spec_decode_num_drafts"] > 0, stats
    if name == "self_int8":  # later rows count too: drafts kept (n-gram rarely matches here)
        assert stats["spec_decode_num_accepted_tokens"] > 0, stats


def _check_mixed_batch(base, root, engine) -> None:
    la, lb = LoRARequest("a", str(root / "a")), LoRARequest("b", 2, str(root / "b"))
    prompts = {f"p{i}": _prompt(11 + 3 * i, i) for i in range(3)}
    requests = {}
    for rid, prompt in prompts.items():
        for tag, lora in (("base", None), ("a", la), ("b", lb)):
            requests[f"{rid}-{tag}"] = (prompt, lora)
    done = _run(engine, requests)
    oracles = {"base": base, "a": peft_model(base, root / "a"), "b": peft_model(base, root / "b")}
    distinct = set()
    for rid, (prompt, _) in requests.items():
        tag = rid.split("-")[1]
        tokens = done[rid].outputs[0].token_ids
        assert tokens == _greedy_hf(oracles[tag], prompt), rid
        logits = _logits_hf(oracles[tag], prompt + tokens[:-1])
        want = torch.log_softmax(logits[len(prompt) - 1 :], -1)
        got = done[rid].outputs[0].token_logprobs
        expected = [want[i, t].item() for i, t in enumerate(tokens)]
        assert max(abs(g - e) for g, e in zip(got, expected, strict=True)) <= TOL, rid
        distinct.add((rid.split("-")[0], tuple(tokens)))
    assert len(distinct) > len(prompts), "the adapters never changed a token: a weak test"


def test_the_reference_merges_the_adapter_on_its_own(setup):
    base, root = setup
    engine = _engine(root)
    merged = merged_model(engine.model, root / "b")  # its own read of the directory (rsLoRA)
    prompt = _prompt(20, 7)
    ours = generate(merged, prompt, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert ours.token_ids == _greedy_hf(peft_model(base, root / "b"), prompt)
    # and the engine's own model is left as it was: the base's tokens
    plain = generate(engine.model, prompt, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert plain.token_ids == _greedy_hf(base, prompt)


def test_adapters_never_share_blocks_and_one_adapter_does(setup):
    _, root = setup
    engine = _engine(root)
    la, lb = LoRARequest("a", str(root / "a")), LoRARequest("b", str(root / "b"))
    prompt = _prompt(33, 9)  # 4 full blocks
    hits = {}
    for rid, lora in (("base", None), ("a", la), ("b", lb), ("a2", la), ("base2", None)):
        hits[rid] = _run(engine, {rid: (prompt, lora)})[rid].metrics.num_cached_tokens
    assert hits == {"base": 0, "a": 0, "b": 0, "a2": 32, "base2": 32}


def test_a_reload_under_the_same_name_is_a_new_namespace(setup, tmp_path):
    base, root = setup
    engine = _engine(root)
    path = tmp_path / "x"
    shutil.copytree(root / "a", path)
    prompt = _prompt(33, 11)
    first = _run(engine, {"1": (prompt, LoRARequest("x", str(path)))})["1"]
    save_adapter(base, path, seed=5)  # other weights, same name and path
    engine.load_lora_adapter(LoRARequest("x", str(path)), reload=True)
    second = _run(engine, {"2": (prompt, LoRARequest("x", str(path)))})["2"]
    assert second.metrics.num_cached_tokens == 0
    assert second.outputs[0].token_ids == _greedy_hf(peft_model(base, path), prompt)
    assert first.outputs[0].token_ids != second.outputs[0].token_ids


def test_an_adapter_named_like_a_tenant_salt_shares_nothing_with_it(setup):
    _, root = setup
    engine = _engine(root)
    prompt = _prompt(33, 13)
    salted = _run(engine, {"s": (prompt, None)}, None)
    engine.add_request("t", prompt, SamplingParams(max_tokens=2), cache_salt="a")
    named = _run(engine, {"n": (prompt, LoRARequest("a", str(root / "a")))})
    assert salted["s"].metrics.num_cached_tokens == 0
    assert named["n"].metrics.num_cached_tokens == 0


def test_more_adapters_than_slots_all_finish_and_match(setup, tmp_path):
    """max_loras=1 and three adapters in flight: they take turns in the one slot (never
    evicting one in use) and each matches PEFT."""
    base, root = setup
    engine = _engine(root, max_loras=1)
    c = save_adapter(base, tmp_path / "c", seed=3, targets=["o_proj", "up_proj"])
    loras = [LoRARequest("a", str(root / "a")), LoRARequest("b", str(root / "b")), None]
    loras.append(LoRARequest("c", str(c)))
    prompt = _prompt(15, 17)
    done = _run(engine, {str(i): (prompt, lora) for i, lora in enumerate(loras)})
    for i, lora in enumerate(loras):
        oracle = base if lora is None else peft_model(base, __import__("pathlib").Path(lora.path))
        assert done[str(i)].outputs[0].token_ids == _greedy_hf(oracle, prompt), i
    assert engine.lora_slots.evictions >= 2
    assert all(r.holds == 0 for r in engine.lora_slots.resident.values())


def test_llm_generate_takes_a_list_of_lora_requests(setup):
    base, root = setup
    llm = LLM(str(root / "base"), enable_lora=True, max_loras=2, max_lora_rank=8, num_blocks=64)
    prompts = [_prompt(10, 21), _prompt(12, 22)]
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params, lora_request=[LoRARequest("a", str(root / "a")), None])
    assert outs[0].outputs[0].token_ids == _greedy_hf(peft_model(base, root / "a"), prompts[0])
    assert outs[1].outputs[0].token_ids == _greedy_hf(base, prompts[1])
    with pytest.raises(InvalidRequest, match="1 entries for 2 prompts"):
        llm.generate(prompts, params, lora_request=[None])


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"use_dora": True}, "use_dora"),
        ({"bias": "all"}, "bias='all'"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "embed_tokens"),
        ({"r": 16}, "above max_lora_rank=8"),
        ({"rank_pattern": {"q_proj": 2}}, "rank_pattern"),
    ],
)
def test_unsupported_adapters_are_refused_by_name(setup, tmp_path, changes, named):
    _, root = setup
    path = tmp_path / "bad"
    shutil.copytree(root / "a", path)
    edit_config(path, **changes)
    engine = _engine(root)
    with pytest.raises(LoRAError, match=named):
        engine.add_request(
            "x", [5, 6, 7], SamplingParams(max_tokens=1), lora_request=LoRARequest("bad", str(path))
        )
    assert not engine.has_unfinished_requests()


def test_a_lora_request_needs_enable_lora_and_a_real_directory(setup, tmp_path):
    _, root = setup
    plain = LLMEngine(EngineConfig(model=str(root / "base"), num_blocks=16))
    with pytest.raises(InvalidRequest, match="enable_lora=True"):
        plain.add_request("x", [5, 6], lora_request=LoRARequest("a", str(root / "a")))
    engine = _engine(root)
    with pytest.raises(LoRAError, match="adapter_config.json"):
        engine.add_request("y", [5, 6], lora_request=LoRARequest("nope", str(tmp_path)))
    with pytest.raises(LoRAError, match="int_id"):
        LoRARequest("a", 1, 2, 3)


class _Logits:
    """Every sampled row's logits, by (request, output position)."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, int], torch.Tensor] = {}

    def on_sampled(self, batch, logits, tokens) -> None:
        for row, item in enumerate(batch.sample_seqs):
            self.rows[(item.seq.request_id, len(item.seq.output_ids) - 1)] = logits[row].clone()

    def __getattr__(self, name):  # every other observer hook: nothing to record
        if name.startswith("on_"):
            return lambda *a, **k: None
        raise AttributeError(name)


@pytest.mark.parametrize("base_name", ["llama-gqa-8q-2kv", "qwen2-bias"])
def test_logits_equal_peft_in_a_mixed_batch_with_prefix_hits(tmp_path, base_name):
    """Every step's logits of base, adapter and a second adapter, in mixed batches, the second
    wave served from the prefix cache, against HF + PEFT on the whole sequence."""
    base = save_hf(base_name, tmp_path / "base")
    save_adapter(base, tmp_path / "a", seed=11)
    save_adapter(base, tmp_path / "b", seed=12, targets=["k_proj", "o_proj", "up_proj"], r=2)
    engine = _engine(tmp_path)
    recorder = _Logits()
    engine.add_observer(recorder)
    loras = {"base": None, "a": LoRARequest("a", str(tmp_path / "a"))}
    loras["b"] = LoRARequest("b", str(tmp_path / "b"))
    prompt = _prompt(25, 41)
    first = _run(engine, {f"{tag}.1": (prompt, lora) for tag, lora in loras.items()})
    second = _run(engine, {f"{tag}.2": (prompt, lora) for tag, lora in loras.items()})
    assert all(second[f"{tag}.2"].metrics.num_cached_tokens == 24 for tag in loras)
    oracles = {"base": base, "a": peft_model(base, tmp_path / "a")}
    oracles["b"] = peft_model(base, tmp_path / "b")
    worst = 0.0
    for rid, out in {**first, **second}.items():
        tokens = out.outputs[0].token_ids
        want = _logits_hf(oracles[rid.split(".")[0]], prompt + tokens[:-1])[len(prompt) - 1 :]
        for i in range(len(tokens)):
            worst = max(worst, (recorder.rows[(rid, i)] - want[i]).abs().max().item())
    assert worst <= TOL, worst

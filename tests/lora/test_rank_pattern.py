"""PEFT adapters with per-module ranks and alphas (rank_pattern, alpha_pattern) against PEFT:
which key sets a module's rank or alpha (PEFT's matching rule and its precedence), the engine's
greedy tokens and logprobs in a mixed batch, the reference's merge, and what stays refused."""

from __future__ import annotations

import json
import shutil

import peft
import pytest
import torch
from peft.utils.other import get_pattern_key

from kvpage import LoRAError, LoRARequest
from kvpage.lora.adapter import PeftReader
from kvpage.reference.generator import prompt_logits
from kvpage.reference.lora_merge import merged_model, pattern_value, read_adapter

from ..model.hf_models import save_hf
from .adapters import edit_config, peft_model, save_adapter
from .test_lora import TOL, _engine, _greedy_hf, _logits_hf, _prompt, _run

# Sorted as PEFT writes adapter_config.json (sort_keys), so the model PEFT builds in memory and
# the one it loads from the file agree on which key wins: layer 1's v_proj is rank 2, every
# other v_proj 8, every down_proj 6, the rest r=4; q_proj alpha 3, layer 0's down_proj 20.
RANKS = {"layers.1.self_attn.v_proj": 2, "mlp.down_proj": 6, "v_proj": 8}
ALPHAS = {"layers.0.mlp.down_proj": 20, "q_proj": 3}

NAMES = [
    f"model.layers.{i}.{block}.{m}"
    for i in range(3)
    for block, mods in (("self_attn", ("q_proj", "v_proj", "o_proj")), ("mlp", ("down_proj",)))
    for m in mods
]
PATTERN_SETS = [
    {"q_proj": 1},
    {"layers.1.self_attn.v_proj": 1, "v_proj": 2},  # the specific key first: it wins at layer 1
    {"v_proj": 2, "layers.1.self_attn.v_proj": 1},  # the general key first: it wins everywhere
    {"mlp.down_proj": 1, "down_proj": 2},
    {"proj": 1, "_proj": 2, "attn.q_proj": 3},  # not at a dot boundary: no match; a tail: match
    {".*_proj": 1, "q_proj": 2},  # a regular expression over the tail
    {"^model.layers.0.self_attn.q_proj": 1},  # anchored: only a whole-name match
    {"layers.1": 1, "layers\\.[02]\\.self_attn\\.(q|v)_proj": 2},
    {"model.layers.1.mlp.down_proj": 1, "layers.1.mlp": 2},
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("rank-pattern")
    base = save_hf("llama-gqa-8q-2kv", root / "base")
    save_adapter(base, root / "pat", seed=11, rank_pattern=RANKS, alpha_pattern=ALPHAS)
    save_adapter(  # rsLoRA with patterns: alpha / sqrt(r) of each module's own r and alpha
        base,
        root / "rs",
        seed=12,
        targets=["q_proj", "k_proj", "up_proj"],
        r=2,
        lora_alpha=4,
        use_rslora=True,
        rank_pattern={"k_proj": 8, "layers.0.mlp.up_proj": 5},
        alpha_pattern={"up_proj": 16},
    )
    return base, root


@pytest.mark.parametrize("patterns", PATTERN_SETS, ids=lambda p: ",".join(p))
def test_the_key_a_module_gets_is_pefts(patterns):
    """The engine's matcher and the reference's own both pick the key PEFT's get_pattern_key
    picks, for every module name (PEFT returns the name itself when no key matches)."""
    for name in NAMES:
        want = get_pattern_key(list(patterns), name)
        want = None if want == name and name not in patterns else want
        assert PeftReader().pattern_key(patterns, name) == want, name
        assert pattern_value(patterns, name, None) == (None if want is None else patterns[want])


def test_each_module_has_pefts_rank_and_scale(setup):
    base, root = setup
    for tag in ("pat", "rs"):
        engine = _engine(root)
        adapter = engine.load_lora_adapter(LoRARequest(tag, str(root / tag)))
        oracle = peft_model(base, root / tag)
        want = {}
        for name, module in oracle.named_modules():
            if isinstance(module, peft.tuners.lora.LoraLayer):
                layer, proj = int(name.split(".layers.")[1].split(".")[0]), name.split(".")[-1]
                want[layer, proj] = (module.r["default"], module.scaling["default"])
        got = {
            where: (a.shape[0], adapter.scale_of(where))
            for where, (a, _) in adapter.weights.items()
        }
        assert got.keys() == want.keys()
        for where, (rank, scale) in want.items():
            assert got[where][0] == rank and got[where][1] == pytest.approx(scale), (tag, where)
        assert len({r for r, _ in want.values()}) > 1 and len({s for _, s in want.values()}) > 1
        assert adapter.rank == max(r for r, _ in want.values())
        _, _, _, scales = read_adapter(root / tag)  # the reference's own read
        assert scales == pytest.approx({w: s for w, (_, s) in want.items()})


def test_a_mixed_batch_with_pattern_adapters_matches_peft(setup):
    """Base and the two pattern adapters in the same steps: each request's greedy tokens and
    chosen logprobs equal HF + PEFT's (its model loaded from the directory)."""
    base, root = setup
    engine = _engine(root)
    loras = {"base": None}
    loras.update({tag: LoRARequest(tag, str(root / tag)) for tag in ("pat", "rs")})
    prompts = {f"p{i}": _prompt(10 + 4 * i, 40 + i) for i in range(3)}
    requests = {
        f"{pid}-{tag}": (prompt, lora)
        for pid, prompt in prompts.items()
        for tag, lora in loras.items()
    }
    done = _run(engine, requests)
    oracles = {
        "base": base,
        "pat": peft_model(base, root / "pat"),
        "rs": peft_model(base, root / "rs"),
    }
    changed = 0
    for rid, (prompt, _) in requests.items():
        tag = rid.split("-")[1]
        tokens = done[rid].outputs[0].token_ids
        assert tokens == _greedy_hf(oracles[tag], prompt), rid
        logits = _logits_hf(oracles[tag], prompt + tokens[:-1])
        want = torch.log_softmax(logits[len(prompt) - 1 :], -1)
        expected = [want[i, t].item() for i, t in enumerate(tokens)]
        got = done[rid].outputs[0].token_logprobs
        assert max(abs(g - e) for g, e in zip(got, expected, strict=True)) <= TOL, rid
        if tag != "base":
            changed += tokens != done[rid.replace(tag, "base")].outputs[0].token_ids
    assert changed >= 3, "the pattern adapters hardly changed a token: a weak test"


def test_the_reference_merges_pattern_adapters_as_peft(setup):
    base, root = setup
    engine = _engine(root)
    prompt = _prompt(17, 50)
    for tag in ("pat", "rs"):
        merged = merged_model(engine.model, root / tag)  # its own read of the directory
        want = _logits_hf(peft_model(base, root / tag), prompt)
        got = prompt_logits(merged, prompt).float()
        assert (got - want).abs().max().item() <= TOL, tag


def test_the_files_order_decides_which_key_wins(setup, tmp_path):
    """PEFT writes the patterns sorted and loads the first matching key of the file: made in
    memory with the general key first, layer 1's v_proj is rank 8, but the file says the
    specific key (rank 2) wins there, and PEFT itself cannot load it. The engine refuses it,
    naming the key; with the file's order put back as made, engine and PEFT agree."""
    base, root = setup
    path = save_adapter(
        base,
        tmp_path / "order",
        seed=13,
        targets=["v_proj"],
        rank_pattern={"v_proj": 8, "layers.1.self_attn.v_proj": 2},
    )
    assert list(json.loads((path / "adapter_config.json").read_text())["rank_pattern"]) == [
        "layers.1.self_attn.v_proj",
        "v_proj",
    ]
    with pytest.raises(RuntimeError, match="size mismatch"):
        peft_model(base, path)
    engine = _engine(root)
    with pytest.raises(
        LoRAError, match=r"layer 1 v_proj: .*rank_pattern 'layers.1.self_attn.v_proj': 2"
    ):
        engine.load_lora_adapter(LoRARequest("order", str(path)))
    edit_config(path, rank_pattern={"v_proj": 8, "layers.1.self_attn.v_proj": 2})
    lora = LoRARequest("order", str(path))
    prompt = _prompt(13, 60)
    done = _run(engine, {"x": (prompt, lora)})
    assert done["x"].outputs[0].token_ids == _greedy_hf(peft_model(base, path), prompt)


def test_two_orders_of_the_same_patterns_are_two_adapters(setup, tmp_path):
    """Reordering alpha_pattern keys changes a module's alpha, not the sorted JSON: the
    identity (the cache namespace) must tell them apart."""
    _, root = setup
    first, second = tmp_path / "x1", tmp_path / "x2"
    shutil.copytree(root / "pat", first)
    shutil.copytree(root / "pat", second)
    edit_config(first, alpha_pattern={"layers.0.self_attn.q_proj": 16, "q_proj": 3})
    edit_config(second, alpha_pattern={"q_proj": 3, "layers.0.self_attn.q_proj": 16})
    engine = _engine(root)
    one = engine.load_lora_adapter(LoRARequest("x", str(first)))
    two = engine.load_lora_adapter(LoRARequest("x", str(second)))
    assert one.scale_of((0, "q_proj")) == pytest.approx(16 / 4)
    assert two.scale_of((0, "q_proj")) == pytest.approx(3 / 4)
    assert one.identity != two.identity


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"use_dora": True}, r"use_dora=true \(DoRA\)"),
        ({"lora_bias": True}, "lora_bias=true"),
        ({"bias": "lora_only"}, "bias='lora_only'"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"trainable_token_indices": [1, 2]}, "trainable_token_indices"),
        ({"layer_replication": [[0, 2]]}, "layer_replication"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out"),
        ({"target_modules": ["q_proj", "lm_head"]}, "lm_head"),
        ({"target_modules": ["embed_tokens", "v_proj"]}, "embed_tokens"),
        ({"rank_pattern": {"v_proj": 0}}, r"rank_pattern\['v_proj'\]=0"),
        ({"rank_pattern": {"v_proj": "8"}}, r"rank_pattern\['v_proj'\]='8'"),
        ({"alpha_pattern": {"q_proj": None}}, r"alpha_pattern\['q_proj'\]=None"),
        ({"rank_pattern": {"v_proj(": 8}}, "rank_pattern key 'v_proj\\(' is not a regular"),
        ({"rank_pattern": ["v_proj"]}, "rank_pattern=\\['v_proj'\\]"),
        ({"rank_pattern": {"mlp.down_proj": 4}}, "rank_pattern 'mlp.down_proj': 4 imply"),
    ],
)
def test_what_stays_refused_is_named(setup, tmp_path, changes, named):
    _, root = setup
    path = tmp_path / "bad"
    shutil.copytree(root / "pat", path)
    edit_config(path, **changes)
    with pytest.raises(LoRAError, match=named):
        _engine(root).load_lora_adapter(LoRARequest("bad", str(path)))


def test_max_lora_rank_bounds_the_largest_module_rank(setup):
    _, root = setup
    with pytest.raises(LoRAError, match="rank_pattern 'v_proj': 8 is above max_lora_rank=6"):
        _engine(root, max_lora_rank=6).load_lora_adapter(LoRARequest("p", str(root / "pat")))
    assert _engine(root, max_lora_rank=8).load_lora_adapter(LoRARequest("p", str(root / "pat")))

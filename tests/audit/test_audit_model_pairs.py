"""Which listed models are probed against which, and the pair verdicts on synthetic answers:
aliases (one model under several names, which may share a cache) are never a pair, a cross hit
between names nothing shows to be different models is no finding, and a model whose own prefix
does not hit makes a miss across models inconclusive, never "isolated"."""

from __future__ import annotations

from types import SimpleNamespace

from kvpage.audit.capabilities import Capabilities
from kvpage.audit.classify import INCONCLUSIVE
from kvpage.audit.completion import Completion
from kvpage.audit.config import AuditConfig
from kvpage.audit.model_pairs import ADAPTER, DISTINCT, UNKNOWN, ModelPair, plan_pairs
from kvpage.audit.plan import estimate, fit
from kvpage.audit.suites.models import SHARED_MODELS, Direction, _row
from kvpage.audit.suites.timing import ISOLATED

CTX = SimpleNamespace(cfg=SimpleNamespace(alpha=0.01))


def card(name: str, root: str | None = None, parent: str | None = None) -> dict:
    return {"id": name, "root": root, "parent": parent}


def test_the_base_is_probed_against_each_adapter_then_adapters_in_turn():
    cards = [card("x", "/w"), card("a", "/a", "x"), card("b", "/b", "x"), card("c", "/c", "x")]
    plan = plan_pairs(cards, "x", cap=6)
    assert [(p.first, p.second) for p in plan.pairs] == [
        ("x", "a"), ("x", "b"), ("x", "c"), ("a", "b"), ("b", "c"),
    ]  # fmt: skip
    assert {p.relation for p in plan.pairs} == {ADAPTER} and plan.skipped is None
    capped = plan_pairs(cards, "x", cap=2)
    assert len(capped.pairs) == 2 and "x/c, a/b, b/c left out" in capped.left_out


def test_aliases_are_one_model_and_one_model_is_skipped():
    aliases = plan_pairs([card("m1", "/w"), card("m2", "/w")], "m2", cap=6)
    assert not aliases.pairs and "several names of one model" in aliases.skipped
    assert aliases.notes == [
        "'m1' is another name of 'm2' (the same root, no parent): probed as one model"
    ]
    one = plan_pairs([card("m", "/w")], "m", cap=6)
    assert one.skipped == "/v1/models lists one model ('m'): no other model to keep apart from it"
    assert plan_pairs([], "m", cap=6).skipped.startswith("/v1/models listed no models")
    merged = plan_pairs([card("m1", "/w"), card("m2", "/w"), card("a", "/a", "m1")], "m1", 6)
    assert [(p.first, p.second) for p in merged.pairs] == [("m1", "a")]


def test_relations_come_from_roots_and_parents():
    plan = plan_pairs([card("p", "/p"), card("q", "/q"), card("r")], "zzz", cap=6)
    assert {(p.first, p.second): p.relation for p in plan.pairs} == {
        ("p", "q"): DISTINCT, ("p", "r"): UNKNOWN, ("q", "r"): UNKNOWN,
    }  # fmt: skip


def direction(owner: str, viewer: str, cold: int, same: int, cross: int) -> Direction:
    d = Direction(owner, viewer)
    for arm, n in (("cold", cold), ("same", same), ("cross", cross)):
        d.arms[arm].append(Completion("", cached_tokens=n))
    return d


def verdict(relation: str, first: tuple, second: tuple, alike: bool | None = None) -> str:
    pair = ModelPair("x", "y", relation)
    dirs = [direction("x", "y", *first), direction("y", "x", *second)]
    return _row(CTX, pair, dirs, True, alike)["verdict"]


def test_pair_verdicts_by_cached_tokens():
    assert verdict(ADAPTER, (0, 64, 0), (0, 64, 0)) == ISOLATED
    assert verdict(ADAPTER, (0, 64, 64), (0, 64, 0)) == SHARED_MODELS
    # a chat template or BOS cached for every request is no hit: above a fresh prompt's only
    assert verdict(ADAPTER, (16, 64, 16), (16, 64, 16)) == ISOLATED
    # caching off (or not reported as hits): a miss across models proves nothing
    assert verdict(ADAPTER, (0, 0, 0), (0, 0, 0)) == INCONCLUSIVE
    assert verdict(ADAPTER, (0, 64, 0), (0, 0, 0)) == INCONCLUSIVE


def test_a_hit_between_names_not_shown_to_differ_is_no_finding():
    hit = ((0, 64, 64), (0, 64, 64))
    assert verdict(UNKNOWN, *hit, alike=True) == INCONCLUSIVE  # they answer alike: one model?
    assert verdict(UNKNOWN, *hit, alike=None) == INCONCLUSIVE  # answers not compared
    assert verdict(UNKNOWN, *hit, alike=False) == SHARED_MODELS  # they answer differently
    assert verdict(DISTINCT, *hit) == SHARED_MODELS


def test_the_plan_counts_the_models_suite_and_shrinks_its_pairs():
    cards = [card("x", "/w")] + [card(f"a{i}", f"/a{i}", "x") for i in range(5)]
    caps = Capabilities(cached_tokens=True, models=[c["id"] for c in cards], model_cards=cards)
    cfg = AuditConfig(base_url="http://h:1", model="x", suites=("models",), model_pairs=6)
    assert estimate(cfg, True, caps)["models"] == 6 * 14
    assert estimate(cfg, True)["models"] == 0  # capabilities unknown: nothing planned
    small, notes = fit(cfg, 50, True, caps)
    assert small.model_pairs == 3 and estimate(small, True, caps)["models"] <= 50
    assert notes == ["model_pairs 6 -> 3 to fit the request budget"]  # nothing else saves any

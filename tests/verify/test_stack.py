"""The whole-stack suite (kvpage.verify.stack): the text oracle on hand cases, the generator's
reproducibility, the honest server and router passing, every server and router mutant caught
with its own attribution class, and the router's brute-force model agreeing with the router."""

from __future__ import annotations

import random

import pytest
import torch

from kvpage.model import load_model
from kvpage.serve_replicas.prefix_router import Router, RouterConfig, RoutingKey
from kvpage.verify.diff import REQUIRED_FIELDS, WHERE_TO_LOOK
from kvpage.verify.mutants.base import MissingSeam
from kvpage.verify.stack.expect import CacheModel
from kvpage.verify.stack.mutants import STACK_MUTANTS, plant_server
from kvpage.verify.stack.router_model import RouterModel, router_cases
from kvpage.verify.stack.scenario import AdminEvent, GenRequest, make_scenario, pick_stops
from kvpage.verify.stack.suite import run_server_mutant, run_server_suite
from kvpage.verify.stack.text_oracle import (
    ByteText,
    expected_choice,
    find_stop,
    text_offsets,
    token_text,
)

MODEL = "builtin:tiny-llama"
TOK = ByteText()  # the oracle's byte tokenizer, by its definition
EOS = TOK.NUM_BYTES + 1
VOCAB = TOK.NUM_BYTES + 2


def pieces(data: bytes) -> list[bytes]:
    return [bytes([b]) for b in data]


# --- the text oracle, by hand --------------------------------------------------------------------
def test_offsets_count_replacement_characters_and_whole_multibyte_characters():
    # "a", a lone continuation byte (U+FFFD), "b", é (C3 A9), then EOS after everything
    data = pieces(b"a\x80b\xc3\xa9") + [b""]
    assert text_offsets(data, 99) == [0, 1, 2, 3, 3, 4]


def test_an_incomplete_character_before_eos_is_one_replacement_character():
    assert text_offsets(pieces(b"a\xe2\x82") + [b""], 99) == [0, 1, 1, 2]


def test_a_stop_string_that_ends_in_a_multibyte_character_is_seen_when_it_completes():
    cut = find_stop(pieces("xé!".encode()), ["é"])
    assert (cut.tokens, cut.chars, cut.stop) == (3, 1, "é")  # x, C3, A9: é is whole at A9


def test_a_stop_string_that_starts_inside_a_multibyte_character_never_matches_its_bytes():
    assert find_stop(pieces("ü".encode()), ["\xbc"]) is None  # ü is C3 BC; "\xbc" is ¼'s char


def test_the_first_stop_string_to_complete_wins_over_one_that_starts_earlier():
    cut = find_stop(pieces(b"abcd"), ["abcd", "c"])
    assert (cut.tokens, cut.chars, cut.stop) == (3, 2, "c")


def test_expected_choice_truncates_before_the_stop_and_reports_tokens_up_to_it():
    ids = list("héllo wörld".encode()) + [EOS]
    logits = [torch.zeros(VOCAB) for _ in ids]
    choice = expected_choice(TOK, 0, ids, logits, "stop", ["lo w"], 2)
    assert choice.text == "hél" and choice.finish_reason == "stop" and choice.stop == "lo w"
    assert choice.token_ids == list("héllo w".encode())
    offsets = [e.offset for e in choice.entries]
    assert offsets == [0, 1, 1, 2, 3, 3, 3, 3]  # the stop string's tokens: where the text ends
    streamed = expected_choice(TOK, 0, ids, logits, "stop", ["lo w"], 2, stream=True)
    assert [e.offset for e in streamed.entries] == [0, 1, 1, 2, 3, 4, 5, 3]


def test_expected_choice_without_a_stop_keeps_the_references_finish_and_eos():
    ids = [*b"ab", EOS]
    choice = expected_choice(TOK, 1, ids, [torch.zeros(VOCAB)] * 3, "stop", ["zz"], None)
    assert (choice.text, choice.finish_reason, choice.token_ids, choice.entries) == (
        "ab",
        "stop",
        ids,
        None,
    )


def test_expected_logprobs_are_the_raw_log_softmax():
    logits = torch.tensor([2.0, 1.0] + [0.0] * (VOCAB - 2))
    entry = expected_choice(TOK, 0, [1], [logits], "length", [], 1).entries[0]
    lp = torch.log_softmax(logits, -1)
    assert entry.logprob == pytest.approx(float(lp[1]))
    assert entry.top == {"\x00": pytest.approx(float(lp[0]))}


def test_a_partial_utf8_byte_is_spelled_by_its_id():
    assert token_text(b"\xc3", 0xC3) == "token_id:195" and token_text(b"", EOS) == "token_id:257"


def test_the_cache_model_is_block_granular_per_namespace_and_follows_the_switches():
    cache = CacheModel(block_size=4)
    a, b = ("tenant", "a"), ("tenant", "b")
    assert cache.admit(a, tuple(range(10))) == 0
    assert cache.admit(a, (*range(9), 99)) == 8  # 9 shared tokens: two whole blocks
    assert cache.admit(b, tuple(range(10))) == 0  # another tenant: nothing
    assert cache.admit(a, tuple(range(9))) == 8  # capped: one prompt token is computed
    cache.switch(a, False)
    assert cache.admit(a, (*range(8), 7)) == 0 and cache.switched
    cache.switch(a, True)
    assert cache.admit(a, (*range(8), 7, 7)) == 8  # the prompt sent while off was not published


# --- the generator -------------------------------------------------------------------------------
def test_scenarios_are_reproducible_and_cover_the_dimensions():
    one = make_scenario(random.Random(3), TOK, True, 40, True)
    assert one == make_scenario(random.Random(3), TOK, True, 40, True)
    reqs = one.requests
    assert {r.stream for r in reqs} == {True, False} and {r.chat for r in reqs} == {True, False}
    assert max(r.n for r in reqs) > 1 and {r.logprobs is None for r in reqs} == {True, False}
    assert len({r.tenant for r in reqs}) == 3
    assert any(isinstance(e, AdminEvent) and not e.enabled for e in one.events)
    assert any(
        any(ord(c) > 127 for c in str(r.prompt)) or isinstance(r.prompt, tuple) for r in reqs
    )


def test_stop_strings_come_from_the_text_and_never_hold_a_replacement_character():
    rng = random.Random(1)
    text = "ab\ufffdcdé€fg" * 3
    stops = [s for _ in range(50) for s in pick_stops(rng, text, 3)]
    assert stops and all("\ufffd" not in s for s in stops)
    assert sum(s in text for s in stops) > len(stops) / 2
    assert any(any(ord(c) > 127 for c in s) and s in text for s in stops)


# --- the suite against the honest stack and each mutant ------------------------------------------
@pytest.fixture(scope="module")
def model():
    return load_model(MODEL, torch.float32)


def test_the_honest_stack_passes(model):
    m, tok = model
    cases = run_server_suite(m, tok, MODEL, seed=0, budget_s=120)
    failures = [f.message for c in cases for f in c.failures]
    assert failures == []
    servers = [c for c in cases if c.suite == "server"]
    assert len(servers) == 2 and all(c.requests > 10 for c in servers)
    assert sum(c.suite == "router" for c in cases) > 5


@pytest.mark.parametrize("mutant", STACK_MUTANTS, ids=lambda m: m.name)
def test_each_stack_mutant_is_caught_with_its_class(model, mutant):
    m, tok = model
    result = run_server_mutant(mutant, m, tok, MODEL, seed=0, budget_s=120)
    if mutant.name == "completion_decoded_without_prompt":  # no SentencePiece decoder here
        assert result.not_applicable and not result.caught
        return
    assert result.caught, mutant.name
    assert result.attributed_class == mutant.expected_class, result.first_failure
    assert result.attribution_ok, result.divergence["attribution"]["missing"]


def test_the_attribution_classes_are_declared():
    for cls in {m.expected_class for m in STACK_MUTANTS} | {"server_protocol"}:
        assert REQUIRED_FIELDS[cls] and WHERE_TO_LOOK[cls]


def test_an_undeclared_server_seam_is_refused():
    with pytest.raises(MissingSeam):
        plant_server(None, "loop", object())


# --- the router's brute-force model --------------------------------------------------------------
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_router_model_agrees_with_the_router_on_generated_sequences(seed):
    cases = router_cases(seed)
    assert [f.message for c in cases for f in c.failures] == []


def test_the_router_model_separates_tenants_and_evicts_the_least_recently_used():
    cfg = RouterConfig(
        chunk_tokens=2, min_match_tokens=2, min_match_fraction=0.0, max_nodes_per_replica=4
    )
    model, router = RouterModel(cfg), Router(cfg)
    loads = {"r0": 0, "r1": 0}
    steps = [  # (key, the decision both must make)
        (RoutingKey("tenant:a", (1, 2, 3, 4)), ("r0", "least-loaded", 0)),
        (RoutingKey("tenant:b", (1, 2, 3, 4)), ("r1", "least-loaded", 0)),  # other tenant
        (RoutingKey("tenant:a", (1, 2, 3, 4, 5, 6)), ("r0", "prefix", 4)),  # r0 holds 4 nodes
        (RoutingKey("tenant:a", (1, 2, 9, 9)), ("r0", "prefix", 2)),  # (5, 6) is evicted
        (RoutingKey("tenant:a", (1, 2, 3, 4, 5, 6)), ("r0", "prefix", 4)),
    ]
    for key, want in steps:
        d = router.choose(key, loads)
        assert model.choose(key, loads) == want == (d.replica, d.reason, d.matched_tokens)
        assert model.size("r0") == len(router.trees["r0"]) <= 4


def test_the_router_model_disagrees_with_each_router_mutant():
    for mutant in (m for m in STACK_MUTANTS if m.layer == "router"):
        cases = router_cases(0, mutant.apply)
        assert any(not c.passed for c in cases), mutant.name


def test_generated_requests_are_plain_data():
    req = make_scenario(random.Random(0), TOK, False, 3, False).requests[0]
    assert isinstance(req, GenRequest) and req.tenant is None

"""A speculating server (n-gram drafts): its greedy completions are a plain server's, token for
token; /metrics carries vLLM's spec_decode counters (and only when the engine speculates, as in
vLLM), which grow on a prompt that repeats itself; each finish line of the audit log carries the
request's draft tokens proposed and accepted."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from kvpage import EngineConfig, LLMEngine
from kvpage.server import ServerOptions, create_app
from kvpage.server.background import BackgroundServer

from .conftest import ADMIN, MODEL, Server

K = 3
SPEC = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1}
# A prompt that repeats itself: the n-gram lookup finds drafts in it, and the tiny model's
# greedy continuation repeats too, so some drafts are accepted.
REPEATING = "one two three one two three one two three one two three one two"
PREFIX = "kvpage_spec_decode_"


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory) -> Iterator[Server]:
    engine = LLMEngine(EngineConfig(model=MODEL, num_blocks=64, speculative_config=SPEC))
    audit = tmp_path_factory.mktemp("speculative") / "audit.jsonl"
    options = ServerOptions(model_name=MODEL, admin_token=ADMIN, shadow_rate=0.0, audit_log=audit)
    with BackgroundServer(create_app(engine, options)) as bg:
        yield Server(bg.url, audit)


def _complete(server: Server, prompt: str, max_tokens: int = 24) -> str:
    out = server.client().completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0
    )
    return out.choices[0].text


def _finish_lines(server: Server) -> list[dict]:
    lines = [json.loads(line) for line in server.audit_path.read_text().splitlines()]
    return [line for line in lines if line["event"] == "finish"]


def _spec_stats(server: Server) -> dict[str, int]:
    return {k: v for k, v in server.wait_idle().items() if k.startswith("spec_decode_")}


def test_greedy_completions_equal_a_plain_servers(spec_server, open_server):
    prompts = [REPEATING, "a b a b a b a b", "Speculation on a prompt that does not repeat."]
    for prompt in prompts:
        assert _complete(spec_server, prompt) == _complete(open_server, prompt), prompt
    assert _spec_stats(spec_server)["spec_decode_num_accepted_tokens"] > 0


def test_metrics_carry_vllms_spec_decode_counters(spec_server, open_server):
    before = spec_server.metrics()
    _complete(spec_server, REPEATING)
    spec_server.wait_idle()
    after = spec_server.metrics()
    grew = {name: after[name] - before.get(name, 0) for name in after if name.startswith(PREFIX)}
    drafts = grew[PREFIX + "num_drafts_total"]
    drafted = grew[PREFIX + "num_draft_tokens_total"]
    accepted = grew[PREFIX + "num_accepted_tokens_total"]
    assert drafts > 0 and accepted > 0 and accepted <= drafted <= K * drafts
    per_pos = {n: v for n, v in after.items() if n.startswith(PREFIX + "num_accepted_tokens_per")}
    assert set(per_pos) == {
        f"{PREFIX}num_accepted_tokens_per_pos_total{{position={i}}}" for i in range(K)
    }
    assert sum(per_pos.values()) == after[PREFIX + "num_accepted_tokens_total"]
    # position i is accepted only where every position before it was
    counts = [
        per_pos[f"{PREFIX}num_accepted_tokens_per_pos_total{{position={i}}}"] for i in range(K)
    ]
    assert counts == sorted(counts, reverse=True)
    total_drafted = after[PREFIX + "num_draft_tokens_total"]
    total_accepted = after[PREFIX + "num_accepted_tokens_total"]
    assert after[PREFIX + "acceptance_ratio"] == pytest.approx(total_accepted / total_drafted)
    assert after[PREFIX + "mean_acceptance_length"] == pytest.approx(
        1 + total_accepted / after[PREFIX + "num_drafts_total"]
    )
    # the engine's own counters, read through the admin API, say the same
    stats = _spec_stats(spec_server)
    assert stats["spec_decode_num_drafts"] == after[PREFIX + "num_drafts_total"]
    assert stats["spec_decode_num_draft_tokens"] == total_drafted
    # a server that does not speculate has no spec_decode family at all (vLLM's behaviour)
    assert not any(name.startswith(PREFIX) for name in open_server.metrics())


def test_audit_finish_lines_carry_the_draft_counts(spec_server, open_server):
    before, seen = _spec_stats(spec_server), len(_finish_lines(spec_server))
    _complete(spec_server, REPEATING + " one two three", max_tokens=20)
    after = _spec_stats(spec_server)
    (finish,) = _finish_lines(spec_server)[seen:]
    drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    assert (finish["num_draft_tokens"], finish["num_accepted_tokens"]) == (drafted, accepted)
    assert drafted > 0 and accepted > 0
    _complete(open_server, REPEATING, max_tokens=4)
    open_server.wait_idle()
    plain = _finish_lines(open_server)[-1]
    assert "num_draft_tokens" not in plain and "num_accepted_tokens" not in plain

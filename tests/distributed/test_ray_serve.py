"""`kvpage serve --replicas 2` on a local Ray instance: OpenAI-client parity with a single
engine, prefix routing beating round-robin on multi-turn chat, tenants isolated on every replica,
replicas named in metrics and audit, a killed replica that does not take the service down, and
LoRA adapters loaded at run time reaching every replica, the replacement of a killed one too.

One Ray instance and two applications for the whole module (ray_service.serve_apps); the kill
tests run last: on the round-robin application, then on the prefix one (the adapters')."""

from __future__ import annotations

import itertools
import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from kvpage import LLM, SamplingParams
from kvpage.model import load_model
from kvpage.reference.generator import generate
from kvpage.reference.lora_merge import merged_model
from kvpage.serve_replicas.ray_serve import ENGINE_DEPLOYMENT, REPLICA_HEADER
from kvpage.server.chat import simple_template
from kvpage.verify.lora_adapters import LoraSpec, save_peft
from tests.waiting import READY_S, settled, wait_until

from .ray_service import ADMIN, MODEL, serve_apps, serve_log

pytestmark = pytest.mark.ray

PROMPT = "The paged KV cache keeps every block "
TOKEN_IDS = {"return_token_ids": True}
BLOCK = 16  # the engine's default block size, which the router's chunks follow


@pytest.fixture(scope="module")
def apps(tmp_path_factory):
    yield from serve_apps(tmp_path_factory.mktemp("ray"))


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(MODEL, num_blocks=256)


def _expected(offline: LLM, prompt: str) -> tuple[list[int], str]:
    out = offline.generate(prompt, SamplingParams(max_tokens=24), use_tqdm=False)[0].outputs[0]
    return out.token_ids, out.text


# --- parity --------------------------------------------------------------------------------
def test_completion_and_stream_match_a_single_engine(apps, offline):
    ids, text = _expected(offline, PROMPT)
    client = apps["prefix"].client()
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0.0, extra_body=TOKEN_IDS
    )
    assert r.choices[0].model_extra["token_ids"] == ids
    assert r.choices[0].text == text
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0.0, stream=True,
        extra_body=TOKEN_IDS, stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]] == ids
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == len(ids)


def test_chat_matches_a_single_engine(apps, offline):
    messages = [
        {"role": "system", "content": "Answer in bytes."},
        {"role": "user", "content": "What is a block table?"},
    ]
    ids, text = _expected(offline, simple_template(messages))
    r = (
        apps["prefix"]
        .client()
        .chat.completions.create(
            model=MODEL, messages=messages, max_tokens=24, temperature=0.0, extra_body=TOKEN_IDS
        )
    )
    assert r.choices[0].model_extra["token_ids"] == ids
    assert r.choices[0].message.content == text


def test_bad_input_is_the_single_servers_400(apps):
    r = apps["prefix"].post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -1})
    assert r.status_code == 400
    assert "max_tokens" in r.json()["error"]["message"]
    r = apps["prefix"].post("/v1/completions", {"prompt": "x"}, key="key-mallory")
    assert r.status_code == 401


# --- routing -------------------------------------------------------------------------------
def _conversation(app, index: int, turns: int) -> list[tuple[int, int]]:
    """One chat that grows turn by turn: (prompt tokens, cached tokens) per turn."""
    key = "key-alice" if index % 2 == 0 else "key-bob"
    messages = [
        {"role": "system", "content": f"Conversation {index}: answer as briefly as you can."}
    ]
    usage = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Question {turn} of conversation {index}?"})
        body = {"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0.0}
        r = app.post("/v1/chat/completions", body, key=key)
        assert r.status_code == 200, r.text
        reply = r.json()
        messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
        u = reply["usage"]
        usage.append((u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"]))
    return usage


def _multi_turn(app, conversations: int = 6, turns: int = 4, clients: int = 3):
    """Per conversation, (prompt tokens, cached tokens) per turn."""
    with ThreadPoolExecutor(clients) as pool:
        return list(pool.map(lambda i: _conversation(app, i, turns), range(conversations)))


def _hit_rate(runs) -> float:
    return sum(c for run in runs for _, c in run) / sum(p for run in runs for p, _ in run)


def test_prefix_routing_hits_more_than_round_robin(apps):
    prefix_runs, rr_runs = _multi_turn(apps["prefix"]), _multi_turn(apps["rr"])
    prefix, rr = _hit_rate(prefix_runs), _hit_rate(rr_runs)
    print(f"\nmulti-turn prefix hit rate: prefix router {prefix:.3f}, round-robin {rr:.3f}")
    assert prefix > rr
    # Affinity, turn by turn: with 3 clients the load gap never exceeds the bound (4), so each
    # turn goes where the previous one went and finds at least its full blocks there.
    for run in prefix_runs:
        for (before, _), (_, cached) in zip(run, run[1:], strict=False):
            assert cached >= before - before % BLOCK, run


# --- isolation -----------------------------------------------------------------------------
def test_tenant_salt_is_the_same_on_every_replica(apps):
    app = apps["prefix"]
    digests = [report.salt_digests for report in app.reports().values()]
    assert len(digests) == 2 and digests[0] == digests[1]
    assert set(digests[0]) == {"alice", "bob"} and digests[0]["alice"] != digests[0]["bob"]


def test_no_cross_tenant_hit_on_any_replica(apps):
    app = apps["prefix"]
    body = {"model": MODEL, "prompt": "Tenant wall " * 12, "max_tokens": 4, "temperature": 0.0}
    first, again = (app.post("/v1/completions", body).json() for _ in range(2))
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # alice's cache works
    for replica in app.replica_ids():  # bob, straight to each replica, alice's blocks or not
        status, reply = app.post_to(replica, "/v1/completions", body, key="key-bob")
        assert status == 200
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


# --- observability -------------------------------------------------------------------------
def _metrics_once_idle(url: str, replicas: set[str], timeout_s: float = READY_S) -> list:
    """/metrics samples once the router has seen every routed request complete. Ray reports a
    completion to the router after the reply has reached the client, so the last request of a
    previous test may still count for a moment; bounded, so a leak still fails."""

    def samples() -> list:
        text = httpx.get(f"{url}/metrics", timeout=60).text
        return [s for f in text_string_to_metric_families(text) for s in f.samples]

    def idle(found: list) -> bool:
        loads = [s.value for s in found if s.name == "kvpage_router_in_flight"]
        return len(loads) == len(replicas) and not any(loads)

    return settled(samples, idle, timeout_s)


def test_metrics_and_audit_name_the_replica(apps):
    app = apps["prefix"]
    replicas = set(app.replica_ids())
    samples = _metrics_once_idle(app.url, replicas)
    hits = {
        s.labels["replica"] for s in samples if s.name == "kvpage_prefix_cache_hits_tokens_total"
    }
    assert hits == replicas, f"replicas in /metrics: {hits}, live: {replicas}"
    routed = [s for s in samples if s.name == "kvpage_router_requests_total"]
    assert {s.labels["replica"] for s in routed} <= replicas and sum(s.value for s in routed) > 0
    in_flight = {
        s.labels["replica"]: s.value for s in samples if s.name == "kvpage_router_in_flight"
    }
    assert in_flight == dict.fromkeys(replicas, 0.0)  # every routed request was seen completing
    lines = [json.loads(line) for line in app.audit_path.read_text().splitlines()]
    audited = {line["replica"] for line in lines}
    assert audited == replicas, f"replicas in the audit log: {audited}, live: {replicas}"


def test_an_adapter_loaded_at_run_time_reaches_every_replica(apps, tmp_path):
    """Through the ingress, load and unload go to every replica: one that missed the load
    would answer 404 whenever the router sent it the adapter's requests."""
    app = apps["rr"]
    replicas = set(app.replica_ids())
    path = save_peft(LoraSpec("late", seed=7), load_model(MODEL)[0].config, tmp_path / "late")
    admin = {"X-Admin-Token": ADMIN, "Authorization": "Bearer key-alice"}
    load = {"lora_name": "late", "lora_path": str(path)}
    r = httpx.post(f"{app.url}/v1/load_lora_adapter", json=load, headers=admin, timeout=180)
    assert r.status_code == 200, r.text
    assert set(r.headers[REPLICA_HEADER].split(",")) == replicas
    body = {"model": "late", "prompt": PROMPT, "max_tokens": 4}
    for replica in replicas:
        status, reply = app.post_to(replica, "/v1/completions", body, "key-alice")
        assert status == 200 and reply["model"] == "late", (replica, reply)
    unload = {"lora_name": "late"}
    r = httpx.post(f"{app.url}/v1/unload_lora_adapter", json=unload, headers=admin, timeout=180)
    assert r.status_code == 200, r.text
    for replica in replicas:
        status, reply = app.post_to(replica, "/v1/completions", body, "key-alice")
        assert status == 404 and reply["error"]["param"] == "model", (replica, reply)
    r = httpx.post(
        f"{app.url}/v1/load_lora_adapter",
        json=load,
        headers=admin | {"X-Admin-Token": "no"},
        timeout=60,
    )
    assert r.status_code == 401, r.text  # every replica refused alike: their common answer


# --- faults --------------------------------------------------------------------------------
def _idle(app, replica: str, timeout: float = READY_S):
    """The replica's report once it runs nothing (bounded)."""
    return settled(lambda: app.reports()[replica], lambda r: not r.requests, timeout)


def test_client_gone_mid_stream_aborts_on_the_replica(apps):
    app = apps["rr"]
    aborts = {r.replica: r.stats["aborts"] for r in app.reports().values()}
    body = {"model": MODEL, "prompt": "Long story: ", "max_tokens": 3000, "stream": True}
    headers = {"Authorization": "Bearer key-alice"}
    with httpx.stream("POST", f"{app.url}/v1/completions", json=body, headers=headers,
                      timeout=120) as r:  # fmt: skip
        replica = r.headers[REPLICA_HEADER]
        assert next(line for line in r.iter_lines() if line.startswith("data: "))
    report = _idle(app, replica)  # left after one event: 3000 tokens are not generated
    assert (report.requests, report.leaked_blocks, report.invariants) == (0, 0, "ok")
    assert report.stats["aborts"] == aborts[replica] + 1


def _stream_until_killed(app, victim_of) -> tuple[str, str]:
    """Start a long stream, kill its replica after the first event; (replica, rest of body)."""
    body = {"model": MODEL, "prompt": "Long story: ", "max_tokens": 3000, "stream": True}
    headers = {"Authorization": "Bearer key-alice"}
    with httpx.stream("POST", f"{app.url}/v1/completions", json=body, headers=headers,
                      timeout=120) as r:  # fmt: skip
        assert r.status_code == 200
        replica = r.headers[REPLICA_HEADER]
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        ray.kill(ray.get_actor(victim_of(replica), namespace="serve"), no_restart=True)
        return replica, "\n".join(lines)


def _wait_for_replicas(app_name: str, count: int, timeout: float = READY_S) -> None:
    def replaced() -> bool:
        states = serve.status().applications[app_name].deployments[ENGINE_DEPLOYMENT]
        return states.replica_states.get("RUNNING", 0) == count and states.status == "HEALTHY"

    wait_until(replaced, f"{count} replicas running again", timeout, serve_log)


def test_killed_replica_fails_its_requests_and_the_service_survives(apps):
    app = apps["rr"]
    names = {r.replica: r.actor_name for r in app.reports().values()}
    dead, rest = _stream_until_killed(app, names.__getitem__)
    assert "replica serving this request died" in rest  # a clear error event, not a hang
    assert rest.rstrip().endswith("data: [DONE]")  # then the end, as the single server's
    assert '"finish_reason":"length"' not in rest.replace(" ", "")
    survivor = next(r for r in names if r != dead)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0.0}
    served = [app.post("/v1/completions", body) for _ in range(6)]
    assert [r.status_code for r in served] == [200] * 6
    assert dead not in {r.headers[REPLICA_HEADER] for r in served}
    report = app.reports()[survivor]
    assert (report.requests, report.leaked_blocks, report.invariants) == (0, 0, "ok")
    _wait_for_replicas(app.name, 2)  # Ray starts a replacement


# --- run-time adapters on a replica Ray starts later ----------------------------------------
def _adapter_tokens(app, model: str, prompt: list[int], replica: str | None = None):
    """(replica, greedy token ids) of one completion: through the router, or pinned."""
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    if replica is not None:
        status, reply = app.post_to(replica, "/v1/completions", body, "key-alice")
        assert status == 200, reply
        return replica, reply["choices"][0]["token_ids"]
    r = app.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    return r.headers[REPLICA_HEADER], r.json()["choices"][0]["token_ids"]


def _admin(app, path: str, body: dict) -> httpx.Response:
    headers = {"X-Admin-Token": ADMIN, "Authorization": "Bearer key-alice"}
    return httpx.post(f"{app.url}{path}", json=body, headers=headers, timeout=180)


def test_a_replica_started_after_a_run_time_load_serves_the_adapter(apps, tmp_path):
    """A replica killed after run-time loads is replaced; its replacement loads the adapters
    from the application's record before it is ready and gives an adapter's tokens: those of
    the reference generator on the base with the adapter merged (kvpage.reference), not the
    base's. The router reaches it for that adapter once it reports holding it. An adapter
    whose directory is gone by then fails to load there: /health names it, and the router
    sends its requests to the survivor only. After an unload no replica holds an adapter and
    the ingress answers 404 itself."""
    app = apps["prefix"]
    model = load_model(MODEL)[0]
    prompt = list(range(40, 72))
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    want = {}
    for name, seed in (("phoenix", 11), ("ash", 12)):
        path = save_peft(LoraSpec(name, seed=seed), model.config, tmp_path / name)
        r = _admin(app, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        assert r.status_code == 200, r.text
        want[name] = generate(merged_model(model, path), prompt, params).token_ids
        assert want[name] != generate(model, prompt, params).token_ids  # the adapter matters
        assert _adapter_tokens(app, name, prompt)[1] == want[name]
    shutil.rmtree(tmp_path / "ash")  # held in memory by the live replicas, gone for a new one

    names = {r.replica: r.actor_name for r in app.reports().values()}
    victim = sorted(names)[0]
    ray.kill(ray.get_actor(names[victim], namespace="serve"), no_restart=True)
    replaced = lambda: set(app.replica_ids()) - set(names)  # noqa: E731
    wait_until(lambda: len(app.replica_ids()) == 2 and replaced(), "a replacement", log=serve_log)
    (fresh,) = replaced()
    (survivor,) = set(names) - {victim}
    assert _adapter_tokens(app, "phoenix", prompt, fresh)[1] == want["phoenix"]  # at start

    fresh_prompts = itertools.count(1)  # a new prompt each: least-loaded, the fresh one's tree

    def routed_there() -> bool:
        return _adapter_tokens(app, "phoenix", [next(fresh_prompts), *prompt])[0] == fresh

    wait_until(routed_there, "the router sending the adapter to the replacement", log=serve_log)
    health = httpx.get(f"{app.url}/health", timeout=60).json()
    assert health["status"] == "degraded", health
    assert set(health["adapter_failures"]) == {fresh}
    assert "ash" in health["adapter_failures"][fresh], health
    status, reply = app.post_to(fresh, "/v1/completions", {"model": "ash", "prompt": prompt},
                                "key-alice")  # fmt: skip
    assert status == 404, reply  # the failed adapter is not served there
    for _ in range(4):  # new prompts would go to the fresh replica but for the filter
        seen, tokens = _adapter_tokens(app, "ash", [next(fresh_prompts), *prompt])
        assert seen == survivor
    assert _adapter_tokens(app, "ash", prompt)[1] == want["ash"]

    for name in want:  # ash: 200 on the survivor, 404 on the fresh replica (never had it)
        r = _admin(app, "/v1/unload_lora_adapter", {"lora_name": name})
        assert r.status_code == 200, r.text
    assert httpx.get(f"{app.url}/health", timeout=60).json()["status"] == "ok"
    r = app.post("/v1/completions", {"model": "phoenix", "prompt": prompt, "max_tokens": 2})
    assert r.status_code == 404 and "phoenix" in r.json()["error"]["message"], r.text
    assert REPLICA_HEADER not in r.headers  # answered at the ingress: no replica was asked

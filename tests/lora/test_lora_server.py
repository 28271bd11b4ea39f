"""`kvpage serve` with LoRA adapters: `model: name` selects one, /v1/models lists base and
adapters, adapters load and unload at run time behind the admin token; outputs equal PEFT's."""

from __future__ import annotations

from dataclasses import replace

import httpx
import pytest
import transformers
from prometheus_client.parser import text_string_to_metric_families

from kvpage import EngineConfig, LLMEngine
from kvpage.server import ServerOptions, create_app
from kvpage.server.background import BackgroundServer

from ..real_servers.models import CLIENT_TINY, build
from .adapters import peft_model, save_adapter
from .test_lora import MAX_TOKENS, _greedy_hf, _prompt

# A small Llama with a real BPE tokenizer (the server decodes text); wide init for clear argmaxes.
SPEC = replace(CLIENT_TINY, name="lora-tiny")

ADMIN = "lora-admin"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-server")
    directory = build(root / "base", SPEC)
    base = transformers.AutoModelForCausalLM.from_pretrained(directory).float().eval()
    save_adapter(base, root / "a", seed=1)
    save_adapter(base, root / "b", seed=2, targets=["q_proj", "down_proj"])
    engine = LLMEngine(
        EngineConfig(model=str(root / "base"), num_blocks=64, enable_lora=True, max_loras=2)
    )
    options = ServerOptions(
        model_name="base", admin_token=ADMIN, lora_modules=(("a", str(root / "a")),)
    )
    with BackgroundServer(create_app(engine, options)) as bg:
        yield bg.url, base, root


def test_models_lists_the_base_and_its_adapters(served):
    url, _, root = served
    cards = {c["id"]: c for c in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]}
    assert set(cards) == {"base", "a"}
    assert cards["a"]["parent"] == "base" and cards["a"]["root"] == str(root / "a")
    assert "parent" not in cards["base"]


def test_model_selects_the_adapter(served):
    url, base, root = served
    prompt = _prompt(14, 31)
    for model, oracle in (("a", peft_model(base, root / "a")), ("base", base)):
        r = httpx.post(
            f"{url}/v1/completions",
            json={
                "model": model,
                "prompt": prompt,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
            timeout=60,
        )
        r.raise_for_status()
        assert r.json()["model"] == model
        assert r.json()["choices"][0]["token_ids"] == _greedy_hf(oracle, prompt), model


def test_audit_lines_and_metrics_name_the_adapter(served):
    url, _, _ = served
    body = {"prompt": _prompt(9, 77), "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    for model in ("a", "base"):
        httpx.post(
            f"{url}/v1/completions", json={**body, "model": model}, timeout=60
        ).raise_for_status()
    events = httpx.get(f"{url}/admin/audit", headers={"X-Admin-Token": ADMIN}, timeout=30).json()
    finished = [e for e in events["events"] if e["event"] == "finish"]
    named = {e["request_id"]: e.get("adapter") for e in finished}
    assert set(named.values()) >= {"a", None}, named  # the base model's lines name none
    text = httpx.get(f"{url}/metrics", timeout=30).text
    found = {
        (s.name, s.labels.get("adapter"), s.value)
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name.startswith("kvpage_lora_")
    }
    assert any(n == "kvpage_lora_requests_total" and a == "a" and v >= 1 for n, a, v in found)
    assert any(
        n == "kvpage_lora_generation_tokens_total" and a == "a" and v >= 3 for n, a, v in found
    )


def test_adapters_load_and_unload_at_run_time_behind_the_token(served):
    url, base, root = served
    load = {"lora_name": "b", "lora_path": str(root / "b")}
    assert httpx.post(f"{url}/v1/load_lora_adapter", json=load, timeout=30).status_code == 401
    headers = {"X-Admin-Token": ADMIN}
    r = httpx.post(f"{url}/v1/load_lora_adapter", json=load, headers=headers, timeout=60)
    assert r.status_code == 200 and r.json()["loaded"] is True
    prompt = _prompt(12, 33)
    r = httpx.post(
        f"{url}/v1/completions",
        json={"model": "b", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
              "ignore_eos": True, "return_token_ids": True},
        timeout=60,
    )  # fmt: skip
    assert r.json()["choices"][0]["token_ids"] == _greedy_hf(peft_model(base, root / "b"), prompt)
    bad = {"lora_name": "c", "lora_path": str(root / "missing")}
    r = httpx.post(f"{url}/v1/load_lora_adapter", json=bad, headers=headers, timeout=30)
    assert r.status_code == 400 and "adapter_config.json" in r.json()["error"]["message"]
    gone = {"lora_name": "b"}
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json=gone, headers=headers, timeout=30)
    assert r.status_code == 200
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json=gone, headers=headers, timeout=30)
    assert r.status_code == 404
    r = httpx.post(f"{url}/v1/completions", json={"model": "b", "prompt": "x"}, timeout=30)
    assert r.status_code == 404

"""The pinned `openai` client (the test extra) against a kvpage app, through its typed API: echo
with logprobs, `max_tokens=0` echo, a batch of prompts, vLLM's `prompt_logprobs` (extra_body) on
completions and chat, /v1/models' fields, and vLLM's /tokenize and /detokenize (httpx: the
client has no method for them). Logprobs are checked against transformers' on the same weights
and the same prompt ids; chat prompts are rendered by the model's own Jinja template."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import httpx
import openai
import pytest
import torch
import transformers

from kvpage import EngineConfig, LLMEngine
from kvpage.server import ServerOptions, create_app
from kvpage.server.background import BackgroundServer

from ..real_servers.models import CLIENT_TINY, build

TOL = 1e-4  # fp32 on both sides
SPEC = replace(CLIENT_TINY, name="client-tiny")
NAMES = ("first", "second")  # --served-model-name first second
MAX_MODEL_LEN = 256
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
PROMPT = "The paged cache keeps every block"
MESSAGES = [{"role": "user", "content": "Say something short."}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    directory = build(tmp_path_factory.mktemp("client-model"), SPEC)
    path = directory / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "chat_template": CHAT_TEMPLATE}))
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory).float().eval()
    tok = transformers.AutoTokenizer.from_pretrained(directory)
    engine = LLMEngine(
        EngineConfig(model=str(directory), num_blocks=64, max_model_len=MAX_MODEL_LEN)
    )
    options = ServerOptions(model_name=NAMES[0], served_model_names=NAMES, shadow_rate=0.0)
    with BackgroundServer(create_app(engine, options)) as bg:
        client = openai.OpenAI(base_url=f"{bg.url}/v1", api_key="unused", max_retries=0, timeout=60)
        yield bg.url, client, hf, tok


def _ref(hf, ids: list[int]) -> torch.Tensor:
    """(L, V) log-softmax: row p scores token p + 1."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def _prompt_ids(url: str, prompt: str) -> list[int]:
    r = httpx.post(f"{url}/tokenize", json={"prompt": prompt}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def _chat_ids(tok, messages: list[dict]) -> list[int]:
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return ids if isinstance(ids, list) else list(ids["input_ids"])  # BatchEncoding when newer


def test_echo_with_logprobs(served):
    url, client, hf, tok = served
    ids = _prompt_ids(url, PROMPT)
    r = client.completions.create(
        model=NAMES[1], prompt=PROMPT, echo=True, logprobs=2, max_tokens=3, temperature=0.0
    )
    assert r.model == NAMES[0]  # responses name the first served name, as vLLM's
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 3
    choice = r.choices[0]
    # the tiny tokenizer spells spaces as U+2581 (its vocabulary is bytes, no decoder)
    assert choice.text.startswith(tok.decode(ids)) and choice.finish_reason == "length"
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == len(ids) + 3
    # each token's text starts where the one before it does or later (a byte inside a
    # character starts where that character does), and the prompt's end is where it ends
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert lp.text_offset[len(ids)] == len(tok.decode(ids))
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = _ref(hf, ids)
    worst = max(
        abs(lp.token_logprobs[p + 1] - ref[p, ids[p + 1]].item()) for p in range(len(ids) - 1)
    )
    assert worst <= TOL, worst
    assert all(len(top) >= 2 for top in lp.top_logprobs[1:])  # k = 2, and the chosen token


def test_max_tokens_zero_echo_scores_the_prompt_alone(served):
    url, client, hf, tok = served
    ids = _prompt_ids(url, PROMPT)
    r = client.completions.create(
        model=NAMES[0], prompt=PROMPT, echo=True, max_tokens=0, logprobs=0
    )
    choice = r.choices[0]
    assert choice.text == tok.decode(ids) and choice.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    got = choice.logprobs.token_logprobs
    ref = _ref(hf, ids)
    assert len(got) == len(ids) and got[0] is None
    assert max(abs(got[p + 1] - ref[p, ids[p + 1]].item()) for p in range(len(ids) - 1)) <= TOL


def test_a_list_of_prompts_is_one_batched_request(served):
    _, client, _, _ = served
    prompts = [PROMPT, "Hello there", "A third, longer prompt about caches"]
    r = client.completions.create(model=NAMES[0], prompt=prompts, max_tokens=4, temperature=0.0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    alone = [
        client.completions.create(model=NAMES[0], prompt=p, max_tokens=4, temperature=0.0)
        for p in prompts
    ]
    assert [c.text for c in r.choices] == [a.choices[0].text for a in alone]
    assert r.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert r.usage.completion_tokens == 3 * 4


def _rows_match(rows: list, ids: list[int], ref: torch.Tensor) -> float:
    """Each row (after the first, which has nothing before it) holds the prompt's own token with
    transformers' logprob; the worst difference."""
    assert rows[0] is None and len(rows) == len(ids)
    worst = 0.0
    for p, row in enumerate(rows[1:]):
        entry = row[str(ids[p + 1])]
        worst = max(worst, abs(entry["logprob"] - ref[p, ids[p + 1]].item()))
    return worst


def test_prompt_logprobs_through_extra_body_on_completions_and_chat(served):
    url, client, hf, tok = served
    ids = _prompt_ids(url, PROMPT)
    r = client.completions.create(
        model=NAMES[0], prompt=PROMPT, max_tokens=2, extra_body={"prompt_logprobs": 1}
    )
    rows = r.choices[0].model_extra["prompt_logprobs"]
    assert _rows_match(rows, ids, _ref(hf, ids)) <= TOL
    assert all(1 <= len(row) <= 2 for row in rows[1:])  # the top 1, and the prompt's own token
    chat_ids = _chat_ids(tok, MESSAGES)
    chat = client.chat.completions.create(
        model=NAMES[1], messages=MESSAGES, max_tokens=2, extra_body={"prompt_logprobs": 0}
    )
    assert chat.usage.prompt_tokens == len(chat_ids)
    chat_rows = chat.model_extra["prompt_logprobs"]
    assert _rows_match(chat_rows, chat_ids, _ref(hf, chat_ids)) <= TOL
    assert all(len(row) == 1 for row in chat_rows[1:])


def test_models_list_every_served_name_with_created_and_max_model_len(served):
    _, client, _, _ = served
    models = client.models.list().data
    assert [m.id for m in models] == list(NAMES)
    for card in models:
        assert card.object == "model" and card.owned_by == "kvpage"
        assert 0 < card.created <= time.time()
        assert card.model_extra["max_model_len"] == MAX_MODEL_LEN
    assert client.models.retrieve(NAMES[1]).id == NAMES[1]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("not-served")


def test_tokenize_and_detokenize_agree_with_the_tokenizer(served):
    url, _, _, tok = served
    r = httpx.post(f"{url}/tokenize", json={"prompt": PROMPT, "model": NAMES[1]}, timeout=60)
    body = r.json()
    assert body["tokens"] == tok(PROMPT)["input_ids"] and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == MAX_MODEL_LEN
    chat = httpx.post(f"{url}/tokenize", json={"messages": MESSAGES}, timeout=60).json()
    assert chat["tokens"] == _chat_ids(tok, MESSAGES)
    back = httpx.post(f"{url}/detokenize", json={"tokens": body["tokens"]}, timeout=60).json()
    assert back == {"prompt": tok.decode(body["tokens"], skip_special_tokens=True)}

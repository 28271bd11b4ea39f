"""What real clients check first: chat prompts encoded as transformers' apply_chat_template
encodes them (no second BOS), --served-model-name, /v1/models' created and max_model_len, and
vLLM's /tokenize and /detokenize."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import httpx
import pytest
import transformers
from tokenizers import Tokenizer, processors

from kvpage import EngineConfig, LLMEngine
from kvpage.cli import build_parser
from kvpage.cli.serve import server_options
from kvpage.server import ServerOptions, create_app
from kvpage.server.background import BackgroundServer

from ..real_servers.models import ModelSpec, build

SPEC = replace(
    ModelSpec(),
    name="chat-tiny",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
TURNS = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
TEMPLATES = {
    "with_bos": "{{ bos_token }}"
    + TURNS
    + "{% if add_generation_prompt %}<|assistant|>{% endif %}",
    "without_bos": TURNS + "{% if add_generation_prompt %}<|assistant|>{% endif %}",
}
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there, what is 2 + 2?"},
]


def _model_dir(root, template: str):
    directory = build(root, SPEC)
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    # As a Llama tokenizer does: encoding with special tokens prepends BOS.
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(directory / "tokenizer.json"))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def chat_server(request, tmp_path_factory):
    directory = _model_dir(tmp_path_factory.mktemp(request.param), TEMPLATES[request.param])
    engine = LLMEngine(EngineConfig(model=str(directory), num_blocks=32, max_model_len=200))
    options = ServerOptions(model_name="first", served_model_names=("first", "second"))
    with BackgroundServer(create_app(engine, options)) as bg:
        yield bg.url, transformers.AutoTokenizer.from_pretrained(directory), request.param


def test_chat_prompt_ids_equal_transformers_apply_chat_template(chat_server):
    url, hf_tok, name = chat_server
    expected = hf_tok.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    if not isinstance(expected, list):  # newer transformers return a BatchEncoding
        expected = list(expected["input_ids"])
    assert (expected[0] == 1) == (name == "with_bos")  # the template decides, once
    assert expected.count(1) == (name == "with_bos")
    r = httpx.post(f"{url}/tokenize", json={"messages": MESSAGES}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == expected
    chat = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": "second", "messages": MESSAGES, "max_tokens": 1},
        timeout=60,
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == len(expected)
    assert chat.json()["model"] == "first"  # responses name the first served name, as vLLM


def test_tokenize_and_detokenize_have_vllm_shapes(chat_server):
    url, hf_tok, _ = chat_server
    r = httpx.post(f"{url}/tokenize", json={"prompt": "hello world", "model": "first"}, timeout=30)
    body = r.json()
    assert body == {
        "count": len(hf_tok("hello world")["input_ids"]),
        "max_model_len": 200,
        "tokens": hf_tok("hello world")["input_ids"],
        "token_strs": None,
    }
    raw = httpx.post(
        f"{url}/tokenize", json={"prompt": "hello world", "add_special_tokens": False}, timeout=30
    ).json()
    assert raw["tokens"] == body["tokens"][1:]
    back = httpx.post(f"{url}/detokenize", json={"tokens": body["tokens"]}, timeout=30).json()
    assert back == {"prompt": hf_tok.decode(body["tokens"], skip_special_tokens=True)}
    for path, bad, param in (
        ("/detokenize", {"tokens": [1, 99999]}, "tokens"),
        ("/detokenize", {"tokens": [1], "model": "nope"}, "model"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "x", "messages": MESSAGES}, "prompt"),
    ):
        r = httpx.post(f"{url}{path}", json=bad, timeout=30)
        assert r.status_code in (400, 404), (path, bad, r.text)
        assert r.json()["error"]["param"] == param


def test_models_lists_every_served_name_with_created_and_max_model_len(chat_server):
    url, _, _ = chat_server
    data = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    assert [m["id"] for m in data] == ["first", "second"]
    for card in data:
        assert card["max_model_len"] == 200
        assert 0 < card["created"] <= time.time()
    assert httpx.get(f"{url}/v1/models/second", timeout=30).json()["id"] == "second"
    r = httpx.post(f"{url}/v1/completions", json={"model": "other", "prompt": [1, 300]}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_served_model_name_option_takes_several_names():
    args = build_parser().parse_args(
        ["serve", "--model", "builtin:tiny-llama", "--served-model-name", "a", "b"]
    )
    options = server_options(args)
    assert options.model_name == "a" and options.served_model_names == ("a", "b")
    plain = server_options(build_parser().parse_args(["serve", "--model", "builtin:tiny-llama"]))
    assert plain.served_model_names == ("builtin:tiny-llama",)

"""lm-evaluation-harness (pinned in the test extra) against a real `kvpage serve` app: a
multiple-choice loglikelihood task, generate_until with batch_size 4 and loglikelihood_rolling,
from local JSONL tasks, on a small random-weight Llama with a real BPE tokenizer. Every item's
loglikelihood equals transformers' on the same weights and the same token ids (the ones the
engine received), with prefix caching on, on a first run and on a second one served from the
cache. And `local-chat-completions` with `apply_chat_template`: generate_until through
/v1/chat/completions, each output what transformers' greedy generation gives on the prompt ids
its own apply_chat_template renders (the model ships a Jinja chat template)."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers

from kvpage import EngineConfig, LLMEngine
from kvpage.server import ServerOptions, create_app
from kvpage.server.background import BackgroundServer
from kvpage.server.text_stream import TextStream, prompt_context

from ..real_servers.models import CLIENT_TINY, build

pytestmark = pytest.mark.lm_eval

TOL = 1e-4  # fp32 on both sides
DATA = Path(__file__).parent / "lm_eval_data"
SPEC = replace(CLIENT_TINY, name="lm-eval-tiny")
NAME = "tiny"
SPEC_BOS = 1  # models.build's bos_token_id
# The model's chat template (in its tokenizer_config.json): BOS, then a tag per turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CHAT_TASK = f"""
task: kv_chat
dataset_path: json
dataset_kwargs:
  data_files:
    test: {DATA / "gen.jsonl"}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""

TASKS = {
    "kv_mc": f"""
task: kv_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {DATA / "mc.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""",
    "kv_gen": f"""
task: kv_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {DATA / "gen.jsonl"}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
""",
    "kv_rolling": f"""
task: kv_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: {DATA / "rolling.jsonl"}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
""",
}


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    # Local JSONL only: the datasets library must not look for a hub (none can be reached).
    saved = {k: os.environ.get(k) for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")}
    os.environ.update(dict.fromkeys(saved, "1"))
    root = tmp_path_factory.mktemp("lm-eval")
    directory = build(root / "model", SPEC)
    _add_chat_template(directory)
    tasks = root / "tasks"
    tasks.mkdir()
    for name, text in {**TASKS, "kv_chat": CHAT_TASK}.items():
        (tasks / f"{name}.yaml").write_text(text)
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory).float().eval()
    engine = LLMEngine(EngineConfig(model=str(directory), num_blocks=128, block_size=16))
    received: list[list[int]] = []
    add = engine.add_request

    def spy(request_id, prompt, *args, **kwargs):
        received.append(list(engine.prompt_ids(prompt)))
        return add(request_id, prompt, *args, **kwargs)

    engine.add_request = spy  # records what the engine was asked, nothing else
    generated: dict[tuple[int, ...], list[int]] = {}  # prompt ids -> the tokens drawn for it
    step = engine.step

    def step_spy():
        outputs = step()
        for out in outputs:
            generated.setdefault(tuple(out.prompt_token_ids), []).extend(out.new_token_ids)
        return outputs

    engine.step = step_spy  # records what the engine drew, nothing else
    with BackgroundServer(create_app(engine, ServerOptions(model_name=NAME))) as bg:
        yield bg.url, directory, tasks, hf, engine, received, generated
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _add_chat_template(directory: Path) -> None:
    path = directory / "tokenizer_config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))


def _evaluate(url, directory, tasks):
    import lm_eval
    from lm_eval.tasks import TaskManager

    args = (
        f"model={NAME},base_url={url}/v1/completions,tokenizer_backend=huggingface,"
        f"tokenizer={directory},num_concurrent=1,max_retries=1,tokenized_requests=True,"
        "max_length=256"
    )
    return lm_eval.simple_evaluate(
        model="local-completions",
        model_args=args,
        tasks=list(TASKS),
        # our tasks only: indexing lm-eval's thousands of built-in ones takes most of a run
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
        batch_size=4,
        log_samples=True,
        bootstrap_iters=0,
    )


def _loglikelihood(hf, context: list[int], continuation: list[int]) -> float:
    ids = context + continuation
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    return sum(logprobs[p - 1, ids[p]].item() for p in range(len(context), len(ids)))


def _lm(directory):
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    return LocalCompletionsAPI(
        base_url="http://unused/v1/completions",
        tokenizer_backend="huggingface",
        tokenizer=str(directory),
        model=NAME,
    )


def test_lm_eval_tasks_match_transformers_cold_and_from_the_cache(harness):
    url, directory, tasks, hf, engine, received, _ = harness
    lm = _lm(directory)
    worst, runs, compared = 0.0, [], 0
    for run in range(2):
        before = engine.stats()["prefix_hits"]
        results = _evaluate(url, directory, tasks)
        samples = results["samples"]
        runs.append(samples)
        # multiple choice: each choice's loglikelihood of its continuation
        for doc in samples["kv_mc"]:
            for (context, continuation), resp in zip(doc["arguments"], doc["resps"], strict=True):
                ctx, cont = lm._encode_pair(context, continuation)
                assert ctx + cont in received  # the very ids lm-eval sent
                got = resp[0][0]
                worst = max(worst, abs(got - _loglikelihood(hf, ctx, cont)))
                compared += 1
        # rolling: one window per (short) text, after the prefix token
        for doc in samples["kv_rolling"]:
            text = doc["arguments"][0][0]
            tokens = lm.tok_encode(text)
            got = doc["resps"][0][0]
            worst = max(worst, abs(got - _loglikelihood(hf, [lm.prefix_token_id], tokens)))
            compared += 1
        gens = [doc["resps"][0][0] for doc in samples["kv_gen"]]
        assert len(gens) == 6 and all(isinstance(g, str) and "\n" not in g for g in gens)
        if run == 1:  # everything asked before: the cache serves what it may
            assert engine.stats()["prefix_hits"] > before
    assert compared == 2 * (13 + 3)  # every choice of the 5 questions, every text, twice
    assert worst <= TOL, worst
    print(f"max |loglikelihood - transformers'| over {compared} items: {worst:.3g}")
    # the second run, served from the cache, answers exactly as the first
    for task in TASKS:
        first = [doc["resps"] for doc in runs[0][task]]
        second = [doc["resps"] for doc in runs[1][task]]
        if task == "kv_gen":
            assert first == second
        else:
            a, b = _numbers(first), _numbers(second)
            assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b, strict=True)) <= TOL


def _numbers(value) -> list[float]:
    """The loglikelihoods in lm-eval's nested responses, in order (is_greedy flags left out)."""
    if isinstance(value, bool):
        return []
    if isinstance(value, float | int):
        return [float(value)]
    return [x for item in value for x in _numbers(item)]


def _chat_evaluate(url, tasks):
    import lm_eval
    from lm_eval.tasks import TaskManager

    args = f"model={NAME},base_url={url}/v1/chat/completions,num_concurrent=1,max_retries=1"
    return lm_eval.simple_evaluate(
        model="local-chat-completions",
        model_args=args,
        tasks=["kv_chat"],
        # our tasks only: indexing lm-eval's thousands of built-in ones takes most of a run
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
        apply_chat_template=True,
        log_samples=True,
        bootstrap_iters=0,
    )


def _messages(argument) -> list[dict]:
    """The chat lm-eval sent: its JsonChatStr (a one-field tuple holding the JSON)."""
    text = argument if isinstance(argument, str) else argument[0]
    return json.loads(text)


def test_lm_eval_chat_generate_until_matches_transformers_greedy(harness):
    url, directory, tasks, hf, engine, received, generated = harness
    hf_tok = transformers.AutoTokenizer.from_pretrained(directory)
    samples = _chat_evaluate(url, tasks)["samples"]["kv_chat"]
    assert len(samples) == 6
    for doc in samples:
        messages = _messages(doc["arguments"][0][0])
        assert messages[-1] == {"role": "user", "content": doc["doc"]["prompt"]}
        ids = hf_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        if not isinstance(ids, list):  # newer transformers return a BatchEncoding
            ids = list(ids["input_ids"])
        assert ids.count(SPEC_BOS) == 1 and ids in received  # rendered once, as transformers
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([ids]), max_new_tokens=8, do_sample=False, pad_token_id=0
            )
        greedy = out[0, len(ids) :].tolist()
        drawn = generated[tuple(ids)]  # up to the stop string (and a step past it, at most)
        assert drawn and drawn == greedy[: len(drawn)], (messages, drawn, greedy)
        resp = doc["resps"][0][0]
        assert resp == _streamed_text(engine.tokenizer, ids, greedy, "\n"), (messages, greedy)
        whole = _completion_text(hf_tok, ids, greedy)
        if whole is not None and "\ufffd" not in whole:  # valid text: transformers' too
            assert resp == whole.split("\n")[0], (messages, greedy)


def _completion_text(hf_tok, prompt: list[int], ids: list[int]) -> str | None:
    """transformers' text of a completion: the decode of prompt + completion after the prompt's
    own (a SentencePiece completion keeps its first token's leading space); None where the
    prompt's decode is not a prefix of the whole (a byte-fallback run across the two decodes as
    one buffer)."""
    head = hf_tok.decode(prompt, skip_special_tokens=True)
    full = hf_tok.decode(prompt + ids, skip_special_tokens=True)
    return full[len(head) :] if full.startswith(head) else None


def _streamed_text(tokenizer, prompt: list[int], ids: list[int], stop: str) -> str:
    """The text the server makes of `ids` after `prompt`, token by token, cut at `stop`. It can
    differ from a whole decode only where the tokens are bytes that are not UTF-8: byte-fallback
    decoding turns each byte of an invalid run into U+FFFD, and a byte that was valid text on its
    own (as "/" before a stray 0x8F) was sent before the next one came."""
    stream = TextStream(tokenizer, [stop], context=prompt_context(prompt, tokenizer))
    for i, token in enumerate(ids):
        stream.add([token], final=i == len(ids) - 1)
        if stream.stopped:
            break
    return stream.text

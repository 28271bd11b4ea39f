"""The whole-stack suite's text oracle on real tokenizers (issue 39): the served model's
tokenizer read by transformers, not kvpage's; a SentencePiece completion keeps its first
token's leading space; echo and lists of prompts in the scenarios; and the server fixes the
oracle found (the prompt as the detokenizer's context, token spellings from their own bytes,
`chat_template.jinja`, a surrogate's lead byte in text_offset)."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import AddedToken, Tokenizer, models, normalizers

from kvpage.model.tokenizer import ByteTokenizer, HFTokenizer
from kvpage.server.chat import load_chat_template
from kvpage.server.responses import token_text
from kvpage.server.text_stream import TextStream, prompt_context
from kvpage.verify.stack.scenario import make_scenario
from kvpage.verify.stack.text_oracle import ByteText, HFText, choice_texts, expected_choice
from kvpage.verify.stack.tokenizer_dirs import sentencepiece_decoder

WORDS = ["\u2581hello", "\u2581world", "\u2581the", "\u2581cat"]
HELLO, WORLD, THE, CAT = 259, 260, 261, 262  # no merges: the words are spelled by id here
PROMPT = [1, HELLO]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


def spm_dir(tmp_path, template: str | None = None, jinja_file: bool = False):
    """A Llama-2-style tokenizer: <unk> <s> </s>, byte fallback, ▁ for spaces, the decoder
    stripping the first token's leading space; BOS added on encode."""
    from tokenizers import processors

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab |= {f"<0x{b:02X}>": 3 + b for b in range(256)}
    vocab |= {w: len(vocab) + i for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    tok.pre_tokenizer = None
    tok.decoder = sentencepiece_decoder()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in vocab][:3])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    if template is not None and not jinja_file:
        config["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if template is not None and jinja_file:
        (tmp_path / "chat_template.jinja").write_text(template)
    return tmp_path


def test_the_oracle_keeps_a_sentencepiece_completions_leading_space(tmp_path):
    oracle = HFText(str(spm_dir(tmp_path)))
    prompt, world, cat = PROMPT, WORLD, CAT
    assert oracle.decode([world]) == "world"  # alone: the start of a text
    assert choice_texts(oracle, prompt, [world, cat])[-1] == " world cat"
    assert oracle.spell(world) == " world"
    choice = expected_choice(oracle, 0, [world, cat], [], "length", [], None, context=prompt)
    assert choice.text == " world cat" and choice.stable is None


def test_an_unstable_byte_fallback_run_is_judged_only_up_to_it(tmp_path):
    oracle = HFText(str(spm_dir(tmp_path)))
    prompt = PROMPT
    c3, a9, x80 = (3 + b for b in (0xC3, 0xA9, 0x80))  # é, then a byte no character takes
    world = WORLD
    choice = expected_choice(
        oracle, 0, [world, c3, a9, x80], [], "length", [], None, context=prompt
    )
    assert choice.stable == len(" world")  # the run's é turns into U+FFFD once 0x80 arrives
    assert choice.text.startswith(" world\ufffd")


def test_the_server_decodes_a_completion_after_its_prompt(tmp_path):
    tok = HFTokenizer(spm_dir(tmp_path) / "tokenizer.json", None, None)
    prompt, world, cat = PROMPT, WORLD, CAT
    alone = TextStream(tok, [])
    assert alone.add([world, cat], final=True) == "world cat"  # what the bug looked like
    stream = TextStream(tok, [], context=prompt)
    assert stream.add([world], final=False) + stream.add([cat], final=True) == " world cat"
    assert stream.token_ids == [world, cat]  # the context is not the choice's
    assert token_text(tok, world) == " world"  # tokens add up to the text


def test_the_server_reads_chat_template_jinja(tmp_path):
    directory = spm_dir(tmp_path, TEMPLATE, jinja_file=True)
    render = load_chat_template(str(directory))
    messages = [{"role": "user", "content": "hello"}]
    assert render(messages) == "<s>[user] hello\n[assistant]"
    oracle = HFText(str(directory))
    assert oracle.has_template and oracle.chat(messages).count(1) == 1  # one BOS


def test_a_surrogates_lead_byte_is_a_character_of_its_own_in_text_offset():
    stream = TextStream(ByteTokenizer(), [])
    offsets = []
    for t in [0x2F, 0xED, 0xA0, 0x68]:  # ED A0 starts a surrogate: two U+FFFD, not one
        offsets.append(stream.offset_of(t))
        stream.add([t], final=False)
    assert offsets == [0, 1, 2, 3]


def test_scenarios_have_echo_lists_of_prompts_and_chat():
    reqs = [
        r
        for seed in range(3)
        for r in make_scenario(random.Random(seed), ByteText(), True, 22, True).requests
    ]
    assert any(r.echo and r.max_tokens == 0 for r in reqs)
    assert any(r.echo and r.logprobs is not None and r.max_tokens for r in reqs)
    assert any(len(r.prompts) > 1 and r.n > 1 for r in reqs)
    assert any(r.chat for r in reqs)
    for r in reqs:  # a list of prompts is all text or all token ids, as OpenAI takes it
        assert len({isinstance(p, str) for p in r.prompts}) == 1


@pytest.mark.parametrize("seed", [1, 2])
def test_the_honest_stack_passes_on_more_seeds(seed):
    import torch

    from kvpage.model import load_model
    from kvpage.verify.stack.suite import run_server_suite

    m, tok = load_model("builtin:tiny-llama", torch.float32)
    cases = run_server_suite(m, tok, "builtin:tiny-llama", seed=seed, budget_s=120)
    assert [f.message for c in cases for f in c.failures] == []


# --- byte-fallback runs (issue 39.5: a real tokenizer's stack suite on clean code) -----------
SNOW = [3 + b for b in "☃".encode()]  # E2 98 83 as byte-fallback tokens
PAREN = 3 + ord(")")


def test_the_servers_prompt_context_starts_where_its_byte_run_does(tmp_path):
    """Six tokens back from the prompt's end is 98 (inside ☃☃)): a ByteFallback decoder reads
    the run from there as bytes that are not UTF-8, every one U+FFFD, the completion's ")"
    too. The context reaches back to the run's start, and the text is the whole decode's."""
    tok = HFTokenizer(spm_dir(tmp_path) / "tokenizer.json", None, None)
    prompt = [1, *SNOW, *SNOW, PAREN]
    oracle = HFText(str(tmp_path))
    assert choice_texts(oracle, prompt, [PAREN, WORLD])[-1] == ") world"
    from kvpage.sampling_params import SamplingParams
    from kvpage.server.generation import Generation

    stream = Generation.new("r", prompt, SamplingParams(max_tokens=2), None, tok, []).choices[0]
    text = stream.text.add([PAREN], final=False) + stream.text.add([WORLD], final=True)
    assert text == ") world"  # was "\ufffd world"
    assert prompt_context(prompt, tok) == prompt[1:]  # the run, not BOS
    assert prompt_context([1, HELLO, *[3 + 0x41] * 100], tok) == [3 + 0x41] * 64  # bounded


def test_a_token_never_starts_inside_text_already_sent(tmp_path):
    """ "A" is out when 0x80 arrives; the decoder then reads the run A 80 as two U+FFFD, so the
    window's text changed before 0x80. Its text_offset is after the "A" sent (1), never
    before it (0; inside a longer prompt context, a negative offset)."""
    tok = HFTokenizer(spm_dir(tmp_path) / "tokenizer.json", None, None)
    stream = TextStream(tok, [], context=[1])
    assert stream.add([3 + 0x41], final=False) == "A"
    assert stream.offset_of(3 + 0x80) == 1
    long = TextStream(tok, [], context=prompt_context([1, *SNOW * 4], tok))
    assert long.offset_of(3 + 0x80) == 0


def test_the_oracle_puts_a_byte_where_its_character_starts_in_the_whole_run(tmp_path):
    """☃☃ as six byte tokens: cut after the second ☃'s first byte, the run decodes as four
    U+FFFD, which says nothing about where that byte's character starts (the first text
    offsets read 0 for it); the whole run puts it at 1. A run that is not UTF-8 as a whole is
    one U+FFFD per byte."""
    from kvpage.verify.stack.text_oracle import hf_offsets

    oracle = HFText(str(spm_dir(tmp_path)))
    ids = SNOW * 2
    assert hf_offsets(choice_texts(oracle, [1], ids), ids, oracle) == [0, 0, 0, 1, 1, 1]
    bad = [*SNOW[:2], 3 + 0x41, WORLD]  # E2 98 A: three U+FFFD, then " world"
    texts = choice_texts(oracle, [1], bad)
    assert texts[-1] == "\ufffd" * 3 + " world"
    assert hf_offsets(texts, bad, oracle) == [0, 1, 2, 3]


def test_usage_counts_what_a_choice_ended_early_returned():
    """A stop string past the stable text may end a choice early (tokens_exact False): usage
    counts the tokens the choice returned, not the reference's all."""
    from kvpage.sampling_params import SamplingParams
    from kvpage.verify.stack.compare import Where, compare
    from kvpage.verify.stack.expect import Expected
    from kvpage.verify.stack.responses import parse_body
    from kvpage.verify.stack.scenario import GenRequest
    from kvpage.verify.stack.text_oracle import ExpectedChoice

    req = GenRequest("r0", False, (1, 2), None, None, 1, 0.0, None, 5, None, 1, None, False,
                     False, True)  # fmt: skip
    choice = ExpectedChoice(0, "ab", "length", [5, 6, 7, 8, 9], None, None, 1, False)
    exp = Expected(req, (1, 2), SamplingParams(max_tokens=5), ["x"], [choice], ("salt", None),
                   0, 0, False)  # fmt: skip

    def body(tokens: int, usage: int) -> dict:
        usage_ = {"prompt_tokens": 2, "completion_tokens": usage, "total_tokens": 2 + usage}
        c = {"index": 0, "text": "ab", "finish_reason": "stop", "token_ids": [5, 6, 7][:tokens]}
        return {"object": "text_completion", "model": "m", "id": "cmpl-1", "choices": [c],
                "usage": usage_ | {"prompt_tokens_details": {"cached_tokens": 0}}}  # fmt: skip

    where = Where("r0", False, "m", "")
    assert compare(exp, parse_body(200, body(3, 3), False), where) == []
    assert [f.message for f in compare(exp, parse_body(200, body(3, 5), False), where)] == [
        "r0: usage counts differ"
    ]


def test_a_token_after_an_unk_keeps_its_leading_space(tmp_path):
    """<unk> has no text: the window after it must still start with text, or the next token
    decodes as a text's first and SentencePiece drops its space ("hello world", not
    "helloworld")."""
    tok = HFTokenizer(spm_dir(tmp_path) / "tokenizer.json", None, None)
    stream = TextStream(tok, [], context=[1, HELLO])
    assert stream.add([0], final=False) + stream.add([WORLD], final=True) == " world"
    assert choice_texts(HFText(str(tmp_path)), [1, HELLO], [0, WORLD])[-1] == " world"


def test_a_whole_response_settles_the_offsets_of_a_character_that_never_completed(tmp_path):
    """E3 B9 is a character still arriving (B9 at E3's offset) until "s" (a byte token, 73)
    ends it: the ByteFallback decoder spells the run E3 B9 73 as three U+FFFD, so B9 starts
    at 1 in the text the whole response returns (a stream sent 0 before it could know)."""
    from kvpage.engine.outputs import CompletionOutput
    from kvpage.server.generation import Choice

    tok = HFTokenizer(spm_dir(tmp_path) / "tokenizer.json", None, None)
    choice = Choice(0, TextStream(tok, [], context=[1, HELLO]))
    data = [3 + 0xE3, 3 + 0xB9, 3 + 0x73, WORLD]
    for i, t in enumerate(data):
        out = CompletionOutput(0, [t], "", [{t: -1.0}], None, [-1.0])
        choice.advance(out, [t], final=i == len(data) - 1)
    assert choice.text.text == "\ufffd" * 3 + " world"
    assert choice.logprobs.offsets == [0, 1, 2, 3]


def test_the_oracle_does_not_judge_offsets_a_stream_cannot_know(tmp_path):
    """B9 after E3 in a run that never becomes UTF-8: unsure in a stream, not in a whole
    response; a special token between two bytes of one character is unsure in both."""
    from kvpage.verify.stack.text_oracle import unsure_offsets

    oracle = HFText(str(spm_dir(tmp_path)))
    ids = [3 + 0xE3, 3 + 0xB9, 3 + 0x73, WORLD]
    assert unsure_offsets(ids, oracle, stream=True) == {1}
    assert unsure_offsets(ids, oracle, stream=False) == set()
    assert unsure_offsets([3 + 0xC7, 1, 3 + 0xA4], oracle, stream=False) == {1}


def test_bytes_no_character_can_take_go_out_at_once_in_byte_level_bpe(tmp_path):
    """Byte-level BPE: "Æ" (C6) then "ĺĥ" (98 83) is Ƙ and a continuation byte no character
    can take: the text "Ƙ" is final on that token, so the stop string "Ƙ" ends the choice
    there (it waited for more tokens, as for a character still arriving)."""
    from .stack_dirs import write_bpe_tokenizer

    write_bpe_tokenizer(tmp_path, 320)
    tok = HFTokenizer(tmp_path / "tokenizer.json", None, None)
    lead, tail = tok._tok.token_to_id("Æ"), tok._tok.token_to_id("ĺĥ")
    stream = TextStream(tok, ["Ƙ"], context=[1])
    stream.add([lead], final=False)
    stream.add([tail], final=False)
    assert stream.stopped and stream.text == ""


def test_completion_keys_never_merge_two_tokens_spelled_the_same():
    from kvpage.verify.stack.text_oracle import completion_keys

    class Spelled:
        def spell(self, token_id: int) -> str:
            return {5: "a", 7: "a", 9: " a"}[token_id]

    assert completion_keys(Spelled(), [7, 9, 5, 7]) == {7: "a", 9: " a", 5: "token_id:5"}

"""Server bugs the whole-stack suite (kvpage.verify.stack) found, each pinned by a test of its own:
text_offset after bytes that are not a character, a whole response's offsets of a stop string's
tokens, and audit lines of a request's last engine events naming its tenant."""

from __future__ import annotations

import asyncio

import httpx

from kvpage import EngineConfig, LLMEngine
from kvpage.engine.outputs import CompletionOutput
from kvpage.model.tokenizer import ByteTokenizer
from kvpage.server import ServerOptions, create_app
from kvpage.server.generation import Choice
from kvpage.server.text_stream import TextStream

TOK = ByteTokenizer()


def _offsets(choice: Choice, data: list[int]) -> list[int]:
    offsets = []
    for i, token in enumerate(data):
        out = CompletionOutput(0, [token], "", [{token: -1.0}], None, [-1.0])
        offsets += choice.advance(out, [token], final=i == len(data) - 1).logprobs.offsets
    return offsets


def test_text_offset_of_a_token_after_an_invalid_byte_counts_its_replacement_character():
    """ "a", a lone continuation byte (U+FFFD in the text), "b": b starts at 2. A token inside a
    multi-byte character starts where that character does (é = C3 A9, both at 3)."""
    choice = Choice(0, TextStream(TOK))
    offsets = _offsets(choice, [*b"a\x80b", 0xC3, 0xA9, *b"c", TOK.eos_token_id])
    assert choice.text.text == "a\ufffdbéc"
    assert offsets == [0, 1, 2, 3, 3, 4, 5]


def test_a_byte_that_cannot_continue_its_lead_is_a_character_of_its_own():
    """E0 must be followed by A0..BF: E0 95 is two U+FFFD, so 95 starts one character later
    (the whole-stack oracle found this when continuation bytes were matched by width alone);
    E0 A0 80 is one character, all three bytes at 1."""
    choice = Choice(0, TextStream(TOK))
    offsets = _offsets(choice, [*b"a", 0xE0, 0x95, *b"b", 0xE0, 0xA0, 0x80, *b"c"])
    assert choice.text.text == "a\ufffd\ufffdb\u0800c"
    assert offsets == [0, 1, 2, 3, 4, 4, 4, 5]


def test_a_whole_response_puts_a_stop_strings_earlier_tokens_where_its_text_ends():
    """ "sh" was held back (it may start "sh!"); when "!" completes the stop string, the text
    ends at 2 and so do the offsets of "s" and "h", not only that of "!"."""
    choice = Choice(0, TextStream(TOK, ["sh!"]))
    _offsets(choice, list(b"absh!"))
    assert choice.text.text == "ab" and choice.finish_reason == "stop"
    assert choice.logprobs.offsets == [0, 1, 2, 2, 2]


def test_audit_lines_after_a_stop_string_still_name_the_tenant():
    """Each sample ended by a stop string is aborted on the engine thread after the response;
    those engine events are audit lines too, and must name the tenant like the others."""
    engine = LLMEngine(EngineConfig(model="builtin:tiny-llama", num_blocks=64))
    options = ServerOptions(api_keys={"k": "alice"}, admin_token="t", shadow_rate=0.0)
    app = create_app(engine, options)
    body = {"prompt": [1, 2, 3], "max_tokens": 40, "n": 2, "temperature": 0.0}
    events = asyncio.run(_stop_then_audit(app, body))
    assert any(e["event"] == "abort" for e in events), events
    assert all(e["tenant"] == "alice" for e in events), events


async def _stop_then_audit(app, body: dict) -> list[dict]:
    key, admin = {"Authorization": "Bearer k"}, {"X-Admin-Token": "t"}
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
    async with app.router.lifespan_context(app), client:
        free = (await client.post("/v1/completions", json=body, headers=key)).json()
        stop = free["choices"][0]["text"][2:4]  # both samples (greedy) end on it
        r = await client.post("/v1/completions", json={**body, "stop": stop}, headers=key)
        rid, mine = r.json()["id"], []
        for _ in range(100):  # the aborts land on the engine thread, soon after
            await asyncio.sleep(0.02)
            events = (await client.get("/admin/audit", headers=admin)).json()["events"]
            mine = [e for e in events if e["request_id"].split("#")[0] == rid]
            if any(e["event"] == "abort" for e in mine):
                break
        await asyncio.sleep(0.1)  # and any line after the abort's
        events = (await client.get("/admin/audit", headers=admin)).json()["events"]
        return [e for e in events if e["request_id"].split("#")[0] == rid]


def test_a_special_token_inside_a_byte_fallback_run_does_not_end_it(tmp_path):
    """The decode drops special tokens before ByteFallback joins a run: <0x9B> <s> <0xDA> <0x9B>
    is one run, not UTF-8 as a whole (it starts with a stray continuation byte), so three
    U+FFFD, each byte its own character — not a U+FFFD and then "ڛ" (the whole-stack suite
    found this on a trained vocabulary). transformers' decode is the oracle."""
    from transformers import AutoTokenizer

    from kvpage.model.tokenizer import HFTokenizer
    from kvpage.verify.stack.tokenizer_dirs import build

    directory = build(tmp_path / "spm", "spm")
    theirs = AutoTokenizer.from_pretrained(directory)
    tok = HFTokenizer(directory / "tokenizer.json", 1, 2)
    byte = {b: theirs.convert_tokens_to_ids(f"<0x{b:02X}>") for b in (0x9B, 0xDA)}
    word = theirs.encode("the", add_special_tokens=False)
    ids = [*word, byte[0x9B], theirs.bos_token_id, byte[0xDA], byte[0x9B]]
    choice = Choice(0, TextStream(tok))
    offsets = _offsets(choice, ids)
    text = theirs.decode(ids, skip_special_tokens=True)
    assert choice.text.text == text and text.endswith("\ufffd" * 3)
    n, bytes_at = len(text) - 3, [len(word), len(word) + 2, len(word) + 3]
    assert [offsets[i] for i in bytes_at] == [n, n + 1, n + 2]  # <s> has no one offset


def test_a_long_run_of_bytes_that_is_not_utf8_is_one_replacement_character_per_byte(tmp_path):
    """24 byte-fallback tokens, not UTF-8 as a whole: ByteFallback spells each byte U+FFFD. Once
    a run cannot become UTF-8 its text is final and goes out; a window never starts inside it
    (cut there, part of it may decode as characters and the count of U+FFFD differs: the
    whole-stack suite found 26 for 24)."""
    import random

    from transformers import AutoTokenizer

    from kvpage.model.tokenizer import HFTokenizer
    from kvpage.verify.stack.tokenizer_dirs import build

    directory = build(tmp_path / "spm", "spm")
    theirs = AutoTokenizer.from_pretrained(directory)
    tok = HFTokenizer(directory / "tokenizer.json", 1, 2)
    rng = random.Random(0)
    found = bytes.fromhex("9c8361b959b82222eba1bc2c65f572464a354474f8787dc5")  # "롼" inside
    # a stray continuation byte first: not UTF-8 from its first byte on, whatever follows
    drawn = [
        bytes([0x9C]) + bytes(rng.randrange(0x20, 0x100) for _ in range(23)) for _ in range(20)
    ]
    for data in [found, *drawn]:
        ids = theirs.encode(" brac", add_special_tokens=False)
        ids += [theirs.convert_tokens_to_ids(f"<0x{b:02X}>") for b in data]
        stream = TextStream(tok)
        text = "".join(stream.add([t], final=i == len(ids) - 1) for i, t in enumerate(ids))
        assert text == theirs.decode(ids, skip_special_tokens=True), data.hex()
        assert text.endswith("\ufffd" * 24)

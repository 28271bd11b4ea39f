"""bench/speculative.py's pure parts (no engine runs, no llama.cpp runs): its workloads, the
statistics and table of bench/speculative_table.py, and bench/peers/llama_speculative.py's token
text and output parsing."""

from __future__ import annotations

import random

import pytest

from bench import speculative_table as tbl
from bench import speculative_workload as wlm
from bench.peers import llama_speculative as ls
from kvpage.speculative.config import SpeculativeConfig
from kvpage.speculative.ngram import NgramProposer


# --- workloads ----------------------------------------------------------------------------------
def test_random_prompt_is_bos_then_addressable_ids_and_seeded():
    wl = wlm.make_random(0, wlm.FULL, 32000)
    assert (len(wl.prompt), wl.max_tokens, wl.prompt[0]) == (128, 256, wlm.BOS)
    assert all(wlm.FIRST_ID <= t < 32000 for t in wl.prompt[1:])
    assert wl.prompt == wlm.make_random(0, wlm.FULL, 32000).prompt
    assert wl.prompt != wlm.make_random(1, wlm.FULL, 32000).prompt
    assert wlm.FIRST_ID == ls.FIRST_CHAR_ID  # what llama.cpp can be handed as text


def test_grounded_prompt_is_prefix_continuation_prefix():
    p, m = wlm.grounded_split(128)
    assert (p, m) == (32, 64)
    prefix = wlm.grounded_prefix(0, wlm.FULL, 32000)
    assert len(prefix) == p and prefix[0] == wlm.BOS
    continuation = list(range(1000, 1000 + 200))  # more than m: only m go in
    wl = wlm.make_grounded(prefix, continuation, wlm.FULL)
    assert wl.prompt == prefix + continuation[:64] + prefix and len(wl.prompt) == 128
    with pytest.raises(ValueError):
        wlm.grounded_prompt(prefix, continuation[: m - 1], 128)  # too short a continuation
    with pytest.raises(ValueError):
        wlm.grounded_prompt(prefix[1:], continuation, 128)


def test_lookup_hits_counts_tokens_that_followed_their_predecessor_before():
    prompt, output = [1, 10, 11, 12, 10], [11, 13, 10, 11]
    # 11 followed 10 (yes); 13 never followed 11 (only 12 did); nothing followed 13; 11 did follow 10
    assert wlm.lookup_hits(prompt, output) == 2
    assert wlm.lookup_hits([1, 2, 3], [4, 5, 6]) == 0


def _replay_accepted(proposer: NgramProposer, prompt: list[int], output: list[int]) -> int:
    """What greedy verification would accept of the proposer's drafts on these plain tokens."""
    pos = accepted = 0
    while pos < len(output):
        drafts = proposer.propose(prompt + output[:pos], limit=len(output) - pos - 1)
        a = 0
        while a < len(drafts) and drafts[a] == output[pos + a]:
            a += 1
        accepted += a
        pos += a + 1
    return accepted


def test_lookup_hits_bounds_what_prompt_lookup_accepts():
    rng = random.Random(7)
    proposer = NgramProposer(
        SpeculativeConfig("ngram", 4, prompt_lookup_min=1, prompt_lookup_max=3)
    )
    for _ in range(30):
        alphabet = rng.randint(3, 12)  # a small alphabet: plenty of repeats and lookups
        prompt = [rng.randrange(alphabet) for _ in range(rng.randint(5, 40))]
        output = [rng.randrange(alphabet) for _ in range(rng.randint(5, 40))]
        assert _replay_accepted(proposer, prompt, output) <= wlm.lookup_hits(prompt, output)
    # output copying the prompt: every token but the first follows its predecessor there
    prompt = rng.sample(range(1000), 30)  # distinct: one occurrence each
    output = prompt[1:25]
    assert wlm.lookup_hits(prompt, output) == 23
    assert _replay_accepted(proposer, prompt, output) >= 18


# --- statistics and table -----------------------------------------------------------------------
def _run(decode_s: float, tokens=None, drafted=None, accepted=None, rounds=None) -> tbl.Run:
    return tbl.Run(256, 255, decode_s, decode_s + 0.5, tokens, drafted, accepted, rounds)


def test_row_rates_are_best_and_median_over_rounds():
    row = tbl.Row("random", "fp32", "kvpage", [_run(5.1), _run(2.55), _run(3.4)])
    assert row.rates("decode") == pytest.approx((100.0, 75.0))
    assert row.rates("e2e") == pytest.approx((256 / 3.05, 256 / 3.9))


def test_acceptance_and_mean_accepted_length_pool_every_round():
    row = tbl.Row("random", "fp32", "kvpage-draft")
    row.runs += [
        _run(3.0, drafted=10, accepted=5, rounds=4),
        _run(3.0, drafted=20, accepted=15, rounds=6),
    ]
    assert row.acceptance() == pytest.approx(20 / 30)
    assert row.mean_accepted_length() == pytest.approx(1 + 20 / 10)
    plain = tbl.Row("random", "fp32", "kvpage", [_run(3.0)])
    assert not plain.speculative and plain.acceptance() is None
    none_drafted = tbl.Row(
        "grounded", "fp32", "kvpage-ngram", [_run(3.0, drafted=0, accepted=0, rounds=0)]
    )
    assert tbl.acceptance_text(none_drafted) == "no drafts"


def test_kvpage_run_reads_the_worker_result():
    result = {"wall": 4.0, "decode_s": 3.0, "tokens": list(range(256))}
    result["spec"] = {
        "spec_decode_num_drafts": 60,
        "spec_decode_num_draft_tokens": 240,
        "spec_decode_num_accepted_tokens": 180,
    }
    run = tbl.kvpage_run(result)
    assert (run.output_tokens, run.decode_tokens, run.drafted, run.accepted, run.rounds) == (
        256, 255, 240, 180, 60,
    )  # fmt: skip
    assert run.decode_rate == pytest.approx(85.0) and run.e2e_rate == pytest.approx(64.0)
    assert tbl.kvpage_run({**result, "spec": None}).drafted is None


def test_first_diff_and_agreement():
    assert tbl.first_diff([1, 2, 3], [1, 2, 3]) is None
    assert tbl.first_diff([1, 9, 3], [1, 2, 3]) == 1
    assert tbl.first_diff([1, 2], [1, 2, 3]) == 2
    assert tbl.agreement_text([1, 2, 3, 4], [1, 2, 3, 5], 3) == "same"  # the first 3 only
    assert tbl.agreement_text([1, 2, 3, 4], [1, 2, 3, 5], 4) == "DIFFER at 3"
    assert tbl.agreement_text(None, [1], 1) == "-"


def _rows() -> dict:
    rows = {}
    for engine, decode_s, tokens in [
        ("kvpage", 5.1, [1, 2, 3]),
        ("kvpage-draft", 2.55, [1, 2, 3]),
        ("llama.cpp", 2.55, [1, 2, 4]),
        ("llama.cpp-draft", 3.4, [1, 2, 3]),
    ]:
        spec = {"drafted": 100, "accepted": 75, "rounds": 25} if "draft" in engine else {}
        rows[("random", "fp32", engine)] = tbl.Row(
            "random", "fp32", engine, [_run(decode_s, tokens, **spec)]
        )
    return rows


def test_table_gives_ratios_to_plain_and_to_llama_cpp():
    rows = _rows()
    lines = {line.split()[2]: line for line in tbl.table(rows, 3)[2:]}
    assert "2.00x (2.00x)" in lines["kvpage-draft"]  # over plain kvpage: 100 / 50 tok/s
    assert "1.84x (1.84x)" in lines["kvpage-draft"]  # end to end: (256 / 3.05) / (256 / 5.6)
    assert "1.33x (1.33x)" in lines["kvpage-draft"]  # over llama.cpp-draft: 100 / 75
    assert "75.0%, 4.00" in lines["kvpage-draft"]
    assert "0.75x (0.75x)" in lines["llama.cpp-draft"]  # over llama.cpp plain: 75 / 100
    assert lines["llama.cpp"].endswith("DIFFER at 2")  # llama.cpp plain against kvpage plain
    assert lines["kvpage-draft"].endswith("same")
    rows[("random", "fp32", "llama.cpp-draft")].error = "PeerError: no binary"
    lines = {line.split()[2]: line for line in tbl.table(rows, 3)[2:]}
    assert "FAILED: PeerError: no binary" in lines["llama.cpp-draft"]
    assert "1.33x" not in lines["kvpage-draft"]  # no ratio to a failed row


def test_token_checks_catch_a_speculative_row_that_leaves_plain_tokens():
    rows = _rows()
    lines, ok = tbl.token_checks(rows, 3)
    assert ok and lines == [
        "token check fp32 random: kvpage-draft == kvpage plain, 3 tokens, 1/1 rounds"
    ]
    rows[("random", "fp32", "kvpage-draft")].runs.append(_run(2.5, [1, 7, 3], 100, 75, 25))
    lines, ok = tbl.token_checks(rows, 3)
    assert not ok and lines[0].startswith("*** TOKEN MISMATCH *** fp32 random: kvpage-draft")
    assert "at output 1 in round 2 (1/2 rounds differ)" in lines[0]


# --- llama.cpp's token text and output ------------------------------------------------------------
def test_ids_round_trip_through_text_and_bytes_come_back_as_byte_tokens():
    ids = [259, 1000, 31999, 65000]
    assert ls.text_to_ids(ls.ids_to_text(ids)) == ids
    assert all(len(ch.encode()) == 4 for ch in ls.ids_to_text(ids))  # one character per id
    with pytest.raises(ls.PeerError):
        ls.ids_to_text([258])  # a byte token: not addressable
    # byte tokens print raw: ASCII, a UTF-8 sequence, a lone high byte (surrogate-escaped)
    raw = b"A" + "é".encode() + b"\xff"
    assert ls.text_to_ids(raw.decode("utf-8", errors="surrogateescape")) == [
        3 + 0x41,
        3 + 0xC3,
        3 + 0xA9,
        3 + 0xFF,
    ]


def test_addressable_vocab_keeps_specials_and_bytes():
    tokens = (
        ["<unk>", "<s>", "</s>"]
        + [f"<0x{b:02X}>" for b in range(256)]
        + ["\u2581t259", "\u2581t260"]
    )
    out = ls.addressable_vocab(tokens)
    assert out[:259] == tokens[:259] and out[259:] == [
        chr(ls.CHAR_BASE + 259),
        chr(ls.CHAR_BASE + 260),
    ]


SPECULATIVE_STDERR = """\
0.01.861.426 I encoded  128 tokens in    0.207 seconds, speed:  617.495 t/s
0.01.861.427 I decoded   65 tokens in    1.432 seconds, speed:   45.399 t/s
0.01.861.427 I
0.01.861.427 I n_draft   = 4
0.01.861.428 I n_predict = 65
0.01.861.428 I n_drafted = 176
0.01.861.428 I n_accept  = 20
0.01.861.428 I accept    = 11.364%
"""
COMPLETION_STDERR = """\
0.00.746.928 I common_perf_print: prompt eval time =      81.40 ms /   128 tokens (    0.64 ms per token,  1572.42 tokens per second)
0.00.746.957 I common_perf_print:        eval time =     558.10 ms /    63 runs   (    8.86 ms per token,   112.88 tokens per second)
0.00.746.986 I common_perf_print:       total time =     648.53 ms /   191 tokens
"""


def test_parse_speculative_reads_timings_counters_and_generated_ids():
    prompt = [1, 300, 301]
    generated = [400, 401, 3 + 0x0A, 402]  # a byte token (newline) in the middle
    stdout = "\n\n<s>" + ls.ids_to_text(prompt[1:]) + ls.ids_to_text([400, 401]) + "\n"
    stdout += ls.ids_to_text([402]) + "\n\n"
    run = ls.parse_speculative(stdout, SPECULATIVE_STDERR, prompt, 2.0)
    assert (run.n_input, run.n_predict, run.n_draft, run.n_drafted, run.n_accept) == (
        128,
        65,
        4,
        176,
        20,
    )
    assert (run.t_encode, run.t_decode, run.rounds) == (0.207, 1.432, 44)
    assert run.tokens == generated
    with pytest.raises(ls.PeerError):
        ls.parse_speculative(stdout, SPECULATIVE_STDERR.replace("n_accept", "n_other"), prompt, 2.0)


def test_parse_completion_reads_perf_lines_and_generated_ids():
    prompt = [1, 300, 301]
    stdout = ls.ids_to_text(prompt[1:] + [500, 501]) + "\n\n"
    run = ls.parse_completion(stdout, COMPLETION_STDERR, prompt, 1.0)
    assert (run.n_prompt, run.n_eval) == (128, 63)
    assert (run.t_prompt, run.t_eval, run.t_total) == pytest.approx((0.0814, 0.5581, 0.64853))
    assert run.tokens == [500, 501]
    with pytest.raises(ls.PeerError):  # the prompt is not echoed: the output is not ours
        ls.parse_completion(ls.ids_to_text([500]), COMPLETION_STDERR, prompt, 1.0)

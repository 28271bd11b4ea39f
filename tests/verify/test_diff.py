"""The diff on hand-made traces: the first divergence is found at the known step, with every field
of the result, and the attribution matrix picks the class each kind of divergence calls for."""

from __future__ import annotations

import pytest
import torch

from kvpage.reference.records import CacheView, ViewEntry, make_record
from kvpage.verify.diff import REQUIRED_FIELDS, first_divergence, quantized_attribution

NS = "ab" * 32
V = 10


def _logits(hot: int, bump: float = 0.0) -> torch.Tensor:
    x = torch.arange(V, dtype=torch.float32) * 0.1
    x[hot] = 5.0 + bump
    return x


def _ref_view(length: int) -> CacheView:
    return CacheView((ViewEntry(0, -1, 0, length, False, 1, "CONTIGUOUS"),), 0, NS, 0, True)


def _paged_view(length: int, block_size: int = 4) -> CacheView:
    n = -(-length // block_size)
    entries = tuple(
        ViewEntry(
            i,
            10 + i,
            3,
            min(block_size, length - i * block_size),
            i == 0,
            1 + (i == 0),
            "PRIVATE_WRITABLE",
        )
        for i in range(n)
    )
    return CacheView(entries, 7, NS, block_size)


def _trace(tokens: list[int], paged: bool, prompt: list[int], overrides=None):
    """One record per token; overrides: {step: {field: value}}."""
    overrides = overrides or {}
    records, context = [], len(prompt)
    inputs, positions = prompt, list(range(len(prompt)))
    for step, tok in enumerate(tokens):
        o = overrides.get(step, {})
        view = _paged_view(context) if paged else _ref_view(context)
        extra = {k: v for k, v in o.items() if k not in ("logits", "inputs", "positions")}
        records.append(
            make_record(
                "req",
                step,
                o.get("inputs", inputs),
                o.get("positions", positions),
                o.get("logits", _logits(tok)),
                tok,
                view,
                **extra,
            )
        )
        inputs, positions = [tok], [context]
        context += 1
    return records


PROMPT = [1, 2, 3, 4, 5, 6]  # 6 tokens, block size 4: decode positions 6, 7, 8 (8 starts block 2)
TOKENS = [7, 8, 9, 1, 2]


def test_identical_traces_do_not_diverge():
    assert first_divergence(_trace(TOKENS, False, PROMPT), _trace(TOKENS, True, PROMPT)) is None


def test_token_divergence_after_block_boundary_every_field():
    ref = _trace(TOKENS, False, PROMPT)
    bad = [7, 8, 9, 3, 2]  # step 3 feeds position 8 (first token of block 2) and chooses 3
    cand = _trace(bad, True, PROMPT)
    d = first_divergence(ref, cand)
    assert (d.request_id, d.step, d.kind) == ("req", 3, "token")
    assert d.detail == "chose 3, reference 1"
    assert d.reference is ref[3] and d.candidate is cand[3]
    assert d.max_abs_logit_diff == pytest.approx(5.0 - 0.1)
    assert d.reference.topk_ids[0] == 1 and d.candidate.topk_ids[0] == 3
    a = d.attribution
    assert a.cls == "block_table" and a.reason == "first token after a block boundary"
    assert a.complete and a.missing == []
    assert a.fields["in_block_offset"] == 0
    assert a.fields["last_block_len"] == 1  # context 9 = 4 + 4 + 1
    assert a.fields["block_ids"] == [10, 11, 12]
    assert a.fields["generations"] == [3, 3, 3]
    assert a.fields["shared"] == [True, False, False] and a.fields["ref_counts"] == [2, 1, 1]
    assert a.fields["epoch"] == 7
    out = d.to_dict()
    assert out["attribution"]["class"] == "block_table" and out["step"] == 3
    assert out["candidate"]["view"]["entries"][2]["physical"] == 12


def test_logit_drift_inside_a_block():
    ref = _trace(TOKENS, False, PROMPT)
    cand = _trace(TOKENS, True, PROMPT, {2: {"logits": _logits(9, bump=1e-3)}})
    d = first_divergence(ref, cand, atol=1e-4)
    assert (d.step, d.kind) == (2, "logits")
    assert d.max_abs_logit_diff == pytest.approx(1e-3, rel=1e-3)
    assert d.attribution.cls == "block_table"
    assert d.attribution.fields["in_block_offset"] == 3  # position 7
    assert first_divergence(ref, cand, atol=1e-2) is None


def test_prefill_end_position_divergence_is_prefix_key():
    ref = _trace(TOKENS, False, PROMPT)
    cand = _trace(
        TOKENS,
        True,
        PROMPT,
        {0: {"positions": [0, 1, 2, 3, 5, 6], "prefix_hit_tokens": 4, "prefix_digest": "cd"}},
    )
    d = first_divergence(ref, cand)
    assert (d.step, d.kind) == (0, "position_ids")
    a = d.attribution
    assert a.cls == "prefix_key" and a.reason == "end of prefill" and a.complete
    assert a.fields["position_ids_ref"] == list(range(6))
    assert a.fields["position_ids_cand"] == [0, 1, 2, 3, 5, 6]
    assert a.fields["prefix_hit_tokens"] == 4 and a.fields["prefix_digest"] == "cd"
    assert a.fields["namespace_ref"] == a.fields["namespace_cand"] == NS


def test_divergence_after_resume_is_restore():
    ref = _trace(TOKENS, False, PROMPT)
    cand = _trace(
        [7, 8, 9, 4, 2],
        True,
        PROMPT,
        {3: {"after_resume": True, "resume_mode": "swap", "restore_complete": False}},
    )
    d = first_divergence(ref, cand)
    assert (d.step, d.kind, d.attribution.cls) == (3, "token", "restore")
    assert d.attribution.fields["restore_complete"] is False
    assert d.attribution.fields["resume_mode"] == "swap" and d.attribution.complete


def test_namespace_and_input_and_length_divergences():
    ref = _trace(TOKENS, False, PROMPT)
    cand = _trace(TOKENS, True, PROMPT)
    cand[0].view = CacheView(cand[0].view.entries, 7, "ff" * 32, 4)
    d = first_divergence(ref, cand)
    assert (d.step, d.kind, d.attribution.cls) == (0, "namespace", "prefix_key")
    cand = _trace(TOKENS, True, PROMPT, {2: {"inputs": [99]}})
    assert first_divergence(ref, cand).kind == "input_ids"
    d = first_divergence(ref, _trace(TOKENS[:3], True, PROMPT))
    assert (d.step, d.kind) == (3, "length")


def test_one_quantized_trace_keeps_the_matrix_class():
    """A single trace cannot say a divergence is specific to the quantized path (that takes the
    same case unquantized, kvpage.verify.suites): the matrix alone keeps its cache class."""
    ref = _trace(TOKENS, False, PROMPT)
    cand = _trace([7, 8, 9, 4, 2], True, PROMPT)
    cand[3].view = CacheView(cand[3].view.entries, 7, NS, 4, kv_dtype="int8", kv_layout=2)
    assert first_divergence(ref, cand).attribution.cls == "block_table"


def _scaled(view: CacheView, digests: tuple[str, ...], layout: int = 2) -> CacheView:
    entries = tuple(e._replace(scale=d) for e, d in zip(view.entries, digests, strict=False))
    return CacheView(
        entries, view.epoch, NS, view.block_size, view.contiguous, "int8", layout, digests
    )


def test_quantized_attribution_names_the_first_block_and_layer_whose_scales_differ():
    ref = _trace(TOKENS, False, PROMPT)
    cand = _trace([7, 8, 9, 4, 2], True, PROMPT)
    ref[3].view = _scaled(ref[3].view, ("a1.b1", "a2.b2", "a3.b3"))
    cand[3].view = _scaled(cand[3].view, ("a1.b1", "a2.XX", "a3.b3"))
    d = first_divergence(ref, cand)
    a = quantized_attribution(d.reference, d.candidate, d.attribution)
    assert a.cls == "quantized_kv" and a.complete, a.missing
    assert a.fields["matrix_class"] == "block_table"
    assert a.fields["kv_dtype"] == "int8"
    assert a.fields["kv_layout"] == {"version": 2, "reference_version": 2, "block_size": 4}
    scale = a.fields["kv_scale"]
    assert (scale["first_mismatching_block"], scale["first_mismatching_layer"]) == (1, 1)
    assert scale["block_ids"] == [10, 11, 12] and scale["candidate"][1] == "a2.XX"
    assert "block 1 (layer 1)" in a.reason


def test_quantized_attribution_with_equal_scales_points_at_codes():
    ref = _trace(TOKENS, False, PROMPT)
    cand = _trace([7, 8, 9, 4, 2], True, PROMPT)
    ref[3].view = _scaled(ref[3].view, ("a1", "a2", "a3"))
    cand[3].view = _scaled(cand[3].view, ("a1", "a2", "a3"))
    d = first_divergence(ref, cand)
    a = quantized_attribution(d.reference, d.candidate, d.attribution)
    assert a.complete and a.fields["kv_scale"]["first_mismatching_block"] is None
    assert "scales match" in a.reason


def test_quantized_class_without_scales_is_incomplete():
    """Layout 2 promises scales: a step that recorded none cannot be attributed completely."""
    ref = _trace(TOKENS, False, PROMPT)
    cand = _trace([7, 8, 9, 4, 2], True, PROMPT)
    cand[3].view = CacheView(cand[3].view.entries, 7, NS, 4, kv_dtype="int8", kv_layout=2)
    d = first_divergence(ref, cand)
    a = quantized_attribution(d.reference, d.candidate, d.attribution)
    assert a.cls == "quantized_kv" and a.missing == ["kv_scale"]
    assert set(a.missing) <= set(REQUIRED_FIELDS["quantized_kv"])

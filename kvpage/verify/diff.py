"""First divergence between a reference trace and a candidate trace (R16), attributed by the fixed
matrix of seed 000 §8 (R17):

  diverges right after a preemption resume  -> restore:      restore-complete flag, generations
  diverges only on a quantized-KV path      -> quantized_kv: KV scale and layout
  diverges at the end of prefill / a hit    -> prefix_key:   namespace, prefix digest, position ids
  diverges later (after a block boundary)   -> block_table:  in-block offset, last-block length

Each class names the fields it needs; an attribution missing any of them makes the report fail."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvpage.verify.trace import StepRecord

DEFAULT_ATOL = 1e-4
QUANTIZED_KV_DTYPES = ("int8", "uint8", "int4", "float8_e4m3fn", "float8_e5m2")

REQUIRED_FIELDS: dict[str, tuple[str, ...]] = {
    "restore": ("restore_complete", "resume_mode", "generations", "block_ids"),
    "quantized_kv": ("kv_dtype", "kv_scale", "kv_layout"),
    "prefix_key": (
        "namespace_ref",
        "namespace_cand",
        "prefix_digest",
        "prefix_hit_tokens",
        "position_ids_ref",
        "position_ids_cand",
    ),
    "block_table": ("in_block_offset", "last_block_len", "block_ids", "generations"),
}
WHERE_TO_LOOK = {
    "restore": "restore-complete flag and block generations",
    "quantized_kv": "KV scale and layout",
    "prefix_key": "prefix key (namespace, chained digest) and position ids",
    "block_table": "in-block offset and last-block valid length in the block table",
}


@dataclass(slots=True)
class Attribution:
    cls: str
    reason: str
    fields: dict[str, Any]
    missing: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return not self.missing


@dataclass(slots=True)
class Divergence:
    request_id: str
    step: int
    kind: str  # "namespace" | "input_ids" | "position_ids" | "token" | "logits" | "length"
    detail: str
    reference: StepRecord | None
    candidate: StepRecord | None
    max_abs_logit_diff: float | None
    attribution: Attribution

    def to_dict(self) -> dict:
        return {
            "request_id": self.request_id,
            "step": self.step,
            "kind": self.kind,
            "detail": self.detail,
            "max_abs_logit_diff": self.max_abs_logit_diff,
            "reference": None if self.reference is None else self.reference.to_dict(),
            "candidate": None if self.candidate is None else self.candidate.to_dict(),
            "attribution": {
                "class": self.attribution.cls,
                "reason": self.attribution.reason,
                "where_to_look": WHERE_TO_LOOK.get(self.attribution.cls, ""),
                "fields": self.attribution.fields,
                "missing": self.attribution.missing,
            },
        }


def first_divergence(
    reference: list[StepRecord], candidate: list[StepRecord], atol: float = DEFAULT_ATOL
) -> Divergence | None:
    for step, (ref, cand) in enumerate(zip(reference, candidate, strict=False)):
        found = _compare(ref, cand, atol)
        if found is not None:
            kind, detail, drift = found
            return Divergence(
                cand.request_id, step, kind, detail, ref, cand, drift, attribute(ref, cand)
            )
    if len(reference) != len(candidate):
        step = min(len(reference), len(candidate))
        ref = reference[step] if step < len(reference) else None
        cand = candidate[step] if step < len(candidate) else None
        last = (reference or candidate)[-1]
        detail = f"reference has {len(reference)} steps, candidate {len(candidate)}"
        attribution = (
            attribute(ref, cand)
            if ref is not None and cand is not None
            else Attribution(
                "block_table", "trace lengths differ", {}, list(REQUIRED_FIELDS["block_table"])
            )
        )
        return Divergence(last.request_id, step, "length", detail, ref, cand, None, attribution)
    return None


def _compare(ref: StepRecord, cand: StepRecord, atol: float):
    if ref.view.namespace and cand.view.namespace != ref.view.namespace:
        return (
            "namespace",
            f"keyed in {cand.view.namespace[:16]}, expected {ref.view.namespace[:16]}",
            None,
        )
    if ref.input_ids != cand.input_ids:
        return "input_ids", f"{cand.input_ids[:8]} != {ref.input_ids[:8]}", None
    if ref.position_ids != cand.position_ids:
        return "position_ids", f"{cand.position_ids[:8]} != {ref.position_ids[:8]}", None
    drift = _max_abs(ref, cand)
    if ref.chosen_token != cand.chosen_token:
        return "token", f"chose {cand.chosen_token}, reference {ref.chosen_token}", drift
    if drift is not None and drift > atol:
        return "logits", f"max-abs logit drift {drift:.3g} > atol {atol:g}", drift
    return None


def _max_abs(ref: StepRecord, cand: StepRecord) -> float | None:
    if ref.logits is None or cand.logits is None:
        return None
    return float((ref.logits - cand.logits).abs().max())


def attribute(ref: StepRecord, cand: StepRecord) -> Attribution:
    view = cand.view
    fields: dict[str, Any] = {
        "block_ids": [e.physical for e in view.entries],
        "generations": [e.generation for e in view.entries],
        "valid_lens": [e.valid_len for e in view.entries],
        "shared": [e.shared for e in view.entries],
        "ref_counts": [e.ref_count for e in view.entries],
        "epoch": view.epoch,
        "kv_dtype": view.kv_dtype,
    }
    if cand.after_resume:
        cls, reason = "restore", f"first step after a {cand.resume_mode} resume"
        fields.update(restore_complete=cand.restore_complete, resume_mode=cand.resume_mode)
    elif view.kv_dtype in QUANTIZED_KV_DTYPES:
        cls, reason = "quantized_kv", "divergence on a quantized KV path"
    elif cand.step == 0 or cand.prefix_hit_tokens > 0:
        cls = "prefix_key"
        reason = "end of prefill" if cand.step == 0 else "first token after a prefix hit"
        fields.update(
            namespace_ref=ref.view.namespace,
            namespace_cand=view.namespace,
            prefix_digest=cand.prefix_digest,
            prefix_hit_tokens=cand.prefix_hit_tokens,
            position_ids_ref=ref.position_ids,
            position_ids_cand=cand.position_ids,
        )
    else:
        cls = "block_table"
        last_pos = cand.position_ids[-1] if cand.position_ids else None
        size = view.block_size or None
        offset = None if last_pos is None or size is None else last_pos % size
        reason = (
            "first token after a block boundary"
            if offset == 0
            else "decode inside a block (valid length / overwritten shared block)"
        )
        fields.update(
            in_block_offset=offset, last_block_len=view.last_block_len if view.entries else None
        )
    missing = [f for f in REQUIRED_FIELDS[cls] if fields.get(f) is None]
    return Attribution(cls, reason, fields, missing)

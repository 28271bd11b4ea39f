"""First divergence between a reference trace and a candidate trace, attributed by a fixed
matrix, so where the first divergence falls names what to check:

  same logits, different token              -> sampling:     seed, generator offset/state, filters
  runs longer or shorter / other finish      -> stop_rule:    finish reasons, stop ids, max_tokens
  diverges right after a preemption resume  -> restore:      restore-complete flag, generations
  diverges only on a quantized-KV path      -> quantized_kv: KV scale and layout (decided by the
                                               suite: the same case with unquantized KV matches)
  diverges at the end of prefill / a hit    -> prefix_key:   namespace, prefix digest, position ids
  diverges later (after a block boundary)   -> block_table:  in-block offset, last-block length
  a constrained request's token or end      -> structured:   the grammar's mask, its matcher's
    differs while the logits agree                           state (replay, forks), completion
  a layer group's view is not the window's   -> layer_group:  the group and its first layer, the
                                               blocks its window needs and those it held
                                               (kvpage.verify.group_views; found on the view itself,
                                               so it comes first)

The first two come first: when the logits agree, no KV was read wrongly, so the cause is in what
turns logits into tokens or decides when to stop, whatever the cache did before.
Each class names the fields it needs; an attribution missing any of them makes the report fail."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, is_dataclass
from typing import Any

import torch

from kvpage.reference.records import StepRecord
from kvpage.verify.group_views import group_mismatch
from kvpage.verify.sampling_oracle import filtered_support  # the oracle, not the sampler

DEFAULT_ATOL = 1e-4  # callers that give no tolerance (the diff's own unit tests)
HALF_DTYPES = (torch.bfloat16, torch.float16)

# The logit tolerance of a run: how far the paged engine's logits may drift from the
# reference's when nothing is wrong. Both sides compute the same function, but over other row
# counts (a packed batch against one request) and through other attention kernels, so each rounds
# at other points; the drift is rounding error, and rounding error is relative. So:
#
#     atol = scale * max(COMPUTE_FACTOR * u(compute dtype), KV_FACTOR * u(KV format))
#
# u = the unit roundoff of the compute dtype (2^-24 float32, 2^-8 bfloat16, 2^-11 float16) or
# the relative rounding step of the KV pool's format (a bfloat16 cast 2^-8, int8 half a code
# step of the block's absmax 1/254, fp8_e4m3 2^-4; 0 for "auto", the model's own dtype);
# scale = the largest |logit| of the reference's steps of the request (at least 1): an error
# relative to the values becomes an absolute one in proportion to them, which is what fixed
# constants missed (builtin:passphrase-mini's logits are larger than tiny-llama's, and its clean
# float32 drift of 1.09e-4 failed a fixed 1e-4).
#
# The factors are measured: r = drift / (u * max |logit| of the step), the largest over every
# step pair of the gate's suites (`kvpage verify --no-mutants`, the tolerance lifted so no
# comparison stops early), and each factor is 2-3x the worst r of its kind:
#
#   float32 compute, KV auto       r =  15.6 tiny-llama, 17.5 tiny-qwen2, 548 passphrase-mini
#                                  (7,006 / 7,004 / 6,695 step pairs; max drift 6.2e-6, 7.6e-6,
#                                  7.5e-4)                           -> FULL_PRECISION_FACTOR 1024
#   bfloat16 compute, KV auto      r =  4.3 tiny-llama, 3.8 tiny-qwen2 (12,308 / 11,739 pairs;
#                                  max drift 0.129, 0.094)            -> HALF_PRECISION_FACTOR 8
#   float32 compute, rounded KV    r (against the KV step) = 0.019 bfloat16, 0.039 int8,
#                                  0.003 fp8_e4m3 on tiny-llama (prefix, batching,
#                                  preemption, parallel; 3,738 pairs each; max drift 6.4e-4,
#                                  1.5e-3, 1.6e-3); then the generated stage found r = 0.134
#                                  for int8 (drift 4.3e-3 at logits ~8.3: an 8-token prompt
#                                  prefilled in chunks of 3 or 5 into 4-token blocks, so other
#                                  matmul shapes than any suite's; honest: per-token scales, the
#                                  same with chunks of 4 or 8)       -> KV_FACTOR 0.375
#
# Why the kinds differ:
# - float32 compute: summation order differs (batched vs one-request matmuls, paged vs
#   contiguous attention), so the error is many roundoffs deep, and deeper for a model whose
#   activations amplify it: passphrase-mini (trained, 4 layers) sits 35x above the random
#   built-ins at the same logit magnitude, so the factor is set by it. At tiny-llama's logits
#   (~13) the float32 tolerance is 7.9e-4 against a measured 6.2e-6; a cache bug moves logits by
#   a large fraction of the logits themselves, and tokens are compared exactly anyway.
# - 16-bit compute: both sides round every layer's output to 16 bits; the drift is the few
#   places where they round differently, a few roundoffs. The factor stays small because within
#   it a greedy near-tie ends a comparison (is_numeric_tie): a loose bound would forgive more.
# - a rounded KV format: both sides round the same K/V the same way, and differ only where their
#   float32 K/V (~1e-7 apart) fall on two sides of a rounding boundary: one code step, on a few
#   values, diluted by attention over the rest. A coarser format crosses boundaries less often:
#   fp8's r is 13x below int8's, so its bound (0.30 at logits ~13) is loose, the price of one
#   rule for every format; its tokens are still compared exactly, and a read of other K/V
#   moves logits by O(1).
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
KV_ROUNDOFF = {"auto": 0.0, "bfloat16": 2.0**-8, "int8": 1 / 254, "fp8_e4m3": 2.0**-4}
FULL_PRECISION_FACTOR = 1024.0
HALF_PRECISION_FACTOR = 8.0
# 16-bit compute with a LoRA adapter on the request: every adapted projection adds its float32
# delta to a product already rounded, and the gate's adapters (deltas as large as the weights)
# make the model amplify a rounding more. r = 11.9 tiny-llama, 4.5 tiny-qwen2 over the lora
# suite's 223 bfloat16 step pairs each (bench/tolerance_factors.py --dtype bfloat16 --suite
# lora; the suites without adapters: 4.1 and 3.8)                      -> 24, 2x the worst
ADAPTER_HALF_PRECISION_FACTOR = 24.0
KV_FACTOR = 0.375


def compute_factor(model_dtype: torch.dtype, adapter: bool = False) -> float:
    if model_dtype not in HALF_DTYPES:
        return FULL_PRECISION_FACTOR
    return ADAPTER_HALF_PRECISION_FACTOR if adapter else HALF_PRECISION_FACTOR


def kv_atol(kv_cache_dtype: str, scale: float = 1.0) -> float:
    """The part of the tolerance a pool in `kv_cache_dtype` adds (0 for the model's own dtype)."""
    return KV_FACTOR * KV_ROUNDOFF[kv_cache_dtype] * max(scale, 1.0)


def logit_atol(
    kv_cache_dtype: str,
    model_dtype: torch.dtype = torch.float32,
    scale: float = 1.0,
    adapter: bool = False,
) -> float:
    """The logit tolerance of a run in `model_dtype` with its pool in `kv_cache_dtype`, for
    logits of magnitude `scale` (logit_scale of the reference's records): the larger of the
    compute dtype's and the KV format's rounding, relative to the logits, times a measured
    factor (the rule, its argument and the measurements: the comment above UNIT_ROUNDOFF).
    E.g. float32 on tiny-llama's logits (~13): 7.9e-4; on passphrase-mini's (~30): 1.8e-3;
    bfloat16: 0.41 at ~13; int8 KV under float32: 1.9e-2 at ~13."""
    u = UNIT_ROUNDOFF.get(model_dtype, UNIT_ROUNDOFF[torch.float32])
    compute = compute_factor(model_dtype, adapter) * u * max(scale, 1.0)
    return max(compute, kv_atol(kv_cache_dtype, scale))


def logit_scale(records: list[StepRecord]) -> float:
    """The largest |logit| over the records (1.0 when none has logits): the magnitude the
    reference's rounding error is relative to."""
    peaks = [float(r.logits.abs().max()) for r in records if r.logits is not None]
    return max([1.0, *peaks])


def is_numeric_tie(ref: StepRecord, cand: StepRecord, atol: float, greedy: bool) -> bool:
    """16-bit compute or a rounded KV format only. Same inputs, every logit within `atol`, yet
    another token: for a
    greedy step, one the reference scored within `atol` of its own choice (rounding decided
    between near-equal tokens); for a sampled step, a draw from the same generator state as the
    reference's that fell on the boundary the drift moved (the draw itself is still checked
    against the oracle on the engine's logits; a generator in another state is a sampling bug).
    A cache bug reads other K/V: its logits move by far more than the tolerance."""
    if ref.chosen_token == cand.chosen_token or ref.logits is None or cand.logits is None:
        return False
    if ref.input_ids != cand.input_ids or ref.position_ids != cand.position_ids:
        return False
    drift = _max_abs(ref, cand)
    if drift is None or drift > atol:
        return False
    if not greedy:  # the same uniform (same generator state) landed on a moved boundary
        return ref.sampler is not None and ref.sampler == cand.sampler
    return float(ref.logits[ref.chosen_token] - ref.logits[cand.chosen_token]) <= atol


def numeric_tie_step(
    reference: list[StepRecord], candidate: list[StepRecord], atol: float, greedy: bool
) -> int | None:
    """The step of the first difference if that difference is a numeric tie, else None."""
    for step, (ref, cand) in enumerate(zip(reference, candidate, strict=False)):
        if _compare(ref, cand, atol) is not None:
            return step if is_numeric_tie(ref, cand, atol, greedy) else None
    return None


REQUIRED_FIELDS: dict[str, tuple[str, ...]] = {
    "sampling": (
        "seed",
        "generator_offset",
        "generator_state",
        "temperature",
        "top_k",
        "top_p",
        "support",
    ),
    "stop_rule": (
        "finish_reason_ref",
        "finish_reason_cand",
        "steps_ref",
        "steps_cand",
        "last_token",
        "stop_token_ids",
        "max_tokens",
    ),
    "restore": ("restore_complete", "resume_mode", "generations", "block_ids"),
    # Found by the case checks rather than a step pair (kvpage.verify.checks):
    "liveness": ("steps", "bound", "stalled", "queues", "uncomputed", "free_blocks"),
    "resource": ("leaked", "stats", "live_tables"),
    "accounting": ("counter", "expected", "actual"),
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
    "layer_group": (
        "group",
        "first_layer",
        "window_start",
        "needed_blocks",
        "held_blocks",
        "block_ids",
        "generations",
    ),
    "prompt_logprobs": ("position", "token", "expected", "actual", "num_cached_tokens"),
    "lora": (
        "adapter_ref",
        "adapter_cand",
        "namespace_ref",
        "namespace_cand",
        "batch_adapters",
        "prefix_hit_tokens",
    ),
    # Per-step properties (kvpage.verify.properties), found on the engine's plans and state:
    "step_budget": (
        "step",
        "scheduled_tokens",
        "max_num_batched_tokens",
        "scheduled_seqs",
        "max_num_seqs",
        "per_seq",
    ),
    "sample_independence": ("samples", "seeds", "agreed_steps", "p_value", "threshold", "pairs"),
    "finish_precedence": (
        "finish_reason",
        "expected",
        "last_token",
        "stop_token_ids",
        "num_tokens",
        "max_tokens",
    ),
    "reservation": (
        "step",
        "preemption",
        "violation",
        "request",
        "free_blocks",
        "worst_case_blocks",
        "running_growth",
    ),
    "prefix_hold": ("step", "held_at", "request", "pending_keys", "queues", "budget_left"),
    # Structured outputs: a constrained request's token, end or text (kvpage.verify.structured)
    "structured": ("constraint", "digest", "step", "token", "allowed_next"),
    # Speculative decoding: a token out of a verification, or a step that read KV a speculative
    # step wrote (index -1), or a decision of the rejection rule (kvpage.verify.speculative)
    "speculative": ("step", "method", "index"),
}
WHERE_TO_LOOK = {
    "sampling": "the sampler: seed, per-request generator state, temperature / top-k / top-p",
    "stop_rule": "stop rules: stop token ids, EOS, max_tokens and the finish reason",
    "restore": "restore-complete flag and block generations",
    "liveness": "the scheduler: what was ready, what it waited for, free blocks",
    "resource": "the release paths: blocks, tables, swap space left behind",
    "accounting": "counters and finish reasons against what the case implies",
    "quantized_kv": "KV scale and layout: scales per block against the reference's, the layout "
    "version, the quantiser's rounding",
    "prefix_key": "prefix key (namespace, chained digest) and position ids",
    "block_table": "in-block offset and last-block valid length in the block table",
    "layer_group": "per-layer-group KV: the window trim, the hybrid prefix-hit rule, which "
    "group's table each layer reads (kvpage/cache/groups.py, manager.trim / hit_tables, "
    "runner.layer_map)",
    "lora": "LoRA: the adapter's identity in the namespace (name and weights digest, apart "
    "from the salt), the mixed batch's row groups, the adapter's factors and scale "
    "(kvpage/lora/, LLMEngine.request_namespace)",
    "prompt_logprobs": "prompt logprob rows: which positions a prefill scores, the hit cap of "
    "a request that wants them, row-to-token alignment (kvpage/engine/runner.py, engine.py)",
    "step_budget": "the scheduler's token and sequence budget per step (chunks, restores, forks)",
    "sample_independence": "where unseeded requests and forked samples get their generators",
    "finish_precedence": "the stop rule's order: a stop id at max_tokens is a stop",
    "reservation": "the worst-case reservation with preemption off: running growth, free pool",
    "prefix_hold": "the same-step prefix hold-back: which blocks count as being computed now",
    "structured": "structured outputs: the step's grammar masks (which row gets which), the "
    "matcher's state after a recompute (replay) or a fork (its own copy), the grammar's "
    "completion as a stop, the compiled-grammar cache key (kvpage/engine/grammars.py, "
    "kvpage/structured/)",
    "speculative": "speculative decoding: the rejection rule (acceptance min(1, p/q), the "
    "residual norm(max(0, p - q)), one token after the kept drafts), the roll-back of the "
    "rejected drafts' slots and what is published after it (kvpage/engine/speculation.py, "
    "Scheduler.settle / commit_verified, kvpage/speculative/rejection.py)",
}

# The whole stack (kvpage.verify.stack): the OpenAI app's text-level fields against the text
# oracle, and the replica router against a brute-force model of its policy.
_STACK_FIELDS = ("request", "choice", "field", "expected", "actual", "stream")
REQUIRED_FIELDS.update(
    {
        "server_text": (*_STACK_FIELDS, "stop", "token_ids"),
        "server_logprobs": (*_STACK_FIELDS, "token_ids"),
        "server_tenancy": (*_STACK_FIELDS, "namespace", "prompt_tokens"),
        "server_admin": (*_STACK_FIELDS, "switches"),
        "server_protocol": _STACK_FIELDS,
        "router_policy": ("event", "field", "expected", "actual", "namespace", "loads"),
        "router_adapter": ("event", "field", "expected", "actual", "adapter", "holders"),
    }
)
WHERE_TO_LOOK.update(
    {
        "server_text": "the server's text stream: detokenizer windows, stop-string search and "
        "hold-back, finish reason (kvpage/server/text_stream.py, generation.py)",
        "server_logprobs": "per-token fields of a choice: token ids, logprobs, text_offset "
        "(kvpage/server/generation.py, responses.py)",
        "server_tenancy": "the request's namespace: API key -> tenant -> cache salt, and the "
        "cached-token count (kvpage/server/tenants.py, app.py)",
        "server_admin": "the /admin switches and what they change in the engine "
        "(kvpage/server/admin.py)",
        "server_protocol": "the response shape: status, envelope, stream framing, usage "
        "(kvpage/server/app.py, responses.py)",
        "router_policy": "the replica router: prefix match per namespace, least-loaded and "
        "imbalance rules, LRU bound of the trees (kvpage/serve_replicas/)",
        "router_adapter": "the replica router's adapter filter: which live replicas' latest "
        "adapter reports list the request's adapter (kvpage/serve_replicas/adapter_holdings.py, "
        "prefix_router.Router.choose)",
    }
)


# Found before any engine case, by classes of their own (kvpage.verify.model_oracle, gate.py):
REQUIRED_FIELDS.update(
    {
        "model": (
            "checkpoint",
            "dtype",
            "length",
            "first_layer",
            "layer_kind",
            "max_abs_diff",
            "tolerance",
        ),
        "kernel": ("paths", "passes_without", "case"),
        "crash": ("error", "step", "case"),
    }
)
WHERE_TO_LOOK.update(
    {
        "model": "the family's model math or config reading (kvpage/model/<family>.py, "
        "hf_config.py, layers.py): the first layer whose output leaves transformers'",
        "kernel": "the fast path named: the case passes with it alone turned off "
        "(kvpage/model/native_*.py, decode_tape.py, projection.py, widened.py)",
        "crash": "the exception and the step it was raised in (the traceback in the message)",
    }
)


@dataclass(slots=True)
class Attribution:
    cls: str
    reason: str
    fields: dict[str, Any]
    missing: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return not self.missing


class MutantAttribution:
    """What a mutant's first divergence was attributed to, for a result type with `mutant` (its
    `expected_class`) and `divergence` (Divergence.to_dict(), or None: nothing diverged)."""

    __slots__ = ()

    @property
    def attributed_class(self) -> str | None:
        return None if self.divergence is None else self.divergence["attribution"]["class"]

    @property
    def attribution_ok(self) -> bool:
        return (
            self.divergence is not None
            and self.attributed_class == self.mutant.expected_class
            and not self.divergence["attribution"]["missing"]
        )


@dataclass(frozen=True, slots=True)
class RequestContext:
    """What the diff needs to know about the request beyond its trace: its sampling parameters
    (the sampling and stop classes) and how each side finished."""

    params: object  # kvpage.sampling_params.SamplingParams
    finish_ref: str | None = None
    finish_cand: str | None = None
    stop_ids: tuple[int, ...] = ()  # stop_token_ids plus EOS unless ignore_eos


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
    reference: list[StepRecord],
    candidate: list[StepRecord],
    atol: float = DEFAULT_ATOL,
    context: RequestContext | None = None,
    ties_allowed: bool = False,
) -> Divergence | None:
    """`ties_allowed` (16-bit models): a numeric tie (`is_numeric_tie`) ends the comparison
    without a divergence; the tokens after it follow another path and cannot be compared."""
    greedy = context is None or getattr(context.params, "temperature", 0.0) == 0.0
    for step, (ref, cand) in enumerate(zip(reference, candidate, strict=False)):
        found = _compare(ref, cand, atol)
        if found is not None and ties_allowed and is_numeric_tie(ref, cand, atol, greedy):
            return None
        if found is not None:
            kind, detail, drift = found
            attribution = attribute(ref, cand, context, drift, atol)
            return Divergence(cand.request_id, step, kind, detail, ref, cand, drift, attribution)
    ended = _ending_divergence(reference, candidate, context)
    return ended


def _ending_divergence(reference, candidate, context: RequestContext | None):
    """Same tokens so far, but one side ran longer, or both stopped for different reasons."""
    finish_ref = context.finish_ref if context else None
    finish_cand = context.finish_cand if context else None
    same_length = len(reference) == len(candidate)
    if same_length and (finish_ref is None or finish_cand is None or finish_ref == finish_cand):
        return None
    step = min(len(reference), len(candidate))
    ref = reference[step] if step < len(reference) else None
    cand = candidate[step] if step < len(candidate) else None
    last = (candidate or reference)[-1] if (candidate or reference) else None
    kind = "finish_reason" if same_length else "length"
    detail = (
        f"reference {len(reference)} tokens ({finish_ref}), candidate {len(candidate)} tokens "
        f"({finish_cand})"
    )
    shown_ref = ref if ref is not None else (reference[-1] if reference else None)
    shown_cand = cand if cand is not None else (candidate[-1] if candidate else None)
    if _grammar_ending(reference, candidate, context):
        why = f"a constrained request's end differs: {detail}"
        attribution = structured_attribution(_ref_at(reference, step), shown_cand, context, why)
    else:
        attribution = _stop_attribution(reference, candidate, context)
    rid = last.request_id if last is not None else ""
    return Divergence(rid, step, kind, detail, shown_ref, shown_cand, None, attribution)


def _ref_at(reference: list[StepRecord], step: int) -> StepRecord | None:
    """The reference's record at `step`, or its last when it ended before."""
    if not reference:
        return None
    return reference[min(step, len(reference) - 1)]


def constrained(context: RequestContext | None) -> bool:
    return context is not None and getattr(context.params, "structured_outputs", None) is not None


def grammar_decided(ref: StepRecord, token: int, context: RequestContext) -> bool:
    """Whether the grammar, not the sampler, explains another token from the same logits: a
    greedy step's token is the argmax over its mask (no generator to blame), and a sampled
    token outside the mask the reference's own matcher allowed there was never drawable. A
    sampled token inside that mask came from the right support: its sampler chose it."""
    if context.params.greedy or ref.allowed is None:
        return True
    return not bool(ref.allowed[token])


def _grammar_ending(reference, candidate, context: RequestContext | None) -> bool:
    """The grammar decided where one side ended: the reference's grammar was complete on a
    token that is no stop id, or the candidate stopped on such a token where the reference did
    not end on a stop id (a stop id's end, on either side, is the stop rule's)."""
    if not constrained(context):
        return False
    stop_ids = set(context.stop_ids)
    last_ref = reference[-1] if reference else None
    ref_on_stop_id = last_ref is not None and last_ref.chosen_token in stop_ids
    ref_done = (
        last_ref is not None
        and (last_ref.grammar or {}).get("finished", False)
        and not ref_on_stop_id
    )
    cand_done = (
        context.finish_cand == "stop"
        and bool(candidate)
        and candidate[-1].chosen_token not in stop_ids
        and not (context.finish_ref == "stop" and ref_on_stop_id)
    )
    return ref_done or cand_done


def structured_attribution(
    ref: StepRecord | None,
    cand: StepRecord | None,
    context: RequestContext | None,
    reason: str,
    extra: dict | None = None,
) -> Attribution:
    """A constrained request whose token, end or text is not what its grammar makes it: the
    constraint, the step, the candidate's token there and what the reference's own matcher
    allowed at it (its grammar note)."""
    constraint = getattr(context.params, "structured_outputs", None) if context else None
    shown = cand or ref
    fields: dict[str, Any] = {
        "constraint": None if constraint is None else constraint.kind,
        "spec": None if constraint is None else constraint.spec[:200],
        "digest": None if constraint is None else constraint.digest[:16],
        "step": None if shown is None else shown.step,
        "token": None if cand is None else cand.chosen_token,
        "reference_token": None if ref is None else ref.chosen_token,
        "allowed_next": None if ref is None else ref.grammar,
        "finish_reason_ref": context.finish_ref if context else None,
        "finish_reason_cand": context.finish_cand if context else None,
    }
    fields.update(extra or {})
    missing = [f for f in REQUIRED_FIELDS["structured"] if fields.get(f) is None]
    return Attribution("structured", reason, fields, missing)


def _stop_attribution(reference, candidate, context: RequestContext | None) -> Attribution:
    shorter = reference if len(reference) <= len(candidate) else candidate
    params = context.params if context else None
    fields: dict[str, Any] = {
        "finish_reason_ref": context.finish_ref if context else None,
        "finish_reason_cand": context.finish_cand if context else None,
        "steps_ref": len(reference),
        "steps_cand": len(candidate),
        "last_token": shorter[-1].chosen_token if shorter else None,
        "stop_token_ids": list(context.stop_ids) if context else None,
        "max_tokens": getattr(params, "max_tokens", None),
        "ignore_eos": getattr(params, "ignore_eos", None),
    }
    which = "candidate" if len(candidate) < len(reference) else "reference"
    reason = (
        f"the {which} stopped first"
        if len(reference) != len(candidate)
        else "same tokens, different finish reason"
    )
    missing = [f for f in REQUIRED_FIELDS["stop_rule"] if fields.get(f) is None]
    return Attribution("stop_rule", reason, fields, missing)


def _compare(ref: StepRecord, cand: StepRecord, atol: float):
    if ref.view.namespace and cand.view.namespace != ref.view.namespace:
        return (
            "namespace",
            f"keyed in {cand.view.namespace[:16]}, expected {ref.view.namespace[:16]}",
            None,
        )
    groups = group_mismatch(ref, cand)
    if groups is not None:
        return "layer_group", groups.reason, _max_abs(ref, cand)
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


def attribute(
    ref: StepRecord,
    cand: StepRecord,
    context: RequestContext | None = None,
    drift: float | None = None,
    atol: float = DEFAULT_ATOL,
) -> Attribution:
    groups = group_mismatch(ref, cand)
    if groups is not None:
        missing = [f for f in REQUIRED_FIELDS["layer_group"] if groups.fields.get(f) is None]
        return Attribution("layer_group", groups.reason, groups.fields, missing)
    if cand.speculative is not None:  # its token or its KV came out of a speculative step
        fields = {**cand.speculative, "step": cand.step}
        reason = "a verified token" if fields.get("index", -1) >= 0 else "read speculated KV"
        missing = [f for f in REQUIRED_FIELDS["speculative"] if fields.get(f) is None]
        return Attribution("speculative", reason, fields, missing)
    if (
        ref.chosen_token != cand.chosen_token
        and drift is not None
        and drift <= atol
        and ref.input_ids == cand.input_ids
        and ref.position_ids == cand.position_ids
    ):
        if constrained(context) and grammar_decided(ref, cand.chosen_token, context):
            return structured_attribution(ref, cand, context, "logits agree but the token differs")
        return sampling_attribution(ref, cand, context, ref.allowed)
    lora = lora_attribution(ref, cand)
    if lora is not None:
        return lora
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


def lora_attribution(ref: StepRecord, cand: StepRecord) -> Attribution | None:
    """The lora class, where adapters are involved: the request (or its step's batch) ran with
    one, and either its namespace is not the reference's (the adapter's identity is missing
    from the key, or stands for other weights) or it diverged on a prefill that shared nothing
    (only the model's own computation, adapters included, can explain that)."""
    if not (ref.adapter or cand.adapter or cand.batch_adapters):
        return None
    keyed_apart = ref.view.namespace != cand.view.namespace
    alone = cand.step == 0 and cand.prefix_hit_tokens == 0 and not cand.after_resume
    if not (keyed_apart or alone):
        return None
    reason = "namespace differs from the reference's" if keyed_apart else "prefill sharing nothing"
    fields = {
        "adapter_ref": ref.adapter,
        "adapter_cand": cand.adapter,
        "namespace_ref": ref.view.namespace,
        "namespace_cand": cand.view.namespace,
        "batch_adapters": list(cand.batch_adapters),
        "prefix_hit_tokens": cand.prefix_hit_tokens,
    }
    return Attribution("lora", reason, fields, [])


def quantized_attribution(ref: StepRecord, cand: StepRecord, base: Attribution) -> Attribution:
    """Re-attribute a divergence that appears only on the quantized path (the same case with
    unquantized KV matches the reference): the KV format is the suspect. The scales the step
    read are compared block by block with the reference's for the same tokens; `base` (what the
    matrix alone said) is kept as `matrix_class` with its fields."""
    view, ref_view = cand.view, ref.view
    cand_d, ref_d = list(view.scale_digests), list(ref_view.scale_digests)
    mismatch = next(
        (i for i, (a, b) in enumerate(zip(cand_d, ref_d, strict=False)) if a != b), None
    )
    layer = None if mismatch is None else _first_differing_part(cand_d[mismatch], ref_d[mismatch])
    if cand_d:
        kv_scale: dict | None = {
            "block_ids": [e.physical for e in view.entries],
            "candidate": cand_d,
            "reference": ref_d,
            "first_mismatching_block": mismatch,
            "first_mismatching_layer": layer,
        }
    else:  # a layout without scales (a bfloat16 cast) has nothing to show; layout 2 must
        kv_scale = {"layout_has_scales": False} if view.kv_layout == 1 else None
    fields = dict(base.fields)
    fields.update(
        matrix_class=base.cls,
        kv_dtype=view.kv_dtype,
        kv_scale=kv_scale,
        kv_layout={
            "version": view.kv_layout,
            "reference_version": ref_view.kv_layout,
            "block_size": view.block_size,
        },
    )
    if mismatch is not None:
        reason = (
            f"only on {view.kv_dtype} KV: block {mismatch} (layer {layer}) holds other scales "
            "than the reference for the same tokens"
        )
    elif cand_d:
        reason = f"only on {view.kv_dtype} KV: scales match the reference; codes or layout differ"
    else:
        reason = f"only on {view.kv_dtype} KV (layout {view.kv_layout})"
    missing = [f for f in REQUIRED_FIELDS["quantized_kv"] if fields.get(f) is None]
    return Attribution("quantized_kv", reason, fields, missing)


def _first_differing_part(a: str, b: str) -> int | None:
    """Index of the first '.'-separated part (a layer) where two scale digests differ."""
    pairs = zip(a.split("."), b.split("."), strict=False)
    return next((i for i, (x, y) in enumerate(pairs) if x != y), None)


def sampling_attribution(
    ref: StepRecord,
    cand: StepRecord,
    context: RequestContext | None,
    allowed: torch.Tensor | None = None,
) -> Attribution:
    """Same inputs, same logits, another token: the sampler (or its generator) chose it.
    `allowed`: a constrained step's grammar mask (the support is the masked one)."""
    params = context.params if context else None
    sampler = cand.sampler or {}
    fields: dict[str, Any] = {
        "seed": sampler.get("seed"),
        "generator_offset": sampler.get("generator_offset"),
        "generator_state": sampler.get("generator_state"),
        "temperature": getattr(params, "temperature", None),
        "top_k": getattr(params, "top_k", None),
        "top_p": getattr(params, "top_p", None),
        "support": None,
        "reference_token": ref.chosen_token,
        "candidate_token": cand.chosen_token,
        "reference_sampler": ref.sampler,
    }
    if params is not None and cand.logits is not None:
        support = filtered_support(cand.logits, params, allowed)
        fields["support"] = asdict(support) if is_dataclass(support) else support
    if params is not None and params.greedy:
        # A greedy request has no generator: its "state" is the argmax rule itself.
        fields.update(seed="greedy", generator_offset=0, generator_state="greedy")
    reason = "logits agree but the chosen token differs"
    missing = [f for f in REQUIRED_FIELDS["sampling"] if fields.get(f) is None]
    return Attribution("sampling", reason, fields, missing)

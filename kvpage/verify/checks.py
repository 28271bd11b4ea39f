"""What a finished case is checked for besides the token-by-token diff: sampled draws against the
independent sampling oracle, KV provenance of every read, the case's expectations (prefix hits,
finish reasons, counters) and the idle engine's baseline. Every failure carries an attribution,
so a bug caught only by these checks still says where to look."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpage.engine.engine import LLMEngine
from kvpage.reference.records import StepRecord
from kvpage.verify.case import Case, RequestSpec
from kvpage.verify.diff import (
    REQUIRED_FIELDS,
    Attribution,
    Divergence,
    RequestContext,
    attribute,
    sampling_attribution,
    structured_attribution,
)
from kvpage.verify.sampling_oracle import (
    SAMPLING_P_THRESHOLD,
    DrawSample,
    check_draw,
    check_logprobs,
    uniformity_test,
)


@dataclass(slots=True)
class Failure:
    kind: str  # divergence | sampling | canary | provenance | expectation | baseline | liveness
    # | property (kvpage.verify.properties) | crash
    message: str
    request_id: str | None = None
    divergence: Divergence | None = None

    def to_dict(self) -> dict:
        return {
            "kind": self.kind,
            "message": self.message,
            "request_id": self.request_id,
            "divergence": None if self.divergence is None else self.divergence.to_dict(),
        }


def finding(
    kind: str, cls: str, reason: str, fields: dict[str, Any], request_id: str = "", step: int = -1
) -> Divergence:
    """A failure with no reference/candidate step pair, attributed all the same."""
    missing = [f for f in REQUIRED_FIELDS[cls] if fields.get(f) is None]
    return Divergence(
        request_id, step, kind, reason, None, None, None, Attribution(cls, reason, fields, missing)
    )


# --- sampling ----------------------------------------------------------------------------------
def check_sampling(
    spec: RequestSpec,
    sample: int,
    ref: list[StepRecord],
    cand: list[StepRecord],
    completion,
    masks: list | None = None,
) -> list[Failure]:
    """Every draw of a sampled request must be possible under the oracle, and its logprobs must be
    the raw distribution's. The first violation per sample is enough to fail it. A constrained
    sample's draws are checked against the masked distribution: `masks` (the verifier's own
    grammar walk, kvpage.verify.structured) holds the mask before each of its tokens, and its
    steps past the last mask are not checked (the walk's own failure says why)."""
    params = spec.params.for_sample(sample)
    logprobs = None if completion is None else completion.logprobs
    checked = cand if masks is None else cand[: len(masks)]
    for step, rec in enumerate(checked):
        allowed = None if masks is None else masks[step]
        problem = None
        if rec.logits is not None:
            problem = check_draw(rec.logits, params, rec.chosen_token, allowed)
        if problem is None and logprobs is not None and step < len(logprobs):
            problem = check_logprobs(rec.logits, logprobs[step], params.logprobs)
        if problem is not None:
            ref_rec = ref[step] if step < len(ref) else rec
            context = RequestContext(params)
            # greedy: the argmax over the mask; sampled outside it: never drawable
            if allowed is not None and (params.greedy or not bool(allowed[rec.chosen_token])):
                attribution = structured_attribution(ref_rec, rec, context, problem)
            else:  # a free draw, or a sampled one inside its mask: the sampler's rules drew it
                attribution = sampling_attribution(ref_rec, rec, context, allowed)
            div = Divergence(
                rec.request_id, step, "sampling", problem, ref_rec, rec, None, attribution
            )
            return [
                Failure("sampling", f"{rec.request_id} step {step}: {problem}", rec.request_id, div)
            ]
    return []


def check_draw_distribution(
    case: Case, records: dict[str, list[StepRecord]], masks: dict[str, list] | None = None
) -> list[Failure]:
    """All sampled draws of the case together must be distributed as the oracle says (a
    randomized-PIT uniformity test; deterministic, since every draw is seeded). A constrained
    sample's draws (its `masks`, sample id -> the mask before each token) count against the
    masked, renormalised distribution."""
    draws, first = [], None
    masks = masks or {}
    for spec in case.requests:
        for sample, sample_id in enumerate(spec.sample_ids()):
            params = spec.params.for_sample(sample)
            if params.greedy:
                continue
            own = masks.get(sample_id)
            recs = records.get(sample_id, [])
            for step, rec in enumerate(recs if own is None else recs[: len(own)]):
                allowed = None if own is None else own[step]
                draws.append(DrawSample(rec.logits, params, rec.chosen_token, allowed))
                first = first or (rec, params)
    if not draws:
        return []
    stat = uniformity_test(draws)
    if stat.p_value >= SAMPLING_P_THRESHOLD:
        return []
    rec, params = first
    message = (
        f"{stat.n} draws do not follow the oracle's distribution: statistic "
        f"{stat.statistic:.4g}, p = {stat.p_value:.3g} < {SAMPLING_P_THRESHOLD:g}"
    )
    attribution = sampling_attribution(rec, rec, RequestContext(params))
    attribution.reason = message
    div = Divergence(rec.request_id, 0, "draw_distribution", message, None, rec, None, attribution)
    return [Failure("sampling", message, rec.request_id, div)]


# --- provenance --------------------------------------------------------------------------------
def check_provenance(tracer, refs: dict[str, list[StepRecord]]) -> list[Failure]:
    """Every (block, generation) a step read must hold KV written for the reader's own history."""
    provenance = getattr(tracer, "provenance", None)
    if provenance is None or not provenance.violations:
        return []
    records = tracer.records
    failures = []
    for v in provenance.violations[:4]:
        own = records.get(v.sample_id, [])
        rec = own[min(v.record_step, len(own) - 1)] if own else None
        ref_records = refs.get(v.sample_id, [])
        ref = ref_records[v.record_step] if v.record_step < len(ref_records) else None
        if v.kind.startswith("rows_"):
            attribution = _rows_attribution(v, tracer.engine.config.block_size)
        elif rec is not None and v.kind not in _WRITE_SIDE:
            # Where the bad read happened decides the class, as for any divergence.
            attribution = attribute(ref or rec, rec)
            attribution.reason = f"{v.kind}: {attribution.reason}"
        elif rec is not None:
            attribution = _write_side_attribution(v, rec)
        else:
            fields = {"block_ids": [v.block_id], "generations": [v.generation]}
            fields.update(in_block_offset=-1, last_block_len=-1)
            attribution = Attribution("block_table", v.kind, fields, [])
        attribution.fields.update(violation=v.kind, logical_block=v.logical, block=v.block_id)
        div = Divergence(
            v.sample_id, v.record_step, "provenance", v.message, ref, rec, None, attribution
        )
        failures.append(Failure("provenance", v.message, v.sample_id, div))
    return failures


_WRITE_SIDE = ("no_generation_bump", "write_into_foreign")


def _rows_attribution(v, block_size: int) -> Attribution:
    """Prompt rows a hit took from the row store that are not the reader's own: another
    namespace's or prefix's, or a block incarnation since reused."""
    fields = {
        "position": v.logical * block_size,
        "token": -1,
        "expected": "rows of the reader's own KV at that block",
        "actual": f"rows kept for block {v.block_id} gen {v.generation}",
        "num_cached_tokens": -1,
    }
    return Attribution("prompt_logprobs", v.kind, fields, [])


def _write_side_attribution(v, rec: StepRecord) -> Attribution:
    """A bad write is about the block table entry it went through, wherever the writer was."""
    view = rec.view
    size = view.block_size or None
    last = rec.position_ids[-1] if rec.position_ids else None
    fields = {
        "block_ids": [e.physical for e in view.entries] or [v.block_id],
        "generations": [e.generation for e in view.entries] or [v.generation],
        "in_block_offset": None if last is None or size is None else last % size,
        "last_block_len": view.last_block_len,
    }
    missing = [f for f in REQUIRED_FIELDS["block_table"] if fields.get(f) is None]
    return Attribution("block_table", v.kind, fields, missing)


# --- expectations ------------------------------------------------------------------------------
def check_expectations(
    case: Case,
    engine: LLMEngine,
    finished,
    refs: dict[str, list[StepRecord]],
    tied: frozenset[str] = frozenset(),
) -> list[Failure]:
    """`tied`: samples whose comparison stopped at a numeric tie (16-bit compute, a rounded KV
    format: kvpage.verify.diff.is_numeric_tie): the engine then followed other tokens than the
    reference, rightly, and a finish the case derived from the reference's tokens (a stop on
    the reference's own token at step k) says nothing about them."""
    failures: list[Failure] = []
    for rid, reason in case.expect_finish.items():
        got = finished[rid].outputs[0].finish_reason if rid in finished else None
        if got != reason and rid not in tied:
            message = f"finish_reason {got}, expected {reason}"
            fields = {"expected": reason, "actual": got, "counter": "finish_reason"}
            div = finding("finish_reason", "accounting", message, fields, rid)
            failures.append(Failure("expectation", message, rid, div))
    failures += _check_hits(case, engine, finished, refs)
    failures += _check_counters(case, engine, finished)
    return failures


def _expected_hits(case: Case) -> dict[str, tuple[str, int | None]]:
    """request -> ("exact", n) | ("some", None) | ("none", 0)."""
    expected: dict[str, tuple[str, int | None]] = {}
    for rid in case.expect_hit:
        expected[rid] = ("some", None)
    for rid in case.expect_no_hit:
        expected[rid] = ("none", 0)
    for rid, n in case.expect_hit_tokens.items():
        expected[rid] = ("exact", n)
    return expected


def _check_hits(case: Case, engine: LLMEngine, finished, refs) -> list[Failure]:
    failures = []
    records = engine.tracer.records
    for rid, (how, n) in _expected_hits(case).items():
        if rid not in finished:
            continue
        got = finished[rid].metrics.num_cached_tokens
        if (how == "some" and got > 0) or (how != "some" and got == n):
            continue
        want = "a prefix-cache hit" if how == "some" else f"{n} cached tokens"
        message = f"expected {want}, got {got} cached tokens"
        spec = next(s for s in case.requests if s.request_id == rid)
        div = _hit_divergence(spec, records, refs, message)
        failures.append(Failure("expectation", message, rid, div))
    return failures


def _hit_divergence(spec: RequestSpec, records, refs, message: str) -> Divergence | None:
    """A wrong hit or miss is a prefix-key matter: show the step-0 record and its namespace."""
    sample_id = spec.sample_ids()[0]
    own = records.get(sample_id, [])
    if not own:
        return None
    rec = own[0]
    ref = (refs.get(sample_id) or [rec])[0]
    attribution = attribute(ref, rec)
    attribution.reason = message
    if attribution.cls != "prefix_key":
        fields = dict(attribution.fields)
        fields.update(
            namespace_ref=ref.view.namespace,
            namespace_cand=rec.view.namespace,
            prefix_digest=rec.prefix_digest,
            prefix_hit_tokens=rec.prefix_hit_tokens,
            position_ids_ref=ref.position_ids,
            position_ids_cand=rec.position_ids,
        )
        attribution = Attribution("prefix_key", message, fields, [])
    return Divergence(sample_id, 0, "prefix_hit", message, ref, rec, None, attribution)


def _check_counters(case: Case, engine: LLMEngine, finished) -> list[Failure]:
    failures = []
    stats = engine.stats()
    # A pool sized to run out under plain decoding's schedule may not under speculation's
    # (fewer steps per request, fewer at once): the case still runs, its tokens still diffed,
    # but "it preempted" is the plain schedule's property. Forced preemptions stay counted.
    speculating = getattr(engine, "speculation", None) is not None
    if case.expect_preemption and stats["preemptions"] == 0 and not speculating:
        message = "the case was built to preempt, but nothing was"
        fields = {"counter": "preemptions", "expected": ">0", "actual": 0}
        failures.append(
            Failure("expectation", message, None, finding("counter", "accounting", message, fields))
        )
    expected = dict(case.expect_counters)
    # Prefix accounting: hits count each prompt once, at its first admission.
    expected.setdefault("prefix_hits", sum(o.metrics.num_cached_tokens for o in finished.values()))
    for name, value in expected.items():
        if stats[name] != value:
            message = f"stats[{name!r}] = {stats[name]}, expected {value}"
            if name in _BASELINE_KEYS:  # memory left behind, not a miscount
                fields = _resource_fields(engine, [message])
                div = finding("counter", "resource", message, fields)
            else:
                fields = {"counter": name, "expected": value, "actual": stats[name]}
                div = finding("counter", "accounting", message, fields)
            failures.append(Failure("expectation", message, None, div))
    return failures


# --- baseline ----------------------------------------------------------------------------------
def check_baseline(engine: LLMEngine) -> list[Failure]:
    """Idle engine: every block free or cached, each cached block indexed, nothing held, so a
    release path that leaks a block or a reference shows here."""
    s = engine.stats()
    problems = []
    if s["private_blocks"] or s["shared_blocks"] or s["evicting_blocks"] or s["restoring_blocks"]:
        problems.append(
            f"blocks still held: {s['private_blocks']} private, {s['shared_blocks']} "
            f"shared, {s['evicting_blocks']} evicting, {s['restoring_blocks']} restoring"
        )
    if s["free_blocks"] + s["cached_blocks"] != s["num_blocks"]:
        problems.append(
            f"free {s['free_blocks']} + cached {s['cached_blocks']} != {s['num_blocks']}"
        )
    if s["index_entries"] != s["cached_blocks"]:
        problems.append(
            f"index has {s['index_entries']} entries for {s['cached_blocks']} cached blocks"
        )
    if s["running"] or s["waiting"] or s["swapped"] or s["swap_space_used"]:
        problems.append("requests or swap space still held")
    if engine.cache.live_tables or engine.cache.inflight:
        problems.append("live tables or in-flight snapshots remain")
    fields = _resource_fields(engine, problems)
    return [
        Failure("baseline", p, None, finding("baseline", "resource", p, fields)) for p in problems
    ]


def _resource_fields(engine: LLMEngine, problems: list[str]) -> dict:
    stats = engine.stats()
    return {
        "leaked": problems,
        "stats": {k: stats[k] for k in _BASELINE_KEYS},
        "live_tables": sorted(engine.cache.live_tables),
    }


_BASELINE_KEYS = (
    "num_blocks",
    "free_blocks",
    "private_blocks",
    "shared_blocks",
    "cached_blocks",
    "evicting_blocks",
    "restoring_blocks",
    "index_entries",
    "running",
    "waiting",
    "swapped",
    "swap_space_used",
)

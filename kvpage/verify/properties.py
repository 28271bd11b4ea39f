"""Per-step properties: rules every step of every case must keep, whatever the requests are, so
a generated scenario is held to them as much as a hand-written one. `StepProperties` watches the
engine next to the tracer (an observer: it reads plans and public state, never changes them);
`check_independence` looks at a finished case's unseeded draws.

  step_budget          a plan schedules at most max_num_batched_tokens tokens and max_num_seqs
                       sequences (a parallel request about to fork counts as its n samples)
  finish_precedence    a stop id (EOS unless ignore_eos, or a stop_token_id) drawn exactly at
                       max_tokens ends the sample with "stop", not "length" (the reference's rule)
  reservation          with preemption off, a request admitted then never lacks a block it was
                       promised, and a request whose worst case fits the free pool is not refused
  prefix_hold          a request held back for a prefix computed in the same step is admitted in
                       the very next step
  sample_independence  unseeded samples (of one request, of several) are not drawn in lockstep

The engine's own arithmetic is not reused: worst cases, the blocks a step completes and the stop
set are computed here from the configuration and public sequence state."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from itertools import combinations, takewhile

from kvpage.engine.engine import LLMEngine
from kvpage.engine.events import EngineObserver, Finished
from kvpage.engine.plan import StepPlan
from kvpage.engine.sequence import Sequence
from kvpage.reference.generator import stop_token_ids
from kvpage.reference.records import StepRecord
from kvpage.verify.case import Case
from kvpage.verify.checks import Failure, finding
from kvpage.verify.sampling_oracle import SAMPLING_P_THRESHOLD, oracle_probs

# (constraint, tokens) -> the verifier's grammar mask before each token (kvpage.verify.structured)
GrammarMasks = Callable[[object, list[int]], list]


def _property_failure(cls: str, message: str, fields: dict, request_id: str = "", step=-1):
    div = finding(cls, cls, message, fields, request_id, step)
    return Failure("property", message, request_id or None, div)


# --- the engine-side rules -----------------------------------------------------------------
@dataclass(slots=True)
class _Held:
    seq: Sequence
    step: int
    keys: list[str]  # hex digests it could hit that the holding step was computing
    behind: set[int]  # seq ids queued behind it when it was held


@dataclass(slots=True)
class _Memory:
    """What the previous plan left: who ran, who was held, who was promised blocks."""

    running: set[int] = field(default_factory=set)
    held: list[_Held] = field(default_factory=list)
    promised: set[str] = field(default_factory=set)  # request ids admitted with preemption off
    checked: set[int] = field(default_factory=set)  # seq ids whose promise was decided
    seen: set[int] = field(default_factory=set)  # seq ids queued or running at an earlier plan


class StepProperties(EngineObserver):
    """Attach with `engine.add_observer(StepProperties(engine))`; read `failures` at the end.
    Each rule reports its first violation only: the rest usually follow from it."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.config = engine.config  # the user's budget, not whatever the scheduler reads
        self.failures: list[Failure] = []
        self._fired: set[str] = set()
        self._mem = _Memory()
        self._computing_now: set[bytes] = set()  # this plan's, computed once per plan

    def _report(self, cls: str, message: str, fields: dict, request_id: str = "", step=-1):
        if cls not in self._fired:
            self._fired.add(cls)
            self.failures.append(_property_failure(cls, message, fields, request_id, step))

    # --- hooks -----------------------------------------------------------------------------
    def on_plan(self, plan: StepPlan) -> None:
        self._computing_now = self._computing(plan)
        self._check_budget(plan)
        self._note_promises()
        self._check_reservation(plan)
        self._check_holds(plan)
        self._remember(plan)

    def on_event(self, event) -> None:
        if isinstance(event, Finished) and event.reason in ("stop", "length"):
            self._check_finish(event)

    # --- step budget -----------------------------------------------------------------------
    def _check_budget(self, plan: StepPlan) -> None:
        tokens = sum(item.num_new_tokens for item in plan.scheduled)
        seqs = sum(self._weight(item.seq) for item in plan.scheduled)
        cap_tokens, cap_seqs = self.config.max_num_batched_tokens, self.config.max_num_seqs
        if tokens <= cap_tokens and seqs <= cap_seqs:
            return
        fields = {
            "step": plan.step,
            "scheduled_tokens": tokens,
            "max_num_batched_tokens": cap_tokens,
            "scheduled_seqs": seqs,
            "max_num_seqs": cap_seqs,
            "per_seq": {i.seq.sample_id: i.num_new_tokens for i in plan.scheduled},
        }
        message = (
            f"step {plan.step} scheduled {tokens} tokens in {seqs} sequences; the budget is "
            f"{cap_tokens} tokens and {cap_seqs} sequences"
        )
        self._report("step_budget", message, fields, step=plan.step)

    def _weight(self, seq: Sequence) -> int:
        """Sequences `seq` stands for: a parallel request before its fork becomes n at once."""
        return seq.params.n if seq.seq_id in self.engine.scheduler.to_fork else 1

    # --- finish precedence -----------------------------------------------------------------
    def _check_finish(self, event: Finished) -> None:
        seq = self.engine.requests.sample(event.sample_id)
        if seq is None or not seq.output_ids:
            return
        stops = stop_token_ids(self.engine.model, seq.params)
        last, count = seq.output_ids[-1], len(seq.output_ids)
        if not (last in stops and count == seq.params.max_tokens) or event.reason == "stop":
            return
        fields = {
            "finish_reason": event.reason,
            "expected": "stop",
            "last_token": last,
            "stop_token_ids": sorted(stops),
            "num_tokens": count,
            "max_tokens": seq.params.max_tokens,
        }
        message = (
            f"{event.sample_id} drew stop id {last} as its token {count} = max_tokens and "
            f"finished with {event.reason!r}: a stop drawn at max_tokens is a stop"
        )
        self._report("finish_precedence", message, fields, event.sample_id, count - 1)

    # --- reservation with preemption off ---------------------------------------------------
    def _note_promises(self) -> None:
        """A request first seen running while preemption is off was admitted under the
        worst-case reservation; its forked samples share the promise."""
        off = not self.engine.scheduler.preemption_enabled
        for seq in self.engine.scheduler.running:
            if seq.seq_id not in self._mem.checked:
                self._mem.checked.add(seq.seq_id)
                if off and seq.sample_index == 0:
                    self._mem.promised.add(seq.request_id)

    def _check_reservation(self, plan: StepPlan) -> None:
        sched = self.engine.scheduler
        if sched.preemption_enabled:
            return
        short = plan.stalled + [seq for seq, _ in plan.failed]
        broken = next((s for s in short if s.request_id in self._mem.promised), None)
        if broken is not None:
            self._overcommitted(plan, broken)
            return
        head = sched.waiting[0] if sched.waiting else None
        if head is not None and self._reachable(plan, head) and self._fits(head):
            self._refused(plan, head)

    def _overcommitted(self, plan: StepPlan, seq: Sequence) -> None:
        self._reservation_broken(
            plan,
            seq,
            "over-commit",
            "was admitted with preemption off but cannot grow: the reservation promised blocks "
            "the pool does not have",
        )

    def _refused(self, plan: StepPlan, seq: Sequence) -> None:
        self._reservation_broken(
            plan,
            seq,
            "refused",
            "was kept waiting with preemption off although its worst case and every running "
            "request's fit in the free pool",
        )

    def _reservation_broken(self, plan: StepPlan, seq: Sequence, violation: str, what: str):
        message = f"step {plan.step}: {seq.sample_id} {what}"
        fields = self._pool_fields(plan, seq, violation)
        self._report("reservation", message, fields, seq.sample_id, plan.step)

    def _pool_fields(self, plan: StepPlan, seq: Sequence, violation: str) -> dict:
        return {
            "step": plan.step,
            "preemption": "off",
            "violation": violation,
            "request": seq.sample_id,
            "free_blocks": self.engine.cache.num_free_blocks(),
            "worst_case_blocks": self._worst(seq),
            "running_growth": self._growth(),
        }

    def _worst(self, seq: Sequence) -> int:
        total = len(seq.prompt_ids) + seq.params.max_tokens
        return self.engine.cache.max_blocks_for(total) * self._unforked_n(seq)  # all groups

    def _unforked_n(self, seq: Sequence) -> int:
        unforked = seq.params.n > 1 and seq.sample_index == 0 and not seq.output_ids
        return seq.params.n if unforked else 1

    def _growth(self) -> int:
        running = self.engine.scheduler.running
        return sum(max(0, self._worst(s) - s.table.num_held()) for s in running)

    def _fits(self, seq: Sequence) -> bool:
        need = min(self._worst(seq), self.engine.cache.pool.num_blocks)
        return self._growth() + need <= self.engine.cache.num_free_blocks()

    def _reachable(self, plan: StepPlan, seq: Sequence) -> bool:
        """The admission loop got to `seq` with room for it: nothing preempted or swapped,
        tokens and sequences left, and no chunk of this step computing a block it could hit
        (then holding it back is the prefix rule, not a refusal), and its adapter, if any,
        resident or with a slot it may take (else it waits for one, whatever the pool)."""
        sched = self.engine.scheduler
        if plan.preempted or sched.swapped or self._hittable(seq, self._computing_now):
            return False
        slots = sched.lora_slots
        if seq.lora is not None and not seq.lora_held and not slots.can_hold(seq.lora):
            return False
        tokens = sum(item.num_new_tokens for item in plan.scheduled)
        running = sum(self._unforked_n(s) for s in sched.running)
        return (
            tokens < self.config.max_num_batched_tokens
            and running + self._unforked_n(seq) <= self.config.max_num_seqs
        )

    # --- bounded hold-back -----------------------------------------------------------------
    def _computing(self, plan: StepPlan) -> set[bytes]:
        """Digests of the full blocks this step's chunks complete, which its end publishes."""
        cache = self.engine.cache
        if not cache.enable_prefix_caching:
            return set()
        out: set[bytes] = set()
        for item in plan.scheduled:
            table, chain = item.seq.table, item.seq.chain
            if table.publish_blocked or not cache.index.is_enabled(chain.namespace_digest):
                continue
            end = min(len(chain.keys), table.num_tokens // self.config.block_size)
            out.update(k.digest for k in chain.keys[table.num_published : end])
        return out

    def _hittable(self, seq: Sequence, computing: set[bytes]) -> list[str]:
        """The blocks `seq` could hit that are being computed now. What it could hit is the
        hit cap's to say (a bug there is a prefix_key matter, not a hold that lasts too long)."""
        cap = self.engine.cache.max_hit_blocks(seq.num_tokens)
        return [k.digest.hex() for k in seq.chain.keys[:cap] if k.digest in computing]

    def _check_holds(self, plan: StepPlan) -> None:
        sched = self.engine.scheduler
        # A forked sample (index > 0) is new to the plan but was never waiting: not an admission.
        scheduled = {item.seq.seq_id for item in plan.scheduled if item.seq.sample_index == 0}
        admitted = scheduled - self._mem.running - {s.seq_id for s in plan.resumed}
        waiting = {s.seq_id for s in sched.waiting}
        for held in self._mem.held:
            seq = held.seq
            if seq.seq_id not in waiting or self._hittable(seq, self._computing_now):
                continue  # admitted, gone, or held again by a block computed in this step
            passed = admitted & (held.behind | (admitted - self._mem.seen))
            first = sched.waiting[0] is seq and self._first_reachable(plan, seq)
            if passed or first:
                self._held_too_long(plan, held, sorted(passed))

    def _first_reachable(self, plan: StepPlan, seq: Sequence) -> bool:
        """Reachable, and the pool has room for it: for its whole prompt without a hit (then
        any first chunk fits, hit or not), or for its worst case with preemption off."""
        if not self._reachable(plan, seq):
            return False
        if not self.engine.scheduler.preemption_enabled:
            return self._fits(seq)
        whole = self.engine.cache.max_blocks_for(seq.num_tokens)  # every layer group's
        return whole <= self.engine.cache.num_free_blocks()

    def _held_too_long(self, plan: StepPlan, held: _Held, passed: list[int]) -> None:
        sched = self.engine.scheduler
        tokens = sum(item.num_new_tokens for item in plan.scheduled)
        fields = {
            "step": plan.step,
            "held_at": held.step,
            "request": held.seq.sample_id,
            "pending_keys": held.keys[:8],
            "queues": {
                "running": len(sched.running),
                "waiting": len(sched.waiting),
                "swapped": len(sched.swapped),
            },
            "budget_left": self.config.max_num_batched_tokens - tokens,
            "admitted_behind_it": passed,
        }
        message = (
            f"{held.seq.sample_id} was held back at step {held.step} for a prefix computed in "
            f"that step, and step {plan.step} still did not admit it"
        )
        self._report("prefix_hold", message, fields, held.seq.sample_id, plan.step)

    def _remember(self, plan: StepPlan) -> None:
        sched = self.engine.scheduler
        order = [s.seq_id for s in sched.waiting]
        held = []
        for i, seq in enumerate(sched.waiting):
            keys = self._hittable(seq, self._computing_now)
            if keys:
                held.append(_Held(seq, plan.step, keys, set(order[i + 1 :])))
        self._mem.held = held
        self._mem.running = {s.seq_id for s in sched.running}
        self._mem.seen |= self._mem.running | set(order)


# --- unseeded samples ----------------------------------------------------------------------
def check_independence(
    case: Case, records: dict[str, list[StepRecord]], grammar_masks: GrammarMasks | None = None
) -> list[Failure]:
    """Unseeded samples must not share a generator seed (one random stream for two samples,
    whatever their prompts), and must not draw in lockstep (`check_lockstep`). Constrained
    samples agree where their grammar leaves one token: `grammar_masks` (constraint, tokens)
    -> the verifier's mask before each token scores their agreement on the masked
    distribution."""
    unseeded = [
        (spec, sid)
        for spec in case.requests
        if spec.params.seed is None and not spec.params.greedy
        for sid in spec.sample_ids()
    ]
    return _shared_seed(unseeded, records) or check_lockstep(unseeded, records, grammar_masks)


def _shared_seed(unseeded, records) -> list[Failure]:
    by_seed: dict[int, str] = {}
    for _, sid in unseeded:
        seed = _seed(records.get(sid))
        if seed is None:
            continue
        if seed not in by_seed:
            by_seed[seed] = sid
            continue
        other = by_seed[seed]
        both = zip(records[other], records[sid], strict=False)
        agreed = sum(1 for _ in takewhile(_same_token, both))
        fields = {
            "samples": [other, sid],
            "seeds": [seed, seed],
            "agreed_steps": agreed,
            "p_value": 0.0,  # one stream: dependent by construction
            "threshold": SAMPLING_P_THRESHOLD,
            "pairs": 1,
        }
        message = f"unseeded samples {other} and {sid} draw from one generator seed ({seed})"
        return [_property_failure("sample_independence", message, fields, sid)]
    return []


def check_lockstep(
    unseeded, records: dict[str, list[StepRecord]], grammar_masks: GrammarMasks | None = None
) -> list[Failure]:
    """Unseeded samples with the same prompt and sampling parameters draw from the same
    distributions; independent ones agree on their first L tokens with probability
    P = prod_t p_B,t(a_t): B's oracle probability of A's token at each step, from B's own logits,
    which given the agreeing history are exactly what B drew from. P is an exact p-value for
    "B repeated A for L tokens". Over the K pairs of a case the threshold is
    SAMPLING_P_THRESHOLD / K, so by the union bound an engine whose unseeded samples are
    independent fails a case with probability at most SAMPLING_P_THRESHOLD (1e-4), whatever the
    dependence between pairs; the seeds are fixed, so a verdict replays. Lockstep samples (a
    copied generator) agree on every token and reach p-values far below it."""
    groups: dict[tuple, list[str]] = {}
    params = {}
    for spec, sid in unseeded:
        p = spec.params
        key = (tuple(spec.prompt), p.temperature, p.top_k, p.top_p, p.structured_outputs)
        groups.setdefault(key, []).append(sid)
        params[sid] = p
    pairs = [pair for ids in groups.values() for pair in combinations(ids, 2)]
    if not pairs:
        return []
    threshold = SAMPLING_P_THRESHOLD / len(pairs)
    scored = [
        (_pair(records.get(a, []), records.get(b, []), params[b], grammar_masks), a, b)
        for a, b in pairs
    ]
    (p_value, agreed), a, b = min(scored, key=lambda s: s[0][0])
    if p_value >= threshold:
        return []
    fields = {
        "samples": [a, b],
        "seeds": [_seed(records.get(a)), _seed(records.get(b))],
        "agreed_steps": agreed,
        "p_value": p_value,
        "threshold": threshold,
        "pairs": len(pairs),
    }
    message = (
        f"unseeded samples {a} and {b} drew the same first {agreed} tokens: p = {p_value:.3g} "
        f"< {threshold:.3g} ({SAMPLING_P_THRESHOLD:g} over {len(pairs)} pairs)"
    )
    return [_property_failure("sample_independence", message, fields, b)]


def _pair(ra, rb, params, grammar_masks: GrammarMasks | None) -> tuple[float, int]:
    constraint = params.structured_outputs
    if constraint is None or grammar_masks is None:
        return pair_p_value(ra, rb, params)
    # the masks along the history the two share (a token the grammar refuses ends it)
    masks = grammar_masks(constraint, [r.chosen_token for r in ra])
    return pair_p_value(ra[: len(masks)], rb, params, masks)


def pair_p_value(
    ra: list[StepRecord], rb: list[StepRecord], params, masks: list | None = None
) -> tuple[float, int]:
    """(p-value, L) for B agreeing with A on their first L tokens; `masks`: a constrained
    pair's grammar mask before each of A's tokens (the same for B while they agree)."""
    p, agreed = 1.0, 0
    for step, (a, b) in enumerate(zip(ra, rb, strict=False)):
        if a.chosen_token != b.chosen_token or b.logits is None:
            break
        allowed = None if masks is None else masks[step]
        probs = oracle_probs(b.logits, params.temperature, params.top_k, params.top_p, allowed)
        prob = float(probs[a.chosen_token])
        # A token the oracle puts just outside the support (float32 filtering) carries no
        # evidence either way: counting it as 1 keeps P a valid (conservative) p-value.
        p *= prob if prob > 0.0 else 1.0
        agreed += 1
    return p, agreed


def _same_token(pair: tuple[StepRecord, StepRecord]) -> bool:
    return pair[0].chosen_token == pair[1].chosen_token


def _seed(records: list[StepRecord] | None):
    if not records or records[0].sampler is None:
        return None
    return records[0].sampler.get("seed")


def pin_unseeded(case: Case, records: dict[str, list[StepRecord]], finished: dict):
    """The case and outputs to diff against the reference: an unseeded sample draws from a
    generator the engine seeded itself, so its reference replays that seed (read from its first
    record) as a request of its own. Whether those seeds make independent samples is
    check_independence's question; the diff still checks every token drawn from them."""
    specs, outputs = [], dict(finished)
    for spec in case.requests:
        if spec.params.seed is not None or spec.params.greedy:
            specs.append(spec)
            continue
        out = finished.get(spec.request_id)
        for i, sid in enumerate(spec.sample_ids()):
            params = replace(spec.params.for_sample(i), seed=_seed(records.get(sid)))
            specs.append(replace(spec, request_id=sid, params=params))
            if out is not None:
                own = [replace(c, index=0) for c in out.outputs if c.index == i]
                outputs[sid] = replace(out, request_id=sid, outputs=own)
    return replace(case, requests=specs), outputs

"""No phantom hits: a request's prefix-cache hit can never exceed what was really published for
it. A full block can be served from the cache only if another request of the same namespace
(the same cache salt; "" is not None) computed the same tokens for that block and everything
before it, in a step that ran while caching was on — globally and for that namespace — and
finished that step before the request was admitted. A request admitted while its namespace's
caching is off gets no hit at all; and no hit covers the whole prompt (one token is always
computed, for the logits).

The model is built from what the verifier saw, not from the engine's cache: the plans (which
tokens each sample computed in which step), the tokens each sample drew (the tracer), and the
caching switches the case set through the test driver (logged as asked for, whatever the engine
does with them). It is an upper bound: eviction and
the same-step wait only ever make a real hit smaller, so an honest engine never exceeds it."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpage.engine.events import EngineObserver
from kvpage.engine.plan import StepPlan
from kvpage.verify.case import Case, RequestSpec
from kvpage.verify.checks import Failure, _hit_divergence


@dataclass(slots=True)
class _Switches:
    """Caching switch settings over time: the driver's log, (steps run before the call, salt
    or None for the global switch, is global, enabled)."""

    initial: bool
    changes: list[tuple[int, str | None, bool, bool]] = field(default_factory=list)

    def on(self, step: int, salt: str | None) -> bool:
        """Whether caching was on for `salt` in engine step `step` (1-based)."""
        enabled_global, enabled_ns = self.initial, True
        for at, key, is_global, enabled in self.changes:
            if at >= step:
                break
            if is_global:
                enabled_global = enabled
            elif key == salt:
                enabled_ns = enabled
        return enabled_global and enabled_ns


class HitBounds(EngineObserver):
    def __init__(self, engine, case: Case) -> None:
        self.engine, self.case = engine, case
        self.block_size = engine.config.block_size
        self.initial = engine.config.enable_prefix_caching
        # sample -> (step, first token computed, end) of each step that computed its KV
        self.computed: dict[str, list[tuple[int, int, int]]] = {}
        self.admitted: dict[str, int] = {}  # request id -> the step it was first scheduled in
        engine.add_observer(self)

    def on_plan(self, plan: StepPlan) -> None:
        step = self.engine.step_count
        for item in plan.scheduled:
            seq = item.seq
            start = seq.num_computed
            span = (step, start, start + item.num_new_tokens)
            self.computed.setdefault(seq.sample_id, []).append(span)
            self.admitted.setdefault(seq.request_id, step)

    # --- after the case ----------------------------------------------------------------------
    def check(self, finished, refs, switch_log) -> list[Failure]:
        """`switch_log`: the test driver's (kvpage.verify.driver.StepDriver.switch_log)."""
        self.switches = _Switches(self.initial, list(switch_log))
        failures = []
        specs = {s.request_id: s for s in self.case.requests}
        tokens = self._tokens(specs)
        for rid, out in finished.items():
            spec, got = specs.get(rid), out.metrics.num_cached_tokens
            if spec is None or not got or rid not in self.admitted:
                continue
            bound = self.bound(spec, specs, tokens)
            if got > bound:
                message = (
                    f"{got} cached tokens, but at most {bound} were published for its prefix "
                    f"in its namespace (salt {spec.cache_salt!r}) before it was admitted"
                )
                div = _hit_divergence(spec, self.engine.tracer.records, refs, message)
                failures.append(Failure("expectation", message, rid, div))
        return failures

    def bound(self, spec: RequestSpec, specs, tokens) -> int:
        admitted = self.admitted[spec.request_id]
        if not self.switches.on(admitted, spec.cache_salt):
            return 0
        size, prompt = self.block_size, spec.prompt
        blocks = 0
        while (blocks + 1) * size <= len(prompt):
            want = prompt[: (blocks + 1) * size]
            if not any(
                self._published(sid, want, admitted, spec.cache_salt, tokens[sid])
                for sid, other in self._others(spec, specs)
            ):
                break
            blocks += 1
        return min(blocks * size, len(prompt) - 1)

    def _others(self, spec: RequestSpec, specs):
        for other in specs.values():
            if other.request_id == spec.request_id or other.cache_salt != spec.cache_salt:
                continue
            for sid in other.sample_ids():
                yield sid, other

    def _published(self, sid: str, want: list[int], before: int, salt, seq_tokens) -> bool:
        """Sample `sid` holds `want` at its start, and ran a step before step `before`, while
        caching was on for `salt`, by whose end its KV covered `want`. A step publishes every
        full block of the sample's table not yet published, so blocks computed while caching
        was off are published by the sample's first step after it is back on, never sooner."""
        if seq_tokens[: len(want)] != want:
            return False
        return any(
            step < before and end >= len(want) and self.switches.on(step, salt)
            for step, _, end in self.computed.get(sid, [])
        )

    def _tokens(self, specs) -> dict[str, list[int]]:
        """Each sample's prompt and drawn tokens, as far as the tracer saw them."""
        records = self.engine.tracer.records
        return {
            sid: list(spec.prompt) + [r.chosen_token for r in records.get(sid, [])]
            for spec in specs.values()
            for sid in spec.sample_ids()
        }

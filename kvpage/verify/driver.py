"""A test driver: what the verifier and the tests do to an engine between steps.

Forced preemption, holds and swap-write failures are not engine features: the driver makes them
out of public engine calls between steps (`preempt`, `suspend`, `resume`, the swap space's
`store`), so nothing inside `schedule()` is there for a test. Drive the engine with
`driver.step()` instead of `engine.step()`; a driver also remembers each step's plan."""

from __future__ import annotations

from dataclasses import dataclass

from kvpage.engine.engine import LLMEngine
from kvpage.engine.events import EngineObserver
from kvpage.engine.outputs import RequestOutput
from kvpage.engine.plan import StepPlan
from kvpage.engine.sequence import SeqStatus, Sequence
from kvpage.errors import SwapError


@dataclass(slots=True)
class ForcedPreemption:
    """Preempt `sample_id` once it has `after_tokens` outputs; keep it out for
    `resume_after_steps` engine steps (at least the step after the preemption)."""

    sample_id: str
    after_tokens: int
    resume_after_steps: int
    mode: str | None
    done: bool = False


class StepDriver(EngineObserver):
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.forced: list[ForcedPreemption] = []
        self.resume_at: dict[str, int] = {}  # held sample id -> the step it may run again
        self.failing_writes = 0
        self.last_plan: StepPlan | None = None
        self._store = None  # the swap space's own store, once writes are made to fail
        # (steps run before the call, cache salt or None for the global switch, is global,
        # enabled): the caching switches a case set, as it asked for them
        self.switch_log: list[tuple[int, str | None, bool, bool]] = []
        engine.add_observer(self)

    # --- what a case asks for --------------------------------------------------------------
    def force_preempt(
        self,
        sample_id: str,
        after_tokens: int,
        resume_after_steps: int = 1,
        mode: str | None = None,
    ) -> None:
        """A request id targets its sample 0; `rid#i` sample i, also before it is forked."""
        if mode not in (None, "recompute", "swap"):
            raise ValueError(f"mode must be 'recompute' or 'swap', got {mode!r}")
        self.forced.append(ForcedPreemption(sample_id, after_tokens, resume_after_steps, mode))

    def fail_swap_writes(self, count: int = 1) -> None:
        """The next `count` swap-out copies fail: the engine must recompute instead."""
        self.failing_writes += count
        if self._store is None:
            space = self.engine.swap_space
            self._store = space.store
            space.store = self._failing_store

    def _failing_store(self, seq_id: int, blocks) -> None:
        if self.failing_writes > 0:
            self.failing_writes -= 1
            raise SwapError(f"injected swap-write failure for seq {seq_id}")
        self._store(seq_id, blocks)

    def set_prefix_caching(self, enabled: bool) -> None:
        self.switch_log.append((self.engine.step_count, None, True, bool(enabled)))
        self.engine.set_prefix_caching(enabled)

    def set_namespace_caching(self, cache_salt: str | None, enabled: bool) -> None:
        self.switch_log.append((self.engine.step_count, cache_salt, False, bool(enabled)))
        self.engine.set_namespace_caching(cache_salt, enabled)

    @property
    def seqs(self) -> dict[str, Sequence]:
        return self.engine.seqs

    @property
    def held(self) -> set[str]:
        """Sample ids this driver keeps out of the steps."""
        return set(self.resume_at)

    # --- one step --------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        self.prepare()
        return self.engine.step()

    def on_plan(self, plan: StepPlan) -> None:
        self.last_plan = plan

    def prepare(self) -> None:
        """Do what is due before the coming step: let held samples back, then preempt those
        whose plans came due (idempotent until the step runs)."""
        step = self.engine.step_count + 1
        for sample_id in [s for s, at in self.resume_at.items() if at <= step]:
            del self.resume_at[sample_id]
            seq = self.engine.requests.sample(sample_id)
            if seq is not None and seq.seq_id in self.engine.scheduler.suspended:
                self.engine.resume(sample_id)
        for plan in self.forced:
            if not plan.done and self._due(plan):
                plan.done = True
                self._preempt(plan, step)
        self._hold_speculation()

    def _hold_speculation(self) -> None:
        """A speculating engine adds several tokens a step: each sample with a preemption still
        to come is held at its token count, so the preemption finds it there."""
        speculation = self.engine.speculation
        if speculation is None:
            return
        for plan in self.forced:
            seq = self.engine.requests.sample(plan.sample_id)
            if seq is not None:
                speculation.hold_at(seq, None if plan.done else plan.after_tokens)

    def _due(self, plan: ForcedPreemption) -> bool:
        seq = self.engine.requests.sample(plan.sample_id)
        return (
            seq is not None
            and seq.status is SeqStatus.RUNNING
            and len(seq.output_ids) >= plan.after_tokens
        )

    def _preempt(self, plan: ForcedPreemption, step: int) -> None:
        self.engine.preempt(plan.sample_id, plan.mode)
        self.engine.suspend(plan.sample_id)
        self.resume_at[plan.sample_id] = step + max(1, plan.resume_after_steps)

"""What the engine tells whoever watches it: one observer interface for the verifier's tracer, the
server's audit log and metrics, and tests.

An observer subclasses `EngineObserver`, overrides the hooks it needs (all are no-ops here) and is
attached with `engine.add_observer(obs)`. Hooks run on the engine thread, synchronously, at the
moment the thing happens; they observe and never change engine state. With no observer attached the
engine builds no event and pays an empty-list test where a hook would run.

Two kinds of hook:
- `on_event(event)`: request lifecycle and cache events, as frozen dataclasses below. Every event
  names the request and the sample (not only the internal sequence id), the tenant key (the
  request's cache_salt) and the namespace digest its blocks are keyed in.
- tracing hooks (`on_batch`, `on_sampled`, ...): the fine-grained view the verifier diffs against
  the reference; they hand over engine objects (batches, sequences, logits) as they are.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from kvpage.cache.block_pool import BlockPool
    from kvpage.cache.manager import KVCacheManager
    from kvpage.engine.plan import StepBatch, StepPlan
    from kvpage.engine.sequence import Sequence


@dataclass(frozen=True, slots=True)
class EngineEvent:
    kind: ClassVar[str] = ""
    request_id: str
    sample_id: str  # request_id for n == 1; `request_id#i` for sample i of a parallel request
    seq_id: int
    tenant: str | None  # the request's cache_salt, the tenant key (None: unsalted)
    namespace: str  # hex digest of the namespace the request's blocks are keyed in


@dataclass(frozen=True, slots=True)
class PrefixHit(EngineEvent):
    """An admission that took cached KV; sent once the admission is final (not for a retry)."""

    kind: ClassVar[str] = "prefix_hit"
    token_count: int  # tokens not computed (a multiple of block_size unless a block was joined)
    blocks_hit: tuple[int, ...]  # physical block ids, logical order
    prefix_digest: str  # hex chained digest of the last full block hit ("" if none)
    last_block_full: bool  # observed in the pool; a hit on a partial block would be a bug
    prompt_tokens: int  # tokens looked up
    capped: bool  # shortened so that the last prompt token is computed
    first_admission: bool  # False for a re-prefill after recompute (not counted in prefix_hits)


@dataclass(frozen=True, slots=True)
class CowCopy(EngineEvent):
    """A write into a shared partial block copied it first (copy-on-write)."""

    kind: ClassVar[str] = "cow_copy"
    logical_block: int
    src_block: int
    dst_block: int


@dataclass(frozen=True, slots=True)
class Preempted(EngineEvent):
    kind: ClassVar[str] = "preempt"
    mode: str  # the mode used: "recompute" or "swap"
    requested_mode: str  # differs from `mode` when swap fell back to recompute
    blocks: tuple[int, ...]  # held before the preemption
    generations: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SwappedOut(EngineEvent):
    kind: ClassVar[str] = "swap_out"
    num_tokens: int  # tokens whose KV went to the swap space
    blocks: tuple[int, ...]  # the pool blocks it was copied from (given back now)
    generations: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SwappedIn(EngineEvent):
    kind: ClassVar[str] = "swap_in"
    num_tokens: int
    blocks: tuple[int, ...]  # the pool blocks it was restored into
    generations: tuple[int, ...]
    latency_s: float  # allocation + copy back, until the blocks are readable


@dataclass(frozen=True, slots=True)
class Freed(EngineEvent):
    """A finished sample gave its blocks back (swap space included)."""

    kind: ClassVar[str] = "free"
    reason: str  # its finish reason
    blocks: tuple[int, ...]
    generations: tuple[int, ...]  # before the free (a free bumps them)


@dataclass(frozen=True, slots=True)
class Finished(EngineEvent):
    """A sample ended, for any reason."""

    kind: ClassVar[str] = "finish"
    reason: str  # "stop" | "length" | "abort" | "timeout" | "error"
    num_output_tokens: int
    error: str | None = None  # why, for reason "error"


@dataclass(frozen=True, slots=True)
class Aborted(EngineEvent):
    """abort_request ended these samples (each then sends Freed and Finished)."""

    kind: ClassVar[str] = "abort"
    samples: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class TimedOut(EngineEvent):
    kind: ClassVar[str] = "timeout"
    samples: tuple[str, ...]
    overdue_s: float  # how long past its deadline it was noticed


@dataclass(frozen=True, slots=True)
class CacheCorruption(EngineEvent):
    """A lookup's fast key matched an entry whose full digest differs: corruption, never served."""

    kind: ClassVar[str] = "cache_corruption"
    fast_key: int
    wanted_digest: str
    found_digest: str
    block_id: int
    depth: int  # logical block index of the lookup


class EngineObserver:
    """Override what you watch; every hook here is a no-op."""

    traces_steps: ClassVar[bool] = False  # the verifier's tracer; `engine.tracer` returns it

    def on_event(self, event: EngineEvent) -> None:
        """A lifecycle or cache event (the dataclasses above)."""

    # --- tracing: engine objects as they are, read-only ------------------------------------
    def on_plan(self, plan: StepPlan) -> None:
        """What the scheduler decided for a step, before any of it is executed."""

    def on_batch(self, batch: StepBatch) -> None:
        """Before the model runs over one step's batch."""

    def on_step_ran(self, batch: StepBatch) -> None:
        """After the model ran over the batch, while its snapshots still pin the blocks it read
        (before anything is committed or freed): the pool holds the KV the step wrote."""

    def on_sampled(self, batch: StepBatch, logits: torch.Tensor, tokens: list[int]) -> None:
        """After the step's tokens were drawn and appended; logits (M, V), one row per sample."""

    def on_verified(self, batch: StepBatch, spec_logits: torch.Tensor, verified: list) -> None:
        """Speculating sequences' rows were verified (kvpage.engine.speculation) and their
        tokens appended: one kvpage.engine.plan.Verified per sequence, each draw's `row`
        indexing spec_logits (sum of 1 + k, V); draw i stands at position
        batch.positions[first row] + i and the KV of the first len(draws) positions is the
        sequence's (unless it finished)."""

    def on_forked(
        self, parent: Sequence, child: Sequence, logits_row: torch.Tensor, token: int
    ) -> None:
        """A parallel sample forked off `parent` drew its first token from the parent's row."""

    def on_kv_copy(self, src: int, dst: int) -> None:
        """A copy-on-write of block `src` into `dst` was decided (the executor copies the KV
        before the step's forward pass), as the pool stands at that moment."""

    def on_kv_restored(self, seq: Sequence, block_ids: list[int]) -> None:
        """A swap-in wrote `seq`'s saved KV (its first `seq.swapped_tokens` tokens) into
        `block_ids`, its table's first blocks; they become readable right after."""

    def on_prefix_hit(self, seq: Sequence, cached_tokens: int) -> None:
        """A lookup gave `seq` its first `cached_tokens` (every lookup, retries included)."""

    def on_prompt_rows(self, seq: Sequence, sources: list) -> None:
        """A hit served `seq` prompt-logprob rows kept in the row store: per logical block, the
        (block id, generation) they were computed for (kvpage.engine.prompt_row_store)."""

    def on_resume(self, seq: Sequence, mode: str, restore_complete: bool) -> None:
        """A preempted sequence runs again (mode "recompute" or "swap")."""


def emit(observers: list[EngineObserver], event: EngineEvent) -> None:
    for observer in observers:
        observer.on_event(event)


def who(seq: Sequence) -> dict[str, Any]:
    """The fields every event takes from its sequence."""
    return dict(
        request_id=seq.request_id,
        sample_id=seq.sample_id,
        seq_id=seq.seq_id,
        tenant=seq.cache_salt,
        namespace=seq.chain.namespace_digest.hex(),
    )


def held_blocks(seq: Sequence, pool: BlockPool) -> dict[str, tuple[int, ...]]:
    """The blocks a sequence holds and their generations (read before they are given back)."""
    ids = tuple(b for b in seq.table.block_ids if b >= 0)  # a window's given-back NULLs out
    return {"blocks": ids, "generations": tuple(pool.blocks[b].generation for b in ids)}


def prefix_hit(seq: Sequence, cache: KVCacheManager, first_admission: bool) -> PrefixHit:
    """The hit `seq` was admitted with: its first `num_computed` tokens, from its own table."""
    size, n = cache.block_size, seq.num_computed
    blocks = tuple(b for b in seq.table.block_ids[: cache.blocks_for(n)] if b >= 0)
    full = n // size
    return PrefixHit(
        **who(seq),
        token_count=n,
        blocks_hit=blocks,
        prefix_digest=seq.chain.keys[full - 1].digest.hex() if full else "",
        last_block_full=cache.pool.blocks[blocks[-1]].valid_len == size,
        prompt_tokens=seq.num_tokens,
        capped=full == cache.max_hit_blocks(seq.num_tokens) < seq.num_tokens // size,
        first_admission=first_admission,
    )


def end_events(seq: Sequence, reason: str, held: dict) -> tuple[Freed, Finished]:
    """A finished sample's events: the blocks it gave back (`held`, read before), then its end."""
    count = len(seq.output_ids)
    return (
        Freed(**who(seq), reason=reason, **held),
        Finished(**who(seq), reason=reason, num_output_tokens=count, error=seq.error),
    )


def abort_event(name: str, live: list[Sequence], reason: str) -> Aborted | TimedOut:
    """One event for an abort (or timeout) of `live`; it names the request (or sample) as the
    caller did."""
    fields = {**who(live[0]), "sample_id": name, "samples": tuple(s.sample_id for s in live)}
    if reason == "timeout":
        return TimedOut(**fields, overdue_s=time.monotonic() - live[0].deadline)
    return Aborted(**fields)

"""Per-step traces (R15): for each request and each sampled token, what went in (input ids, position
ids), what came out (a logits digest, top-k, the chosen token) and the cache view the step read.

The engine calls an `EngineTracer` only when one is attached (`engine.tracer`), so tracing off costs
one `is None` test per step. The reference produces the same `StepRecord` shape with a contiguous
view, so the two can be diffed field by field (kvpage.verify.diff)."""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field

import torch

TOP_K = 5


@dataclass(frozen=True, slots=True)
class ViewEntry:
    logical: int
    physical: int  # -1 for the reference's contiguous tensor
    generation: int
    valid_len: int
    shared: bool
    ref_count: int
    state: str


@dataclass(frozen=True, slots=True)
class CacheView:
    """The KV one step read for one request. Every layer reads through the same table here (the
    pool has one table per sequence for all layers), so one view stands for all layers."""

    entries: tuple[ViewEntry, ...]
    epoch: int
    namespace: str  # hex digest of the namespace the request's blocks are keyed in
    block_size: int  # 0 for contiguous
    contiguous: bool = False
    kv_dtype: str = "float32"

    @property
    def last_block_len(self) -> int:
        return self.entries[-1].valid_len if self.entries else 0


@dataclass(slots=True)
class StepRecord:
    request_id: str
    step: int  # index of the output token this record produced
    input_ids: list[int]  # tokens that entered the context since the previous record
    position_ids: list[int]  # their positions (as fed; cached tokens at their cache position)
    logits_digest: str
    topk_ids: list[int]
    topk_values: list[float]
    chosen_token: int
    view: CacheView
    prefix_hit_tokens: int = 0  # tokens of input_ids served from the prefix cache
    prefix_digest: str = ""  # chained digest of the last block hit
    after_resume: bool = False  # first record after a preemption (swap restore or recompute)
    resume_mode: str = ""
    restore_complete: bool = True  # the restored KV had landed when this step read it
    engine_step: int = -1
    logits: torch.Tensor | None = field(default=None, repr=False)  # (V,) float32, for atol checks

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("logits")
        return d


def logits_digest(logits: torch.Tensor) -> str:
    """Stable digest of float32 logits rounded to 1e-4 (bitwise equality is not the contract)."""
    rounded = torch.round(logits.float() * 1e4).to(torch.int64).cpu().numpy().tobytes()
    return hashlib.sha256(rounded).hexdigest()[:16]


def make_record(request_id, step, input_ids, position_ids, logits, token, view, **extra):
    logits = logits.detach().float().cpu()
    values, ids = torch.topk(logits, min(TOP_K, logits.shape[-1]))
    return StepRecord(
        request_id=request_id,
        step=step,
        input_ids=list(input_ids),
        position_ids=list(position_ids),
        logits_digest=logits_digest(logits),
        topk_ids=ids.tolist(),
        topk_values=values.tolist(),
        chosen_token=int(token),
        view=view,
        logits=logits,
        **extra,
    )


@dataclass(slots=True)
class _PendingInputs:
    """Inputs a request accumulated since its last sampled token (chunks, cached prefix)."""

    context_start: int = 0  # context length at the previous record
    by_index: dict[int, tuple[int, int]] = field(default_factory=dict)  # index -> (token, pos)
    hit_tokens: int = 0
    hit_digest: str = ""
    resume_mode: str = ""
    restore_complete: bool = True


class EngineTracer:
    """Attach with `engine.tracer = EngineTracer(engine)`; read `records[request_id]`."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.records: dict[str, list[StepRecord]] = {}
        self._pending: dict[str, _PendingInputs] = {}
        self._views: dict[int, CacheView] = {}

    # --- hooks the engine calls ------------------------------------------------------------
    def on_prefix_hit(self, seq, cached_tokens: int) -> None:
        pend = self._pending_for(seq)
        pend.hit_tokens = max(0, cached_tokens - pend.context_start)
        if cached_tokens:
            key = seq.chain.keys[cached_tokens // seq.chain.block_size - 1]
            pend.hit_digest = key.digest.hex()
        for i in range(pend.context_start, cached_tokens):
            pend.by_index[i] = (seq.token_at(i, i + 1)[0], i)

    def on_resume(self, seq, mode: str, restore_complete: bool = True) -> None:
        pend = self._pending_for(seq)
        pend.resume_mode = mode
        pend.restore_complete = pend.restore_complete and restore_complete

    def on_batch(self, batch) -> None:
        """Before the model runs: the inputs each request feeds and the view it will read."""
        self._views = {}
        for item, snap, start, end in zip(
            batch.scheduled,
            batch.snapshots,
            batch.cu_seqlens_q,
            batch.cu_seqlens_q[1:],
            strict=False,
        ):
            seq = item.seq
            pend = self._pending_for(seq)
            first = seq.num_computed
            for row in range(start, end):
                index = first + row - start
                if index >= pend.context_start:
                    pend.by_index[index] = (batch.input_ids[row], batch.positions[row])
            self._views[seq.seq_id] = self._view(seq, snap)

    def on_sampled(self, batch, logits: torch.Tensor, tokens: list[int]) -> None:
        for row, (item, token) in enumerate(zip(batch.sample_seqs, tokens, strict=True)):
            seq = item.seq
            pend = self._pending.pop(seq.request_id, _PendingInputs())
            order = sorted(pend.by_index)
            records = self.records.setdefault(seq.request_id, [])
            records.append(
                make_record(
                    seq.request_id,
                    len(records),
                    [pend.by_index[i][0] for i in order],
                    [pend.by_index[i][1] for i in order],
                    logits[row],
                    token,
                    self._views[seq.seq_id],
                    prefix_hit_tokens=pend.hit_tokens,
                    prefix_digest=pend.hit_digest,
                    after_resume=bool(pend.resume_mode),
                    resume_mode=pend.resume_mode,
                    restore_complete=pend.restore_complete,
                    engine_step=self.engine.step_count,
                )
            )
            self._pending[seq.request_id] = _PendingInputs(context_start=seq.num_tokens - 1)

    # --- helpers ---------------------------------------------------------------------------
    def _pending_for(self, seq) -> _PendingInputs:
        return self._pending.setdefault(seq.request_id, _PendingInputs())

    def _view(self, seq, snap) -> CacheView:
        pool = self.engine.cache.pool
        entries = []
        for i, e in enumerate(snap.entries):
            b = pool.blocks[e.block_id]
            owners = len(b.owners)
            entries.append(
                ViewEntry(
                    i,
                    e.block_id,
                    e.generation,
                    e.valid_len,
                    owners > 1 or b.published,
                    owners,
                    b.state.name,
                )
            )
        return CacheView(
            tuple(entries),
            snap.epoch,
            seq.chain.namespace_digest.hex(),
            self.engine.config.block_size,
            kv_dtype=str(self.engine.model.dtype).removeprefix("torch."),
        )

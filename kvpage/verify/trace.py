"""Per-step traces (R15): for each request and each sampled token, what went in (input ids, position
ids), what came out (a logits digest, top-k, the chosen token) and the cache view the step read.

An `EngineTracer` is an engine observer (kvpage.engine.events): attach it with
`engine.add_observer(EngineTracer(engine))` and read it back as `engine.tracer`; with no observer
attached, tracing costs the engine an empty-list test per hook. The reference produces the same `StepRecord` shape with a contiguous
view, so the two can be diffed field by field (kvpage.verify.diff)."""

from __future__ import annotations

import functools
import hashlib
from dataclasses import asdict, dataclass, field, replace
from typing import NamedTuple

import torch

from kvpage.verify.provenance import KVProvenance

TOP_K = 5


class ViewEntry(NamedTuple):  # a tuple: one is built per block per traced step
    logical: int
    physical: int  # -1 for the reference's contiguous tensor
    generation: int
    valid_len: int
    shared: bool
    ref_count: int
    state: str
    scale: str = ""  # digest of the block's scales over its valid tokens (quantized KV only)


@dataclass(frozen=True, slots=True)
class CacheView:
    """The KV one step read for one request. Every layer reads through the same table here (the
    pool has one table per sequence for all layers), so one view stands for all layers."""

    entries: tuple[ViewEntry, ...]
    epoch: int
    namespace: str  # hex digest of the namespace the request's blocks are keyed in
    block_size: int  # 0 for contiguous
    contiguous: bool = False
    kv_dtype: str = "float32"  # the stored dtype (int8, float8_e4m3fn, bfloat16, float32 ...)
    kv_layout: int = 1  # kvpage.model.kv_format layout version (2: codes + per-token scales)
    # Quantized KV: one digest of the scales read per block (the reference: per block-sized
    # span of its contiguous cache, so the two line up block by block).
    scale_digests: tuple[str, ...] = ()

    @property
    def last_block_len(self) -> int:
        return self.entries[-1].valid_len if self.entries else 0


EMPTY_VIEW = CacheView((), -1, "", 0)


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
    sampler: dict | None = None  # seed, generator offset and state digest after this draw
    logits: torch.Tensor | None = field(default=None, repr=False)  # (V,) float32, for atol checks

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("logits")
        d["view"]["entries"] = [e._asdict() for e in self.view.entries]
        return d


def logits_digest(logits: torch.Tensor) -> str:
    """Stable digest of float32 logits rounded to 1e-4 (bitwise equality is not the contract)."""
    return logits_digests(logits.reshape(1, -1))[0]


def logits_digests(logits: torch.Tensor) -> list[str]:
    """One 64-bit fingerprint per row of (M, V) logits: the 1e-4-rounded values dotted with fixed
    pseudo-random 64-bit weights (wrapping). Not cryptographic — a compact identity for reports,
    cheap for a 32k vocabulary every step; the atol check compares the logits themselves."""
    rounded = torch.round(logits.float() * 1e4).to(torch.int64)  # (M, V)
    fingerprint = (rounded * _digest_weights(logits.shape[-1])).sum(dim=-1)  # (M,) wraps mod 2^64
    return [f"{value & 0xFFFFFFFFFFFFFFFF:016x}" for value in fingerprint.tolist()]


@functools.cache
def _digest_weights(vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0x6B7670616765)
    return torch.randint(-(2**62), 2**62, (vocab,), generator=gen, dtype=torch.int64)


def scale_digest(scales: torch.Tensor) -> str:
    """Digest of float16 scales laid out (L, 2, tokens, KVH), one part per layer joined by '.',
    so two digests also say in which layer the scales first differ."""
    data = scales.detach().to(torch.float16).contiguous().cpu().view(torch.int16).numpy()
    return ".".join(hashlib.sha256(layer.tobytes()).hexdigest()[:8] for layer in data)


def sampler_state(generator: torch.Generator | None, num_draws: int) -> dict | None:
    """The request's generator after a draw: seed, offset (draws so far) and a state digest."""
    if generator is None:
        return None
    state = hashlib.sha256(generator.get_state().numpy().tobytes()).hexdigest()[:16]
    return {
        "seed": generator.initial_seed(),
        "generator_offset": num_draws,
        "generator_state": state,
    }


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
    """Attach with `engine.add_observer(EngineTracer(engine))`; read `records[request_id]`.

    It implements kvpage.engine.events.EngineObserver (every hook) without subclassing it: the
    reference imports this module's record types and must reach no engine code (R14)."""

    traces_steps = True  # `engine.tracer` returns it

    def __init__(self, engine) -> None:
        self.engine = engine
        self._records: dict[str, list[StepRecord]] = {}
        # Whose KV every block incarnation holds; a violation names the reader's next record.
        self.provenance = KVProvenance(engine, lambda sid: len(self._records.get(sid, ())))
        self._unsummarized: list[tuple[torch.Tensor, list[StepRecord]]] = []
        self._pending: dict[str, _PendingInputs] = {}
        self._views: dict[int, CacheView] = {}
        self._block_size = engine.config.block_size
        self._kv_format = engine.kv_format

    # --- hooks the engine calls ------------------------------------------------------------
    def on_event(self, event) -> None:
        """Lifecycle events are not part of a step trace (the hooks below are)."""

    def on_prefix_hit(self, seq, cached_tokens: int) -> None:
        pend = self._pending_for(seq)
        pend.hit_tokens = max(0, cached_tokens - pend.context_start)
        if cached_tokens:
            key = seq.chain.keys[cached_tokens // seq.chain.block_size - 1]
            pend.hit_digest = key.digest.hex()
        first = pend.context_start
        if cached_tokens > first:  # served from the cache, at their cache positions
            ids = seq.token_at(first, cached_tokens)
            pend.by_index.update(
                zip(
                    range(first, cached_tokens),
                    zip(ids, range(first, cached_tokens), strict=True),
                    strict=True,
                )
            )

    def on_resume(self, seq, mode: str, restore_complete: bool = True) -> None:
        pend = self._pending_for(seq)
        pend.resume_mode = mode
        pend.restore_complete = pend.restore_complete and restore_complete

    def on_kv_copy(self, src: int, dst: int) -> None:
        """A copy-on-write copied block `src` into `dst` (KV written outside a step)."""
        self.provenance.on_kv_copy(src, dst)

    def on_kv_restored(self, seq, block_ids: list[int]) -> None:
        """A swap-in wrote `seq`'s saved KV into `block_ids` (KV written outside a step)."""
        self.provenance.on_kv_restored(seq, block_ids)

    def on_batch(self, batch) -> None:
        """Before the model runs: the inputs each request feeds, and the view each request that
        will sample reads."""
        self.provenance.on_batch(batch)
        sampling = {item.seq.seq_id for item in batch.sample_seqs}
        self._views = {}
        cu = batch.cu_seqlens_q
        for item, snap, start, end in zip(
            batch.scheduled, batch.snapshots, cu, cu[1:], strict=False
        ):
            seq = item.seq
            pend = self._pending_for(seq)
            first = seq.num_computed
            lo = start + max(0, pend.context_start - first)  # re-fed old context is not input
            if lo < end:
                rows = zip(batch.input_ids[lo:end], batch.positions[lo:end], strict=True)
                pend.by_index.update(
                    zip(range(first + lo - start, first + end - start), rows, strict=True)
                )
            if seq.seq_id in sampling:
                self._views[seq.seq_id] = self._view(seq, snap)

    def on_step_ran(self, batch) -> None:
        """The model ran and the blocks are still pinned: a quantized view takes the scales its
        step read now (the step wrote its new tokens' scales; a commit may free a block next,
        which invalidates them)."""
        if self.engine.storage.scales is None:
            return
        # One read for every block the step's views name: under tensor parallelism it gathers
        # every rank's KV heads (a command and a gather per step, not per block).
        ids = sorted({e.physical for view in self._views.values() for e in view.entries})
        if not ids:
            return
        scales = self.engine.storage.block_scales(ids)  # (L, 2, n, B, KVH) over all KV heads
        at = {bid: i for i, bid in enumerate(ids)}
        self._views = {
            sid: self._with_scales(view, scales, at) for sid, view in self._views.items()
        }

    @property
    def records(self) -> dict[str, list[StepRecord]]:
        """Per request, its records in order. Top-k and digests are summarised here, when the
        trace is read, so the step loop only keeps the raw logits."""
        for logits, step_records in self._unsummarized:
            top_values, top_ids = torch.topk(logits, min(TOP_K, logits.shape[-1]), dim=-1)
            digests = logits_digests(logits)
            for rec, values, ids, digest in zip(
                step_records, top_values.tolist(), top_ids.tolist(), digests, strict=True
            ):
                rec.topk_values, rec.topk_ids, rec.logits_digest = values, ids, digest
        self._unsummarized.clear()
        return self._records

    def on_sampled(self, batch, logits: torch.Tensor, tokens: list[int]) -> None:
        logits = logits.detach().float().cpu()  # (M, V): the step's own tensor, kept as is
        step_records = []
        for row, (item, token) in enumerate(zip(batch.sample_seqs, tokens, strict=True)):
            seq = item.seq
            pend = self._pending.pop(seq.sample_id, _PendingInputs())
            view = self._views.get(seq.seq_id, EMPTY_VIEW)
            # logits[row] is a view of this step's own logits tensor
            step_records.append(self._append(seq, pend, view, token, logits[row]))
        self._unsummarized.append((logits, step_records))

    def on_forked(self, parent, child, logits_row: torch.Tensor, token: int) -> None:
        """A parallel sample forked off `parent` drew its first token from the parent's logits:
        its first record has the parent's inputs and cache view (the blocks they share)."""
        logits = logits_row.detach().float().cpu()[None]  # (1, V)
        view = self._views.get(parent.seq_id, EMPTY_VIEW)
        record = self._append(child, self._pending_for(parent), view, token, logits[0])
        self._unsummarized.append((logits, [record]))

    def _append(self, seq, pend: _PendingInputs, view: CacheView, token: int, logits):
        """Record `seq`'s next token from the inputs it accumulated; start its next inputs."""
        order = sorted(pend.by_index)
        records = self._records.setdefault(seq.sample_id, [])
        record = StepRecord(
            request_id=seq.sample_id,
            step=len(records),
            input_ids=[pend.by_index[i][0] for i in order],
            position_ids=[pend.by_index[i][1] for i in order],
            logits_digest="",
            topk_ids=[],
            topk_values=[],
            chosen_token=int(token),
            view=view,
            prefix_hit_tokens=pend.hit_tokens,
            prefix_digest=pend.hit_digest,
            after_resume=bool(pend.resume_mode),
            resume_mode=pend.resume_mode,
            restore_complete=pend.restore_complete,
            engine_step=self.engine.step_count,
            sampler=sampler_state(seq.generator, seq.num_draws),
            logits=logits,
        )
        records.append(record)
        self._pending[seq.sample_id] = _PendingInputs(context_start=seq.num_tokens - 1)
        return record

    # --- helpers ---------------------------------------------------------------------------
    def _pending_for(self, seq) -> _PendingInputs:
        return self._pending.setdefault(seq.sample_id, _PendingInputs())

    def _view(self, seq, snap) -> CacheView:
        blocks = self.engine.cache.pool.blocks
        entries = []
        for i, (bid, generation, valid_len) in enumerate(snap.entries):
            b = blocks[bid]
            owners = len(b.owners)
            entries.append(
                ViewEntry(
                    i,
                    bid,
                    generation,
                    valid_len,
                    owners > 1 or b.published,
                    owners,
                    b.state._value_,  # the plain attribute: Enum.name/.value go through descriptors
                )
            )
        return CacheView(
            tuple(entries),
            snap.epoch,
            seq.chain.namespace_digest.hex(),
            self._block_size,
            kv_dtype=self._kv_format.name,
            kv_layout=self._kv_format.layout_version,
        )

    def _with_scales(self, view: CacheView, scales: torch.Tensor, at: dict[int, int]) -> CacheView:
        """The scales a quantized step read, per block and layer; `scales` holds block
        `e.physical` at index `at[e.physical]`."""
        if not view.entries:
            return view
        entries = tuple(
            e._replace(scale=scale_digest(scales[:, :, at[e.physical], : e.valid_len]))
            for e in view.entries
        )
        return replace(view, entries=entries, scale_digests=tuple(e.scale for e in entries))

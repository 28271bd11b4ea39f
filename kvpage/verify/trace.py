"""The engine's step tracer. An `EngineTracer` is an engine observer (kvpage.engine.events):
attach it with `engine.add_observer(EngineTracer(engine))` and read it back as `engine.tracer`;
with no observer attached, tracing costs the engine an empty-list test per hook. It writes the
same `StepRecord`s (kvpage.reference.records) as the contiguous reference, so the two can be
diffed field by field (kvpage.verify.diff)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from kvpage.reference.records import (
    EMPTY_VIEW,
    TOP_K,
    CacheView,
    GroupView,
    StepRecord,
    ViewEntry,
    logits_digests,
    sampler_state,
    scale_digest,
)
from kvpage.verify.provenance import KVProvenance


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
    reference imports this module's record types and must reach no engine code, or it
    could share the bugs it is there to catch."""

    traces_steps = True  # `engine.tracer` returns it

    def __init__(self, engine) -> None:
        self.engine = engine
        self._records: dict[str, list[StepRecord]] = {}
        # Whose KV every block incarnation holds; a violation names the reader's next record.
        self.provenance = KVProvenance(engine, lambda sid: len(self._records.get(sid, ())))
        self._unsummarized: list[tuple[torch.Tensor, list[StepRecord]]] = []
        self._pending: dict[str, _PendingInputs] = {}
        self._views: dict[int, CacheView] = {}
        self._batch_adapters: tuple[str, ...] = ()  # of the step being traced
        # Speculative decoding: block incarnations a speculating step wrote, and per sample its
        # verifications (the record step of the first token each produced, and the rule's
        # record), which kvpage.verify.speculative re-checks against p and q.
        self._spec_written: set[tuple[int, int]] = set()
        self.verifications: dict[str, list[tuple[int, object]]] = {}
        spec = getattr(engine, "speculation", None)
        self._spec_method = None if spec is None else spec.config.method
        self._block_size = engine.config.block_size
        self._kv_format = engine.kv_format

    # --- hooks the engine calls ------------------------------------------------------------
    def on_event(self, event) -> None:
        """Lifecycle events are not part of a step trace (the hooks below are)."""

    def on_plan(self, plan) -> None:
        """A plan is traced through what it leads to (on_batch, on_sampled, the copies)."""

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

    def on_prompt_rows(self, seq, sources: list) -> None:
        """A hit served prompt rows kept for these (block, generation)s: they must be rows of
        seq's own KV at those logical blocks, as if read."""
        self.provenance.on_prompt_rows(seq, sources)

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
        adapters = {item.seq.lora.identity for item in batch.scheduled if item.seq.lora}
        self._batch_adapters = tuple(sorted(adapters))
        sampling = {item.seq.seq_id for item in (*batch.sample_seqs, *batch.spec_seqs)}
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
                self._views[seq.seq_id] = self._view(seq, snap, first)
        for item in batch.spec_seqs:  # whose KV a speculative step wrote (for attribution)
            blocks = self.engine.cache.pool.blocks
            bids = {slot // self._block_size for slot in item.slots}
            self._spec_written.update((bid, blocks[bid].generation) for bid in bids)

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

    def on_verified(self, batch, spec_logits: torch.Tensor, verified: list) -> None:
        """A speculating sequence's verified tokens, one record each, as plain decoding would
        write them: draw i was chosen from the row at position start + i, whose input is the
        token at that position (the pending token, then the kept drafts). The rejected drafts'
        inputs go nowhere: the next record starts from the position after the last kept."""
        self.provenance.on_verified(batch, verified)
        logits = spec_logits.detach().float().cpu()  # (sum of 1 + k, V)
        step_records = []
        for v, first in zip(verified, batch.spec_rows, strict=True):
            seq, draws = v.item.seq, v.draws[: v.appended]  # the stop rule may end it early
            start = batch.positions[first]
            pend = self._pending.pop(seq.sample_id, _PendingInputs())
            view = self._views.get(seq.seq_id, EMPTY_VIEW)
            own = self.verifications.setdefault(seq.sample_id, [])
            own.append((len(self._records.get(seq.sample_id, ())), v.verification))
            fed = pend.by_index
            for i, draw in enumerate(draws):
                at = start + i
                pend.by_index = {j: x for j, x in fed.items() if (j <= at if i == 0 else j == at)}
                note = _spec_note(v.verification, i, self._spec_method)
                record = self._append(seq, pend, view, draw.token, logits[draw.row], note)
                step_records.append(record)
                pend = _PendingInputs(context_start=at + 1)
            self._pending[seq.sample_id] = pend
        rows = [d.row for v in verified for d in v.draws[: v.appended]]
        self._unsummarized.append((logits[rows], step_records))

    def on_forked(self, parent, child, logits_row: torch.Tensor, token: int) -> None:
        """A parallel sample forked off `parent` drew its first token from the parent's logits:
        its first record has the parent's inputs and cache view (the blocks they share)."""
        logits = logits_row.detach().float().cpu()[None]  # (1, V)
        view = self._views.get(parent.seq_id, EMPTY_VIEW)
        record = self._append(child, self._pending_for(parent), view, token, logits[0])
        self._unsummarized.append((logits, [record]))

    def _append(self, seq, pend: _PendingInputs, view: CacheView, token: int, logits, spec=None):
        """Record `seq`'s next token from the inputs it accumulated; start its next inputs.
        `spec`: the verification it came out of (a note); a record that read KV a speculative
        step wrote gets a note too."""
        if spec is None and self._spec_written:
            spec = self._spec_read_note(view)
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
            adapter="" if seq.lora is None else seq.lora.identity,
            batch_adapters=self._batch_adapters,
            speculative=spec,
        )
        records.append(record)
        self._pending[seq.sample_id] = _PendingInputs(context_start=seq.num_tokens - 1)
        return record

    # --- helpers ---------------------------------------------------------------------------
    def _spec_read_note(self, view: CacheView) -> dict | None:
        written = [
            e.physical for e in view.entries if (e.physical, e.generation) in self._spec_written
        ]
        if not written:
            return None
        return {"index": -1, "read_blocks": written, "method": self._spec_method}

    def _pending_for(self, seq) -> _PendingInputs:
        return self._pending.setdefault(seq.sample_id, _PendingInputs())

    def _view(self, seq, snap, query_start: int = 0) -> CacheView:
        skip = len(snap.block_ids) - len(snap.entries)  # a window group 0's leading NULLs
        entries = self._entries(enumerate(snap.entries, start=skip))
        groups = ()
        if self.engine.cache.windows[0] is not None:  # group 0 is a window group: a view too
            groups = (self._group_view(snap.block_ids, snap.entries, 0, query_start),)
        if snap.extra_entries:
            groups += self._group_views(snap, query_start)
        return CacheView(
            tuple(entries),
            snap.epoch,
            seq.chain.namespace_digest.hex(),
            self._block_size,
            kv_dtype=self._kv_format.name,
            kv_layout=self._kv_format.layout_version,
            groups=groups,
        )

    def _entries(self, numbered) -> list[ViewEntry]:
        blocks = self.engine.cache.pool.blocks
        entries = []
        for i, (bid, generation, valid_len) in numbered:
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
        return entries

    def _published_at(self, block_id: int) -> int:
        entry = self.engine.cache.index.by_block.get(block_id)
        return -1 if entry is None else entry.depth

    def _group_views(self, snap, query_start: int) -> tuple[GroupView, ...]:
        """Every extra layer group's view: the layers whose attention reads it (the runner's
        map), its window, the first key the step's first query sees, its held entries at their
        logical positions."""
        pairs = zip(snap.extra_block_ids, snap.extra_entries, strict=True)
        return tuple(
            self._group_view(ids, held, g, query_start) for g, (ids, held) in enumerate(pairs, 1)
        )

    def _group_view(self, ids, held, g: int, query_start: int) -> GroupView:
        cache = self.engine.cache
        window = cache.windows[g]
        layers = tuple(i for i, (group, _) in enumerate(self.engine.runner.layer_map) if group == g)
        logical = [i for i, bid in enumerate(ids) if bid >= 0]
        start = 0 if window is None else max(0, query_start - window + 1)
        entries = tuple(self._entries(zip(logical, held, strict=True)))
        at = tuple(self._published_at(e.block_id) for e in held)
        return GroupView(g, window, layers, start, entries, query_start, at)

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


def _spec_note(verification, index: int, method: str | None) -> dict:
    """What a verified token's record says of its verification (the report shows it)."""
    return {
        "method": method,
        "index": index,
        "drafts": list(verification.draft_tokens),
        "num_accepted": verification.num_accepted,
        "tokens": list(verification.tokens),
    }

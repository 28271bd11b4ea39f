"""Builds one step's packed batch from its plan and runs the model once over it."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvpage.cache.block_table import TableSnapshot
from kvpage.cache.manager import KVCacheManager
from kvpage.engine.plan import PromptRows, ScheduledSeq, StepBatch, StepLogits
from kvpage.kv.storage import KVStorage
from kvpage.lora.apply import AdapterRows, LoraBatch, LoraContext
from kvpage.lora.slots import LoraSlots
from kvpage.model.base import CausalLM
from kvpage.model.paged_attention import (
    PagedAttentionMetadata,
    PrefillChunk,
    paged_backend,
    validate_cu_seqlens,
)

# Runs the local forward pass on every rank (tensor parallelism: the inputs are sent first).
AroundForward = Callable[
    [torch.Tensor, PagedAttentionMetadata, Callable[[], torch.Tensor]], torch.Tensor
]


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        storage: KVStorage,
        cache: KVCacheManager,
        around_forward: AroundForward | None = None,
        lora: LoraContext | None = None,
        lora_slots: LoraSlots | None = None,
    ) -> None:
        self.model = model
        self.storage = storage
        self.cache = cache
        self.around_forward = around_forward
        self.device = model.device
        self.block_size = storage.block_size
        self._block_offsets = torch.arange(self.block_size, device=self.device)
        # Layer -> (group, row) of its KV (kvpage.cache.groups): whose table each layer reads.
        layout = cache.layout
        self.layer_map = () if layout is None else layout.layer_map
        # A windowed group 0 (an all-windowed model) has NULL entries in block_ids too.
        self._null0 = layout is not None and layout.groups[0].window is not None
        self._arange = torch.arange(0, device=self.device)  # grown on demand; rows and positions
        # With adapters served (kvpage.engine.engine): the model's context, the engine's slots.
        self.lora = lora
        self.lora_slots = lora_slots

    def build(self, scheduled: list[ScheduledSeq]) -> StepBatch:
        ids: list[int] = []
        positions: list[int] = []
        cu = [0]
        sample_rows: list[int] = []
        sample_seqs: list[ScheduledSeq] = []
        context_lens: list[int] = []
        prompt_rows: list[PromptRows] = []
        spec_seqs: list[ScheduledSeq] = []
        spec_rows: list[int] = []
        for item in scheduled:
            seq, start, n = item.seq, item.seq.num_computed, item.num_new_tokens
            if item.drafts:  # its pending token, then the drafts: every row is scored
                spec_seqs.append(item)
                spec_rows.append(len(ids))
                ids += seq.token_at(start, seq.num_tokens) + item.drafts
            else:
                if seq.needs_prompt_rows:
                    rows = prompt_rows_of(seq, start, n, len(ids))
                    if rows is not None:
                        prompt_rows.append(rows)
                ids += seq.token_at(start, start + n)
                if start + n == seq.num_tokens:
                    sample_rows.append(len(ids) - 1)
                    sample_seqs.append(item)
            positions += range(start, start + n)
            cu.append(cu[-1] + n)
            context_lens.append(start + n)
        self.check_batch(cu, len(ids))
        snaps = [self.cache.snapshot(item.seq.table) for item in scheduled]
        return StepBatch(
            scheduled,
            ids,
            positions,
            cu,
            snaps,
            sample_rows,
            sample_seqs,
            context_lens,
            prompt_rows,
            spec_seqs,
            spec_rows,
        )

    def check_batch(self, cu_seqlens: list[int], num_tokens: int) -> None:
        """The packed batch's layout guard (a declared seam, kvpage.engine.hooks: the
        check a naive engine lacks, which the verifier must not need to catch its bugs)."""
        validate_cu_seqlens(cu_seqlens, num_tokens)

    @torch.inference_mode()
    def run(self, batch: StepBatch) -> StepLogits:
        """The sampling rows' logits (len(sample_rows), V) in float32, and the prompt rows'."""
        meta = self.attention_metadata(batch)
        ids_pos = torch.tensor(
            (batch.input_ids, batch.positions), dtype=torch.long, device=self.device
        )  # (2, N): one host-to-tensor copy for both
        if self.lora is not None:
            self.lora.batch = self.adapter_rows(batch)
        try:
            hidden = self.forward(ids_pos, meta)  # (N, C)
        finally:
            if self.lora is not None:
                self.lora.batch = None
        prompt = self._prompt_logits(hidden, batch.prompt_rows) if batch.prompt_rows else None
        rows = batch.sample_rows
        if batch.spec_seqs:  # every row of a speculating sequence, after the sampling rows
            rows = rows + [
                r
                for item, first in zip(batch.spec_seqs, batch.spec_rows, strict=True)
                for r in range(first, first + item.num_new_tokens)
            ]
        if rows != list(range(hidden.shape[0])):  # a decode step samples every row
            hidden = hidden[torch.tensor(rows, dtype=torch.long, device=self.device)]
        logits = self.model.compute_logits(hidden).float()  # (M + S, V)
        if not batch.spec_seqs:
            return StepLogits(logits, prompt)
        m = len(batch.sample_rows)
        return StepLogits(logits[:m], prompt, logits[m:])

    def adapter_rows(self, batch: StepBatch) -> LoraBatch | None:
        """The step's rows grouped by the adapter their sequence runs with (None: no row has
        one). Rows of the base model are in no group."""
        rows: dict[int, list[int]] = {}
        adapters = {}
        cu = batch.cu_seqlens_q
        for item, start, end in zip(batch.scheduled, cu, cu[1:], strict=False):
            lora = item.seq.lora
            if lora is not None:
                rows.setdefault(id(lora), []).extend(range(start, end))
                adapters[id(lora)] = lora
        if not rows:
            return None
        total = cu[-1]
        groups = []
        for key, own in rows.items():
            resident = self.lora_slots.resident[adapters[key].identity]
            index = None if len(own) == total else torch.tensor(own, device=self.device)
            groups.append(AdapterRows(resident, index))
        return LoraBatch(groups, total)

    def _prompt_logits(self, hidden: torch.Tensor, prompt_rows: list[PromptRows]) -> torch.Tensor:
        rows = [r for p in prompt_rows for r in range(p.first_row, p.first_row + p.count)]
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden[index]).float()  # (R, V)

    def forward(self, ids_pos: torch.Tensor, meta: PagedAttentionMetadata) -> torch.Tensor:
        """Hidden states (N, C); under tensor parallelism every worker runs the same inputs."""

        def local() -> torch.Tensor:
            return self.model(ids_pos[0], ids_pos[1], paged_backend(self.storage, meta))

        return local() if self.around_forward is None else self.around_forward(ids_pos, meta, local)

    def release(self, batch: StepBatch) -> None:
        for snap in batch.snapshots:
            self.cache.release_snapshot(snap)

    def attention_metadata(self, batch: StepBatch) -> PagedAttentionMetadata:
        """What every layer's attention reads of the step: slots, decode tables and lengths,
        prefill chunks with their cached context."""
        decode_rows: list[int] = []
        decode_tables: list[tuple[int, ...]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        slots: list[int] = []
        for item, snap, context_len, start, end in zip(
            batch.scheduled,
            batch.snapshots,
            batch.context_lens,
            batch.cu_seqlens_q,
            batch.cu_seqlens_q[1:],
            strict=False,
        ):
            slots += item.slots
            if item.num_new_tokens == 1:
                decode_rows.append(start)
                decode_tables.append(self._ids0(snap))
                decode_lens.append(context_len)
            else:
                fresh = item.seq.num_computed == 0
                slots_ctx = None if fresh else self._context_slots(snap, context_len)
                prefills.append(PrefillChunk(start, end, slots_ctx))
        decode_tables_t, decode_mask, decode_lens_t = self._decode_tables(
            decode_tables, decode_lens
        )
        decode_only = not prefills and len(decode_rows) == len(batch.input_ids)
        meta = PagedAttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            cu_seqlens_q=batch.cu_seqlens_q,
            decode_rows=self._rows(len(decode_rows))
            if decode_only
            else torch.tensor(decode_rows, dtype=torch.long, device=self.device),
            decode_tables=decode_tables_t,
            decode_mask=decode_mask,
            decode_lens=decode_lens_t,
            prefills=prefills,
            decode_only=decode_only,
        )
        if self.cache.extra_windows:
            meta.groups = [
                self._group_meta(batch, meta, g) for g in range(len(self.cache.extra_windows))
            ]
            meta.layer_map = self.layer_map
        return meta

    def _group_meta(
        self, batch: StepBatch, base: PagedAttentionMetadata, g: int
    ) -> PagedAttentionMetadata:
        """Extra group g's view of the step: the same rows and lengths as group 0's, its own
        slots and tables (a NULL entry reads block 0: outside every window it is masked)."""
        bs = self.block_size
        slots: list[int] = []
        decode_tables: list[tuple[int, ...]] = []
        prefills: list[PrefillChunk] = []
        chunks = iter(base.prefills)
        for item, snap, context_len in zip(
            batch.scheduled, batch.snapshots, batch.context_lens, strict=False
        ):
            ids = tuple(max(b, 0) for b in snap.extra_block_ids[g])
            start = item.seq.num_computed
            slots += [ids[p // bs] * bs + p % bs for p in range(start, start + item.num_new_tokens)]
            if item.num_new_tokens == 1:
                decode_tables.append(ids)
            else:
                chunk = next(chunks)
                ctx = None if chunk.context_slots is None else self._slots_of(ids, context_len)
                prefills.append(PrefillChunk(chunk.token_start, chunk.token_end, ctx))
        tables, _, _ = self._decode_tables(decode_tables, [1] * len(decode_tables))
        return PagedAttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            cu_seqlens_q=base.cu_seqlens_q,
            decode_rows=base.decode_rows,
            decode_tables=tables,
            decode_mask=base.decode_mask,
            decode_lens=base.decode_lens,
            prefills=prefills,
            decode_only=base.decode_only,
        )

    def _rows(self, n: int) -> torch.Tensor:
        """arange(n) as a view of one cached tensor (no per-step allocation)."""
        if self._arange.numel() < n:
            self._arange = torch.arange(max(n, 2 * self._arange.numel()), device=self.device)
        return self._arange[:n]

    def _context_slots(self, snap: TableSnapshot, context_len: int) -> torch.Tensor:
        return self._slots_of(self._ids0(snap), context_len)

    def _ids0(self, snap: TableSnapshot) -> tuple[int, ...]:
        """Group 0's table as the kernels read it: a NULL entry reads block 0, outside the
        window the layer masks (only an all-windowed model has any)."""
        return tuple(max(b, 0) for b in snap.block_ids) if self._null0 else snap.block_ids

    def _slots_of(self, block_ids: tuple[int, ...], context_len: int) -> torch.Tensor:
        blocks = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        return (blocks[:, None] * self.block_size + self._block_offsets).flatten()[:context_len]

    def _decode_tables(self, tables: list[tuple[int, ...]], lens: list[int]):
        """(Sd, max_blocks) block tables padded with block 0, the (Sd, 1, 1, max_blocks * B) mask
        of real context positions, and the (Sd,) context lengths."""
        if not tables:
            empty = torch.zeros(0, 0, dtype=torch.long, device=self.device)
            no_mask = torch.zeros(0, 1, 1, 0, dtype=torch.bool, device=self.device)
            return empty, no_mask, torch.zeros(0, dtype=torch.long, device=self.device)
        width = max(map(len, tables))
        flat = [b for t in tables for b in (*t, *(0,) * (width - len(t)))]
        padded = torch.tensor(flat, dtype=torch.long, device=self.device).view(len(tables), width)
        lens_t = torch.tensor(lens, dtype=torch.long, device=self.device)
        mask = self._rows(width * self.block_size)[None, :] < lens_t[:, None]
        return padded, mask[:, None, None, :], lens_t


def prompt_rows_of(seq, start: int, n: int, first_row: int) -> PromptRows | None:
    """The chunk's rows [start, start + n) whose logits score a prompt token not scored yet:
    position p scores token p + 1, for the prompt's tokens 1..L-1 (rows scored before a
    recompute preemption are not scored again)."""
    done = len(seq.prompt_logprobs) - 1  # rows scored so far
    if start > done:
        # A prefix hit skipped rows never scored: appending these would shift every row by the
        # gap, so the list stays short (the scheduler's hit cap keeps this from happening).
        return None
    lo = max(start, done)
    hi = min(start + n, len(seq.prompt_ids) - 1)
    if lo >= hi:
        return None
    return PromptRows(seq, first_row + lo - start, lo, hi - lo)

"""Attention weights of one request's decode steps, captured from the engine's real paged KV (so a
contaminated pool shows up in the weights). Experiment-only: patches one engine's runner, through
its public `run` (a rename fails loudly, as a mutant's would)."""

from __future__ import annotations

import torch

from kvpage.engine.plan import StepLogits
from kvpage.model.paged_attention import PagedAttention
from kvpage.verify.mutants.base import bind

MAX_STEPS = 4


class _CapturingAttention(PagedAttention):
    def __init__(self, storage, meta, decode_index: int | None, sink: dict) -> None:
        super().__init__(storage, meta)
        self.decode_index, self.sink = decode_index, sink

    def attend(self, layer, q, k, v, scale, window=None):
        out = super().attend(layer, q, k, v, scale, window)
        if self.decode_index is not None:
            self.sink[layer] = self._weights(layer, q, scale)
        return out

    def _weights(self, layer: int, q: torch.Tensor, scale: float) -> list[list[float]]:
        i, meta = self.decode_index, self.meta
        length = int(meta.decode_mask[i].sum())
        keys = self.storage.gather_blocks(layer, meta.decode_tables[i : i + 1])[0][0]
        keys = keys.transpose(0, 1)[:length]  # (ctx, KVH, D)
        query = q[meta.decode_rows[i]]  # (H, D)
        keys = keys.repeat_interleave(query.shape[0] // keys.shape[1], dim=1)  # (ctx, H, D)
        scores = torch.einsum("hd,chd->hc", query.float(), keys.float()) * scale
        return torch.softmax(scores, dim=-1).tolist()  # (H, ctx)


class AttentionCapture:
    """`weights[step][layer][head][position]` for the watched request's first decode steps."""

    def __init__(self, engine, watch: str) -> None:
        self.engine, self.watch = engine, watch
        self.weights: list[list[list[list[float]]]] = []
        runner = engine.runner
        capture = self

        def run(self, batch):
            meta = self.attention_metadata(batch)
            sink: dict[int, list] = {}
            index = capture._decode_index(batch, meta)
            ids = torch.tensor(batch.input_ids, dtype=torch.long, device=self.device)
            pos = torch.tensor(batch.positions, dtype=torch.long, device=self.device)
            backend = _CapturingAttention(self.storage, meta, index, sink)
            with torch.inference_mode():
                hidden = self.model(ids, pos, backend)
                rows = torch.tensor(batch.sample_rows, dtype=torch.long, device=self.device)
                logits = self.model.compute_logits(hidden[rows]).float()
            if sink and len(capture.weights) < MAX_STEPS:
                capture.weights.append([sink[layer] for layer in sorted(sink)])
            return StepLogits(logits)

        bind(runner, "run", run)

    def _decode_index(self, batch, meta) -> int | None:
        rows = meta.decode_rows.tolist()
        for item, start in zip(batch.scheduled, batch.cu_seqlens_q, strict=False):
            if item.seq.request_id == self.watch and item.num_new_tokens == 1 and start in rows:
                return rows.index(start)
        return None

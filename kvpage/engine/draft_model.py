"""The draft model's side of speculative decoding: a second, smaller or quantized model that
proposes k tokens per speculating sequence, batched over the step's sequences, with its own KV.

Its own pool, not the target's block tables: the draft's KV has other dimensions in general (a
smaller model), its blocks must never be published to or hit from the target's prefix cache, and
a preemption or a roll-back of the target must not free KV the draft still reads. So each
speculating sequence has a shadow here: the tokens the draft has seen and a table in a private
pool without prefix caching. Before proposing, a shadow is synced to its sequence's tokens: its
KV is kept up to the first token that differs (a rejected draft, a preemption's recompute) and
rolled back past it, then the draft computes what it lacks and proposes k tokens, one forward pass
per draft position over every shadow at once. A shadow whose pool is full proposes nothing this
step (the sequence decodes plainly); shadows of sequences that stopped running are freed."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvpage.cache.block_table import BlockTable
from kvpage.cache.groups import kv_layout
from kvpage.cache.manager import KVCacheManager
from kvpage.engine.kv_pool import local_storage
from kvpage.engine.plan import ScheduledSeq
from kvpage.engine.runner import ModelRunner
from kvpage.engine.sequence import Sequence
from kvpage.kv.format import kv_format
from kvpage.model.base import CausalLM
from kvpage.sampling import make_generator
from kvpage.speculative.rejection import target_probs

# A draft generator is seeded apart from its request's: the request's own draws (the rejection
# rule's) stay exactly the ones plain sampling's position would take.
DRAFT_SEED_OFFSET = 0x5EED_D4AF


@dataclass(slots=True, eq=False)
class Shadow:
    """What the draft model knows of one sequence; read by ModelRunner as a sequence is."""

    seq_id: int
    table: BlockTable
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)  # the target's tokens, then own drafts
    num_computed: int = 0  # leading tokens whose draft KV is in the draft pool
    synced: int = 0  # leading tokens known equal to the target sequence's
    needs_prompt_rows: bool = False
    lora = None  # the draft runs without adapters

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def token_at(self, start: int, end: int) -> list[int]:
        return self.tokens[start:end]


@dataclass(frozen=True, slots=True)
class Proposal:
    tokens: list[int]
    probs: torch.Tensor | None  # (k, V) q of each draft when the request samples; None: greedy


class DraftModelProposer:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, seed: int) -> None:
        mcfg = model.config
        layout = kv_layout(mcfg.num_layers, mcfg.layer_windows, False)  # one table: no trim
        storage = local_storage(
            model, layout, num_blocks, block_size, kv_format("auto", model.dtype)
        )
        self.cache = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(model, storage, self.cache)
        self.vocab_size = mcfg.vocab_size
        self.seed = seed
        self.shadows: dict[int, Shadow] = {}

    def propose(self, wanted: dict[int, tuple[Sequence, int]]) -> dict[int, Proposal]:
        """`wanted`: seq id -> (sequence, k). Drafts for each, computed together."""
        self._free_others(wanted)
        shadows = {sid: self._synced(seq) for sid, (seq, _) in wanted.items()}
        drafts: dict[int, list[int]] = {sid: [] for sid in wanted}
        probs: dict[int, list[torch.Tensor]] = {sid: [] for sid in wanted}
        for r in range(max((k for _, k in wanted.values()), default=0)):
            active = [sid for sid, (_, k) in wanted.items() if k > r and sid in shadows]
            items = self._schedule(shadows, active)
            if not items:
                break
            logits = self._run(items)
            for item, row in zip(items, logits, strict=True):
                shadow, seq = item.seq, wanted[item.seq.seq_id][0]
                token, q = self._draw(row, seq, shadow)
                shadow.num_computed += item.num_new_tokens
                shadow.tokens.append(token)
                drafts[shadow.seq_id].append(token)
                if q is not None:
                    probs[shadow.seq_id].append(q)
        return {
            sid: Proposal(tokens, torch.stack(probs[sid]) if probs[sid] else None)
            for sid, tokens in drafts.items()
            if tokens
        }

    def forget(self, seq_id: int) -> None:
        shadow = self.shadows.pop(seq_id, None)
        if shadow is not None:
            self.cache.free_table(shadow.table)

    def _free_others(self, wanted: dict[int, tuple[Sequence, int]]) -> None:
        """Shadows of sequences not speculating this step (finished, preempted, swapped) give
        their blocks back: a sequence that comes back recomputes its draft KV."""
        for sid in [sid for sid in self.shadows if sid not in wanted]:
            self.forget(sid)

    def _synced(self, seq: Sequence) -> Shadow:
        """The sequence's shadow, its tokens equal to the sequence's and its KV rolled back to
        the first token that differs."""
        shadow = self.shadows.get(seq.seq_id)
        if shadow is None:
            shadow = Shadow(
                seq.seq_id,
                self.cache.new_table(seq.seq_id),
                make_generator(seq.params, self.seed + seq.seq_id, self.runner.device),
            )
            if shadow.generator is not None and seq.params.seed is not None:
                shadow.generator.manual_seed(seq.params.seed ^ DRAFT_SEED_OFFSET)
            self.shadows[seq.seq_id] = shadow
        # The sequence only ever appends: its first `synced` tokens are still the shadow's.
        start = same = shadow.synced
        limit = min(len(shadow.tokens), seq.num_tokens)
        if same < limit:
            theirs = seq.token_at(start, limit)
            while same < limit and shadow.tokens[same] == theirs[same - start]:
                same += 1
        del shadow.tokens[same:]
        shadow.tokens += seq.token_at(same, seq.num_tokens)
        shadow.synced = seq.num_tokens
        # The last token is fed again if need be: its logits propose the first draft.
        keep = min(same, seq.num_tokens - 1)
        if shadow.num_computed > keep:
            shadow.num_computed = keep
            self.cache.roll_back(shadow.table, keep)
        return shadow

    def _schedule(self, shadows: dict[int, Shadow], active: list[int]) -> list[ScheduledSeq]:
        """Each active shadow's uncomputed tokens (all of them: the first pass catches up, the
        others are one token); a shadow the pool cannot grow drops out, freed."""
        items = []
        for sid in active:
            shadow = shadows[sid]
            n = shadow.num_tokens - shadow.num_computed
            if not self.cache.can_append(shadow.table, n):
                self.forget(sid)
                del shadows[sid]
                continue
            items.append(ScheduledSeq(shadow, n, self.cache.append_slots(shadow.table, n)))
        return items

    def _run(self, items: list[ScheduledSeq]) -> torch.Tensor:
        batch = self.runner.build(items)
        try:
            return self.runner.run(batch).logits  # (len(items), V)
        finally:
            self.runner.release(batch)

    def _draw(
        self, row: torch.Tensor, seq: Sequence, shadow: Shadow
    ) -> tuple[int, torch.Tensor | None]:
        """Greedy: the draft's argmax. Sampled: a draw from q, the draft's distribution under the
        request's own temperature, top-k and top-p, returned with it."""
        if seq.params.greedy:
            return int(torch.argmax(row)), None
        q = target_probs(row[None], seq.params)[0]  # (V,)
        race = torch.empty_like(q).exponential_(generator=shadow.generator)
        return int(torch.argmax(q / race)), q

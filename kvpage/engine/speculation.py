"""Speculative decoding in the engine: who speculates, with which drafts, and what the target's
verification makes of them.

A running sequence in decode (one pending token, its first output drawn) speculates: the
proposer (n-gram lookup in its own tokens, or a draft model, kvpage.engine.draft_model) gives up
to k drafts, and the scheduler runs it as a chunk of 1 + k tokens over its cached context — its
pending token and the drafts, with KV slots appended for all of them — beside the step's other
rows. The target scores every row; `verify` applies the rule of kvpage.speculative.rejection to
the 1 + k rows, and the scheduler then appends the kept tokens (the stop rule between them),
counts computed only the pending token and the kept drafts, rolls the table back past them and
only then publishes full blocks: a block holding a rejected draft is never published, and its
slots are written again by the tokens that follow.

Not speculating: a sequence under a grammar (its drafts would need the mask at every position),
one before its parallel fork, one with no tokens left to draft for (max_tokens), and any sequence
when the step's token budget or the pool cannot take its drafts (it decodes one token)."""

from __future__ import annotations

import torch

from kvpage.config import EngineConfig
from kvpage.engine.draft_model import DraftModelProposer, Proposal
from kvpage.engine.kv_pool import num_kv_blocks
from kvpage.engine.plan import ScheduledSeq
from kvpage.engine.sequence import Sequence
from kvpage.errors import InvalidConfig
from kvpage.kv.format import kv_format
from kvpage.model import load_model
from kvpage.model.base import CausalLM
from kvpage.speculative.config import SpeculativeConfig
from kvpage.speculative.ngram import NgramProposer
from kvpage.speculative.rejection import Verification, verify_drafts


class Speculation:
    def __init__(
        self,
        config: SpeculativeConfig,
        ngram: NgramProposer | None = None,
        draft_model: DraftModelProposer | None = None,
    ) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.ngram = ngram
        self.draft_model = draft_model
        # vLLM's spec_decode_* counters: verifications, drafts proposed, drafts accepted, and
        # accepted drafts by their position (0..k-1)
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.k
        # seq id -> an output length its steps may not pass (a test driver's hold: a forced
        # preemption "after t tokens" must find the sequence at t, not past it)
        self.holds: dict[int, int] = {}

    def draft_room(self, seq: Sequence, to_fork: set[int]) -> int:
        """How many drafts `seq` may take this step (0: it decodes plainly)."""
        if seq.num_uncomputed != 1 or not seq.output_ids or seq.grammar is not None:
            return 0
        if seq.seq_id in to_fork:
            return 0
        # The step appends up to k drafts and one more token: never past max_tokens.
        limit = min(seq.params.max_tokens, self.holds.get(seq.seq_id, seq.params.max_tokens))
        return max(0, min(self.k, limit - len(seq.output_ids) - 1))

    def hold_at(self, seq: Sequence, num_output_tokens: int | None) -> None:
        """Speculate `seq` no further than `num_output_tokens` outputs (None: no hold)."""
        if num_output_tokens is None:
            self.holds.pop(seq.seq_id, None)
        else:
            self.holds[seq.seq_id] = num_output_tokens

    def propose(self, running: list[Sequence], to_fork: set[int]) -> dict[int, Proposal]:
        """Drafts for every running sequence that may speculate: seq id -> proposal."""
        wanted = {}
        for seq in running:
            room = self.draft_room(seq, to_fork)
            if room:
                wanted[seq.seq_id] = (seq, room)
        if self.draft_model is not None:
            return self.draft_model.propose(wanted)
        proposals = {}
        for sid, (seq, room) in wanted.items():
            drafts = self.ngram.propose(seq.prompt_ids + seq.output_ids, room)
            if drafts:
                proposals[sid] = Proposal(drafts, None)
        return proposals

    def verify(self, items: list[ScheduledSeq], logits: torch.Tensor) -> list[Verification]:
        """logits: (sum of 1 + k, V), each item's rows in order -> one verification per item."""
        out = []
        first = 0
        for item in items:
            rows = logits[first : first + item.num_new_tokens]
            first += item.num_new_tokens
            seq = item.seq
            verification = verify_drafts(
                rows, item.drafts, seq.params, seq.generator, item.draft_probs
            )
            if not seq.params.greedy:
                seq.num_draws += 1
            self.count(seq, verification)
            out.append(verification)
        return out

    def count(self, seq: Sequence, verification: Verification) -> None:
        k, kept = len(verification.draft_tokens), verification.num_accepted
        self.num_drafts += 1
        self.num_draft_tokens += k
        self.num_accepted_tokens += kept
        for pos in range(kept):
            self.accepted_per_pos[pos] += 1
        seq.num_draft_tokens += k
        seq.num_accepted_tokens += kept

    def forget(self, seq: Sequence) -> None:
        """The sequence finished: the draft model's shadow of it goes."""
        self.holds.pop(seq.seq_id, None)
        if self.draft_model is not None:
            self.draft_model.forget(seq.seq_id)

    def stats(self) -> dict[str, int]:
        per_pos = {
            f"spec_decode_num_accepted_tokens_pos_{i}": n
            for i, n in enumerate(self.accepted_per_pos)
        }
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            **per_pos,
        }


def build_speculation(
    config: EngineConfig, target: CausalLM, max_model_len: int
) -> Speculation | None:
    """The engine's speculation from its config (None: plain decoding). What does not work
    with speculation yet is refused here, by name."""
    if config.speculative_config is None:
        return None
    spec = SpeculativeConfig.from_dict(config.speculative_config)
    if spec.method == "ngram":
        return Speculation(spec, ngram=NgramProposer(spec))
    if config.tensor_parallel_size > 1:
        raise InvalidConfig(
            "speculative method 'draft_model' runs in one process for now: it needs "
            f"tensor_parallel_size 1, got {config.tensor_parallel_size}"
        )
    draft = draft_model_for(spec, config)
    if draft.config.vocab_size != target.config.vocab_size:
        raise InvalidConfig(
            f"the draft model's vocabulary ({draft.config.vocab_size}) is not the target's "
            f"({target.config.vocab_size}): a draft must share the target's tokenizer"
        )
    fmt = kv_format("auto", draft.dtype)
    num_blocks = num_kv_blocks(config, draft.config, max_model_len, fmt)
    proposer = DraftModelProposer(draft, num_blocks, config.block_size, config.seed)
    return Speculation(spec, draft_model=proposer)


def draft_model_for(spec: SpeculativeConfig, config: EngineConfig) -> CausalLM:
    """The draft: the named model, or (model None) the target's own int8-weight copy, loaded
    from the target's weights with its LM head quantized too."""
    name = config.model if spec.is_self_draft else spec.model
    model, _ = load_model(
        name, config.dtype, config.device, spec.quantization, spec.quantization == "int8"
    )
    return model

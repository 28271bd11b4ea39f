"""One request's state as it moves through the engine.

WAITING --admit--> RUNNING --finish--> FINISHED
   ^                 |  \\--preempt(recompute)--> WAITING (front of the queue)
   |                 \\--preempt(swap)--> SWAPPED --restore--> RUNNING
any state --abort/timeout--> FINISHED

A WAITING or SWAPPED sequence may be suspended (`Scheduler.suspend`, from a test driver between
steps): it keeps its state but leaves the queues until resumed, so no step schedules it.

A request with n > 1 enters as one sequence, sample 0. The step that samples its first token
forks samples 1..n-1: new sequences, RUNNING, sharing its blocks and key chain up to the prompt's
end. From then on each sample moves through this machine on its own.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from kvpage.cache.block_table import BlockTable
from kvpage.cache.key_chain import BlockKeyChain
from kvpage.lora.adapter import LoraAdapter
from kvpage.sampling_params import SamplingParams
from kvpage.structured.matcher import GrammarMatcher


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    chain: BlockKeyChain
    table: BlockTable
    generator: torch.Generator | None
    stop_ids: frozenset[int]
    arrival_time: float
    deadline: float | None = None
    cache_salt: str | None = None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    token_logprobs: list[float] | None = None  # the chosen token's, when logprobs are wanted
    # Per prompt token, None first (no logits precede it): the token's logprob and the top k
    # of the logits row before it. Filled as prefill chunks compute the rows, in order.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0  # leading tokens whose KV is in the pool
    num_cached_tokens: int = 0  # prefix-cache hit at first admission
    num_preemptions: int = 0
    admitted_once: bool = False
    first_token_time: float | None = None
    finish_reason: str | None = None
    error: str | None = None
    swapped_tokens: int = 0  # KV tokens held in the swap space while SWAPPED
    resume_pending: str = ""  # preemption mode, until the request runs again
    kv_restored: bool = True  # False from swap-out until the restored KV has been copied back
    sample_index: int = 0  # which of the request's n parallel samples this sequence is
    num_draws: int = 0  # random draws taken from `generator` so far (its offset)
    rows_offered: int = 0  # leading full blocks whose prompt rows went to the row store
    lora: LoraAdapter | None = None  # the adapter it runs with; None: the base model
    lora_held: bool = False  # it holds its adapter's slot (from admission to its finish)
    grammar: GrammarMatcher | None = None  # its structured-output matcher (kvpage.engine.grammars)
    num_draft_tokens: int = 0  # speculative drafts proposed for it (kvpage.engine.speculation)
    num_accepted_tokens: int = 0  # of those, the ones the target kept

    @property
    def sample_id(self) -> str:
        """The request id for n == 1; `request_id#i` for sample i of a parallel request."""
        return self.request_id if self.params.n == 1 else f"{self.request_id}#{self.sample_index}"

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_at(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output."""
        n_prompt = len(self.prompt_ids)
        if end <= n_prompt:
            return self.prompt_ids[start:end]
        if start >= n_prompt:
            return self.output_ids[start - n_prompt : end - n_prompt]
        return self.prompt_ids[start:] + self.output_ids[: end - n_prompt]

    @property
    def needs_prompt_rows(self) -> bool:
        """Prompt logprobs were asked for and some are not computed yet."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def fan_out(self) -> int:
        """Running sequences it becomes once admitted: a parallel request forks into n at its
        first token, and every one of them then runs in each step (max_num_seqs counts them)."""
        unforked = self.params.n > 1 and self.sample_index == 0 and not self.output_ids
        return self.params.n if unforked else 1

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

"""The live requests: request id -> its samples, seq id -> sequence, and the deadlines in flight.

A request with n > 1 enters as one sequence, sample 0; its samples 1..n-1 are made at the
fork (`new_sample`). A sample id is the request id for n == 1 and `rid#i` for sample i."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvpage.cache.block_table import BlockTable
from kvpage.cache.key_chain import BlockKeyChain
from kvpage.cache.manager import KVCacheManager
from kvpage.cache.namespace import CacheNamespace
from kvpage.engine.grammars import Grammars
from kvpage.engine.sequence import SeqStatus, Sequence
from kvpage.lora.adapter import LoraAdapter
from kvpage.sampling import make_generator
from kvpage.sampling_params import SamplingParams
from kvpage.structured.matcher import GrammarMatcher


@dataclass(frozen=True, slots=True)
class NewRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    arrival_time: float
    deadline: float | None
    lora: LoraAdapter | None = None
    grammar: GrammarMatcher | None = None  # sample 0's matcher, compiled at add_request


class Requests:
    def __init__(
        self,
        cache: KVCacheManager,
        seed: int,
        device: str | torch.device,
        eos_token_ids: tuple[int, ...],
        grammars: Grammars | None = None,  # None: no request of this engine is constrained
    ) -> None:
        self.cache, self.seed, self.device = cache, seed, device
        self.grammars = grammars
        self.eos_token_ids = eos_token_ids
        self.heads: dict[str, Sequence] = {}  # request id -> its sample 0
        self.samples: dict[str, list[Sequence]] = {}  # request id -> its samples, by index
        self.by_seq_id: dict[int, Sequence] = {}
        self.with_deadline: set[str] = set()  # request ids with a timeout still in flight
        self._seq_ids = itertools.count()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.heads

    # --- making sequences ------------------------------------------------------------------
    def new_sequence(self, req: NewRequest, namespace: CacheNamespace) -> Sequence:
        """Sample 0 of a new request, registered; its key chain already covers the prompt."""
        chain = self.cache.new_key_chain(namespace)
        chain.extend(req.prompt_ids)
        eos = () if req.params.ignore_eos else self.eos_token_ids
        # Sample 0's seed is params.seed, which is what params.for_sample(0) would give.
        seq = self._sequence(
            req,
            chain,
            self.cache.new_table,
            req.params,
            stop_ids=frozenset((*eos, *req.params.stop_token_ids)),
            prompt_logprobs=None if req.params.prompt_logprobs is None else [None],
            grammar=req.grammar,
        )
        self.heads[req.request_id] = seq
        self.samples[req.request_id] = [seq]
        if seq.deadline is not None:
            self.with_deadline.add(req.request_id)
        return seq

    def new_sample(self, parent: Sequence, index: int) -> Sequence:
        """Sample `index` of a parallel request: every block of sample 0 shared (the partial
        last one is copied on its first write), its own generator."""
        req = NewRequest(
            parent.request_id,
            parent.prompt_ids,
            parent.params,  # n kept, so sample_id reads `rid#index`
            parent.cache_salt,
            parent.arrival_time,
            parent.deadline,
            parent.lora,
        )
        child = self._sequence(
            req,
            parent.chain.copy(),
            lambda seq_id: self.cache.fork(parent.table, seq_id),
            parent.params.for_sample(index),
            stop_ids=parent.stop_ids,
            # The prompt's rows are complete at the fork (it follows the prefill) and never
            # change again: shared, so each sample's first output can carry them.
            prompt_logprobs=parent.prompt_logprobs,
            sample_index=index,
            grammar=None if self.grammars is None else self.grammars.fork(parent.grammar),
        )
        # It runs on from the parent's admission: the prompt computed (its blocks shared), and
        # its later re-prefills (after recompute) are not new prefix queries.
        child.status, child.admitted_once = SeqStatus.RUNNING, True
        child.num_computed, child.num_cached_tokens = parent.num_computed, parent.num_cached_tokens
        self.samples[parent.request_id].append(child)
        return child

    def _sequence(
        self,
        req: NewRequest,
        chain: BlockKeyChain,
        table_for: Callable[[int], BlockTable],
        seed_params: SamplingParams,
        **state,
    ) -> Sequence:
        """A new sequence of `req`, registered under a new seq id (its table made for it)."""
        seq_id = next(self._seq_ids)
        wants_logprobs = req.params.logprobs is not None
        seq = Sequence(
            seq_id=seq_id,
            request_id=req.request_id,
            prompt_ids=req.prompt_ids,
            params=req.params,
            chain=chain,
            table=table_for(seq_id),
            generator=make_generator(seed_params, self.seed + seq_id, self.device),
            arrival_time=req.arrival_time,
            deadline=req.deadline,
            cache_salt=req.cache_salt,
            logprobs=[] if wants_logprobs else None,
            token_logprobs=[] if wants_logprobs else None,
            lora=req.lora,
            **state,
        )
        self.by_seq_id[seq_id] = seq
        return seq

    # --- lookups ---------------------------------------------------------------------------
    def named(self, name: str) -> list[Sequence]:
        """A request id names all its samples; `rid#i` names sample i once it exists."""
        if name in self.samples:
            return self.samples[name]
        ref = self.split_sample_id(name)
        if ref is None or ref[1] >= len(self.samples[ref[0]]):
            return []
        return [self.samples[ref[0]][ref[1]]]

    def sample(self, sample_id: str) -> Sequence | None:
        """The sequence a sample id names, if it exists (a request id names its sample 0)."""
        found = self.named(sample_id)
        return found[0] if found else None

    def split_sample_id(self, sample_id: str) -> tuple[str, int] | None:
        """`rid#i` of a live parallel request -> (rid, i); anything else -> None."""
        rid, sep, index = sample_id.rpartition("#")
        head = self.heads.get(rid)
        if not sep or head is None or not index.isdigit() or int(index) >= head.params.n:
            return None
        return rid, int(index)

    def unfinished(self) -> list[Sequence]:
        return [s for samples in self.samples.values() for s in samples if not s.finished]

    def retire(self, request_id: str) -> None:
        del self.heads[request_id]
        for seq in self.samples.pop(request_id):
            self.by_seq_id.pop(seq.seq_id, None)
        self.with_deadline.discard(request_id)

"""Step records: per request and sampled token, what went in (input ids, positions), what
came out (a logits digest, top-k, the chosen token) and the cache view the step read. The
reference generator writes them for its contiguous run, the verifier's tracer for the engine, so
the two can be diffed field by field (kvpage.verify.diff)."""

from __future__ import annotations

import functools
import hashlib
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import torch

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


class GroupView(NamedTuple):
    """One extra layer group's table as a step read it (kvpage.cache.groups): its window (None:
    global), its layers, the first position its window lets the step's last query see, and its
    entries (a window group's given-back ones are absent)."""

    group: int
    window: int | None
    layers: tuple[int, ...]  # the layers whose attention reads this table
    window_start: int  # the first key the step's first query may see
    entries: tuple[ViewEntry, ...]
    query_start: int = 0  # the step's first query position
    # Per entry, the block position its prefix-index key names (-1: not published): a block
    # published for one position and read at another holds another position's KV.
    published_at: tuple[int, ...] = ()


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
    kv_layout: int = 1  # kvpage.kv.format layout version (2: codes + per-token scales)
    # Quantized KV: one digest of the scales read per block (the reference: per block-sized
    # span of its contiguous cache, so the two line up block by block).
    scale_digests: tuple[str, ...] = ()
    # Layer groups 1.. (group 0 is `entries`); empty with one group (every layer, one table).
    groups: tuple[GroupView, ...] = ()
    # The reference's side: each layer's sliding window (None: global), from its own config.
    layer_windows: tuple[int | None, ...] = ()

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
    adapter: str = ""  # the LoRA adapter it ran with (its identity); "" for the base model
    # Candidate only: the adapters of every row of the engine step it came from (a bug in the
    # mixed batch shows on the rows of others too).
    batch_adapters: tuple[str, ...] = ()
    # Reference only, for a constrained request: what its grammar allowed at this step and
    # whether the token completed it (grammar_note); None otherwise.
    grammar: dict | None = None
    # Candidate only, on a speculating engine: set when this record's token came out of a
    # verification, or its step read KV a speculative step wrote (the drafts, how many were
    # kept, which of the verified tokens this is: -1 for a read only)
    speculative: dict | None = None
    # Reference only: that step's whole grammar mask, (V,) bool (not in reports: grammar is)
    allowed: torch.Tensor | None = field(default=None, repr=False)
    logits: torch.Tensor | None = field(default=None, repr=False)  # (V,) float32, for atol checks

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("logits")
        d.pop("allowed")
        d["view"]["entries"] = [e._asdict() for e in self.view.entries]
        return d


GRAMMAR_IDS_SHOWN = 16


def grammar_note(allowed: torch.Tensor, finished: bool) -> dict:
    """A constrained step's grammar, for the report: how many ids it allowed, the first of
    them, and whether the chosen token completed it."""
    ids = torch.nonzero(allowed).flatten()
    return {
        "allowed": int(ids.numel()),
        "allowed_ids": ids[:GRAMMAR_IDS_SHOWN].tolist(),
        "finished": bool(finished),
    }


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

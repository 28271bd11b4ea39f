"""KV provenance: for every block incarnation (block id, generation), whose KV it holds;
for every read, whether that KV is the reader's own.

The identity of one KV slot is what its values depend on: the namespace and every token from
position 0 up to the slot's own position. A slot at offset o of logical block j therefore holds
(base_j, tokens[j*B : j*B+o+1]) where base_j digests the namespace and tokens [0, j*B). The
namespace is the engine's digest plus the request's cache salt, taken from the request itself: a
namespace that forgets the salt shares numerically identical KV across tenants, and that must not
pass either. An incarnation keeps its slots as segments of one writer each (usually one segment);
a reader of logical block j needs, at every offset it reads, its own base_j and its own tokens. A
prefix-cache hit passes (same namespace and tokens, another writer); KV of another prefix, another
namespace, another position, or of an incarnation nobody wrote does not — whether or not the
sampled tokens happen to come out the same.

Writes (before reads, so a prefill chunk reading its own KV is covered):
- offset 0 of an incarnation that already holds other KV: the block was reused without a
  generation bump (free must bump; a fresh incarnation is empty);
- offset > 0 over KV that is not the writer's own prefix: a write into a block holding another
  request's KV (a shared block written without copy-on-write).
Copy-on-write gives the copy the source's segments; a swap-in gives the restored blocks the
restored sequence's own KV.

Costs only while tracing: O(tokens written) per write; per step and reader, one tuple comparison
for the full blocks it has already verified (valid while their (block, generation) entries hold
and no recorded KV changed in place) plus the blocks not yet verified, O(block) each at most.
Only each block's latest incarnation is kept."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

# The reference imports kvpage.verify.trace, which imports this module, and must share no code
# with what it checks: nothing here may import kvpage.cache or kvpage.engine, so the engine's
# types are named in docstrings only.
Seq = Any  # a kvpage.engine.sequence.Sequence

_DOMAIN = b"kvpage.verify.provenance.v1"


@dataclass(frozen=True, slots=True)
class ProvenanceViolation:
    sample_id: str  # the request (sample) whose step wrote or read the bad KV
    engine_step: int
    record_step: int  # index of that request's next StepRecord: the record the bad step feeds
    logical: int
    block_id: int
    generation: int
    kind: str  # no_generation_bump | write_into_foreign | stale_read | unwritten_read
    message: str


@dataclass(slots=True)
class ProvenanceStats:
    writes: int = 0  # write runs recorded (one per block touched per scheduled sequence)
    reads: int = 0  # table entries checked
    shared_reads: int = 0  # of which verified against KV another sequence wrote
    copies: int = 0
    restored_blocks: int = 0


@dataclass(slots=True)
class _Segment:
    """Offsets [start, end) hold `seq_id`'s KV for logical block `logical` (-1: written at a
    position that is not logical*B + offset). tokens[o] is the writer's token at offset o, kept
    from offset 0 so that comparing a prefix is a slice."""

    start: int
    end: int
    logical: int
    base: bytes
    namespace: bytes
    tokens: list[int]
    writer: str
    seq_id: int

    def copy(self) -> _Segment:
        return _Segment(
            self.start,
            self.end,
            self.logical,
            self.base,
            self.namespace,
            list(self.tokens),
            self.writer,
            self.seq_id,
        )


@dataclass(slots=True)
class _Incarnation:
    generation: int
    segments: list[_Segment] = field(default_factory=list)  # sorted by start, disjoint


@dataclass(slots=True)
class _Chain:
    """This module's own digests of one sequence's prefixes (the engine's key chain is what is
    being verified, so it is not trusted here). bases[j] covers namespace + tokens [0, j*B)."""

    engine_namespace: bytes
    namespace: bytes  # engine namespace + cache salt
    bases: list[bytes]


class _Who(NamedTuple):
    """A sequence's identity for one logical block it writes or reads."""

    seq: Seq
    logical: int  # -1: misaligned (origin not on a block boundary)
    origin: int  # position of offset 0
    base: bytes


class _Mismatch(NamedTuple):
    offset: int
    segment: _Segment | None  # None: nothing recorded there


_WHY = {
    "no_generation_bump": "block reused without a generation bump",
    "write_into_foreign": "a write into a block holding another request's KV "
    "(a shared block written without copy-on-write?)",
    "stale_read": "stale read: KV written for another prefix, namespace or position",
    "unwritten_read": "a read of freed or never-written KV",
}


def _length_prefixed(data: bytes) -> bytes:
    return len(data).to_bytes(8, "little") + data


def _own_end(inc: _Incarnation, seq: Seq, logical: int) -> int:
    """n when offsets [0, n) of inc are all one segment of seq's own KV for `logical`, else -1
    (the common case, checked without any digest or token)."""
    if len(inc.segments) != 1 or logical < 0:
        return -1
    seg = inc.segments[0]
    if seg.start or seg.seq_id != seq.seq_id or seg.logical != logical:
        return -1
    return seg.end


def _content(segments: list[_Segment]) -> list[tuple]:
    return [(s.start, s.end, s.logical, s.base, tuple(s.tokens[s.start : s.end])) for s in segments]


class KVProvenance:
    """Fed by the EngineTracer: `on_batch` every step, `on_kv_copy` / `on_kv_restored` for KV
    written outside a step. `violations` lists what was found, each once, naming the request
    whose step wrote or read the bad KV and the record that step feeds. Attach it before the
    engine's first step: KV written earlier is unknown, and reads of it count as unwritten."""

    def __init__(self, engine, next_record: Callable[[str], int] | None = None) -> None:
        self.engine = engine
        self.block_size = engine.config.block_size
        self.violations: list[ProvenanceViolation] = []
        self.stats = ProvenanceStats()
        self._next_record = next_record or (lambda sample_id: 0)
        self._blocks: dict[int, _Incarnation] = {}  # block id -> its latest recorded incarnation
        self._chains: dict[int, _Chain] = {}  # seq id -> prefix digests
        # seq id -> (epoch, leading full-block entries verified at that epoch)
        self._verified: dict[int, tuple[tuple[int, int], tuple]] = {}
        self._epoch = 0  # bumped when recorded KV changes in place (never, in a correct engine)
        self._sample_ids: dict[int, str] = {}  # seq id -> sample id, for copies (no seq given)
        self._reported: set[tuple] = set()

    # --- hooks -----------------------------------------------------------------------------
    def on_batch(self, batch) -> None:
        cu = batch.cu_seqlens_q
        for item, start, end in zip(batch.scheduled, cu, cu[1:], strict=False):
            self._sample_ids[item.seq.seq_id] = item.seq.sample_id
            # A speculating sequence's drafts are not its tokens (yet): only its pending token's
            # KV is recorded now, the kept drafts' once verified (on_verified), the rejected
            # drafts' never — KV nobody may read.
            end = start + 1 if item.drafts else end
            self._record_writes(item.seq, item.slots, batch.positions[start:end])
        for item, snap in zip(batch.scheduled, batch.snapshots, strict=False):
            if item.seq.num_computed == 0 and item.num_new_tokens > 1:
                continue  # a fresh prompt attends to its own in-batch K/V, not to the pool
            # Drafts attend to their own in-batch KV: the pool holds the context and the
            # pending token.
            new = 1 if item.drafts else item.num_new_tokens
            self._check_reads(item.seq, snap, item.seq.num_computed + new)

    def on_verified(self, batch, verified: list) -> None:
        """The kept drafts' KV is now the sequence's: positions start + 1 .. start + kept (a
        finished sequence's blocks are gone: nothing to record)."""
        for v, first in zip(verified, batch.spec_rows, strict=True):
            item, draws = v.item, v.draws[: v.appended]
            if item.seq.finished or len(draws) < 2:
                continue
            start = batch.positions[first]
            kept = range(start + 1, start + len(draws))
            self._record_writes(item.seq, item.slots[1 : len(draws)], list(kept))

    def on_kv_copy(self, src: int, dst: int) -> None:
        """dst now holds src's KV (copy-on-write; the manager gives dst src's valid_len)."""
        self.stats.copies += 1
        source = self._current(src)
        segments = [] if source is None else [s.copy() for s in source.segments]
        old = self._current(dst)
        if old is not None and _content(old.segments) != _content(segments):
            self._report_copy(dst, old)  # dst is freshly allocated: it must hold nothing yet
        self._restart(dst, segments)

    def on_kv_restored(self, seq: Seq, block_ids: list[int]) -> None:
        """A swap-in wrote seq's saved KV into block_ids: its logical blocks 0.., up to the
        tokens it had when swapped out (a swapped table restarts empty:
        kvpage.cache.manager.allocate_restoring)."""
        self._sample_ids[seq.seq_id] = seq.sample_id
        B = self.block_size
        # The restored table's held entries, in order (a window group 0 holds none for its
        # leading NULL blocks; extra groups' blocks follow and are not group 0's).
        logical = [i for i, b in enumerate(seq.table.block_ids) if b >= 0]
        for i, bid in zip(logical, block_ids, strict=False):
            hi = min(B, seq.swapped_tokens - i * B)
            if hi > 0:
                self.stats.restored_blocks += 1
                self._write(seq, bid, 0, hi, i * B)

    def on_prompt_rows(self, seq: Seq, sources: list) -> None:
        """A hit served prompt-logprob rows computed for each source's (block, generation) as
        seq's logical block: like a read of the whole block, the incarnation must be the
        latest and hold seq's own KV there (same namespace, prefix and tokens). A violation's
        kind is `rows_` + the read's kind."""
        before = len(self.violations)
        for src in sources:
            self._check_entry(seq, src.logical, src, self.block_size)
        for i in range(before, len(self.violations)):
            v = self.violations[i]
            message = f"prompt rows: {v.message}"
            self.violations[i] = replace(v, kind=f"rows_{v.kind}", message=message)

    # --- writes ----------------------------------------------------------------------------
    def _record_writes(self, seq: Seq, slots: list[int], positions: list[int]) -> None:
        """One write per maximal run of consecutive slots in one block fed consecutive
        positions (a whole chunk's block at once, one slot per decode)."""
        B, n = self.block_size, min(len(slots), len(positions))
        i = 0
        while i < n:
            bid, lo = divmod(slots[i], B)
            k = i + 1
            while (
                k < n
                and slots[k] == slots[k - 1] + 1
                and positions[k] == positions[k - 1] + 1
                and slots[k] // B == bid
            ):
                k += 1
            self._write(seq, bid, lo, lo + k - i, positions[i] - lo)
            i = k

    def _write(self, seq: Seq, bid: int, lo: int, hi: int, origin: int) -> None:
        """seq writes its KV for positions [origin+lo, origin+hi) into offsets [lo, hi)."""
        self.stats.writes += 1
        inc = self._current(bid)
        logical = origin // self.block_size if origin % self.block_size == 0 else -1
        if inc is not None and 0 < lo == _own_end(inc, seq, logical):
            own = inc.segments[0]  # decode: extend the sole segment, the writer's own
            own.tokens += seq.token_at(origin + len(own.tokens), origin + hi)
            own.end = hi
            return
        who = self._who(seq, origin)
        if inc is not None and who.logical >= 0:
            bad = self._mismatch(inc, who, 0, hi, gaps_ok=True)
            if bad is not None:
                kind = "no_generation_bump" if lo == 0 else "write_into_foreign"
                self._report(who, bid, inc.generation, kind, bad)
        if inc is None or lo == 0:  # a fresh incarnation as far as the writer knows
            self._restart(bid, [self._segment(who, lo, hi)])
        elif not self._extend_own(inc, who, lo, hi):
            self._overwrite(inc, self._segment(who, lo, hi))

    def _restart(self, bid: int, segments: list[_Segment]) -> None:
        if self._current(bid) is not None:  # KV replaced under the same generation
            self._epoch += 1
        self._blocks[bid] = _Incarnation(self._pool_block(bid).generation, segments)

    def _extend_own(self, inc: _Incarnation, who: _Who, lo: int, hi: int) -> bool:
        """The common decode case: the last segment is the writer's own and reaches lo."""
        last = inc.segments[-1] if inc.segments else None
        if last is None or not self._own(last, who) or not last.start <= lo <= last.end:
            return False
        if hi > len(last.tokens):
            last.tokens += who.seq.token_at(who.origin + len(last.tokens), who.origin + hi)
        last.end = max(last.end, hi)
        return True

    def _overwrite(self, inc: _Incarnation, seg: _Segment) -> None:
        """seg replaces whatever was recorded over [seg.start, seg.end)."""
        kept: list[_Segment] = []
        for s in inc.segments:
            if s.end <= seg.start or s.start >= seg.end:
                kept.append(s)
                continue
            self._epoch += 1  # recorded offsets change hands
            if s.start < seg.start:
                head = s.copy()
                head.end = seg.start
                kept.append(head)
            if s.end > seg.end:
                tail = s.copy()
                tail.start = seg.end
                kept.append(tail)
        kept.append(seg)
        inc.segments = sorted(kept, key=lambda s: s.start)

    def _segment(self, who: _Who, lo: int, hi: int) -> _Segment:
        seq = who.seq
        tokens = seq.token_at(who.origin, who.origin + hi) if who.logical >= 0 else []
        namespace = self._chain(seq).namespace
        return _Segment(lo, hi, who.logical, who.base, namespace, tokens, seq.sample_id, seq.seq_id)

    # --- reads -----------------------------------------------------------------------------
    def _check_reads(self, seq: Seq, snap, context_len: int) -> None:
        """Every table entry the step reads, over the offsets the runner reads (the context,
        whatever valid_len the metadata claims). Leading full blocks verified at an earlier step
        are skipped while their entries and every recorded incarnation's content stand."""
        B, entries = self.block_size, snap.entries
        # A window group 0 (an all-windowed model) holds no entry for its leading NULL blocks:
        # entry k is logical block k + skip.
        skip = len(snap.block_ids) - len(entries)
        cached = self._verified.get(seq.seq_id)
        start = 0
        if cached is not None and cached[0] == (self._epoch, skip):
            start = len(cached[1])
            if entries[:start] != cached[1]:
                start = 0
        verified_full = start
        for k in range(start, len(entries)):
            j = k + skip
            need = min(B, context_len - j * B)
            if need <= 0:
                break
            if self._check_entry(seq, j, entries[k], need) and k == verified_full and need == B:
                verified_full += 1
        self._verified[seq.seq_id] = ((self._epoch, skip), entries[:verified_full])

    def _check_entry(self, seq: Seq, j: int, entry, need: int) -> bool:
        """Offsets [0, need) of logical block j, read through entry, are seq's own KV."""
        bid, generation = entry.block_id, entry.generation
        self.stats.reads += 1
        inc = self._blocks.get(bid)  # the latest recorded, whatever the pool says now
        if inc is None or inc.generation != generation:
            self._report_missing(seq, j, bid, generation, inc, need)
            return False
        if _own_end(inc, seq, j) >= need:
            return True  # its own KV, written by this sequence for this block
        who = self._who(seq, j * self.block_size)
        bad = self._mismatch(inc, who, 0, need, gaps_ok=False)
        if bad is not None:
            self._report(who, bid, generation, self._read_kind(bad), bad)
            return False
        if any(s.seq_id != seq.seq_id for s in inc.segments if s.start < need):
            self.stats.shared_reads += 1
        return True

    @staticmethod
    def _read_kind(bad: _Mismatch) -> str:
        return "unwritten_read" if bad.segment is None else "stale_read"

    # --- comparison ------------------------------------------------------------------------
    def _mismatch(
        self, inc: _Incarnation, who: _Who, lo: int, hi: int, gaps_ok: bool
    ) -> _Mismatch | None:
        """The first offset in [lo, hi) whose recorded KV is not who's own (or is unrecorded,
        unless gaps_ok)."""
        cursor = lo
        for seg in inc.segments:
            if seg.end <= cursor:
                continue
            if seg.start >= hi:
                break
            if seg.start > cursor and not gaps_ok:
                return _Mismatch(cursor, None)
            a, b = max(seg.start, cursor), min(seg.end, hi)
            bad = self._first_foreign(seg, who, a, b)
            if bad is not None:
                return _Mismatch(bad, seg)
            cursor = b
        if cursor < hi and not gaps_ok:
            return _Mismatch(cursor, None)
        return None

    def _first_foreign(self, seg: _Segment, who: _Who, a: int, b: int) -> int | None:
        if seg.logical != who.logical or seg.base != who.base or who.logical < 0:
            return a
        if seg.seq_id == who.seq.seq_id:
            return None  # its own KV: a sequence's tokens never change
        mine = who.seq.token_at(who.origin + a, who.origin + b)
        for offset, (theirs, own) in enumerate(zip(seg.tokens[a:b], mine, strict=False), a):
            if theirs != own:
                return offset
        return None

    def _own(self, seg: _Segment, who: _Who) -> bool:
        return seg.seq_id == who.seq.seq_id and seg.logical == who.logical and who.logical >= 0

    # --- identities ------------------------------------------------------------------------
    def _who(self, seq: Seq, origin: int) -> _Who:
        B = self.block_size
        if origin < 0 or origin % B:
            return _Who(seq, -1, origin, b"")
        return _Who(seq, origin // B, origin, self._base(seq, origin // B))

    def _chain(self, seq: Seq) -> _Chain:
        engine_namespace = seq.chain.namespace_digest
        chain = self._chains.get(seq.seq_id)
        if chain is None or chain.engine_namespace != engine_namespace:
            salt = seq.cache_salt
            salted = b"\x00" if salt is None else b"\x01" + _length_prefixed(salt.encode())
            namespace = hashlib.sha256(_DOMAIN + engine_namespace + salted).digest()
            chain = _Chain(engine_namespace, namespace, [namespace])
            self._chains[seq.seq_id] = chain
        return chain

    def _base(self, seq: Seq, j: int) -> bytes:
        """Digest of the namespace and seq's tokens [0, j*B), extended on demand: O(new
        tokens) over a sequence's life."""
        chain, B = self._chain(seq), self.block_size
        while len(chain.bases) <= j:
            k = len(chain.bases) - 1
            payload = array("q", seq.token_at(k * B, (k + 1) * B)).tobytes()
            chain.bases.append(hashlib.sha256(chain.bases[-1] + payload).digest())
        return chain.bases[j]

    # --- reports ---------------------------------------------------------------------------
    def _report(self, who: _Who, bid: int, generation: int, kind: str, bad: _Mismatch) -> None:
        """A write or read of (bid, generation) as who's logical block met KV not its own."""
        sample_id, offset = who.seq.sample_id, bad.offset
        seg = bad.segment
        held = (
            "nothing written in this generation"
            if seg is None
            else f"{seg.writer}'s KV for {self._describe(seg, who, offset)}"
        )
        verb = "reads" if kind in ("stale_read", "unwritten_read") else "writes"
        message = (
            f"{sample_id} {verb} block {bid} gen {generation} as its logical block {who.logical}: "
            f"offset {offset} holds {held}, where it {verb} its own position {who.origin + offset}"
            f" ({_WHY[kind]})"
        )
        self._add(sample_id, who.logical, bid, generation, kind, message)

    def _report_missing(
        self, seq: Seq, j: int, bid: int, generation: int, inc: _Incarnation | None, need: int
    ) -> None:
        """The step reads an incarnation with no record: reused since, or never written."""
        B = self.block_size
        span = f"{seq.sample_id} reads block {bid} gen {generation} for positions [{j * B}, {j * B + need})"
        if inc is not None and inc.generation > generation:
            kind = "stale_read"
            writers = sorted({s.writer for s in inc.segments})
            message = (
                f"{span}, but the block was reused since: gen {inc.generation} holds {writers}'s KV"
            )
        else:
            kind = "unwritten_read"
            last = "never written" if inc is None else f"last written at gen {inc.generation}"
            message = f"{span}, but nothing was written into that incarnation ({last})"
        self._add(seq.sample_id, j, bid, generation, kind, f"{message} ({_WHY[kind]})")

    def _report_copy(self, dst: int, old: _Incarnation) -> None:
        owners = self._pool_block(dst).owners
        seq_id = min(owners) if owners else -1
        writer = self._sample_ids.get(seq_id, f"seq {seq_id}")
        held = sorted({s.writer for s in old.segments})
        logical = old.segments[0].logical if old.segments else -1
        message = (
            f"copy-on-write for {writer} into block {dst} gen {old.generation}, which still "
            f"holds {held}'s KV: {_WHY['no_generation_bump']}"
        )
        self._add(writer, logical, dst, old.generation, "no_generation_bump", message)

    def _describe(self, seg: _Segment, who: _Who, offset: int) -> str:
        B = self.block_size
        if seg.logical < 0:
            return "written at a position off the block grid"
        pos = seg.logical * B + offset
        if seg.logical != who.logical:
            return f"position {pos}, logical block {seg.logical}"
        if seg.namespace != self._chain(who.seq).namespace:
            return f"position {pos} in namespace {seg.namespace.hex()[:12]}"
        if seg.base != who.base:
            return f"position {pos} after a different prefix"
        return f"position {pos}, token {seg.tokens[offset]}"

    def _add(
        self, sample_id: str, logical: int, bid: int, generation: int, kind: str, message: str
    ) -> None:
        key = (sample_id, kind, logical, bid, generation)
        if key in self._reported:
            return  # a bad entry is read every step; the first read is the one to attribute
        self._reported.add(key)
        self.violations.append(
            ProvenanceViolation(
                sample_id,
                self.engine.step_count,
                self._next_record(sample_id),
                logical,
                bid,
                generation,
                kind,
                message,
            )
        )

    # --- helpers ---------------------------------------------------------------------------
    def _current(self, bid: int) -> _Incarnation | None:
        """The recorded incarnation of bid if it is the pool's current one."""
        inc = self._blocks.get(bid)
        if inc is None or inc.generation != self._pool_block(bid).generation:
            return None
        return inc

    def _pool_block(self, bid: int):
        return self.engine.cache.pool.blocks[bid]

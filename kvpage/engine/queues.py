"""Where each live sequence waits its turn: the scheduler's queues, shared with the swap
lifecycle (kvpage.engine.swapping), which moves sequences between them on preemption."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvpage.engine.sequence import SeqStatus, Sequence


@dataclass(slots=True)
class Queues:
    waiting: deque[Sequence] = field(default_factory=deque)  # the front is admitted first
    running: list[Sequence] = field(default_factory=list)  # oldest first
    swapped: deque[Sequence] = field(default_factory=deque)  # oldest first
    suspended: dict[int, Sequence] = field(default_factory=dict)  # seq id -> one kept out

    def take_out(self, seq: Sequence) -> None:
        """Out of whatever queue holds it."""
        for queue in (self.waiting, self.running, self.swapped):
            if seq in queue:
                queue.remove(seq)
        self.suspended.pop(seq.seq_id, None)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self.suspended)

    def suspend(self, seq: Sequence) -> None:
        """Keep a WAITING or SWAPPED sequence out of every step until `resume` (between steps:
        a test driver's hold after a forced preemption)."""
        queue = {SeqStatus.WAITING: self.waiting, SeqStatus.SWAPPED: self.swapped}[seq.status]
        queue.remove(seq)
        self.suspended[seq.seq_id] = seq

    def resume(self, seq: Sequence) -> None:
        """Back where a preemption puts it: the front of the waiting queue, or swapped."""
        del self.suspended[seq.seq_id]
        if seq.status is SeqStatus.WAITING:
            self.waiting.appendleft(seq)
        else:
            self.swapped.append(seq)

    def to_recompute(self, seq: Sequence) -> None:
        """A preempted sequence that computes its KV again: first in line to be admitted."""
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

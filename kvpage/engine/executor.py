"""The executor: does to the KV pool's tensors what a plan's block operations say, in order, and
runs the model over the step's batch (kvpage.engine.runner). One process or tensor parallel, the
same object: under tensor parallelism the storage sends each operation to every rank, and the
runner sends the step's inputs."""

from __future__ import annotations

import time

from kvpage.cache.block_ops import BlockOp, CopyBlock, InvalidateBlock, SwapIn, SwapOut
from kvpage.engine.plan import BlockOpsDone, StepBatch, StepLogits, StepPlan
from kvpage.engine.runner import ModelRunner
from kvpage.errors import SwapError
from kvpage.kv.storage import KVStorage
from kvpage.kv.swap_space import SwapSpace


class Executor:
    def __init__(self, runner: ModelRunner, storage: KVStorage, swap_space: SwapSpace) -> None:
        self.runner = runner
        self.storage = storage
        self.swap_space = swap_space

    def apply_block_ops(self, ops: list[BlockOp]) -> BlockOpsDone:
        """Apply every op in order. A swap-out whose write fails is reported (its request is
        recomputed instead), never raised: the other ops still apply."""
        done = BlockOpsDone()
        for op in ops:
            if isinstance(op, CopyBlock):
                self.storage.copy_block(op.src, op.dst)
            elif isinstance(op, InvalidateBlock):
                self.storage.invalidate(op.block_id)
            elif isinstance(op, SwapOut):
                if not self._swap_out(op):
                    done.failed_swap_outs.add(op.seq_id)
            elif isinstance(op, SwapIn):
                done.restored[op.seq_id] = self._swap_in(op)
        return done

    def _swap_out(self, op: SwapOut) -> bool:
        try:
            self.swap_space.store(op.seq_id, self.storage.read_blocks(list(op.block_ids)))
        except SwapError:
            self.swap_space.cancel(op.seq_id)
            return False
        return True

    def _swap_in(self, op: SwapIn) -> float:
        start = time.perf_counter()
        self.storage.write_blocks(list(op.block_ids), self.swap_space.take(op.seq_id))
        return time.perf_counter() - start

    def build(self, plan: StepPlan) -> StepBatch:
        return self.runner.build(plan.scheduled)

    def run(self, batch: StepBatch) -> StepLogits:
        """The sampling rows' logits (len(sample_rows), V) in float32, and the prompt rows'."""
        return self.runner.run(batch)

    def release(self, batch: StepBatch) -> None:
        self.runner.release(batch)

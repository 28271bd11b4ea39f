"""Tensor-parallel failure paths: a worker that dies or hangs fails every in-flight
request with an error within 30 s and leaves no process behind; a worker whose rank 0 dies
exits by itself; rank 0 failing mid-step stops its workers at once; a model that cannot be
split is refused before anything starts."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
import types

import pytest

from kvpage import SamplingParams
from kvpage.config import EngineConfig
from kvpage.engine.engine import LLMEngine
from kvpage.errors import TensorParallelError, WorkerFailure
from kvpage.kv.storage import KVShard
from kvpage.parallel.executor import shared_workers

from .conftest import children_alive, engine_for

LONG = SamplingParams(max_tokens=400, ignore_eos=True)


def _fail_midway(engine: LLMEngine, sig: int) -> tuple[dict, float]:
    """Start 4 requests, let them run, send `sig` to the worker, step until all have ended."""
    for i in range(4):
        engine.add_request(str(i), f"request {i} " * 3, LONG)
    for _ in range(3):
        engine.step()
    os.kill(engine.tp.worker_pids[0], sig)
    start, outs = time.monotonic(), {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
        assert time.monotonic() - start < 30, "the lost worker was not detected in 30 s"
    return outs, time.monotonic() - start


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_lost_worker_fails_requests_and_leaves_no_process(sig):
    config = EngineConfig(tensor_parallel_size=2, tensor_parallel_timeout_s=3.0)
    with engine_for(config) as engine:
        pids = engine.tp.worker_pids
        outs, _elapsed = _fail_midway(engine, sig)
        assert sorted(outs) == ["0", "1", "2", "3"]
        for out in outs.values():
            assert out.outputs[0].finish_reason == "error"
            assert "tensor-parallel" in out.error
            assert 0 < len(out.outputs[0].token_ids) < LONG.max_tokens
        with pytest.raises(WorkerFailure):
            engine.add_request("late", "too late", LONG)
        assert children_alive(pids) == []  # the group was shut down with the failure
    assert engine.cache.usage().free + engine.cache.usage().cached == engine.cache.usage().total


ORPHAN_SCRIPT = """
import os, sys
from kvpage.config import EngineConfig
from kvpage.engine.engine import LLMEngine
if __name__ == "__main__":
    engine = LLMEngine(EngineConfig(tensor_parallel_size=2))
    print(engine.tp.worker_pids[0], flush=True)
    os.kill(os.getpid(), 9)  # rank 0 dies without a word
"""


def test_worker_exits_when_rank0_dies(tmp_path):
    script = tmp_path / "rank0.py"
    script.write_text(ORPHAN_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=env
    )
    assert proc.returncode == -9, proc.stderr
    worker = int(proc.stdout.split()[0])
    deadline = time.monotonic() + 10
    while children_alive([worker]) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = children_alive([worker])
    if alive:
        os.kill(worker, signal.SIGKILL)
    assert alive == [], "the worker outlived its rank 0"


def test_heads_not_divisible_is_refused_before_any_process():
    before = set(multiprocessing.active_children())
    with pytest.raises(TensorParallelError, match="tensor_parallel_size=3 does not divide"):
        LLMEngine(EngineConfig(tensor_parallel_size=3))  # tiny-llama: 4 heads, 2 kv heads
    assert set(multiprocessing.active_children()) == before


def test_tp1_starts_no_process():
    before = set(multiprocessing.active_children())
    engine = LLMEngine(EngineConfig())
    assert engine.tp is None
    assert set(multiprocessing.active_children()) == before


def _rank0_write_raises(shard: KVShard) -> None:
    """Rank 0 fails inside a step, after the workers got it (module level: workers import it)."""
    if shard.rank == 0:

        def write(self, layer, slots, k, v):
            raise RuntimeError("rank 0 broke mid-step")

        shard.storage.write = types.MethodType(write, shard.storage)


def test_rank0_failing_mid_step_replaces_a_shared_group_at_once():
    """The workers are left inside the step's all-reduce that rank 0 never joins: the group is
    failed and its workers stopped at once, and the next engine gets a fresh group that works,
    instead of its first command waiting out the collective timeout (60 s here)."""
    config = EngineConfig(tensor_parallel_size=2, tensor_parallel_timeout_s=60.0)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    with shared_workers():
        with engine_for(config) as engine:
            pids = engine.tp.worker_pids
            engine.patch_kv_shards(_rank0_write_raises)
            engine.add_request("r", "a prompt", params)
            with pytest.raises(RuntimeError, match="rank 0 broke mid-step"):
                engine.step()
            assert not engine.tp.workers.healthy
            assert children_alive(pids) == []
        start = time.monotonic()
        with engine_for(config) as engine:
            assert engine.tp.worker_pids != pids
            engine.add_request("r", "a prompt", params)
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - start < 30

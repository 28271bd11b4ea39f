"""bench/rss_soak.py's engine-only driver on a short run: every request aborted after its first
token leaves nothing behind, the steps' sizes vary (the point of the mode: batch shapes as under
concurrent streams), and the decode tape keeps a bounded number of shapes."""

from __future__ import annotations

import argparse

from bench import rss_soak
from kvpage import EngineConfig, LLMEngine
from kvpage.model.decode_tape import MAX_TAPES


def test_engine_only_driver_aborts_every_request_and_varies_the_step_sizes():
    engine = LLMEngine(EngineConfig(model="builtin:tiny-llama", num_blocks=512, max_num_seqs=16))
    rss_soak.SHAPES.clear()
    rss_soak._count_shapes(engine)
    args = argparse.Namespace(clients=6, n=3, max_tokens=32, prompt_tokens="4-40", linger=8, seed=0)
    drive = rss_soak._EngineDriver(engine, args)
    assert drive(range(40)) == 0
    stats = engine.stats()
    assert not (stats["running"] or stats["waiting"] or stats["swapped"])
    assert stats["private_blocks"] == 0 and not engine.has_unfinished_requests()
    assert not engine.seqs and not engine.samples
    assert len(rss_soak.SHAPES) >= 5  # prefills of varied lengths, decodes of varied batches
    # the decode tape keeps at most MAX_TAPES shapes, however many batch sizes the soak ran
    assert 1 <= rss_soak._plan_rows(engine) <= MAX_TAPES
    used, held = rss_soak.malloc_mib()
    assert used > 0 and held >= 0

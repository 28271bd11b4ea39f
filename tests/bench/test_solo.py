"""bench/solo.py's pure helpers (no engine runs): the solo-mode workloads, token agreement and the
min / median table of `throughput.py`."""

from __future__ import annotations

from bench import solo


def test_workloads_have_the_asked_shapes_and_are_seeded():
    wls = solo.make_workloads(list(solo.WORKLOADS), vocab=32000, seed=0, quick=False)
    by = {w.name: w for w in wls}
    assert [len(p) for p in by["batched"].prompts] == [128] * 32
    assert by["batched"].max_tokens == [64] * 32
    assert [len(p) for p in by["single"].prompts] == [128] and by["single"].max_tokens == [128]
    prefix = by["prefix"]
    assert all(len(p) == 544 and p[:512] == prefix.prompts[0][:512] for p in prefix.prompts)
    assert len({tuple(p[512:]) for p in prefix.prompts}) == 32 and prefix.max_tokens == [32] * 32
    varied = by["varied"]
    assert len(varied.prompts) == 64 and varied.llama_cpp is None
    assert all(16 <= len(p) <= 256 for p in varied.prompts)
    assert all(16 <= m <= 256 for m in varied.max_tokens) and len(set(varied.max_tokens)) > 1
    assert all(3 <= t < 32000 for w in wls for p in w.prompts for t in p)
    # seeded per workload: the same tokens whichever others are picked, others with another seed
    alone = solo.make_workloads(["varied"], vocab=32000, seed=0, quick=False)[0]
    assert alone.prompts == varied.prompts and alone.max_tokens == varied.max_tokens
    other = solo.make_workloads(["varied"], vocab=32000, seed=1, quick=False)[0]
    assert other.prompts != varied.prompts
    assert prefix.llama_cpp == solo.BatchedBench(
        512, 32, 32, shared=True, note=prefix.llama_cpp.note
    )


def test_agreement_names_the_first_differing_position():
    ref = [[5, 6, 7], [1, 2, 3], [9, 9]]
    assert str(solo.agreement(ref, ref)) == "3/3"
    got = solo.agreement([[5, 6, 7], [1, 4, 3], [9]], ref)
    assert (got.same, got.total, got.first_diff) == (1, 3, (1, 1))
    assert solo.agreement([[9]], [[9, 9]]).first_diff == (0, 1)  # shorter: at its length


def test_table_rates_are_best_and_median_and_ratios_match():
    wl = solo.make_workloads(["single", "varied"], vocab=100, seed=0, quick=True)
    out = wl[0].output_tokens  # 32
    cells = {
        ("single", "float32", "kvpage"): solo.Cell([1.0, 2.0, 4.0], [[1, 2]]),
        ("single", "float32", "vllm"): solo.Cell([2.0, 4.0, 8.0], [[1, 3]]),
        ("varied", "float32", "kvpage"): solo.Cell([1.0], [[1]] * 8),
        ("varied", "float32", "vllm"): solo.Cell(error="boom"),
    }
    assert cells[("single", "float32", "kvpage")].rates(out) == (32.0, 16.0)
    lines = solo.table(wl, ["float32"], ["kvpage", "vllm"], cells)
    kv, vl = lines[2], lines[3]
    assert "32.0 (16.0)" in kv and "16.0 (8.0)" in vl
    assert "2.00x (2.00x)" in vl and "0/1, first diff: request 0 at output 1" in vl
    assert "FAILED" in lines[5]

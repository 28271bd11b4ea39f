from __future__ import annotations

import torch

from kvpage.reference.records import CacheView, make_record
from kvpage.verify.canary import find_foreign_canaries, make_canaries

VIEW = CacheView((), 0, "", 0, True)


def _records(tokens, topk_first=None):
    out = []
    for step, tok in enumerate(tokens):
        logits = -torch.arange(20, dtype=torch.float32)  # no ties: top-5 is ids 0..4
        logits[tok] = 5.0
        if topk_first is not None and step == topk_first[0]:
            logits[topk_first[1]] = 4.0
        out.append(make_record("r", step, [tok], [step], logits, tok, VIEW))
    return out


def test_canaries_are_distinct():
    c = make_canaries(["a", "b", "c"], list(range(3, 50)), seed=1)
    assert len({v[0] for v in c.values()}) == 3 and all(len(v) == 3 for v in c.values())


def test_foreign_canary_in_output_names_both_requests():
    canaries = {"a": (11, 12, 13), "b": (14, 15, 16)}
    cand = {"a": _records([1, 14, 15, 16, 2]), "b": _records([3, 4])}
    ref = {"a": _records([1, 2, 3, 4, 5]), "b": _records([3, 4])}
    leaks = find_foreign_canaries(canaries, cand, ref)
    assert [(x.victim, x.source, x.where) for x in leaks] == [
        ("a", "b", "output"),
        ("a", "b", "topk@1"),
    ]


def test_topk_leak_counts_only_when_the_reference_lacks_it():
    canaries = {"a": (11, 12, 13), "b": (14, 15, 16)}
    cand = {"a": _records([1, 2, 3], topk_first=(1, 14))}
    assert [x.where for x in find_foreign_canaries(canaries, cand, {"a": _records([1, 2, 3])})] == [
        "topk@1"
    ]
    same = {"a": _records([1, 2, 3], topk_first=(1, 14))}
    assert find_foreign_canaries(canaries, cand, same) == []

"""Shrinking a failing scenario to a small reproducer: greedy passes that drop events, drop
requests, and make requests shorter and plainer, keeping each change only while the scenario
still fails the same way (the same failure kind and attribution class — a smaller scenario that
fails for another reason is another bug, not a smaller copy of this one)."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator

from kvpage.verify.generated.scenario import Scenario

Fails = Callable[[Scenario], bool]


def shrink(scenario: Scenario, fails: Fails, budget_s: float = 60.0, max_tries: int = 200):
    """The smallest scenario the passes reach within `budget_s` / `max_tries` runs."""
    deadline = time.monotonic() + budget_s
    best, tries = scenario, 0
    improved = True
    while improved and tries < max_tries and time.monotonic() < deadline:
        improved = False
        for candidate in _candidates(best):
            if tries >= max_tries or time.monotonic() >= deadline:
                break
            if candidate.size >= best.size:
                continue
            tries += 1
            if fails(candidate):
                best, improved = candidate, True
                break  # restart the passes from the smaller scenario
    return best, tries


def _candidates(s: Scenario) -> Iterator[Scenario]:
    for i in range(len(s.events)):
        yield _edit(s, lambda c, i=i: c.events.pop(i))
    for i in range(len(s.requests)):
        yield _without_request(s, i)
    for i in range(len(s.requests)):
        yield from _plainer_request(s, i)
    yield from _plainer_engine(s)


def _edit(s: Scenario, change) -> Scenario:
    c = copy.deepcopy(s)
    change(c)
    c.name = f"{s.name}~"
    return c


def _without_request(s: Scenario, i: int) -> Scenario:
    rid = s.requests[i].request_id

    def drop(c: Scenario) -> None:
        c.requests.pop(i)
        c.events = [e for e in c.events if e.request_id != rid]

    return _edit(s, drop)


def _plainer_request(s: Scenario, i: int) -> Iterator[Scenario]:
    r = s.requests[i]
    if r.n > 1:
        yield _edit(s, lambda c: setattr(c.requests[i], "n", 1))
    if r.max_tokens > 1:
        yield _edit(s, lambda c: setattr(c.requests[i], "max_tokens", r.max_tokens // 2))
        yield _edit(s, lambda c: setattr(c.requests[i], "max_tokens", r.max_tokens - 1))
    if len(r.prompt) > 1:
        yield _edit(s, lambda c: setattr(c.requests[i], "prompt", r.prompt[: len(r.prompt) // 2]))
        yield _edit(s, lambda c: setattr(c.requests[i], "prompt", r.prompt[:-1]))
    if r.arrive_step:
        yield _edit(s, lambda c: setattr(c.requests[i], "arrive_step", 0))
    if r.logprobs is not None:
        yield _edit(s, lambda c: setattr(c.requests[i], "logprobs", None))


def _plainer_engine(s: Scenario) -> Iterator[Scenario]:
    if s.engine.get("kv_cache_dtype", "auto") != "auto":
        yield _edit(s, lambda c: c.engine.update(kv_cache_dtype="auto"))
    if s.engine.get("max_num_batched_tokens", 2048) != 2048:
        yield _edit(s, lambda c: c.engine.update(max_num_batched_tokens=2048))

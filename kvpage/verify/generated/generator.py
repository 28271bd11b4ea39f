"""A seeded generator of whole scenarios: an engine configuration × requests × events, drawn
so that the places bugs live are hit often — shared prefixes ending on a block boundary or one
token either side, `max_tokens` that end a block, a pool from just-enough to ample, a token
budget that chunks prefill, preemption by recompute, by swap or switched off, kill switches
flipped mid-run, aborts in every request state. Each dimension's value is recorded (`covers`),
so a run can say what it covered. The same (seed, index) always gives the same scenario."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from kvpage.config import KV_CACHE_DTYPES
from kvpage.verify.generated.constraints import draw_constraints
from kvpage.verify.generated.scenario import (
    ABORT_STATES,
    EventScenario,
    RequestScenario,
    Scenario,
)
from kvpage.verify.generated.served import (
    P_EVICTION,
    add_cover,
    draw_lora,
    draw_rows,
    draw_seeded_recompute,
    eviction_requests,
    holds_within_slots,
    stream,
    taker,
    window_cut,
    window_root_blocks,
)

BLOCK_SIZES = (4, 8, 16, 32)
POOLS = ("tiny", "small", "ample")
BUDGETS = ("tight", "medium", "large")
PREEMPTION = ("recompute", "swap", "off")
SAMPLING = ("greedy", "seeded", "unseeded")
STOPS = ("none", "reference_token", "eos")  # and "timeout", drawn apart
SAMPLING_SETTINGS = (  # temperature, top_k, top_p
    (0.7, -1, 1.0),
    (1.0, 20, 1.0),
    (1.0, -1, 0.9),
    (1.3, 5, 0.95),
    (0.5, 1, 1.0),
    (2.0, 50, 0.5),
)
EVENTS = (
    "abort",
    "preempt",
    "switch",
    "swap_fail",
    "swap_then_abort",
    "swap_mid_prefill",
    "park_first",
)
SALTS = (None, None, "tenant-a", "tenant-b", "")  # "" is a namespace of its own, not None's
TENANTS = (None, "", "tenant-a", "tenant-b")  # the distinct namespaces among them
TIMEOUT_MAX_TOKENS = 600  # a timed-out request must not be able to finish first, even unloaded
TIMEOUT_S = 0.05


@dataclass(frozen=True, slots=True)
class Limits:
    """How big a scenario may get: the generated stage runs many, so each stays small."""

    max_requests: int = 7
    max_prefix_blocks: int = 3
    max_tail: int = 9
    max_events: int = 5
    max_n: int = 4
    vocab_low: int = 3  # below: special ids (BOS/EOS of the byte tokenizer sit above 255)
    vocab_high: int = 256


# Engine fields a user may fix (`kvpage verify --block-size 16 ...`): a scenario then draws
# everything else around them. The pool stays the scenario's: its size is what makes a scenario
# tight or ample for its own requests.
FIXABLE = (
    "block_size",
    "kv_cache_dtype",
    "preemption_mode",
    "enable_prefix_caching",
    "max_num_seqs",
    "max_num_batched_tokens",
)


def generate(
    seed: int,
    index: int,
    limits: Limits = Limits(),
    fixed: dict | None = None,
    windows: tuple[int, ...] = (),
    adapters: bool = True,
    constraints: bool = True,
):
    """Scenario `index` of the stream `seed`; `fixed`: engine fields (FIXABLE) it must keep;
    `adapters`: whether the engine serves LoRA adapters on the model (Llama-shaped ones);
    `windows`: the model's sliding windows, around which prefixes are cut (kvpage.verify
    .generated.served: the same (seed, index) on a model without windows draws none);
    `constraints`: whether requests may be constrained (structured outputs need the model's
    tokenizer)."""
    lora_ok = adapters
    fixed = {k: v for k, v in (fixed or {}).items() if k in FIXABLE and v is not None}
    rng = random.Random(f"kvpage-scenario:{seed}:{index}")
    gen = _Draw(rng, limits, random.Random(f"kvpage-scenario:{seed}:{index}:side"))
    gen.windows, gen.wrng = tuple(windows), stream(seed, index, "window")
    gen.off_rng = stream(seed, index, "off_window")
    block = fixed.get("block_size", rng.choice(BLOCK_SIZES))
    shape = stream(seed, index, "eviction")
    if shape.random() < P_EVICTION and fixed.get("enable_prefix_caching", True):
        return _eviction_scenario(seed, index, gen, shape, block, fixed)
    requests = gen.requests(block)
    max_loras = None
    if lora_ok:
        added, max_loras = draw_lora(stream(seed, index, "lora"), requests, gen.covers)
        requests += added
    for r in requests:  # a request of more samples than the fixed cap would be refused
        r.n = min(r.n, fixed.get("max_num_seqs", r.n))
    if constraints:
        draw_constraints(stream(seed, index, "structured"), requests, gen.covers)
    engine, covers = gen.engine(block, requests)
    engine.update(fixed)
    if max_loras is not None:
        engine["max_loras"] = max_loras
    covers.update({k: v for k, v in fixed.items() if k in covers})
    if "enable_prefix_caching" in fixed:
        covers["prefix_caching"] = fixed["enable_prefix_caching"]
    if "preemption_mode" in fixed and covers["preemption"] != "off":
        covers["preemption"] = fixed["preemption_mode"]
    if engine["kv_cache_dtype"] == "auto":  # the row check's reference has no KV round trip
        rows = stream(seed, index, "rows")
        take = taker(rows, gen.tokens)
        requests += draw_rows(rows, take, requests, engine, limits, TENANTS, covers)
    events = gen.events(requests, covers, engine)
    events += draw_seeded_recompute(stream(seed, index, "recompute"), requests, covers)
    events = holds_within_slots(events, requests, max_loras)
    covers.update(gen.covers)
    return Scenario(f"s{seed}-{index}", engine, requests, events, seed, index, covers)


def _eviction_scenario(seed: int, index: int, gen, shape: random.Random, block: int, fixed):
    """A scenario of its own (eviction_requests): the eviction order decides a hit, so
    the requests run one after the other in a pool they fill exactly, with no event."""
    rng = gen.rng
    budget = rng.choice(BUDGETS)
    tokens = {"tight": max(block // 2, 3), "medium": 2 * block + 3, "large": 2048}[budget]
    tokens = fixed.get("max_num_batched_tokens", tokens)
    covers: dict = {}
    take = taker(shape, gen.tokens)
    requests, pool, hits = eviction_requests(shape, take, block, tokens, covers)
    engine = dict(
        block_size=block,
        num_blocks=pool,
        max_num_batched_tokens=tokens,
        max_num_seqs=rng.choice((1, 2, 4, 64)),
        preemption_mode=rng.choice(("recompute", "swap")),
        swap_space_blocks=64,
        enable_prefix_caching=True,
        kv_cache_dtype=rng.choice(KV_CACHE_DTYPES),
    )
    engine.update(fixed)
    covers.update(
        block_size=block,
        pool="exact",
        budget=budget,
        max_num_seqs=engine["max_num_seqs"],
        preemption=engine["preemption_mode"],
        prefix_caching=True,
        kv_cache_dtype=engine["kv_cache_dtype"],
        sampling=sorted({"greedy" if r.seed is None else "seeded" for r in requests}),
    )
    name = f"s{seed}-{index}"
    return Scenario(name, engine, requests, [], seed, index, covers, expect_hit_tokens=hits)


class _Draw:
    def __init__(self, rng: random.Random, limits: Limits, side: random.Random) -> None:
        self.rng, self.limits, self.side = rng, limits, side
        self.covers: dict[str, object] = {}
        self.window: tuple[int, int, str | None] | None = None  # caching off from, on at, salt
        self.tokens = list(range(limits.vocab_low, limits.vocab_high))
        self.windows: tuple[int, ...] = ()  # the model's sliding windows (window_cut)
        self.wrng = random.Random(0)
        self.off_rng = random.Random(0)  # the off window's writer and reader (generate sets it)
        self.window_pair: tuple[str, str] | None = None  # writer, reader of the off window

    def take(self, n: int) -> list[int]:
        return [self.rng.choice(self.tokens) for _ in range(n)]

    # --- requests ------------------------------------------------------------------------------
    def requests(self, block: int) -> list[RequestScenario]:
        """A prefix tree: each request extends a root, or an earlier request's prompt, to a
        shared length on a block boundary or one token either side of it."""
        rng = self.rng
        count = rng.randint(1, self.limits.max_requests)
        roots = [
            self.take(block * rng.randint(1, self.limits.max_prefix_blocks) + 1)
            for _ in range(rng.randint(1, 2))
        ]
        longer = window_root_blocks(self.wrng, self.windows, block)
        if longer is not None and len(roots[0]) < block * longer:  # a root to cut past a window
            roots[0] = roots[0] + self.take(block * longer + 1 - len(roots[0]))
        # a prompt's namespace: most often its source's (sharing needs one), else any
        sources = [(root, rng.choice(SALTS)) for root in roots]
        prompts, salts, late, offsets = [], [], [], []
        for i in range(count):
            source, salt = rng.choice(sources)
            salt = salt if rng.random() < 0.7 else rng.choice(SALTS)
            if rng.random() < 0.2 and len(source) >= 2 * block:
                source = self._transplant(source, [p for p, _ in sources], block)
                late.append(i)  # after both of its parents are cached
            prompt, offset = self._extend(source, block)
            offsets.append(offset)
            prompts.append(prompt)
            salts.append(salt)
            sources.append((prompt, salt))
        self.covers["shared_offset"] = sorted(set(offsets))
        arrivals = self._arrivals(count)
        for i in late:
            arrivals[i] = max(arrivals) + rng.randint(3, 10)
        requests = [
            self._request(f"r{i}", p, a, s, block)
            for i, (p, a, s) in enumerate(zip(prompts, arrivals, salts, strict=True))
        ]
        if rng.random() < 0.2:
            requests += self._aligned_again(requests, block)
        if rng.random() < 0.1:
            requests += self._siblings(block, len(requests))
        if rng.random() < 0.4:
            requests += self._after_an_off_window(requests, block)
        return requests

    def _after_an_off_window(self, requests, block: int) -> list[RequestScenario]:
        """A writer of a prompt of its own runs while caching is off (globally or for its
        namespace: a tenant's kill switch) and a reader of its prefix in its namespace comes
        after caching is back on: what was computed while off must not be served. The prompt
        is no other request's, so nothing published while on can serve the reader. Drawn on
        a stream of its own; the switch events follow from `self.window`."""
        side = self.off_rng
        take = taker(side, self.tokens)
        prompt = take(block * side.randint(1, self.limits.max_prefix_blocks) + side.randint(1, 4))
        salt, at = side.choice(TENANTS), side.randint(0, 8)
        writer = RequestScenario(f"r{len(requests)}", prompt, at, side.randint(1, 4))
        shared = block * side.randint(1, len(prompt) // block)
        arrive = at + side.randint(4, 14)
        reader_prompt = prompt[:shared] + take(side.randint(1, 5))
        reader = RequestScenario(f"r{len(requests) + 1}", reader_prompt, arrive, side.randint(1, 6))
        writer.cache_salt = reader.cache_salt = salt
        self.window = (at, arrive - 1, salt)
        self.window_pair = (writer.request_id, reader.request_id)
        self.covers["off_window"] = True
        return [writer, reader]

    def _extend(self, source: list[int], block: int) -> tuple[list[int], int]:
        """`source` cut on a block boundary or one token either side, then a private tail."""
        rng = self.rng
        whole = len(source) // block
        offset = rng.choice((-1, 0, 1))
        shared = max(0, min(len(source), block * rng.randint(0, max(whole, 1)) + offset))
        if rng.random() < 0.15:
            shared = len(source)  # the whole prompt again: the cap leaves one token
        cut, side = window_cut(self.wrng, self.windows, block, len(source), offset)
        if cut is not None:
            shared = cut
            add_cover(self.covers, "window_hit", side)
        tail = self.take(rng.randint(0 if shared else 1, self.limits.max_tail))
        return source[:shared] + tail, offset

    def _siblings(self, block: int, first: int) -> list[RequestScenario]:
        """One shared first block under many distinct second blocks, in two waves: with narrow
        fast keys, siblings collide, and only a digest confirmed at every depth tells them
        apart."""
        rng = self.rng
        head, salt = self.take(block), rng.choice(SALTS)
        out = []
        for i in range(rng.randint(16, 24)):
            prompt = head + self.take(block) + self.take(rng.randint(1, 3))
            r = RequestScenario(f"r{first + i}", prompt, 0 if i < 10 else 6, rng.randint(1, 2))
            r.cache_salt = salt
            out.append(r)
        self.covers["siblings"] = True
        return out

    def _aligned_again(self, requests, block: int) -> list[RequestScenario]:
        """A prompt of whole blocks, and later the very same prompt: every block is a hit, yet
        one token must still be computed for the logits."""
        r = self.rng.choice(requests)
        if len(r.prompt) < block:
            return []
        prompt = r.prompt[: block * (len(r.prompt) // block)]
        first = RequestScenario(f"r{len(requests)}", prompt, r.arrive_step, self.rng.randint(1, 6))
        again = RequestScenario(f"r{len(requests) + 1}", list(prompt), r.arrive_step + 3, 3)
        first.cache_salt = again.cache_salt = r.cache_salt
        self.covers["aligned_again"] = True
        return [first, again]

    def _transplant(self, source: list[int], pool: list[list[int]], block: int) -> list[int]:
        """Another prompt's first block before `source`'s later blocks: the same block after a
        different parent, which only a key that chains its parent tells apart."""
        heads = [p[:block] for p in pool if len(p) >= block and p[:block] != source[:block]]
        head = self.rng.choice(heads) if heads else self.take(block)
        self.covers["transplanted"] = True
        return head + source[block:]

    def _arrivals(self, count: int) -> list[int]:
        spread = self.rng.choice(("together", "spread", "late"))
        self.covers["arrivals"] = spread
        if spread == "together":
            return [0] * count
        top = 6 if spread == "spread" else 30
        return sorted(self.rng.randint(0, top) for _ in range(count))

    def _request(self, rid: str, prompt, arrive: int, salt, block: int) -> RequestScenario:
        rng = self.rng
        # max_tokens ending a block, one either side, or anything small
        # (a second block boundary only for small blocks: long outputs are what a stage pays for)
        ends = block - (len(prompt) % block) + (block * rng.randint(0, 1) if block <= 8 else 0)
        max_tokens = max(1, rng.choice((ends - 1, ends, ends + 1, rng.randint(1, 12))))
        how = rng.choice(SAMPLING)
        request = RequestScenario(rid, prompt, arrive, max_tokens, cache_salt=salt)
        if how != "greedy":
            request.temperature, request.top_k, request.top_p = rng.choice(SAMPLING_SETTINGS)
            request.seed = rng.randint(0, 2**31) if how == "seeded" else None
        request.n = rng.choice((1, 1, 1, 2, 3, 4)) if how != "greedy" else 1
        stop = rng.choice(STOPS)
        if stop == "reference_token":
            request.stop_at_ref_step = rng.randint(0, max_tokens)
        elif stop == "eos":
            request.ignore_eos = False
        if rng.random() < 0.3:
            request.logprobs = rng.choice((0, 1, 5))
        if rng.random() < 0.06:
            # cannot finish before its deadline, even on an idle machine: only the clock stops it
            request.max_tokens, request.timeout_s, request.n = TIMEOUT_MAX_TOKENS, TIMEOUT_S, 1
            request.stop_at_ref_step, request.ignore_eos, stop = None, True, "timeout"
        self._cover(request, how, stop)
        return request

    def _cover(self, request: RequestScenario, how: str, stop: str) -> None:
        for key, value in (
            ("sampling", how),
            ("n", request.n),
            ("stop", stop),
            ("logprobs", request.logprobs is not None),
            ("cache_salt", repr(request.cache_salt)),
        ):
            seen = self.covers.setdefault(key, [])
            if value not in seen:
                seen.append(value)

    # --- the engine ------------------------------------------------------------------------------
    def engine(self, block: int, requests: list[RequestScenario]):
        rng = self.rng
        need = [r.n * math.ceil((len(r.prompt) + r.max_tokens) / block) for r in requests]
        pool = rng.choice(POOLS)
        # "tiny" fits the largest request alone (worst case, every sample's tail apart) plus one
        total = sum(need)
        blocks = {
            "tiny": max(need) + 1,
            "small": max(max(need) + 1, total // 2),
            "ample": total + 8,
        }[pool]
        budget = rng.choice(BUDGETS)
        tokens = {"tight": max(block // 2, 3), "medium": 2 * block + 3, "large": 2048}[budget]
        preemption = rng.choice(PREEMPTION)
        max_seqs = max(max(r.n for r in requests), rng.choice((1, 2, 3, 4, 8, 64)))
        engine = dict(
            block_size=block,
            num_blocks=blocks,
            max_num_batched_tokens=tokens,
            max_num_seqs=max_seqs,
            preemption_mode="recompute" if preemption == "off" else preemption,
            swap_space_blocks=rng.choice((0, total + 8)) if preemption == "swap" else 64,
            enable_prefix_caching=rng.random() < 0.8,
            kv_cache_dtype=rng.choice(KV_CACHE_DTYPES),
        )
        if engine["kv_cache_dtype"] == "auto":  # the row check's reference has no KV round trip
            for r in requests:  # a side stream: the scenarios drawn before it stay the same
                if r.timeout_s is None and self.side.random() < 0.25 and r.lora is None:
                    r.prompt_logprobs = self.side.choice((0, 1, 3))
                    self.covers["prompt_logprobs"] = True
        covers = dict(
            block_size=block,
            pool=pool,
            budget=budget,
            max_num_seqs=max_seqs,
            preemption=preemption,
            prefix_caching=engine["enable_prefix_caching"],
            kv_cache_dtype=engine["kv_cache_dtype"],
        )
        return engine, covers

    # --- events -----------------------------------------------------------------------------------
    def events(self, requests: list[RequestScenario], covers: dict, engine: dict):
        rng = self.rng
        events: list[EventScenario] = []
        if covers["preemption"] == "off":
            events.append(EventScenario("switch", 0, switch="preemption", enabled=False))
        if self.window is not None:
            off, on, salt = self.window
            on = self._fit_window(requests, off, on, engine)
            which = rng.choice(("prefix_caching", "namespace_caching"))
            salt = salt if which == "namespace_caching" else None
            events.append(EventScenario("switch", off, switch=which, cache_salt=salt))
            events.append(EventScenario("switch", on, switch=which, enabled=True, cache_salt=salt))
        kinds = []
        for _ in range(rng.randint(0, self.limits.max_events)):
            kind = rng.choice(EVENTS)
            if kind in ("swap_then_abort", "swap_mid_prefill", "park_first"):
                if covers["preemption"] != "off":
                    events += self._swap_pattern(kind, requests)
            else:
                events += self._event(kind, requests, covers)
            kinds.append(kind)
        covers["events"] = sorted(set(kinds))
        return events

    def _fit_window(self, requests, off: int, on: int, engine: dict) -> int:
        """The off window lasts until its writer could have finished inside it (its prefill
        chunks and every decode step, with a margin): what it computed while off is then what
        the reader, arriving after the window, must not be served."""
        by_id = {r.request_id: r for r in requests}
        writer, reader = (by_id[i] for i in self.window_pair)
        budget = engine["max_num_batched_tokens"]
        # twice its own steps: other requests share the steps, and a margin
        work = 2 * (math.ceil(len(writer.prompt) / budget) + writer.n * writer.max_tokens) + 4
        if on - off >= work:
            return on
        reader.arrive_step = off + work + 1
        self.covers["off_window_fitted"] = True
        return off + work

    def _event(self, kind: str, requests, covers) -> list[EventScenario]:
        rng = self.rng
        target = rng.choice(requests)
        step = rng.randint(0, 8)
        if kind == "abort":
            state = rng.choice(ABORT_STATES)
            if state == "prefill":  # the longest prompt is the one most likely to be chunked
                target = max(requests, key=lambda r: len(r.prompt))
            covers.setdefault("abort_state", []).append(state)
            return [EventScenario("abort", step, target.request_id, state=state)]
        if kind == "preempt" and covers["preemption"] != "off":
            mode = rng.choice(("recompute", "swap", None))
            after = rng.randint(0, max(target.max_tokens - 1, 0))
            hold = rng.choice((1, 2, 3, 4, 8, 12))
            event = EventScenario("preempt", step, target.request_id, after_tokens=after)
            event.resume_after_steps, event.mode = hold, mode
            return [event]
        if kind == "switch":
            return self._switch(step, requests)
        if kind == "swap_fail":
            return [EventScenario("swap_fail", step, count=rng.randint(1, 2))]
        return []

    def _swap_pattern(self, kind: str, requests) -> list[EventScenario]:
        """swap_then_abort: park a request in swap and most often abort it there (or as soon
        as it is back). swap_mid_prefill: swap out the longest prompt in its first chunk (it
        must come back a chunk at a time, within the step's budget). park_first: park the
        first arrival for long, while the later ones must still be admitted."""
        rng = self.rng
        if kind == "swap_mid_prefill":
            target = max(requests, key=lambda r: len(r.prompt))
            event = EventScenario("preempt", 0, target.request_id, mode="swap")
            event.resume_after_steps = rng.randint(1, 3)
            return [event]
        if kind == "park_first":
            target = min(requests, key=lambda r: r.arrive_step)
            event = EventScenario("preempt", 0, target.request_id, after_tokens=1, mode="swap")
            event.resume_after_steps = rng.randint(8, 16)
            return [event]
        return self._swap_then_abort(rng.choice(requests))

    def _swap_then_abort(self, target: RequestScenario) -> list[EventScenario]:
        rng = self.rng
        after = rng.randint(0, max(target.max_tokens - 1, 0))
        hold = rng.randint(4, 12)
        park = EventScenario(
            "preempt",
            0,
            target.request_id,
            after_tokens=after,
            resume_after_steps=hold,
            mode="swap",
        )
        state = rng.choice(("swapped", "swapped", "running", None))
        if state is None:
            return [park]
        return [park, EventScenario("abort", 0, target.request_id, state=state)]

    def _switch(self, step: int, requests) -> list[EventScenario]:
        """A kill switch flipped, and most often flipped back a few steps later: what was
        computed while it was off must never be served once it is on again."""
        rng = self.rng
        which = rng.choice(("prefix_caching", "namespace_caching", "preemption"))
        salt = (
            rng.choice([r.cache_salt for r in requests]) if which == "namespace_caching" else None
        )
        off = EventScenario("switch", step, switch=which, enabled=False, cache_salt=salt)
        if rng.random() < 0.25:
            return [off]
        back = step + rng.randint(1, 10)
        return [off, EventScenario("switch", back, switch=which, enabled=True, cache_salt=salt)]

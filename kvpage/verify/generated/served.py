"""Draws from the served configuration, each on a random stream of its own (so adding one leaves
the rest of a scenario as it was drawn): LoRA adapters (several, with different target sets and
ranks, rsLoRA or not, alpha != rank, `max_loras` 1..3 so slots are evicted and reused, base and
adapters on one prompt in one step, an adapter named like a tenant's salt, a reload under the same
name with other weights), prompt-logprob rows served across tenants and after the block they were
kept for was reused, a recompute preemption of a seeded sampled request, prefix cuts either side
of a model's sliding window, and a scenario of its own where the eviction order decides a hit
(a pool exactly full, one request after the other, exact cached tokens stated).

Each draw records what it drew in the scenario's `covers`, like the generator's own."""

from __future__ import annotations

import math
import random
from dataclasses import replace

from kvpage.lora.adapter import TARGETS
from kvpage.verify.generated.scenario import EventScenario, RequestScenario

LORA_NAMES = ("a", "b", "c", "tenant-a")  # "tenant-a": an adapter named like a tenant's salt
LORA_TARGETS = {  # label -> target modules (PEFT's target_modules)
    "all": TARGETS,
    "attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "qv": ("q_proj", "v_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
    "qv_down": ("q_proj", "v_proj", "down_proj"),
}
LORA_RANKS = (2, 4, 8)
MAX_LORAS = (1, 2, 3)
MAX_LORA_REQUESTS = 12  # adapters over a larger scenario (siblings) cost more than they add
ROWS_PATTERNS = ("tenants", "reused")
P_LORA = 0.3
P_ROWS = 0.7
P_SEEDED_RECOMPUTE = 0.4
P_EVICTION = 0.1
P_WINDOW_CUT = 0.5


def stream(seed: int, index: int, name: str) -> random.Random:
    return random.Random(f"kvpage-scenario:{seed}:{index}:{name}")


def taker(rng: random.Random, tokens: list[int]):
    """Token material from `rng`'s own stream."""
    return lambda n: [rng.choice(tokens) for _ in range(n)]


def add_cover(covers: dict, key: str, value) -> None:
    seen = covers.setdefault(key, [])
    if value not in seen:
        seen.append(value)


# --- LoRA ------------------------------------------------------------------------------------
def draw_adapters(rng: random.Random) -> list[dict]:
    """Two or three adapters: the first targets every projection (PEFT's all-linear), the
    others fewer, so a slot taken over by one of them has projections it must clear."""
    adapters = []
    for i, name in enumerate(rng.sample(LORA_NAMES, rng.randint(2, 3))):
        label = "all" if i == 0 else rng.choice(list(LORA_TARGETS)[1:])
        rank = rng.choice(LORA_RANKS)
        alpha = rng.choice((2.0 * rank, 6.0, 16.0, 3.0))  # never == rank (ranks are 2, 4, 8)
        adapters.append(
            dict(
                name=name,
                seed=rng.randint(1, 2**31),
                targets=list(LORA_TARGETS[label]),
                rank=rank,
                alpha=alpha,
                rslora=rng.random() < 0.35,
            )
        )
    return adapters


def _short(source: RequestScenario, rid: str, at: int, rng: random.Random) -> RequestScenario:
    """A short greedy request on `source`'s prompt, in its namespace (a twin or a reload)."""
    r = RequestScenario(rid, list(source.prompt), at, rng.randint(2, 5))
    r.cache_salt = source.cache_salt
    return r


def holds_within_slots(events, requests, max_loras: int | None) -> list[EventScenario]:
    """The forced preemptions (holds) of adapter requests are kept only where every adapter the
    scenario loads has a slot: a request held by the test driver keeps its adapter's slot, and
    one waiting for that slot would wait out the hold in steps that schedule nothing, which the
    liveness check rightly reads as a stall (no engine runs a hold)."""
    identities = {(r.lora["name"], r.lora["seed"]) for r in requests if r.lora is not None}
    if max_loras is None or len(identities) <= max_loras:
        return events
    adapters = {r.request_id for r in requests if r.lora is not None}
    return [e for e in events if not (e.kind == "preempt" and e.request_id in adapters)]


def _label(targets: list[str]) -> str:
    return next(k for k, v in LORA_TARGETS.items() if tuple(targets) == v)


def draw_lora(rng: random.Random, requests: list[RequestScenario], covers: dict):
    """Adapters over a scenario's requests (base requests stay among them), twins of one
    request under every adapter and the base model in the same step (the base twin under a
    salt spelled like an adapter's name where one is), and a reload: the same name and config
    with other tensor bytes, on a prompt the old weights cached. Returns the added requests and
    `max_loras`, or ([], None) when the scenario draws no adapters."""
    if rng.random() >= P_LORA or len(requests) > MAX_LORA_REQUESTS:
        return [], None
    adapters = draw_adapters(rng)
    for r in requests:
        if r.timeout_s is None and rng.random() < 0.6:
            r.lora = dict(rng.choice(adapters))
    added: list[RequestScenario] = []

    def new_id() -> str:
        return f"r{len(requests) + len(added)}"

    plain = [r for r in requests if r.timeout_s is None]
    if plain:  # base and every adapter on one prompt, in one step
        source = rng.choice(plain)
        for adapter in [None, *adapters]:
            if adapter is not None and source.lora == adapter:
                continue
            twin = _short(source, new_id(), source.arrive_step, rng)
            twin.lora = None if adapter is None else dict(adapter)
            if adapter is None and any(a["name"] == "tenant-a" for a in adapters):
                twin.cache_salt = "tenant-a"
                covers["lora_named_like_salt"] = True
            added.append(twin)
    users = [r for r in requests + added if r.lora is not None and r.timeout_s is None]
    if users and rng.random() < 0.7:  # the same name, other weights, after the old ones ran
        old = rng.choice(users)
        later = old.arrive_step + rng.randint(4, 12)
        again = _short(old, new_id(), later, rng)
        again.lora = {**old.lora, "seed": old.lora["seed"] + 1}
        added.append(again)
        if rng.random() < 0.5:  # and again, from the reloaded weights' own blocks
            added.append(replace(again, request_id=new_id(), arrive_step=later + 6))
        covers["lora_reload"] = True
    max_loras = rng.choice(MAX_LORAS)
    covers["lora_adapters"] = len(adapters)
    covers["max_loras"] = max_loras
    for a in adapters:
        add_cover(covers, "lora_targets", _label(a["targets"]))
        add_cover(covers, "lora_rank", a["rank"])
        add_cover(covers, "lora_rslora", a["rslora"])
    covers["lora_mixed"] = bool(plain)
    return added, max_loras


# --- prompt-logprob rows ----------------------------------------------------------------------
def draw_rows(
    rng: random.Random,
    take,
    requests: list[RequestScenario],
    engine: dict,
    limits,
    salts: tuple,
    covers: dict,
) -> list[RequestScenario]:
    """Prompt-logprob requests whose prefix hits are served kept rows: `tenants` (a writer
    scores a prompt in one namespace, a plain request caches it in another, where a scored one
    follows: no rows of the writer's may serve it; then a reader in the writer's namespace
    whose next token after a block is among the writer's kept top k), `reused` (the writer's
    blocks evicted by a filler that needs all but one block of the pool, the prompt cached again
    by a plain request, then scored: the old rows must not be served)."""
    if rng.random() >= P_ROWS:
        return []
    block = engine["block_size"]
    budget = engine["max_num_batched_tokens"]
    start = max([r.arrive_step for r in requests], default=0) + rng.randint(0, 4)
    gap = rng.randint(3, 8)
    blocks = rng.randint(1, limits.max_prefix_blocks)
    prompt = take(block * blocks + rng.randint(1, 4))
    kx = rng.choice((2, 3, 5))
    first = len(requests)
    ids = (f"r{first + i}" for i in range(8))

    def scored(p, at, salt, k, tokens=2):
        return RequestScenario(next(ids), list(p), at, tokens, cache_salt=salt, prompt_logprobs=k)

    def plain(p, at, salt, tokens=2):
        return RequestScenario(next(ids), list(p), at, tokens, cache_salt=salt)

    pattern = rng.choice(ROWS_PATTERNS)
    add_cover(covers, "prompt_rows", pattern)
    covers["prompt_logprobs"] = True
    if pattern == "tenants":
        s1, s2 = rng.sample(salts, 2)
        cut = block * rng.randint(1, blocks)
        reader = prompt[:cut] + [prompt[cut]] + take(rng.randint(0, 3))
        z = scored(reader, start + 3 * gap, s1, rng.randint(1, kx))
        z.top_next = [cut, rng.randint(0, kx - 2)]
        return [
            scored(prompt, start, s1, kx),
            plain(prompt, start + gap, s2),
            scored(prompt, start + 2 * gap, s2, rng.randint(0, kx)),
            z,
        ]
    need = [r.n * math.ceil((len(r.prompt) + r.max_tokens) / block) for r in requests]
    filler_blocks = max([*need, blocks + 2]) + 1
    filler_tokens = filler_blocks * block - 2
    engine["num_blocks"] = filler_blocks + 1  # the filler needs all but one
    covers["pool"] = "tiny"
    at_filler = start + gap
    done = at_filler + math.ceil(filler_tokens / budget) + 4
    return [
        scored(prompt, start, None, kx),
        plain(take(filler_tokens), at_filler, None, 1),
        plain(prompt, done, None),
        scored(prompt, done + gap, None, rng.randint(0, kx)),
    ]


# --- events ------------------------------------------------------------------------------------
def draw_seeded_recompute(rng: random.Random, requests, covers: dict) -> list[EventScenario]:
    """A seeded sampled request preempted by recompute after it drew tokens: its generator must
    go on from where it was, never start again from the seed."""
    if covers.get("preemption") == "off" or rng.random() >= P_SEEDED_RECOMPUTE:
        return []
    seeded = [
        r for r in requests if r.seed is not None and r.max_tokens >= 3 and r.timeout_s is None
    ]
    if not seeded:
        return []
    target = rng.choice(seeded)
    after = rng.randint(1, target.max_tokens - 2)
    event = EventScenario("preempt", 0, target.request_id, after_tokens=after, mode="recompute")
    event.resume_after_steps = rng.randint(1, 4)
    covers["seeded_recompute"] = True
    return [event]


# --- sliding windows ---------------------------------------------------------------------------
def window_cut(rng: random.Random, windows: tuple[int, ...], block: int, source_len: int, offset):
    """A shared length either side of one of the model's windows (a block boundary +-1), or None
    (no window, or not drawn)."""
    if not windows or rng.random() >= P_WINDOW_CUT:
        return None, None
    window = rng.choice(windows)
    side = rng.choice(("shorter", "longer"))
    whole = window // block if side == "shorter" else window // block + 1
    shared = max(0, min(source_len, block * whole + offset))
    return shared, "shorter" if shared < window else "longer"


def window_root_blocks(rng: random.Random, windows: tuple[int, ...], block: int) -> int | None:
    """Blocks of a root prompt long enough to be cut past a window (None: no window)."""
    if not windows:
        return None
    return max(windows) // block + rng.randint(1, 2)


# --- the eviction order -----------------------------------------------------------------------
def eviction_requests(rng: random.Random, take, block: int, budget: int, covers: dict):
    """R and U each leave k cached blocks; R is hit again after U was cached; a filler then
    needs every free block and k more, so exactly k cached blocks are evicted: U's, the least
    recently used, never R's; R's prefix is then hit in full. Every tail stays below a block,
    so only the k prefix blocks of each are ever cached. Returns the requests, the pool and the
    exact cached tokens."""
    k = rng.randint(1, 3)
    extra = rng.randint(1, 3)  # free blocks beside the cached ones before the filler
    pool = 2 * k + extra
    reused, unused = take(k * block), take(k * block)

    def request(rid, prompt, at):
        tokens = rng.randint(1, max(1, block - 1 - (len(prompt) - k * block)))
        r = RequestScenario(rid, prompt, at, tokens)
        if rng.random() < 0.5:
            r.temperature, r.top_k, r.top_p = 1.0, 20, 1.0
            r.seed = rng.randint(0, 2**31)
        return r

    def tail():
        return take(rng.randint(1, max(1, min(2, block - 2))))

    def steps(r):
        return math.ceil(len(r.prompt) / budget) + r.max_tokens + 3

    out: list[RequestScenario] = []
    at = 0
    for rid, prefix in (("R", reused), ("U", unused), ("R.reuse", reused)):
        r = request(rid, prefix + tail(), at)
        out.append(r)
        at += steps(r)
    # the filler needs pool - k blocks whether or not its last token's slot is counted
    need = pool - k
    filler_tokens = rng.randint(1, 3)
    length = (need - 1) * block + rng.randint(1, max(1, block - 2)) + 1 - filler_tokens
    filler = RequestScenario("filler", take(max(1, length)), at, filler_tokens)
    out.append(filler)
    at += steps(filler)
    out.append(request("R.after", reused + tail(), at))
    covers["eviction_order"] = {1: "one_block", 2: "two_blocks", 3: "three_blocks"}[k]
    hits = {"R": 0, "U": 0, "R.reuse": k * block, "R.after": k * block}
    return out, pool, hits

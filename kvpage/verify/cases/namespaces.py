"""Namespaces and kill switches. The reference keys namespaces with the same code
as the engine, so token equality cannot see a namespace bug: every request here states exactly
how many cached tokens it must get.

- salts: None, "" and "x" are three namespaces; each hits only its own entries;
- per-namespace switch: while a tenant's caching is off it gets no hit and publishes nothing,
  other tenants are untouched, and after it is back on the tenant hits again;
- global switch: the same for every namespace at once."""

from __future__ import annotations

from collections.abc import Callable

from kvpage.verify.case import Action, Case, RequestSpec, Tokens, greedy

B = 8


def namespace_cases(vocab: int) -> list[Case]:
    t = Tokens(vocab, seed=505)
    return [_salts(t), _tenant_switch(t), _global_switch(t)]


def _at(step: int):
    return lambda e, s: s == step


def _salts(t: Tokens) -> Case:
    prompt = t.take(3 * B + 2)
    full = 3 * B
    order = [
        ("none.1", None, 0),
        ("empty.1", "", 0),  # "" is not None: no hit
        ("x.1", "x", 0),
        ("none.2", None, full),
        ("empty.2", "", full),
        ("x.2", "x", full),
    ]
    specs = [
        RequestSpec(rid, prompt, greedy(4), arrive_step=4 * i, cache_salt=salt)
        for i, (rid, salt, _) in enumerate(order)
    ]
    return Case(
        "namespaces",
        "salt_none_empty_x",
        specs,
        dict(block_size=B, num_blocks=64),
        expect_hit_tokens={rid: hits for rid, _, hits in order},
    )


def _tenant_switch(t: Tokens) -> Case:
    """Tenant a's caching goes off at step 6 and back on at step 18."""
    shared, fresh = t.take(2 * B + 1), t.take(2 * B + 1)
    full = 2 * B
    plan = [
        # (request, salt, prompt, arrive, cached tokens)
        ("a.seed", "a", shared, 0, 0),
        ("b.seed", "b", shared, 0, 0),
        ("a.off", "a", shared, 8, 0),  # off: no hit although a.seed published
        ("b.on", "b", shared, 8, full),  # other tenants untouched
        ("a.fresh-off", "a", fresh, 11, 0),  # off: must not publish
        ("a.fresh-on", "a", fresh, 20, 0),  # so nothing of `fresh` is there after on
        ("a.back", "a", shared, 20, full),  # entries from before stayed
        ("a.fresh-again", "a", fresh, 26, full),  # a.fresh-on published
    ]
    return _switched(
        "tenant_switch", plan, "tenant a", lambda e, on: e.set_namespace_caching("a", on)
    )


def _global_switch(t: Tokens) -> Case:
    shared, fresh = t.take(2 * B + 3), t.take(2 * B + 3)
    full = 2 * B
    plan = [
        ("seed", None, shared, 0, 0),
        ("off", None, shared, 8, 0),
        ("off-salted", "s", fresh, 8, 0),
        ("on", None, shared, 20, full),
        ("on-salted", "s", fresh, 20, 0),  # nothing was published while off
        ("again-salted", "s", fresh, 26, full),
    ]
    return _switched("global_switch", plan, "caching", lambda e, on: e.set_prefix_caching(on))


def _switched(name: str, plan: list[tuple], switch: str, turn: Callable) -> Case:
    """The requests of `plan`, rows of (request, salt, prompt, arrive, cached tokens), with a
    caching switch turned off at step 6 and back on at step 18 by `turn(driver, on)`."""
    specs = [
        RequestSpec(rid, prompt, greedy(3), arrive_step=at, cache_salt=salt)
        for rid, salt, prompt, at, _ in plan
    ]
    actions = [
        Action(f"{switch} off", _at(6), lambda e: turn(e, False)),
        Action(f"{switch} on", _at(18), lambda e: turn(e, True)),
    ]
    return Case(
        "namespaces",
        name,
        specs,
        dict(block_size=B, num_blocks=64),
        actions=actions,
        expect_hit_tokens={rid: hits for rid, *_, hits in plan},
    )

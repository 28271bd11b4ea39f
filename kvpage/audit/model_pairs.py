"""Which of the models a server lists are probed against which. /v1/models' cards (vLLM's shape)
tell adapters from aliases: an adapter's card names its base as `parent`; names without a parent
and with the same `root` are one model under several names (vLLM's --served-model-name), which
may share a cache, so they are probed as one. The pairs are bounded (--model-pairs): the base
against each other model, then each model against the next."""

from __future__ import annotations

from dataclasses import dataclass, field

ADAPTER = "adapter"  # one of the two is an adapter (its card names a parent): never one cache
DISTINCT = "distinct"  # two base models with different roots (weights)
UNKNOWN = "unknown"  # the cards do not say: the answers tell whether they are one model


@dataclass(frozen=True, slots=True)
class ModelPair:
    first: str
    second: str
    relation: str  # ADAPTER, DISTINCT or UNKNOWN

    def to_json(self) -> dict[str, str]:
        return {"models": [self.first, self.second], "relation": self.relation}


@dataclass(slots=True)
class PairPlan:
    pairs: list[ModelPair] = field(default_factory=list)
    skipped: str | None = None  # why nothing is probed (None: the pairs are)
    notes: list[str] = field(default_factory=list)  # aliases merged into one model
    left_out: str | None = None  # the pairs the cap left out


def plan_pairs(cards: list[dict[str, str | None]], primary: str, cap: int) -> PairPlan:
    """The pairs to probe, at most `cap`, from the cards as listed (`primary`: --model)."""
    if not cards:
        return PairPlan(skipped="/v1/models listed no models, so there are none to keep apart")
    plan = PairPlan()
    models = _distinct(cards, primary, plan.notes)
    if len(models) < 2:
        names = ", ".join(repr(c["id"]) for c in cards)
        what = "one model" if len(cards) == 1 else "several names of one model"
        plan.skipped = f"/v1/models lists {what} ({names}): no other model to keep apart from it"
        return plan
    by_id = {c["id"]: c for c in cards}
    base, others = models[0], models[1:]
    wanted = [(base, m) for m in others] + list(zip(others, others[1:], strict=False))
    if len(wanted) > cap:
        plan.left_out = (
            f"{cap} of {len(wanted)} model pairs probed (at most {cap}): "
            + ", ".join(f"{a}/{b}" for a, b in wanted[cap:])
            + " left out"
        )
    plan.pairs = [ModelPair(a, b, _relation(by_id[a], by_id[b])) for a, b in wanted[:cap]]
    return plan


def _distinct(cards: list[dict[str, str | None]], primary: str, notes: list[str]) -> list[str]:
    """One name per model: aliases (no parent, same root) merged into the first listed (--model
    if it is one of them); --model first, else the first base model."""
    kept: dict[tuple[str, str], str] = {}
    out: list[str] = []
    ordered = sorted(cards, key=lambda c: c["id"] != primary)  # stable: --model first
    for card in ordered:
        root = card.get("root")
        if card.get("parent") is None and root is not None:
            alias_of = kept.setdefault(("root", root), card["id"])
            if alias_of != card["id"]:
                notes.append(
                    f"{card['id']!r} is another name of {alias_of!r} (the same root, no parent): "
                    "probed as one model"
                )
                continue
        if card["id"] not in out:
            out.append(card["id"])
    bases = [m for m in out if next(c for c in cards if c["id"] == m).get("parent") is None]
    if primary not in out and bases:  # the base model leads: base vs each adapter
        out.remove(bases[0])
        out.insert(0, bases[0])
    return out


def _relation(a: dict[str, str | None], b: dict[str, str | None]) -> str:
    if a.get("parent") is not None or b.get("parent") is not None:
        return ADAPTER
    if a.get("root") is not None and b.get("root") is not None:
        return DISTINCT  # different roots: aliases were merged above
    return UNKNOWN

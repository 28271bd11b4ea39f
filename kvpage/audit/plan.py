"""Fitting the audit into --budget-requests: estimate each suite's requests, shrink the sizes
(timing trials, probes, canary groups, then block sizes) until the plan fits, and say so."""

from __future__ import annotations

from dataclasses import replace

from kvpage.audit.capabilities import Capabilities
from kvpage.audit.config import AuditConfig
from kvpage.audit.suites import models
from kvpage.audit.suites.batch import requests as batch_requests
from kvpage.audit.suites.prefix import requests_per_block


def estimate(cfg: AuditConfig, cold_refs: bool, caps: Capabilities | None = None) -> dict[str, int]:
    """Requests each chosen suite will send (the baseline runs whenever batch does; the models
    suite sends nothing where `caps` lists fewer than two models)."""
    wanted = set(cfg.suites) | ({"baseline"} if "batch" in cfg.suites else set())
    costs = {
        "baseline": 2 * cfg.probes,
        "batch": batch_requests(cfg.probes),
        "prefix": len(cfg.block_sizes) * requests_per_block(cold_refs),
        "canaries": 2 * 2 * cfg.canary_group,
        "timing": 4 * cfg.timing_trials,
        "models": 0 if caps is None else models.requests(cfg, caps, cold_refs),
    }
    return {name: cost for name, cost in costs.items() if name in wanted}


_SHRINK = (
    ("timing_trials", 6),
    ("model_pairs", 3),
    ("probes", 4),
    ("canary_group", 4),
    ("timing_trials", 5),
    ("probes", 3),
    ("canary_group", 3),
)


def fit(
    cfg: AuditConfig, budget: int, cold_refs: bool, caps: Capabilities | None = None
) -> tuple[AuditConfig, list[str]]:
    """A config whose estimate fits `budget`, and notes on what was cut (empty: nothing)."""
    notes: list[str] = []
    for name, value in _SHRINK:
        total = sum(estimate(cfg, cold_refs, caps).values())
        if total <= budget:
            return cfg, notes
        smaller = replace(cfg, **{name: min(value, getattr(cfg, name))})
        if sum(estimate(smaller, cold_refs, caps).values()) < total:  # a cut that saves nothing
            notes.append(f"{name} {getattr(cfg, name)} -> {value} to fit the request budget")
            cfg = smaller  # (a suite not chosen, no adapters listed) is not made, nor noted
    while sum(estimate(cfg, cold_refs, caps).values()) > budget and len(cfg.block_sizes) > 1:
        notes.append(f"block size {cfg.block_sizes[-1]} dropped to fit the request budget")
        cfg = replace(cfg, block_sizes=cfg.block_sizes[:-1])
    if sum(estimate(cfg, cold_refs, caps).values()) > budget:
        notes.append("the budget is below even the reduced plan: later suites may not run")
    return cfg, notes

"""The report's three short lists, built from report.json's data: what was found, what could not
be tested and why, and what to do — one sentence each, so a reader who stops after them knows
the outcome and the next step. The tolerances behind each verdict are in the suites' reasons."""

from __future__ import annotations

from typing import Any

FAILED, SHARED = "isolation failure", "shared across tenants"
SHARED_MODELS, NOT_APPLICABLE = "shared across models", "not applicable"
MODEL_ROWS = 3  # model pairs named in the findings (the rest are in report.json)
SERVER_ERRORS, SERVER_FAILED = "server errors", "server failed"


def findings(data: dict[str, Any]) -> dict[str, list[str]]:
    suites = list(data["suites"].values())
    return {
        "found": _found(data, suites),
        "not_tested": _not_tested(suites),
        "to_do": _to_do(data, suites),
    }


def _found(data: dict[str, Any], suites: list[dict[str, Any]]) -> list[str]:
    out = []
    for s in suites:
        if s["name"] == "models" and s["verdict"] in (FAILED, SHARED_MODELS):
            out += _models_found(s)
        elif s["verdict"] == FAILED and s["name"] == "reference":
            bad = [c for c in s["checks"] if c["class"] == "isolation"]
            out.append(
                f"reference: {len(bad)} answer(s) differ from what the served checkpoint answers "
                f"alone beyond numeric drift (first: {bad[0]['name']}: {bad[0]['reason']})."
            )
        elif s["verdict"] == FAILED:
            bad = [c for c in s["checks"] if c["class"] == "isolation"]
            why = bad[0]["reason"] if bad else s["summary"]
            out.append(
                f"{s['name']}: {len(bad)} answer(s) changed beyond numeric drift when the "
                f"cache was shared or batched (first: {bad[0]['name'] if bad else '-'}: {why})."
            )
        elif s["verdict"] == SHARED:
            out.append(
                f"timing: a second tenant was served the first one's cache ({s['summary']})."
            )
        elif s["verdict"] == SERVER_ERRORS:
            n = sum(1 for e in s["errors"] if e["status"] >= 500)
            out.append(f"{s['name']}: {n} request(s) failed with a 5xx under sharing.")
    failure = data.get("server_failure")
    if failure:
        state = "answered again afterwards" if failure["alive_after"] else "never answered again"
        out.append(
            f"the server failed under cache sharing: it stopped answering during "
            f"{failure['suite']} and {state} ({failure['error']})."
        )
    for anomaly in data.get("accounting_anomalies", [])[:3]:
        out.append(f"phantom cache hit: {anomaly['sentence']}.")
    extra = len(data.get("accounting_anomalies", [])) - 3
    if extra > 0:
        out.append(f"... and {extra} more phantom cache hit(s) (report.json).")
    if not out:
        judged = [s["name"] for s in suites if s["verdict"] not in ("untestable", NOT_APPLICABLE)]
        out.append(f"no isolation failure found in {', '.join(judged) or 'any suite'}.")
    return out


def _models_found(suite: dict[str, Any]) -> list[str]:
    """One sentence per pair of models whose caches were shared, naming both models."""
    bad = [r for r in suite["data"].get("pairs", []) if r["verdict"] in (FAILED, SHARED_MODELS)]
    out = [
        f"models: {r['models'][0]} / {r['models'][1]}: a prefix cached under one model was "
        f"served to the other ({r['reason']})."
        for r in bad[:MODEL_ROWS]
    ]
    if len(bad) > MODEL_ROWS:
        out.append(f"... and {len(bad) - MODEL_ROWS} more pair(s) of models (report.json).")
    return out or [f"models: {suite['summary']}."]


def _not_tested(suites: list[dict[str, Any]]) -> list[str]:
    """A suite that could not run, or ran reduced: its first reason (the rest are below)."""
    out = []
    for s in suites:
        whole = s["verdict"] in ("untestable", NOT_APPLICABLE) or "partial" in s["verdict"]
        if whole or s["untested"]:
            why = s["untested"][0] if s["untested"] else s["summary"]
            more = len(s["untested"]) - 1
            extra = f" (+{more} more below)" if more > 0 else ""
            out.append(f"{s['name']}{'' if whole else ' (in part)'}: {why}{extra}.")
    return out


def _to_do(data: dict[str, Any], suites: list[dict[str, Any]]) -> list[str]:
    verdicts = {s["verdict"] for s in suites}
    timing = data["suites"].get("timing", {})
    out = []
    if SHARED in verdicts:
        out.append(_shared_advice(data, timing))
    if data["suites"].get("models", {}).get("verdict") in (FAILED, SHARED_MODELS):
        out.append(
            "give every served model (each LoRA adapter and the base) its own prefix-cache "
            "namespace: the adapter's identity belongs in the block key, apart from the tenant's "
            "salt; until then do not serve adapters side by side with prefix caching on."
        )
    if FAILED in verdicts:
        out.append(
            "do not serve untrusted tenants from this server with prefix caching on until the "
            "divergences below are explained: each row names the probe and what it shared."
        )
    if data.get("server_failure") or SERVER_ERRORS in verdicts:
        out.append(
            "treat the failure as a bug of cache sharing: report.json's server_failure lists "
            "the requests that preceded it, to reproduce."
        )
    if data.get("accounting_anomalies"):
        out.append(
            "do not trust this server's usage.cached_tokens (it counts hits that cannot be); "
            "check its prefix-cache hit accounting, which may also hand out wrong blocks."
        )
    if not out:
        out.append("nothing to fix; re-run after upgrades (each run uses fresh prompts).")
    return out


def _shared_advice(data: dict[str, Any], timing: dict[str, Any]) -> str:
    how = (timing.get("data") or {}).get("second_tenant", "")
    if how == "another cache_salt" and data["capabilities"].get("cache_salt"):
        return (
            "this server shares one prompt cache among all clients (cache_salt is accepted but "
            "does not separate caches): do not serve two tenants from one instance."
        )
    if how == "second API key":
        return (
            "this server shares its prompt cache across API keys: give each tenant its own cache "
            "namespace (e.g. vLLM's cache_salt per tenant) or its own instance."
        )
    return "this server shares one prompt cache among tenants: do not serve two from one instance."

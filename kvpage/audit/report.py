"""The audit's reports, all built from report.json's data: `report.json` (every verdict, probe,
divergence with class and evidence), `report.md` (readable, with the first-divergence tables) and
`report.html` (self-contained: the same tables and an SVG plot of TTFT per timing arm)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvpage.audit.html import html_page
from kvpage.audit.runner import AuditResult
from kvpage.audit.tables import (
    DIVERGENCE_HEADER,
    FINDING_HEADINGS,
    MODEL_HEADER,
    cell,
    divergence_rows,
    model_rows,
)
from kvpage.verify.report import write_report_files


def write_reports(result: AuditResult, directory: str | Path) -> dict[str, Any]:
    data = result.to_json()
    write_report_files(directory, data, markdown(data), html_page(data))
    return data


def summary_lines(data: dict[str, Any]) -> list[str]:
    """The console summary: one line per suite, then the overall verdict."""
    lines = [f"{'suite':<10} {'verdict':<22} summary"]
    for suite in data["suites"].values():
        lines.append(f"{suite['name']:<10} {suite['verdict']:<22} {suite['summary']}")
    block = data.get("inferred_block_size")
    lines.append(f"inferred block size: {block if block else 'not inferred'}")
    if data.get("retries"):
        lines.append(f"{data['retries']} request(s) retried on a fresh connection")
    for heading, key in FINDING_HEADINGS:
        lines += [f"{heading} {s}" for s in data["findings"][key]]
    lines.append(
        f"verdict: {data['verdict']} (exit {data['exit_code']}); {data['requests']} requests "
        f"of {data['budget_requests']}; {data['wall_s']:.1f} s"
    )
    return lines


# --- markdown ---------------------------------------------------------------------------------
def markdown(data: dict[str, Any]) -> str:
    lines = [
        f"# kvpage audit of {data['server']} ({data['model']})",
        "",
        f"**Verdict: {data['verdict']}** (exit {data['exit_code']}) — {data['requests']} "
        f"requests of a budget of {data['budget_requests']}, {data['wall_s']:.1f} s.",
        "",
    ]
    for heading, key in FINDING_HEADINGS:
        lines += [f"- **{heading}** {s}" for s in data["findings"][key]]
    lines += ["", "| suite | verdict | summary |", "|---|---|---|"]
    for suite in data["suites"].values():
        lines.append(f"| {suite['name']} | {suite['verdict']} | {cell(suite['summary'])} |")
    lines += ["", *_md_capabilities(data), *_md_connection(data), *_md_accounting(data)]
    lines += _md_untested(data)
    for suite in data["suites"].values():
        lines += _md_suite(suite)
    return "\n".join(lines) + "\n"


def _md_capabilities(data: dict[str, Any]) -> list[str]:
    caps = data["capabilities"]
    shown = {k: v for k, v in caps.items() if k not in ("notes", "models", "model_cards")}
    lines = ["## What the server offers", "", "| capability | found |", "|---|---|"]
    lines += [f"| {k} | {cell(v)} |" for k, v in shown.items()]
    if caps.get("models"):
        shown_models = ", ".join(_model_name(c) for c in caps.get("model_cards") or [])
        lines += ["", f"Models listed: {shown_models or ', '.join(caps['models'])}."]
    lines += ["", *[f"- {note}" for note in caps["notes"]], ""]
    block = data.get("inferred_block_size")
    lines.append(f"Inferred caching block size: {block if block else 'not inferred'}.")
    return lines + [""]


def _model_name(card: dict[str, Any]) -> str:
    return f"{card['id']} (adapter of {card['parent']})" if card.get("parent") else card["id"]


def _md_connection(data: dict[str, Any]) -> list[str]:
    lines = []
    if data.get("retries"):
        lines += [
            f"{data['retries']} request(s) retried on a fresh connection (the server closed a "
            "kept-alive connection before any byte of the answer; never resent after one):",
            "",
            *[f"- {r['path']}: {r['error']}" for r in data["retried_requests"][:10]],
            "",
        ]
    failure = data.get("server_failure")
    if failure:
        lines += [
            "## The server failed under cache sharing",
            "",
            f"During {failure['suite']}: {failure['error']}. Afterwards it "
            f"{'answered again' if failure['alive_after'] else 'no longer answered'}. "
            "The requests before it (most recent last):",
            "",
            "| # | path | prompt | max_tokens | salted | stream | status | error |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in failure["preceding_requests"]:
            cells = [r.get(k, "") for k in ("n", "path", "prompt", "max_tokens", "salted")]
            cells += [r.get(k, "") for k in ("stream", "status", "error")]
            lines.append("| " + " | ".join(cell(c) for c in cells) + " |")
        lines.append("")
    return lines


def _md_accounting(data: dict[str, Any]) -> list[str]:
    anomalies = data.get("accounting_anomalies") or []
    if not anomalies:
        return []
    lines = [
        "## Cache accounting anomalies (phantom hits)",
        "",
        "A request may be served from cache at most the longest prefix it shares with a prompt "
        "sent before in its namespace (a fresh prompt under a fresh salt: 0). These exceeded it:",
        "",
    ]
    return lines + [f"- {a['sentence']}" for a in anomalies] + [""]


def _md_untested(data: dict[str, Any]) -> list[str]:
    items = [f"- plan: {n}" for n in data["plan_notes"]]
    for suite in data["suites"].values():
        items += [f"- {suite['name']}: {u}" for u in suite["untested"]]
    return ["## Not tested, reduced, or why", "", *items, ""] if items else []


def _md_suite(suite: dict[str, Any]) -> list[str]:
    lines = [f"## {suite['name']}: {suite['verdict']}", "", suite["summary"], ""]
    if suite["name"] == "timing" and suite["data"].get("tests"):
        lines += _md_timing(suite["data"])
    if suite["name"] == "prefix" and suite["data"].get("shares"):
        lines += _md_shares(suite["data"]["shares"])
    if suite["name"] == "models" and suite["data"].get("pairs"):
        lines += _md_table(MODEL_HEADER, model_rows(suite))
    if suite["errors"]:
        lines += ["| scenario | status | message |", "|---|---|---|"]
        lines += [
            f"| {e['scenario']} | {e['status']} | {cell(e['message'])} |" for e in suite["errors"]
        ]
        lines.append("")
    rows = divergence_rows(suite)
    if rows:
        lines += _md_table(DIVERGENCE_HEADER, rows)
    return lines


def _md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows] + [""]


def _md_timing(data: dict[str, Any]) -> list[str]:
    lines = [
        f"Prefix of {data['prefix_tokens']} tokens; second tenant: {data['second_tenant']}; "
        f"alpha {data['alpha']}.",
        "",
        "| arm | median TTFT (ms) | cached tokens |",
        "|---|---|---|",
    ]
    for arm, med in data["median_ttft_s"].items():
        if med is not None:
            lines.append(f"| {arm} | {med * 1000:.2f} | {data['cached_tokens'][arm]} |")
    lines += ["", "| test | U | p | effect (rank-biserial) | method |", "|---|---|---|---|---|"]
    for name, t in data["tests"].items():
        lines.append(
            f"| {name} ({t['alternative']}) | {t['u']:g} | {t['p']:.3g} | {t['effect']:.2f} | {t['method']} |"
        )
    return lines + [""]


def _md_shares(rows: list[dict[str, Any]]) -> list[str]:
    """Where reuse starts: cached tokens (and latency) of the warm answer per shared length."""
    lines = [
        "| block size | tokens shared | cold latency (ms) | warm latency (ms) | warm cached tokens |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['block_size']} | {r['shared_tokens']} | {r['cold_latency_s'] * 1000:.1f} | "
            f"{r['warm_latency_s'] * 1000:.1f} | {r['warm_cached_tokens']} |"
        )
    return lines + [""]

"""report.html: self-contained (inline CSS and SVG, no scripts, nothing fetched): the verdicts,
a TTFT strip plot per timing arm (cold / same tenant / other tenant) and the divergence tables."""

from __future__ import annotations

import html
from typing import Any

from kvpage.audit.tables import (
    DIVERGENCE_HEADER,
    FINDING_HEADINGS,
    MODEL_HEADER,
    divergence_rows,
    model_rows,
)

ARM_LABELS = {"cold": "cold", "same": "same tenant, warm", "cross": "other tenant"}
ARM_COLOURS = {"cold": "#777", "same": "#2a7", "cross": "#c33"}
_CSS = (
    "body{font-family:sans-serif;margin:2em;max-width:1400px}table{border-collapse:collapse;"
    "margin:1em 0}td,th{border:1px solid #ccc;padding:3px 6px;font-size:13px;text-align:left}"
    ".bad{color:#c33;font-weight:bold}.ok{color:#2a7;font-weight:bold}"
)


def html_page(data: dict[str, Any]) -> str:
    e = html.escape
    bad = data["exit_code"] != 0
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>kvpage audit: "
        f"{e(data['verdict'])}</title><style>{_CSS}</style></head><body>",
        f"<h1>kvpage audit of {e(data['server'])} ({e(data['model'])})</h1>",
        f"<p class='{'bad' if bad else 'ok'}'>Verdict: {e(data['verdict'])} "
        f"(exit {data['exit_code']})</p>",
        f"<p>{data['requests']} requests of {data['budget_requests']}; {data['wall_s']:.1f} s; "
        f"inferred block size: {data.get('inferred_block_size') or 'not inferred'}</p>",
        "<ul>"
        + "".join(
            f"<li><b>{e(h)}</b> {e(x)}</li>"
            for h, k in FINDING_HEADINGS
            for x in data["findings"][k]
        )
        + "</ul>",
        _table(
            ["suite", "verdict", "summary"],
            [[s["name"], s["verdict"], s["summary"]] for s in data["suites"].values()],
        ),
        _table(
            ["capability", "found"],
            [[k, v] for k, v in data["capabilities"].items() if k not in ("notes", "model_cards")],
        ),
        "<ul>" + "".join(f"<li>{e(n)}</li>" for n in data["capabilities"]["notes"]) + "</ul>",
    ]
    for suite in data["suites"].values():
        parts.append(
            f"<h2>{e(suite['name'])}: {e(suite['verdict'])}</h2><p>{e(suite['summary'])}</p>"
        )
        if suite["untested"]:
            parts.append("<ul>" + "".join(f"<li>{e(u)}</li>" for u in suite["untested"]) + "</ul>")
        if suite["name"] == "timing" and suite["data"].get("ttft_s"):
            parts.append(ttft_svg(suite["data"]["ttft_s"]))
        if suite["name"] == "models" and suite["data"].get("pairs"):
            parts.append(_table(MODEL_HEADER, model_rows(suite)))
        if suite["errors"]:
            rows = [[x["scenario"], x["status"], x["message"]] for x in suite["errors"]]
            parts.append(_table(["scenario", "status", "message"], rows))
        rows = divergence_rows(suite)
        if rows:
            parts.append(_table(DIVERGENCE_HEADER, rows))
    return "\n".join(parts) + "</body></html>\n"


def ttft_svg(ttft: dict[str, list[float]], width: int = 640, row: int = 50) -> str:
    """One row of dots per arm on a shared millisecond axis, the median as a bar."""
    arms = [a for a in ("cold", "same", "cross") if ttft.get(a)]
    values = [v * 1000 for a in arms for v in ttft[a]]
    if not values:
        return ""
    top, left, plot = max(values) * 1.05 or 1.0, 140, width - 160
    height = row * len(arms) + 40
    out = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}'>"]
    for i, arm in enumerate(arms):
        y = 20 + i * row + row / 2
        out.append(f"<text x='5' y='{y + 4}' font-size='12'>{ARM_LABELS[arm]}</text>")
        for v in ttft[arm]:
            x = left + plot * (v * 1000) / top
            out.append(
                f"<circle cx='{x:.1f}' cy='{y}' r='4' fill='{ARM_COLOURS[arm]}' fill-opacity='0.6'/>"
            )
        med = sorted(ttft[arm])[len(ttft[arm]) // 2] * 1000
        x = left + plot * med / top
        out.append(f"<line x1='{x:.1f}' x2='{x:.1f}' y1='{y - 12}' y2='{y + 12}' stroke='black'/>")
    axis_y = height - 15
    out.append(f"<line x1='{left}' x2='{left + plot}' y1='{axis_y}' y2='{axis_y}' stroke='black'/>")
    for k in range(5):
        x = left + plot * k / 4
        out.append(
            f"<text x='{x:.1f}' y='{axis_y + 12}' font-size='10'>{top * k / 4:.1f} ms</text>"
        )
    return "".join(out) + "</svg>"


def _table(header: list[str], rows: list[list[Any]]) -> str:
    e = html.escape
    head = "".join(f"<th>{e(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{e(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"

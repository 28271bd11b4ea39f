"""Gate reports: report.json (machine-readable), report.md and a self-contained report.html with
the first-divergence tables and the reference and candidate block tables side by side."""

from __future__ import annotations

import html
import json
from pathlib import Path

from kvpage.verify.diff import WHERE_TO_LOOK
from kvpage.verify.generated.report import markdown_lines as generated_markdown_lines
from kvpage.verify.generated.report import summary_lines as generated_summary_lines

# The per-step fields shown for reference and candidate at a first divergence.
STEP_FIELDS = (
    "input_ids",
    "position_ids",
    "chosen_token",
    "topk_ids",
    "topk_values",
    "logits_digest",
    "prefix_hit_tokens",
    "after_resume",
    "restore_complete",
)


def write_report_files(directory: str | Path, data: dict, markdown_text: str, html_text: str):
    """report.json, report.md and report.html in `directory` (made if missing): the gate's and
    the audit's reports share these names and this layout."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(data, indent=2, default=str))
    (out / "report.md").write_text(markdown_text)
    (out / "report.html").write_text(html_text)


def write_reports(result, directory: str | Path) -> dict:
    """`result`: a GateResult or a MatrixResult (its to_dict() has `cells`)."""
    data = result.to_dict()
    write_report_files(directory, data, markdown(data), html_page(data))
    return data


def scores(data: dict) -> str:
    if data["mutation_check"] == "skipped":
        return "mutation check skipped (--no-mutants)"
    na = sum(m.get("not_applicable") is not None for m in data["mutants"].values())
    run = len(data["mutants"]) - na
    also = f" ({na} not applicable to this model)" if na else ""
    if data["mutation_score"] is None:
        return f"no mutant applicable{also}"
    return (
        f"mutation score {data['mutation_score']:.0%}, attribution "
        f"{data['attribution_score']:.0%} over {run} mutants{also}"
    )


def _caught(m: dict) -> str:
    """A mutant's verdict: caught, MISSED, or n/a with the reason it was not run."""
    if m.get("not_applicable"):
        return f"n/a: {m['not_applicable']}"
    return "caught" if m["caught"] else "MISSED"


def cell_rows(data: dict) -> list[tuple[str, ...]]:
    """One row per matrix cell: configuration, parts run, verdict, cases, mutants, seconds."""
    rows = []
    for c in data.get("cells", []):
        mutants = (
            "-"
            if c["mutation_score"] is None
            else f"{c['mutation_score']:.0%} of {c['mutants_run']}"
        )
        cases = f"{c['cases'] - c['case_failures']}/{c['cases']} cases"
        if c.get("scenarios"):
            cases = f"{c['scenarios']} scenarios"
        rows.append(
            (
                c["cell"],
                "PASS" if c["passed"] else "FAIL",
                cases,
                f"mutants {c['parts']['mutants']}: {mutants}",
                f"{c['seconds']:.1f}s",
            )
        )
    return rows


CELL_HEADER = ("cell", "result", "cases", "mutants", "seconds")


def _cell_table(data: dict) -> list[str]:
    rows = [CELL_HEADER, *cell_rows(data)]
    width = [max(len(r[i]) for r in rows) for i in range(len(CELL_HEADER))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, width, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in width))
    return lines


def summary_table(data: dict) -> str:
    """The main cell's suites and mutants, then (a matrix) one line per cell."""
    rows = [("suite / mutant", "result", "detail")]
    for suite, s in data["suites"].items():
        rows.append(
            (
                suite,
                "PASS" if s["failures"] == 0 else "FAIL",
                f"{s['cases'] - s['failures']}/{s['cases']} cases",
            )
        )
    for name, why in data.get("cases_not_applicable", {}).items():
        rows.append((f"case {name}", "n/a", why))
    for name, m in data["mutants"].items():
        if m.get("not_applicable"):
            rows.append((f"mutant {name}", "n/a", m["not_applicable"]))
            continue
        status = "caught" if m["caught"] else "MISSED"
        attributed = m["attributed_class"] or "-"
        ok = "ok" if m["attribution_ok"] else f"expected {m['expected_class']}"
        rows.append((f"mutant {name}", status, f"attributed {attributed} ({ok})"))
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, width, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in width))
    if data.get("cells"):
        lines += ["", *_cell_table(data)]
    generated = generated_summary_lines(data.get("generated"))
    if generated:
        lines += ["", *generated]
    lines += fast_path_lines(data.get("fast_paths") or {})
    verdict = "PASSED" if data["passed"] else "FAILED"
    cells = f" over {len(data['cells'])} cells" if len(data.get("cells", [])) > 1 else ""
    lines.append(f"\ngate {verdict}{cells}: {scores(data)}, {data['seconds']:.1f}s")
    return "\n".join(lines)


def fast_path_lines(paths: dict) -> list[str]:
    """Which fast paths the honest engine took (kvpage.verify.path_coverage): per path the
    cells (a matrix) or the calls (one configuration); a path this machine has and no case
    took is checked by none, and says so."""
    if not paths:
        return []
    lines = ["", "fast paths taken by the engine's cases (each checked against torch's kernels):"]
    for path, seen in paths.items():
        taken = len(seen["cells"]) if "cells" in seen else seen["calls"]
        unit = "cells" if "cells" in seen else "calls"
        if not seen["available"]:
            lines.append(f"  {path}: not on this machine")
        elif taken:
            lines.append(f"  {path}: {taken} {unit}")
        else:
            lines.append(f"  {path}: on this machine, taken by NO case")
    return lines


# --- markdown ------------------------------------------------------------------------------
def markdown(data: dict) -> str:
    lines = [
        f"# kvpage release gate: {'PASSED' if data['passed'] else 'FAILED'}",
        "",
        f"Model `{data['model']}`; environment `{data['environment']}`; {data['seconds']:.1f}s.",
        "",
        "```",
        summary_table(data),
        "```",
        "",
        *_md_cells(data),
        *generated_markdown_lines(data.get("generated")),
        "",
    ]
    for suite, s in data["suites"].items():
        lines += [
            f"## Suite `{suite}`",
            "",
            "| case | result | requests | steps | failures |",
            "|---|---|---|---|---|",
        ]
        for c in s["results"]:
            fails = "; ".join(f["message"] for f in c["failures"][:3]) or "-"
            lines.append(
                f"| {c['case']} | {'pass' if c['passed'] else 'FAIL'} | "
                f"{c['requests']} | {c['steps']} | {fails} |"
            )
        lines.append("")
        for c in s["results"]:
            for f in c["failures"]:
                if f["divergence"]:
                    lines += _md_divergence(f"{c['case']} / {f['request_id']}", f["divergence"])
    lines += [
        "## Mutants",
        "",
        "| mutant | bug | caught | expected | attributed | first failure |",
        "|---|---|---|---|---|---|",
    ]
    for name, m in data["mutants"].items():
        lines.append(
            f"| {name} | {m['bug']} | {_caught(m)} | {m['expected_class']} | "
            f"{m['attributed_class']} | {m['first_failure']} |"
        )
    lines.append("")
    for name, m in data["mutants"].items():
        if m["first_divergence"]:
            lines += _md_divergence(f"mutant {name}", m["first_divergence"])
    return "\n".join(lines) + "\n"


def _md_cells(data: dict) -> list[str]:
    """The matrix: a table of cells, then the failures of cells other than the main one (the
    main cell's suites and mutants follow in full)."""
    if not data.get("cells"):
        return []
    lines = ["## Cells", "", "| " + " | ".join(CELL_HEADER) + " |", "|---" * len(CELL_HEADER) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in cell_rows(data)]
    lines.append("")
    for cell, case, message in _cell_failures(data):
        lines.append(f"- cell `{cell}`, {case}: {message}")
    return lines + [""]


def _cell_failures(data: dict):
    """(cell, case or mutant, message) of every failure outside the main cell."""
    for c in data.get("cells", [])[1:]:
        for s in c["suites"].values():
            for r in s["results"]:
                for f in r["failures"]:
                    yield c["cell"], r["case"], f["message"]
        for name, m in c["mutants"].items():
            if m.get("not_applicable") is None and not (m["caught"] and m["attribution_ok"]):
                yield c["cell"], f"mutant {name}", m["first_failure"] or "MISSED"


def _md_divergence(title: str, d: dict) -> list[str]:
    ref, cand, a = d["reference"], d["candidate"], d["attribution"]
    lines = [
        f"### First divergence: {title}",
        "",
        f"Step {d['step']} of `{d['request_id']}`: **{d['kind']}** ({d['detail']}); "
        f"class **{a['class']}** ({a['reason']}) — look at {WHERE_TO_LOOK.get(a['class'])}."
        + (f" Missing fields: {a['missing']}." if a["missing"] else ""),
        "",
        "| field | reference | candidate |",
        "|---|---|---|",
    ]
    for key in STEP_FIELDS:
        lines.append(f"| {key} | {_short(ref, key)} | {_short(cand, key)} |")
    lines += [
        "",
        "Attribution fields: " + ", ".join(f"`{k}`={_fmt(v)}" for k, v in a["fields"].items()),
        "",
    ]
    lines += [
        "| logical | ref physical | ref gen | ref valid | cand physical | cand gen | "
        "cand valid | shared | ref_count | state |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r_e, c_e in _paired_entries(ref, cand):
        lines.append(
            "| "
            + " | ".join(
                str(x)
                for x in (
                    (c_e or r_e)["logical"],
                    *_entry_cols(r_e, ("physical", "generation", "valid_len")),
                    *_entry_cols(
                        c_e, ("physical", "generation", "valid_len", "shared", "ref_count", "state")
                    ),
                )
            )
            + " |"
        )
    return lines + [""]


def _paired_entries(ref: dict | None, cand: dict | None):
    r = (ref or {}).get("view", {}).get("entries", [])
    c = (cand or {}).get("view", {}).get("entries", [])
    for i in range(max(len(r), len(c))):
        yield (r[i] if i < len(r) else None), (c[i] if i < len(c) else None)


def _entry_cols(entry: dict | None, keys) -> list[str]:
    return ["" if entry is None else str(entry[k]) for k in keys]


def _short(record: dict | None, key: str) -> str:
    return "-" if record is None else _fmt(record.get(key))


def _fmt(value) -> str:
    if isinstance(value, list) and len(value) > 12:
        return f"{value[:6]} … {value[-3:]} ({len(value)})"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list) and value and isinstance(value[0], float):
        return "[" + ", ".join(f"{v:.3f}" for v in value) + "]"
    return str(value)


# --- html ----------------------------------------------------------------------------------
_CSS = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:3px 8px;
font-size:13px;text-align:left}th{background:#f3f3f3}.pass{color:#176f2c}.fail{color:#b00020;
font-weight:bold}.side{display:flex;gap:2em}pre{background:#f6f6f6;padding:1em}"""


def html_page(data: dict) -> str:
    e = html.escape
    verdict = "PASSED" if data["passed"] else "FAILED"
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>kvpage gate {verdict}"
        f"</title><style>{_CSS}</style></head><body>",
        f"<h1>kvpage release gate: <span class='{'pass' if data['passed'] else 'fail'}'>"
        f"{verdict}</span></h1>",
        f"<p>Model <code>{e(data['model'])}</code>, {data['seconds']:.1f}s, {e(scores(data))}.</p>",
        f"<pre>{e(summary_table(data))}</pre>",
    ]
    generated = data.get("generated")
    if generated:
        parts.append("<h2>Generated scenarios</h2>")
        parts.append(f"<pre>{e(chr(10).join(generated_markdown_lines(generated)[3:]))}</pre>")
    if data.get("cells"):
        parts.append("<h2>Cells</h2>")
        parts.append(_html_table(list(CELL_HEADER), [list(r) for r in cell_rows(data)]))
        failures = [[c, case, msg] for c, case, msg in _cell_failures(data)]
        if failures:
            parts.append(_html_table(["cell", "case / mutant", "failure"], failures))
    for suite, s in data["suites"].items():
        parts.append(f"<h2>Suite {e(suite)}</h2>")
        parts.append(
            _html_table(
                ["case", "result", "requests", "steps", "failures"],
                [
                    [
                        c["case"],
                        _verdict(c["passed"]),
                        c["requests"],
                        c["steps"],
                        "; ".join(f["message"] for f in c["failures"][:3]),
                    ]
                    for c in s["results"]
                ],
            )
        )
        for c in s["results"]:
            for f in c["failures"]:
                if f["divergence"]:
                    parts.append(
                        _html_divergence(f"{c['case']} / {f['request_id']}", f["divergence"])
                    )
    parts.append("<h2>Mutants</h2>")
    parts.append(
        _html_table(
            ["mutant", "bug", "caught", "expected", "attributed", "first failure"],
            [
                [
                    n,
                    m["bug"],
                    _caught(m) if m.get("not_applicable") else _verdict(m["caught"]),
                    m["expected_class"],
                    m["attributed_class"],
                    m["first_failure"],
                ]
                for n, m in data["mutants"].items()
            ],
        )
    )
    for name, m in data["mutants"].items():
        if m["first_divergence"]:
            parts.append(_html_divergence(f"mutant {name}", m["first_divergence"]))
    parts.append("</body></html>")
    return "\n".join(parts)


def _verdict(ok: bool) -> str:
    return f"<span class='{'pass' if ok else 'fail'}'>{'yes' if ok else 'NO'}</span>"


def _html_table(header: list[str], rows: list[list]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>"
        + "".join(
            f"<td>{c if isinstance(c, str) and c.startswith('<span') else html.escape(_fmt(c))}</td>"
            for c in row
        )
        + "</tr>"
        for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _html_divergence(title: str, d: dict) -> str:
    ref, cand, a = d["reference"], d["candidate"], d["attribution"]
    e = html.escape
    keys = STEP_FIELDS
    steps = _html_table(
        ["field", "reference", "candidate"], [[k, _short(ref, k), _short(cand, k)] for k in keys]
    )
    cols = ["logical", "physical", "generation", "valid_len", "shared", "ref_count", "state"]
    tables = []
    for label, record in (("reference", ref), ("candidate", cand)):
        entries = (record or {}).get("view", {}).get("entries", [])
        view = (record or {}).get("view", {})
        tables.append(
            f"<div><h4>{label} block table (epoch {view.get('epoch')}, namespace "
            f"{e(str(view.get('namespace', ''))[:16])})</h4>"
            + _html_table(cols, [[x[c] for c in cols] for x in entries])
            + "</div>"
        )
    fields = _html_table(["attribution field", "value"], [[k, v] for k, v in a["fields"].items()])
    missing = f"<p class='fail'>missing fields: {e(str(a['missing']))}</p>" if a["missing"] else ""
    return (
        f"<h3>First divergence: {e(title)}</h3><p>Step {d['step']} of "
        f"<code>{e(d['request_id'])}</code>: <b>{e(d['kind'])}</b> ({e(d['detail'])}); class "
        f"<b>{e(a['class'])}</b> ({e(a['reason'])}), look at "
        f"{e(WHERE_TO_LOOK.get(a['class'], ''))}.</p>{missing}{steps}{fields}"
        f"<div class='side'>{''.join(tables)}</div>"
    )

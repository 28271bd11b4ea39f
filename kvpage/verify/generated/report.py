"""The generated stage in the gate's reports: how many scenarios ran from which seed, what they
covered, what failed (with the reproducer to replay), and the generality figure — the share
of mutants the generated scenarios catch with every hand-written case switched off."""

from __future__ import annotations

from kvpage.verify.generated.coverage import coverage_lines


def summary_lines(generated: dict | None) -> list[str]:
    if not generated:
        return []
    lines = [
        f"generated: {generated['scenarios']} scenarios (seed {generated['seed']}, stopped by "
        f"{generated['stopped_by']}), {generated['failures']} failed, {generated['seconds']:.1f}s"
    ]
    lines += [f"  reproducer: {path}" for path in generated["reproducers"]]
    alone = generated.get("alone")
    if alone and alone["score"] is not None:
        missed = ", ".join(alone["missed"]) or "none"
        lines.append(
            f"generated stage alone: {alone['caught']}/{alone['mutants']} mutants caught "
            f"({alone['score']:.0%}; {alone['attributed_as_expected']} with their own class); "
            f"missed: {missed}"
        )
    return lines


def markdown_lines(generated: dict | None) -> list[str]:
    if not generated:
        return []
    lines = ["", "## Generated scenarios", ""]
    lines += [f"- {line}" for line in summary_lines(generated)]
    lines += ["", "Coverage (scenarios per value):", "", "```"]
    lines += coverage_lines(generated["coverage"])
    lines += ["```"]
    for failed in generated["failed"]:
        first = failed["failures"][0] if failed["failures"] else {"message": "?"}
        lines.append(f"- FAILED {failed['case']}: {first['message']}")
    alone = generated.get("alone")
    if alone:
        lines += [
            "",
            "| mutant | generated alone | scenario | class (expected) |",
            "|---|---|---|---|",
        ]
        for name, m in alone["per_mutant"].items():
            verdict = "caught" if m["caught"] else "missed"
            cls = f"{m['attributed_class'] or '-'} ({m['expected_class']})"
            lines.append(f"| {name} | {verdict} | {m['caught_by'] or '-'} | {cls} |")
    return lines

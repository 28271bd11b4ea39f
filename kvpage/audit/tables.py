"""The tables both reports print (report.md and report.html): finding headings and the
divergence rows, so neither report module imports the other."""

from __future__ import annotations

from typing import Any

TOP_SHOWN = 3  # top-k entries shown per side in the divergence tables
FINDING_HEADINGS = (("Found:", "found"), ("Not tested:", "not_tested"), ("To do:", "to_do"))


DIVERGENCE_HEADER = [
    "probe",
    "what was shared",
    "class",
    "position",
    "abs pos / offset in block",
    "solo token",
    "other token",
    "solo top",
    "other top",
    "solo top-2 gap",
    "max |Δ lp| before",
    "reason",
]


def divergence_rows(suite: dict[str, Any]) -> list[list[str]]:
    """One row per divergence: the first-divergence table (markdown and HTML alike)."""
    rows = []
    for check in suite["checks"]:
        div = check["divergence"]
        if div is None:
            continue
        ev = check["evidence"]
        offsets = ", ".join(f"B{b}:{o}" for b, o in ev.get("offset_in_block", {}).items())
        position = f"{ev['absolute_position']} ({offsets})" if ev else "-"
        rows.append(
            [
                check["name"],
                _shared(check["context"], check["reference"], check["candidate"]),
                check["class"] or "-",
                f"{div['unit']} {div['index']}"
                + (" (logprobs only)" if div["logprob_only"] else ""),
                position,
                repr(div["ref_token"]),
                repr(div["cand_token"]),
                _top(div["ref_top"]),
                _top(div["cand_top"]),
                _num(div["ref_gap"]),
                _num(div["prior_delta"]),
                check["reason"]
                + (f" (pair {check['pair'][0]} -> {check['pair'][1]})" if check["pair"] else ""),
            ]
        )
    return rows


MODEL_HEADER = ["models", "relation", "verdict", "owner -> viewer", "cold / same / cross", "reason"]


def model_rows(suite: dict[str, Any]) -> list[list[str]]:
    """The models suite: one row per direction of each pair probed (cached tokens per arm, or
    median TTFT in ms where timing decided; a salted arm's count after a slash)."""
    rows = []
    for pair in suite["data"].get("pairs", []):
        for i, d in enumerate(pair["directions"]):
            rows.append(
                [
                    " / ".join(pair["models"]) if i == 0 else "",
                    pair["relation"] if i == 0 else "",
                    pair["verdict"] if i == 0 else "",
                    f"{d['owner']} -> {d['viewer']}",
                    _arms(d),
                    d.get("shared") or (pair["reason"] if i == 0 else ""),
                ]
            )
    return rows


def _arms(direction: dict[str, Any]) -> str:
    if "cached_tokens" in direction:
        c = direction["cached_tokens"]
        text = " / ".join(str(c.get(a)) for a in ("cold", "same", "cross"))
        return text + (f"; salted {c['salted']}" if c.get("salted") else "")
    ttft = direction["ttft_s"]
    medians = [sorted(ttft[a])[len(ttft[a]) // 2] * 1000 for a in ("cold", "same", "cross")]
    return " / ".join(f"{m:.1f} ms" for m in medians)


def _shared(context: dict[str, Any], ref: dict[str, Any], cand: dict[str, Any]) -> str:
    parts = [str(context.get("mode", ""))]
    if "shared_tokens" in context:
        parts.append(f"{context['shared_tokens']} tokens shared")
    if context.get("block_size"):
        parts.append(f"B={context['block_size']}")
    if cand.get("cached_tokens") is not None:
        parts.append(f"cached tokens solo/other {ref.get('cached_tokens')}/{cand['cached_tokens']}")
    return "; ".join(p for p in parts if p)


def _top(entries: list) -> str:
    return " ".join(f"{tok!r}:{lp:.2f}" for tok, lp in entries[:TOP_SHOWN]) or "-"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")

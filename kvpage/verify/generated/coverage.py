"""What a set of generated scenarios covered: for each dimension the generator draws, how many
scenarios took each value (a scenario with several requests counts once per value it holds)."""

from __future__ import annotations

from collections import Counter

from kvpage.verify.generated.scenario import Scenario


def coverage_table(scenarios: list[Scenario]) -> dict[str, dict[str, int]]:
    table: dict[str, Counter] = {}
    for s in scenarios:
        for dimension, value in s.covers.items():
            values = value if isinstance(value, list) else [value]
            counter = table.setdefault(dimension, Counter())
            for v in set(map(str, values)):
                counter[v] += 1
    return {d: dict(sorted(c.items())) for d, c in sorted(table.items())}


def coverage_lines(table: dict[str, dict[str, int]]) -> list[str]:
    """One line per dimension: `dimension  value×count, ...`."""
    width = max((len(d) for d in table), default=0)
    return [
        f"{d.ljust(width)}  " + ", ".join(f"{v}×{n}" for v, n in counts.items())
        for d, counts in table.items()
    ]

"""Which rows a native linear kernel was called on, for tests that check where a Projection
sends its inputs."""

from __future__ import annotations


def count_rows(monkeypatch, kernel: type) -> list[int]:
    """Rows of x of each `kernel.__call__` (WeightGemv, AmxLinear) from now on, in call order."""
    rows: list[int] = []
    original = kernel.__call__

    def counting(self, x, out=None):
        rows.append(x.numel() // x.shape[-1])
        return original(self, x, out)

    monkeypatch.setattr(kernel, "__call__", counting)
    return rows

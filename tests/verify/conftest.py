"""The release gate on the real engine, run once for every test module that reads it (the gate's
own tests and the kernel class's): the whole default gate is the suite's slowest setup."""

from __future__ import annotations

import pytest

from kvpage.verify.gate import GateResult, run_gate


@pytest.fixture(scope="session")
def release_gate() -> GateResult:
    """`kvpage verify` with its defaults on builtin:tiny-llama: every suite, every mutant."""
    return run_gate("builtin:tiny-llama", progress=False)

"""The audit's suites, in the order they run: the baseline first (it measures the noise the
others are judged against, and its probes are the batch suite's)."""

from kvpage.audit.suites import baseline, batch, canaries, models, prefix, timing
from kvpage.audit.suites.base import Check, SuiteContext, SuiteResult

RUNNERS = {
    "baseline": baseline.run,
    "batch": batch.run,
    "prefix": prefix.run,
    "canaries": canaries.run,
    "timing": timing.run,
    "models": models.run,
}

__all__ = ["RUNNERS", "Check", "SuiteContext", "SuiteResult"]

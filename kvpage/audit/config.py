"""What one audit is asked to do: the server, the suites, the sizes and the tolerances."""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from kvpage.audit.errors import AuditUsageError

SUITES = ("baseline", "batch", "prefix", "canaries", "timing", "models")


@dataclass(frozen=True, slots=True)
class Tolerances:
    """When a difference is float noise and when it is a bug (see classify.py)."""

    exact: float = 1e-4  # |Δ logprob| below this is bit-level float noise, not a divergence
    logprob: float = 0.1  # logprobs before a flip must agree within this for "numeric drift"
    gap: float = 0.1  # a flip is drift only where the solo run's top-2 gap is below this


@dataclass(frozen=True, slots=True)
class AuditConfig:
    base_url: str
    model: str
    api_key: str | None = None
    second_api_key: str | None = None  # a second tenant, for cross-tenant timing
    block_sizes: tuple[int, ...] = (16, 32, 64)  # candidate caching granularities
    budget_requests: int = 400  # hard cap on requests sent, probing included
    suites: tuple[str, ...] = SUITES
    max_tokens: int = 16  # per judged probe
    probes: int = 6  # baseline/batch probes (also the concurrency of the batch suite)
    canary_group: int = 6  # concurrent requests per canary group
    timing_trials: int = 8  # victim prefixes in the timing suite
    timing_prefix_tokens: int = 1024  # long enough for a cache hit to show in TTFT
    model_pairs: int = 6  # most pairs of listed models (base, adapters) probed for isolation
    alpha: float = 0.01  # significance level of the timing tests
    tolerances: Tolerances = field(default_factory=Tolerances)
    # The audit's own randomness (prompts, salts, orders). None: a fresh seed per run, so that
    # "fresh" prompts are really new to the server; a fixed seed repeats the prompts, and a
    # second run against the same server then finds them cached (reproduction only).
    seed: int | None = None
    timeout_s: float = 60.0  # per request
    trust_usage: bool = True  # False: judge timing by TTFT alone (a server's usage may lie)
    reference_model: str | None = None  # the served checkpoint, to judge answers against
    reference_dtype: str = "float32"
    progress: bool = True

    def __post_init__(self) -> None:
        parts = urlsplit(self.base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise AuditUsageError(
                f"--base-url {self.base_url!r} is not an http(s)://host[:port] URL"
            )
        if parts.query or parts.fragment:
            raise AuditUsageError(f"--base-url {self.base_url!r} must not have a query")
        if not self.model:
            raise AuditUsageError("--model must name the served model")
        if not self.block_sizes or any(b < 1 for b in self.block_sizes):
            raise AuditUsageError(
                f"--block-sizes must be positive integers, got {self.block_sizes}"
            )
        unknown = set(self.suites) - set(SUITES)
        if unknown or not self.suites:
            raise AuditUsageError(f"unknown suite(s) {sorted(unknown)}; choose from {SUITES}")
        if self.second_api_key is not None and self.second_api_key == self.api_key:
            raise AuditUsageError("--second-api-key must differ from --api-key (a second tenant)")
        if self.timeout_s <= 0:
            raise AuditUsageError(f"--timeout must be > 0 seconds, got {self.timeout_s}")
        if self.budget_requests < 1:
            raise AuditUsageError("--budget-requests must be >= 1")
        if self.model_pairs < 1:
            raise AuditUsageError(f"--model-pairs must be >= 1, got {self.model_pairs}")
        if self.probes < 2 or self.canary_group < 2 or self.timing_trials < 3:
            raise AuditUsageError("probes and canary groups need >= 2 requests, timing >= 3 trials")

    @property
    def root(self) -> str:
        """The server root: a trailing `/v1` (as OpenAI clients spell it) is dropped."""
        url = self.base_url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url

"""Per-request sampling parameters, with vLLM's names."""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvpage.errors import InvalidRequest


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    max_tokens: int = 16
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    n: int = 1  # parallel samples of one prompt (forked after prefill, R33)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not self.temperature >= 0.0:
            raise InvalidRequest(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k == 0 or self.top_k < -1:
            raise InvalidRequest(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise InvalidRequest(f"n must be an int >= 1, got {self.n!r}")
        if self.logprobs is not None and self.logprobs < 0:
            raise InvalidRequest(f"logprobs must be >= 0, got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def for_sample(self, index: int) -> SamplingParams:
        """The n == 1 parameters of parallel sample `index`: its seed is `seed + index`, so each
        sample replays alone exactly (None stays None: the engine derives one per sequence)."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)

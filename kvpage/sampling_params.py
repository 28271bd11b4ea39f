"""Per-request sampling parameters, with vLLM's names."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace

from kvpage.errors import InvalidRequest
from kvpage.structured_params import StructuredOutputsParams

# Below this temperature sampling is greedy, as in vLLM: dividing logits by a tiny temperature
# overflows float32 long before it changes the argmax.
GREEDY_TEMPERATURE = 1e-5
# torch.Generator.manual_seed takes any int in [-(2**63), 2**64 - 1] (a negative seed wraps).
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    max_tokens: int = 16  # 0: the prompt is only scored (prompt_logprobs), nothing is drawn
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    n: int = 1  # parallel samples of one prompt (forked after prefill)
    # Per prompt token after the first: its logprob and the top k at its position (vLLM's name)
    prompt_logprobs: int | None = None
    # What the output must match (a JSON schema, regex, choice or grammar); None: free text
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not _is_real(self.temperature) or not 0.0 <= self.temperature < math.inf:
            raise InvalidRequest(
                f"temperature must be a finite number >= 0, got {self.temperature}"
            )
        if self.temperature < GREEDY_TEMPERATURE:
            # Stored as 0 so every reader (sampler, reference, verifier oracle) sees greedy.
            object.__setattr__(self, "temperature", 0.0)
        if self.top_k == 0 or self.top_k < -1:
            raise InvalidRequest(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 0:
            raise InvalidRequest(f"max_tokens must be >= 0, got {self.max_tokens}")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise InvalidRequest(f"n must be an int >= 1, got {self.n!r}")
        if self.logprobs is not None and self.logprobs < 0:
            raise InvalidRequest(f"logprobs must be >= 0, got {self.logprobs}")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int)
            or isinstance(self.prompt_logprobs, bool)
            or self.prompt_logprobs < 0
        ):
            raise InvalidRequest(
                f"prompt_logprobs must be None or an int >= 0, got {self.prompt_logprobs!r}"
            )
        self._check_seed()
        self._check_structured()

    def _check_structured(self) -> None:
        value = self.structured_outputs
        if isinstance(value, dict):
            try:
                value = StructuredOutputsParams(**value)
            except TypeError as err:  # a field it does not have
                raise InvalidRequest(f"structured_outputs: {err}") from None
            object.__setattr__(self, "structured_outputs", value)
        elif value is not None and not isinstance(value, StructuredOutputsParams):
            raise InvalidRequest(
                f"structured_outputs must be a StructuredOutputsParams, got {type(value).__name__}"
            )

    def _check_seed(self) -> None:
        """Checked here, not when the engine makes the generator: by then the request holds a
        block table. Sample i seeds with seed + i, so the last sample's seed must fit too."""
        if self.seed is None:
            return
        if not isinstance(self.seed, numbers.Integral) or isinstance(self.seed, bool):
            raise InvalidRequest(f"seed must be an int, got {self.seed!r}")
        object.__setattr__(self, "seed", int(self.seed))
        if not SEED_MIN <= self.seed <= SEED_MAX - (self.n - 1):
            raise InvalidRequest(
                f"seed must be in [{SEED_MIN}, {SEED_MAX - (self.n - 1)}] (a 64-bit seed; "
                f"seed + n - 1 too), got {self.seed}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def for_sample(self, index: int) -> SamplingParams:
        """The n == 1 parameters of parallel sample `index`: its seed is `seed + index`, so each
        sample replays alone exactly (None stays None: the engine derives one per sequence)."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)

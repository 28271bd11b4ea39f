"""Offline batch generation with vLLM's names: `LLM(model, ...).generate(prompts, sampling_params)`."""

from __future__ import annotations

import sys
from collections.abc import Sequence as SequenceABC

from kvpage.config import EngineConfig
from kvpage.engine.engine import LLMEngine
from kvpage.engine.outputs import RequestOutput
from kvpage.errors import InvalidRequest
from kvpage.lora.request import LoRARequest
from kvpage.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str = "builtin:tiny-llama", **engine_args) -> None:
        self.config = EngineConfig(model=model, **engine_args)
        self.engine = LLMEngine(self.config)
        self.engine.emit_progress = False  # generate() only needs finished outputs
        self._next_id = 0

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | SequenceABC[str | list[int]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool = True,
        cache_salt: str | None = None,
        lora_request: LoRARequest | SequenceABC[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order, one per prompt (with
        `n` CompletionOutputs, by index, for SamplingParams(n=...)). Every prompt is validated
        before any runs, so one bad prompt raises InvalidRequest (naming its index) and nothing
        is left queued. `lora_request`: one adapter for every prompt, or a list aligned with
        the prompts (None for the base model)."""
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        adapters = _as_lora_list(lora_request, len(prompts))
        ids = self._add_all(prompts, params, cache_salt, adapters)
        finished: dict[str, RequestOutput] = {}
        progress = _Progress(len(ids), enabled=use_tqdm)
        while len(finished) < len(ids):
            for out in self.engine.step():
                if out.finished and out.request_id in ids:
                    finished[out.request_id] = out
                    progress.update()
        progress.close()
        return [finished[i] for i in ids]

    def _add_all(self, prompts, params, cache_salt, adapters) -> list[str]:
        ids: list[str] = []
        try:
            for i, (prompt, p, lora) in enumerate(zip(prompts, params, adapters, strict=True)):
                request_id = str(self._next_id)
                self._next_id += 1
                try:
                    self.engine.add_request(
                        request_id, prompt, p, cache_salt=cache_salt, lora_request=lora
                    )
                except InvalidRequest as err:
                    raise InvalidRequest(f"prompts[{i}]: {err}") from err
                ids.append(request_id)
        except InvalidRequest:
            for request_id in ids:
                self.engine.abort_request(request_id)
            self.engine.step()  # drain the abort outputs
            raise
        return ids

    def stats(self) -> dict[str, int]:
        return self.engine.stats()

    def close(self) -> None:
        """Stop tensor-parallel workers, if any; the LLM cannot generate afterwards."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _as_prompt_list(prompts) -> list[str | list[int]]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _as_params_list(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise InvalidRequest(f"sampling_params has {len(params)} entries for {n} prompts")
    return params


def _as_lora_list(lora, n: int) -> list[LoRARequest | None]:
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * n
    lora = list(lora)
    if len(lora) != n:
        raise InvalidRequest(f"lora_request has {len(lora)} entries for {n} prompts")
    return lora


class _Progress:
    """A dependency-free progress line on stderr."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done = total, 0
        self.enabled = enabled and total > 0 and sys.stderr.isatty()

    def update(self) -> None:
        self.done += 1
        if self.enabled:
            print(f"\rgenerate: {self.done}/{self.total}", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled:
            print(file=sys.stderr)

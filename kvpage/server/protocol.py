"""OpenAI request bodies as pydantic models, their mapping to SamplingParams, and OpenAI-style
error bodies. Every rejection names the offending field, so a client can fix its request and the
engine never sees it."""

from __future__ import annotations

from typing import Any, Literal

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from kvpage.errors import InvalidRequest
from kvpage.sampling_params import SamplingParams

MAX_LOGPROBS = 20
MAX_N = 16  # parallel samples per request (R33)
MAX_STOP = 16  # stop strings per request: each one is searched for on every token
MAX_STOP_CHARS = 256  # per stop string: the text held back from a stream is one less than this


class ApiError(Exception):
    """An error the client caused (or must see), rendered in OpenAI's error shape."""

    def __init__(
        self, message: str, param: str | None = None, status: int = 400, kind: str = ""
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status
        self.kind = kind or ("invalid_request_error" if status == 400 else "server_error")


def error_response(err: ApiError) -> JSONResponse:
    body = {"error": {"message": err.message, "type": err.kind, "param": err.param, "code": None}}
    return JSONResponse(body, status_code=err.status)


def validation_error(exc: RequestValidationError) -> ApiError:
    """pydantic's first complaint, with its location turned into the OpenAI `param`."""
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    return ApiError(f"{param or 'body'}: {first.get('msg', 'invalid request')}", param)


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    """Fields shared by both endpoints; OpenAI names, plus vLLM's extensions (top_k, ignore_eos,
    stop_token_ids, cache_salt) and `return_token_ids` (token ids in each choice)."""

    model_config = ConfigDict(extra="ignore")

    model: str = ""
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    cache_salt: str | None = None
    return_token_ids: bool = False

    def check_unsupported(self) -> None:
        if not 1 <= self.n <= MAX_N:
            raise ApiError(f"n must be between 1 and {MAX_N}, got {self.n}", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0.0:
                raise ApiError(f"{name} is not supported; leave it at 0", name)
        if any(not s for s in self.stop_strings):
            raise ApiError("stop strings must be non-empty", "stop")
        if len(self.stop_strings) > MAX_STOP:
            raise ApiError(f"at most {MAX_STOP} stop strings, got {len(self.stop_strings)}", "stop")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop_strings):
            raise ApiError(f"stop strings must be at most {MAX_STOP_CHARS} characters", "stop")

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def single_prompt(self) -> str | list[int]:
        """One prompt: a string, a token-id list, or a batch of exactly one of them."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ApiError("only one prompt per request is served (no batches)", "prompt")
            p = p[0]
        if not p:
            raise ApiError("prompt is empty", "prompt")
        return p

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.echo:
            raise ApiError("echo is not supported", "echo")
        if self.suffix:
            raise ApiError("suffix is not supported", "suffix")
        if self.best_of not in (None, 1):
            raise ApiError("best_of must be 1", "best_of")


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def sampling_params(
    req: CompletionRequest | ChatCompletionRequest, max_tokens: int, num_logprobs: int | None
) -> SamplingParams:
    """The engine's parameters. At least one logprob is asked of the engine whenever any are
    wanted, so the chosen token's own logprob is known whenever it is the top-1 (greedy)."""
    try:
        return SamplingParams(
            temperature=req.temperature,
            top_k=req.top_k,
            top_p=req.top_p,
            max_tokens=max_tokens,
            seed=req.seed,
            ignore_eos=req.ignore_eos,
            stop_token_ids=tuple(req.stop_token_ids),
            logprobs=None if num_logprobs is None else max(num_logprobs, 1),
            n=req.n,  # sample i draws with seed + i (SamplingParams.for_sample)
        )
    except InvalidRequest as err:
        raise ApiError(str(err), _field_named(str(err))) from err


def _field_named(message: str) -> str | None:
    """InvalidRequest messages start with the field they are about."""
    head = message.split(" ", 1)[0].strip(":")
    return head if head.isidentifier() else None


def invalid_request(err: InvalidRequest) -> ApiError:
    """Map an engine rejection to a 400 naming the field (prompt length/vocab -> prompt)."""
    msg = str(err)
    param = _field_named(msg)
    if param is None or param not in _KNOWN_PARAMS:
        param = "max_tokens" if "max_tokens" in msg else "prompt"
    return ApiError(msg, param)


_KNOWN_PARAMS = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }

"""OpenAI request bodies as pydantic models, their mapping to SamplingParams, and OpenAI-style
error bodies. Every rejection names the offending field, so a client can fix its request and the
engine never sees it."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from kvpage.errors import InvalidRequest, KVPageError
from kvpage.sampling_params import SamplingParams
from kvpage.structured_params import StructuredOutputsParams

MAX_LOGPROBS = 20
MAX_N = 16  # parallel samples per request: each one is a sequence of its own after prefill
MAX_STOP = 16  # stop strings per request: each one is searched for on every token
MAX_STOP_TOKEN_IDS = 1024  # each one is a set lookup per token; more is a mistake or an attack
MAX_STOP_CHARS = 256  # per stop string: the text held back from a stream is one less than this
MAX_TOOLS = 128  # tools and documents a chat template is given (the body's size bounds them too)
MAX_DOCUMENTS = 128


class ApiError(KVPageError):
    """An error the client caused (or must see), rendered in OpenAI's error shape."""

    def __init__(
        self, message: str, param: str | None = None, status: int = 400, kind: str = ""
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status
        self.kind = kind or ("invalid_request_error" if status == 400 else "server_error")


def error_body(message: str, kind: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object: the body of an error response, and a stream's error event."""
    return {"error": {"message": _printable(message), "type": kind, "param": param, "code": None}}


def error_response(err: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(err.message, err.kind, err.param), err.status, headers)


def unavailable(why: str) -> ApiError:
    """A 503 (draining or shutting down): one error type, the message says which."""
    return ApiError(f"{why}; retry elsewhere", None, 503, "service_unavailable")


def _printable(text: str) -> str:
    """A message may quote the client's text; a lone surrogate in it would fail UTF-8 encoding
    of the error body itself (a 500 in place of the 400)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def validation_error(exc: RequestValidationError) -> ApiError:
    """pydantic's complaint, with its location turned into the OpenAI `param`: the field, its
    exact place in the message. A union (`prompt` is a string or token ids) yields one error per
    alternative, each located under a tag such as `list[int]`: the param stops before the tag,
    and the message is the alternative that got furthest (for `[true, 2]`: param `prompt`,
    message `prompt.0: Input should be a valid integer`)."""
    errors = exc.errors()
    if not errors:
        return ApiError("invalid request body", None)
    if errors[0].get("type") == "json_invalid":
        return _json_error(errors[0])
    loc = _loc(errors[0])
    if not loc:
        return ApiError(_body_message(errors[0]), None)
    param = _field_of(_untagged(loc, stop_at_tag=True))
    same = [e for e in errors if _field_of(_untagged(_loc(e), stop_at_tag=True)) == param]
    best = max(same, key=lambda e: len(_loc(e)))  # the first of the deepest
    where = ".".join(_untagged(_loc(best), stop_at_tag=False))
    if best.get("type") == "extra_forbidden":  # the unknown key is the point: name it
        where = f"{where}.{_loc(best)[-1]}"
    return ApiError(f"{where}: {best.get('msg', 'invalid value')}", param)


def _field_of(path: list[str]) -> str:
    """`stop_token_ids.0` -> `stop_token_ids`; `messages.0.role` stays (a field of a message)."""
    while len(path) > 1 and path[-1].isdigit():
        path = path[:-1]
    return ".".join(path)


def _loc(error: dict) -> list[str | int]:
    loc = list(error.get("loc", ()))
    return loc[1:] if loc[:1] == ["body"] else loc


def _untagged(loc: list[str | int], stop_at_tag: bool) -> list[str]:
    """The location's field names and indices, without union tags (names no model has)."""
    out = []
    for part in loc:
        if isinstance(part, str) and part not in _FIELD_NAMES:
            if stop_at_tag:
                break
            continue
        out.append(str(part))
    return out


def _json_error(error: dict) -> ApiError:
    pos = _loc(error)
    # pydantic's reason may end in " at" already ("Unterminated string starting at")
    reason = (error.get("ctx") or {}).get("error", "").removesuffix(" at")
    where = f" at character {pos[0]}" if pos and isinstance(pos[0], int) else ""
    detail = f" ({reason}{where})" if reason or where else ""
    return ApiError(f"the request body is not valid JSON{detail}", None)


def _body_message(error: dict) -> str:
    if error.get("type") == "missing":
        return "the request body is empty: send a JSON object"
    return f"the request body must be a JSON object: {error.get('msg', 'invalid value')}"


# OpenAI and vLLM request fields that would change the output but are not implemented here, each
# with the values that mean "off" (accepted: a client may send the default explicitly). Any other
# value is refused by name rather than ignored. Fields that do not change the output (`user`,
# `metadata`, ...) are accepted and ignored.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "logit_bias": ({},),
    "min_p": (0,),
    "repetition_penalty": (1,),
    "length_penalty": (1,),
    "min_tokens": (0,),
    "use_beam_search": (False,),
    "include_stop_str_in_output": (False,),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "truncate_prompt_tokens": (),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "logits_processors": ([],),
    "prompt_embeds": (),
    "functions": ([],),
    "function_call": ("none", "auto"),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "reasoning_effort": (),
    "web_search_options": (),
    "echo": (False,),  # a field of completions; chat (vLLM) has it too
    "best_of": (1,),
}


def _is_off(value: Any, off: tuple[Any, ...]) -> bool:
    """None, or equal to an "off" value of the same kind (`false` is not 0, nor `1.0` True)."""
    if value is None:
        return True
    return any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in off)


def _lone_surrogate(value: Any, path: str) -> str | None:
    """The path of the first string (or key) holding a lone surrogate: JSON's `"\\ud800"`
    parses, but no UTF-8 encoder (tokenizer, cache salt digest, audit log) accepts it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, BaseModel):
        items = [(k, getattr(value, k)) for k in type(value).model_fields]
        items += list((value.model_extra or {}).items())
    elif isinstance(value, dict):
        items = [(k, k) for k in value] + list(value.items())
    elif isinstance(value, list):
        items = list(enumerate(value))
    else:
        return None
    for key, item in items:
        found = _lone_surrogate(item, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


def _check_unicode(body: BaseModel) -> None:
    bad_text = _lone_surrogate(body, "")
    if bad_text is not None:
        param = _field_of(bad_text.split("."))
        raise ApiError(f"{bad_text} is not valid Unicode (a lone surrogate)", param)


class _Strict(BaseModel):
    """No coercion: `"3"` is not 3, `true` is not 1, `2.0` is not a count (max_tokens, n...),
    and NaN or Infinity (which Python's JSON parser accepts) is not a number. Token ids are
    the exception (`TokenId`)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False)


def _integral(value: Any) -> Any:
    """JSON has one number type, and OpenAI's schema types token ids as numbers: a client may
    send `450.0` for token 450. Anything else (`450.5`, NaN, `true`, `"450"`) is left to the
    strict integer check, which refuses it by field."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


TokenId = Annotated[int, BeforeValidator(_integral)]


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    """response_format's json_schema (OpenAI's): the schema the reply's JSON follows."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is always enforced here


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(_Strict):
    """vLLM's `structured_outputs` request field: StructuredOutputsParams' fields, exactly one
    constraint of them (a field this server does not know is refused, never ignored)."""

    model_config = ConfigDict(
        strict=True, allow_inf_nan=False, extra="forbid", populate_by_name=True
    )

    # a schema (an object, or its JSON text), or true: any JSON value
    json_: dict[str, Any] | str | Literal[True] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None


class _Common(_Strict):
    """Fields shared by both endpoints; OpenAI names, plus vLLM's extensions (top_k, ignore_eos,
    stop_token_ids, cache_salt) and `return_token_ids` (token ids in each choice). Other fields
    are kept (`model_extra`) so that those known to change the output can be refused by name."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")

    model: str = ""
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    cache_salt: str | None = None
    return_token_ids: bool = False
    # vLLM's: every token in logprobs spelled `token_id:N` (kvpage.server.responses)
    return_tokens_as_token_ids: bool = False
    # vLLM's: special tokens in the text ("</s>") or left out (kvpage.model.tokenizer.
    # text_tokenizer); the spaces option is the slow tokenizers' and changes nothing here, as
    # in transformers' fast tokenizers (the ones tokenizer.json gives).
    skip_special_tokens: bool | None = True  # null: the default
    spaces_between_special_tokens: bool | None = True
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's extension
    # the output's constraint (kvpage.server.structured): OpenAI's and vLLM's fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None

    def check_unsupported(self) -> None:
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED and not _is_off(value, UNSUPPORTED[name]):
                raise ApiError(f"{name} is not supported by this server", name)
        _check_unicode(self)
        if self.stream_options is not None and not self.stream:
            raise ApiError("stream_options is only allowed when stream is true", "stream_options")
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
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: int | None = Field(16, ge=0)  # 0 only with echo: the prompt is scored alone
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts: one string or token-id list, or a batch (a list of either)."""
        p = self.prompt
        batch = p if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]
        for i, one in enumerate(batch):
            if not one:
                where = "prompt is empty" if len(batch) == 1 else f"prompt {i} is empty"
                raise ApiError(where, "prompt")
        return batch

    def single_prompt(self) -> str | list[int]:
        """The first prompt (a router's affinity key: a batch goes where its first one does)."""
        return self.prompts()[0]

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.max_tokens == 0 and not self.echo:
            raise ApiError("max_tokens must be >= 1 unless echo is true", "max_tokens")
        if self.suffix:
            raise ApiError("suffix is not supported", "suffix")
        if self.best_of not in (None, 1):
            raise ApiError("best_of must be 1", "best_of")

    @property
    def echo_logprobs(self) -> bool:
        """The echoed prompt carries logprobs: OpenAI scores it whenever logprobs are asked."""
        return self.echo and self.logprobs is not None

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Top k the engine computes per prompt token: vLLM's field, or the echo's k."""
        wanted = [k for k in (self.prompt_logprobs,) if k is not None]
        if self.echo_logprobs:
            wanted.append(self.logprobs)
        return max(wanted) if wanted else None


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    """An assistant message's call of a tool, as OpenAI's API spells it."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall

    def template_dict(self) -> dict[str, Any]:
        """The arguments as a dict where they are a JSON object (vLLM does the same: templates
        index them, or write them with `tojson`)."""
        call = self.model_dump()
        try:
            arguments = json.loads(self.function.arguments)
        except ValueError:
            return call
        if isinstance(arguments, dict):
            call["function"]["arguments"] = arguments
        return call


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None  # a tool message's answer to this call

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def template_dict(self) -> dict[str, Any]:
        """The message as a chat template sees it: content as text, and (as transformers does)
        no key whose value is null (templates test `is defined`, and would write "None")."""
        out: dict[str, Any] = {"role": self.role}
        if self.content is not None:
            out["content"] = self.text
        for key in ("name", "tool_call_id"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.tool_calls is not None:
            out["tool_calls"] = [call.template_dict() for call in self.tool_calls]
        return out


# transformers' names for what a render gets besides the template kwargs: a request sets them as
# fields of their own, not in chat_template_kwargs
RENDER_ARGUMENTS = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message"}
    | {"chat_template", "tokenize"}  # vLLM refuses these two in chat_template_kwargs as well
)


class _ChatTemplateFields(_Strict):
    """What a chat template renders besides the messages (transformers' apply_chat_template
    arguments, vLLM's request fields). `chat_template` names one of the model's templates."""

    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    documents: list[dict[str, Any]] | None = Field(None, max_length=MAX_DOCUMENTS)
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def check_template_fields(self) -> None:
        bad = sorted(RENDER_ARGUMENTS & (self.chat_template_kwargs or {}).keys())
        if bad:
            message = (
                f"chat_template_kwargs.{bad[0]}: set it as a request field, not a template kwarg"
            )
            raise ApiError(message, "chat_template_kwargs")
        if self.continue_final_message and self.add_generation_prompt:
            raise ApiError(
                "continue_final_message and add_generation_prompt cannot both be true: set "
                "add_generation_prompt to false to continue the final message",
                "continue_final_message",
            )


class ToolChoiceFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    """tool_choice naming the function the reply must call."""

    type: Literal["function"] = "function"
    function: ToolChoiceFunction


class ChatCompletionRequest(_ChatTemplateFields, _Common):
    messages: list[ChatMessage] = Field(min_length=1)
    # kvpage.server.tool_calls; None: "auto" where the server parses tool calls, else "none"
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def num_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError("top_logprobs needs logprobs set to true", "top_logprobs")
        self.check_template_fields()


class TokenizeRequest(_ChatTemplateFields):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: str = ""
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # None: True for a prompt, as chat does for messages
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ApiError("send exactly one of prompt and messages", "prompt")
        _check_unicode(self)  # the tokenizer cannot encode a lone surrogate (a 500, before)
        self.check_template_fields()


class DetokenizeRequest(_Strict):
    model: str = ""
    tokens: list[TokenId] = Field(max_length=1_000_000)


class Switch(_Strict):
    """An /admin switch (kvpage.server.admin): strict like every body, so `0` is not `false`."""

    enabled: bool
    tenant: str | None = None  # prefix caching: this tenant's namespace only
    cache_salt: str | None = None  # prefix caching: this salt's namespace only (open server)
    namespace: bool = False  # with neither tenant nor cache_salt: the unsalted namespace


class LoadLoraAdapter(_Strict):
    """POST /v1/load_lora_adapter (vLLM's body): load or reload adapter `lora_name`."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoraAdapter(_Strict):
    """POST /v1/unload_lora_adapter (vLLM's body)."""

    lora_name: str = Field(min_length=1, max_length=256)


def sampling_params(
    req: CompletionRequest | ChatCompletionRequest,
    max_tokens: int,
    num_logprobs: int | None,
    structured: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """The engine's parameters. The engine reports the chosen token's logprob apart from the top
    k, so `num_logprobs` (0 included) is asked for as it is. `structured`: the output's
    constraint (kvpage.server.structured)."""
    try:
        return SamplingParams(
            temperature=req.temperature,
            top_k=req.top_k,
            top_p=req.top_p,
            max_tokens=max_tokens,
            seed=req.seed,
            ignore_eos=req.ignore_eos,
            stop_token_ids=tuple(req.stop_token_ids),
            logprobs=num_logprobs,
            n=req.n,  # sample i draws with seed + i (SamplingParams.for_sample)
            prompt_logprobs=req.num_prompt_logprobs,
            structured_outputs=structured,
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
_FIELD_NAMES = _KNOWN_PARAMS.union(
    ChatMessage.model_fields,
    ContentPart.model_fields,
    ToolCall.model_fields,
    FunctionCall.model_fields,
    StreamOptions.model_fields,
    ResponseFormat.model_fields,
    JsonSchemaFormat.model_fields,
    {"schema", "json"},
    StructuredOutputsField.model_fields,
    NamedToolChoice.model_fields,
    ToolChoiceFunction.model_fields,
    TokenizeRequest.model_fields,  # so that a bad token id names `tokens`, not ""
    DetokenizeRequest.model_fields,
    Switch.model_fields,
)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }

"""Request bodies of the OpenAI-compatible API (pydantic v2) and the server's limits.

Every field is bounded before any work is done on it: string lengths in characters, list sizes,
numeric ranges. Types are strict (no "10" for 10, no "yes" for true); a null reads as the field's
default; unknown fields are ignored, as OpenAI clients send fields this server has no use for.
The limits that depend on the server (prompt characters, stops, prompts per request, n,
max_tokens) are checked by `Limits.check_*` after parsing, with the configured values in the
message.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    model_validator,
)

# Hard ceilings of the schema (the configurable limits are below them).
MAX_STR = 1 << 26  # characters of any one string field (the body cap binds first)
MAX_LIST = 1 << 16  # items of a prompt / message / tool list
MAX_TOKEN_LIST = 1 << 20  # ids of a token-id prompt
I64 = 1 << 63

Str = Annotated[StrictStr, Field(max_length=MAX_STR)]
Name = Annotated[StrictStr, Field(max_length=256)]
Id = Annotated[StrictInt, Field(ge=-I64, lt=I64)]
Number = Union[StrictInt, StrictFloat]


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """An explicit null for a field whose default is not null means "not given" (clients that
        serialise every field send `"n": null`, `"stream": null`), as OpenAI's API reads it."""
        if isinstance(data, dict):
            return {
                k: v
                for k, v in data.items()
                if not (
                    v is None and k in cls.model_fields and cls.model_fields[k].default is not None
                )
            }
        return data


class StreamOptions(_Model):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class _Sampling(_Model):
    model: Name | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[Number, Field(ge=0, le=1e4, allow_inf_nan=False)] | None = None
    top_p: Annotated[Number, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    top_k: Annotated[StrictInt, Field(ge=-1, le=1 << 24)] | None = None
    seed: Annotated[StrictInt, Field(ge=-I64, lt=1 << 64)] | None = None
    n: Annotated[StrictInt, Field(ge=1, le=1 << 10)] = 1
    max_tokens: Annotated[StrictInt, Field(ge=1, le=1 << 30)] | None = None
    stop: Str | Annotated[list[Str], Field(max_length=MAX_LIST)] | None = None
    stop_token_ids: Annotated[list[Id], Field(max_length=1024)] | None = None
    ignore_eos: StrictBool = False
    presence_penalty: Annotated[Number, Field(ge=-2, le=2, allow_inf_nan=False)] = 0
    frequency_penalty: Annotated[Number, Field(ge=-2, le=2, allow_inf_nan=False)] = 0
    logit_bias: Annotated[dict[Name, Number], Field(max_length=1024)] | None = None
    best_of: Annotated[StrictInt, Field(ge=1, le=1 << 10)] | None = None
    user: Name | None = None

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(_Sampling):
    prompt: Union[
        Str,
        Annotated[list[Id], Field(min_length=1, max_length=MAX_TOKEN_LIST)],
        Annotated[
            list[Union[Str, Annotated[list[Id], Field(min_length=1, max_length=MAX_TOKEN_LIST)]]],
            Field(min_length=1, max_length=MAX_LIST),
        ],
    ]
    echo: StrictBool = False
    suffix: Str | None = None
    logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None


class TextPart(_Model):
    type: Literal["text"]
    text: Str


class FunctionCall(_Model):
    name: Name
    arguments: Str | dict[str, Any] = "{}"


class ToolCall(_Model):
    id: Name | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Str | Annotated[list[TextPart], Field(max_length=MAX_LIST)] | None = None
    name: Name | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=1024)] | None = None
    tool_call_id: Name | None = None
    reasoning_content: Str | None = None

    def text(self) -> str:
        c = self.content
        if c is None:
            return ""
        return c if isinstance(c, str) else "".join(p.text for p in c)


class FunctionDef(_Model):
    name: Annotated[StrictStr, Field(min_length=1, max_length=256)]
    description: Str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(_Model):
    type: Literal["function"]
    function: FunctionDef


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: dict[str, Name]


class ChatRequest(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_LIST)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1, le=1 << 30)] | None = None
    tools: Annotated[list[Tool], Field(max_length=1024)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    chat_template_kwargs: Annotated[dict[Name, Any], Field(max_length=64)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    response_format: dict[str, Any] | None = None


@dataclasses.dataclass(frozen=True)
class Limits:
    """Per-request limits of the server (flags of `bole-jax serve`).

    max_body_bytes:    request body (413 beyond; checked on Content-Length and while reading).
    max_prompt_chars:  characters of one prompt or of all messages' contents together, checked
                       before tokenising (None: 8 x max context, at least 4096).
    max_prompts:       prompts of one completion request.
    max_n:             choices per prompt (`n`).
    max_stops:         stop strings per request.
    max_stop_chars:    characters of one stop string.
    max_tokens:        upper bound on a request's max_tokens (None: the max context).
    default_max_tokens: max_tokens of a request that gives none (capped by the context left).
    max_messages:      messages of one chat request.
    max_tools:         tools of one chat request.
    header_timeout_s:  a connection must deliver a whole request head within this after it opens
                       or after its previous response (slow or stalled clients are closed).
    body_timeout_s:    longest wait for the next piece of a request body (408 after), and for a
                       stream's client to take the next chunk (the connection is dropped after).
    keep_alive_s:      idle keep-alive connections are closed after this.
    shutdown_grace_s:  on SIGTERM / SIGINT, how long running requests may go on before they are
                       ended (finish_reason "length"); the server then exits.
    """

    max_body_bytes: int = 32 * 2**20
    max_prompt_chars: int | None = None
    max_prompts: int = 64
    max_n: int = 16
    max_stops: int = 16
    max_stop_chars: int = 256
    max_tokens: int | None = None
    default_max_tokens: int = 4096
    max_messages: int = 1024
    max_tools: int = 128
    header_timeout_s: float = 30.0
    body_timeout_s: float = 30.0
    keep_alive_s: float = 5.0
    shutdown_grace_s: float = 30.0

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is not None and not v > 0:
                flag = "--" + f.name.removesuffix("_s").replace("_", "-")
                raise ValueError(f"{flag} must be > 0, got {v}")

    def prompt_chars(self, max_context: int) -> int:
        return (
            self.max_prompt_chars
            if self.max_prompt_chars is not None
            else max(8 * max_context, 4096)
        )

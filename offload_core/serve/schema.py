"""The OpenAI request bodies the server reads (checked by pydantic: a field of the wrong type is one 400 line), the
responses and stream chunks it writes, and its errors as OpenAI's JSON (``{"error": {"message", "type", ...}}``)."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from offload_core.serve.logprobs import CHAT_TOP, COMPLETION_TOP

#: the error type OpenAI's clients read for each status
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class ApiError(Exception):
    """A request the server answers with ``status`` and one clear ``message`` (``param``: the field at fault)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        kind = ERROR_TYPES.get(self.status, "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class _Body(BaseModel):
    # strict: "5" is not a number, "true" not a boolean; fields OpenAI has and this server ignores are allowed
    model_config = ConfigDict(strict=True, extra="allow")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class StreamOptions(_Body):
    include_usage: bool = False


class _Generation(_Body):
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: Union[str, list[str], None] = None
    n: int = 1

    def stops(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4:
            raise ApiError(400, f"stop holds {len(stops)} strings; give at most 4", "stop")
        return tuple(s for s in stops if s)

    def check(self) -> None:
        if self.n != 1:
            raise ApiError(400, f"n={self.n}: this server returns one choice per request; give n=1", "n")

    def top(self) -> int | None:
        """How many alternatives each token's log-probability comes with; None: no log-probabilities asked."""
        raise NotImplementedError


class ChatRequest(_Generation):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=CHAT_TOP)

    def top(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true; send both", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Generation):
    prompt: Union[str, list[str]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=COMPLETION_TOP)

    @field_validator("prompt", mode="before")
    @classmethod
    def _text(cls, value: Any) -> Any:
        """A prompt is text: token ids (which OpenAI's API also takes) are one clear line, not a union's."""
        if isinstance(value, str) or (isinstance(value, list) and all(isinstance(item, str) for item in value)):
            return value
        raise ValueError("give the prompt as text (a string); token ids are not read here")

    def top(self) -> int | None:
        return self.logprobs

    def limit(self) -> int | None:
        return self.max_tokens

    def text(self) -> str:
        if isinstance(self.prompt, list):
            if len(self.prompt) != 1:
                raise ApiError(400, f"prompt holds {len(self.prompt)} prompts; give one (a string)", "prompt")
            return self.prompt[0]
        return self.prompt


def parse(kind: type[_Generation], body: Any) -> Any:
    """``body`` (decoded JSON) as a ``kind`` request, or one 400 line naming the first field at fault."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body is JSON {type(body).__name__}, not an object; send a JSON object")
    try:
        request = kind.model_validate(body)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "body"
        raise ApiError(400, f"{where}: {first['msg']} (got {first.get('input')!r:.60})", where) from None
    request.check()
    request.top()  # a contradiction between the log-probability fields is a 400 before any work
    return request


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def chat_response(
    rid: str, model: str, text: str, finish: str, use: dict[str, int], logprobs: dict | None = None
) -> dict[str, Any]:
    message = {"role": "assistant", "content": text}
    choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": logprobs}
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": use,
    }


def chat_chunk(
    rid: str, model: str, delta: dict, finish: str | None, use: dict | None = None, logprobs: dict | None = None
) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
    choices = [] if use is not None else [choice]
    chunk = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    if use is not None:
        chunk["usage"] = use
    return chunk


def completion_response(
    rid: str, model: str, text: str, finish: str | None, use: dict | None, logprobs: dict | None = None
) -> dict[str, Any]:
    """A text completion, or (``use`` None and no ``finish``) one chunk of its stream."""
    choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs}
    body = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model, "choices": [choice]}
    if use is not None:
        body["usage"] = use
    return body


def models_list(model: str, created: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"id": model, "object": "model", "created": created, "owned_by": "offload_core"}],
    }

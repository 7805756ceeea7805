"""The HTTP side (Starlette): OpenAI's routes read and checked, each request handed to the engine and its tokens sent
back whole or as server-sent events, a client that goes away cancelled, every error one OpenAI-style JSON line."""

from __future__ import annotations

import asyncio
import json
import secrets
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from offload_core.serve import schema
from offload_core.serve.engine import Draining, Engine, Event, QueueFull, Request
from offload_core.serve.logprobs import TokenLogprob, chat_logprobs, completion_logprobs
from offload_core.serve.sampling import Params
from offload_core.serve.schema import ApiError

#: seconds between checks that a client waiting for its tokens is still there (and SSE keep-alive comments)
POLL_S = 0.5


@dataclass
class Served:
    """What the routes need besides the engine: the model's name, how prompts become ids, the limits."""

    name: str
    encode_chat: Callable[[list[dict]], list[int]]
    encode_text: Callable[[str], list[int]]
    context: int
    max_tokens: int
    api_key: str | None = None
    created: int = 0


def build_app(engine: Engine, served: Served) -> Starlette:
    """The Starlette app serving ``engine``'s model under ``served.name``."""
    metrics = engine.metrics

    def endpoint(route: str, handle: Callable[[HttpRequest], Awaitable[Response]], open_: bool = False):
        async def wrapped(request: HttpRequest) -> Response:
            try:
                if not open_:
                    check_key(request, served.api_key)
                response = await handle(request)
            except ApiError as error:
                response = JSONResponse(error.body(), status_code=error.status)
            except Exception as error:  # a failure of this request alone: the server goes on
                response = JSONResponse(ApiError(500, f"{type(error).__name__}: {error}").body(), status_code=500)
            metrics.requests.labels(route, str(response.status_code)).inc()
            return response

        return wrapped

    async def health(request: HttpRequest) -> Response:
        status = "ok" if engine.admitting else "shutting down"
        return JSONResponse({"status": status, "model": served.name}, status_code=200 if engine.admitting else 503)

    async def models(request: HttpRequest) -> Response:
        return JSONResponse(schema.models_list(served.name, served.created))

    async def metrics_text(request: HttpRequest) -> Response:
        return Response(metrics.text(), media_type=metrics.content_type)

    async def chat(request: HttpRequest) -> Response:
        body = schema.parse(schema.ChatRequest, await read_json(request))
        check_model(body.model, served.name)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            ids = served.encode_chat(messages)
        except Exception as error:  # a template that cannot render these messages
            raise ApiError(400, f"the chat template cannot render these messages: {error}", "messages") from None
        return await generate(request, body, ids, chat=True)

    async def completions(request: HttpRequest) -> Response:
        body = schema.parse(schema.CompletionRequest, await read_json(request))
        check_model(body.model, served.name)
        text = body.text()
        try:
            ids = served.encode_text(text)
        except Exception as error:  # a tokenizer that cannot read this text
            raise ApiError(400, f"the prompt cannot be tokenized: {error}", "prompt") from None
        if not ids:
            raise ApiError(400, "prompt is empty: give some text", "prompt")
        response = await generate(request, body, ids, chat=False, echo=text if body.echo else "")
        return response

    async def generate(request: HttpRequest, body: Any, ids: list[int], chat: bool, echo: str = "") -> Response:
        limit = plan_tokens(len(ids), body.limit(), served, "messages" if chat else "prompt")
        params = Params(limit, body.temperature, body.top_p, body.seed, body.stops(), body.top())
        job = Request(ids, params)
        events = follow(engine, job, request)
        rid = schema.new_id("chatcmpl" if chat else "cmpl")
        if body.stream:
            first = await events.__anext__()  # a full queue is a 429 before the stream starts
            include = bool(body.stream_options and body.stream_options.include_usage)
            chunks = stream(rid, served.name, job, first, events, chat, include, echo)
            return StreamingResponse(chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        text, finish, tokens = [echo], None, []
        async for event in events:
            if event is None:
                continue
            if event.error:
                raise ApiError(500, event.error)
            text.append(event.text)
            tokens += event.logprobs
            finish = event.finish_reason
        use = schema.usage(len(ids), len(job.tokens))
        logprobs = rendered(tokens, params.logprobs, chat, len(echo))
        if chat:
            return JSONResponse(schema.chat_response(rid, served.name, "".join(text), finish, use, logprobs))
        return JSONResponse(schema.completion_response(rid, served.name, "".join(text), finish, use, logprobs))

    routes = [
        Route("/health", endpoint("/health", health, open_=True), methods=["GET"]),
        Route("/v1/models", endpoint("/v1/models", models), methods=["GET"]),
        Route("/metrics", endpoint("/metrics", metrics_text), methods=["GET"]),
        Route("/v1/chat/completions", endpoint("/v1/chat/completions", chat), methods=["POST"]),
        Route("/v1/completions", endpoint("/v1/completions", completions), methods=["POST"]),
    ]

    async def not_found(request: HttpRequest, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        what = "no such route" if status == 404 else f"{request.method} is not allowed here"
        error = ApiError(
            status,
            f"{what}: {request.method} {request.url.path}; the routes are "
            "/v1/chat/completions, /v1/completions, /v1/models, /health and /metrics",
        )
        return JSONResponse(error.body(), status_code=status)

    return Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found})


def rendered(tokens: list[TokenLogprob], asked: int | None, chat: bool, offset: int = 0) -> dict | None:
    """The ``logprobs`` field of a choice (or stream chunk) holding ``tokens``: None when the request asked none."""
    if asked is None:
        return None
    return chat_logprobs(tokens) if chat else completion_logprobs(tokens, offset)


def check_key(request: HttpRequest, key: str | None) -> None:
    if key is None:
        return
    given = request.headers.get("authorization", "")
    token = given[7:] if given.lower().startswith("bearer ") else ""
    if not secrets.compare_digest(token.encode(), key.encode()):
        raise ApiError(401, "the API key is missing or wrong: send the header Authorization: Bearer <key>")


def check_model(name: str, served: str) -> None:
    if name != served:
        raise ApiError(
            404, f"the model {name!r} does not exist here: this server serves {served!r}", "model", "model_not_found"
        )


async def read_json(request: HttpRequest) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as error:
        raise ApiError(400, f"the request body is not valid JSON ({error}); send a JSON object") from None


def plan_tokens(prompt: int, asked: int | None, served: Served, field: str = "messages") -> int:
    """The tokens a request may generate: what it asked for (default ``serve.max_tokens``) within the context
    (``field``: the request's field the prompt came in)."""
    room = served.context - prompt
    if room < 1:
        raise ApiError(
            400,
            f"the prompt holds {prompt} tokens, which fills the context of {served.context} tokens "
            "each request may hold (serve.context); shorten it",
            field,
        )
    if asked is None:
        return min(served.max_tokens, room)
    if asked > room:
        raise ApiError(
            400,
            f"max_tokens={asked} after a prompt of {prompt} tokens exceeds the context of "
            f"{served.context} tokens each request may hold (serve.context); give max_tokens={room} or "
            "less",
            "max_tokens",
        )
    return asked


async def follow(engine: Engine, job: Request, request: HttpRequest) -> AsyncIterator[Event]:
    """``job``'s events as the engine makes them (None every :data:`POLL_S` while there is none); the job is
    cancelled if its client goes away or the caller stops reading."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Event] = asyncio.Queue()

    def emit(event: Event) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, event)
        except RuntimeError:  # the event loop has closed: nobody is listening
            pass

    job.emit = emit
    try:
        engine.submit(job)
    except QueueFull:
        raise ApiError(429, "the server is busy: every slot is generating and the queue is full; retry later") from None
    except Draining:
        raise ApiError(503, "the server is shutting down and takes no new request") from None
    try:
        while True:
            try:
                event = await asyncio.wait_for(queue.get(), POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return
                yield None
                continue
            yield event
            if event.done:
                return
    finally:
        if not job.done:
            engine.cancel(job)


async def stream(rid, model, job, first, events, chat, include_usage, echo) -> AsyncIterator[str]:
    """The SSE lines of a streamed response: a role chunk (chat), a chunk per piece of text, the finishing chunk, the
    usage chunk when asked, then ``[DONE]``; an error mid-stream is an ``error`` object."""

    def line(body: dict) -> str:
        return f"data: {json.dumps(body)}\n\n"

    if chat:
        yield line(schema.chat_chunk(rid, model, {"role": "assistant", "content": ""}, None))
    elif echo:
        yield line(schema.completion_response(rid, model, echo, None, None))
    asked, offset = job.params.logprobs, len(echo)
    event = first
    while True:
        if event is None:
            yield ": keep-alive\n\n"
        elif event.error:
            yield line(ApiError(500, event.error).body())
            break
        else:
            if event.text or event.finish_reason or event.logprobs:
                logprobs = rendered(event.logprobs, asked, chat, offset)
                offset += sum(len(item.text) for item in event.logprobs)
                if chat:
                    delta = {"content": event.text} if event.text else {}
                    yield line(schema.chat_chunk(rid, model, delta, event.finish_reason, logprobs=logprobs))
                else:
                    body = schema.completion_response(rid, model, event.text, event.finish_reason, None, logprobs)
                    yield line(body)
            if event.done:
                if include_usage:
                    use = schema.usage(len(job.prompt), len(job.tokens))
                    if chat:
                        yield line(schema.chat_chunk(rid, model, {}, None, use))
                    else:
                        body = schema.completion_response(rid, model, "", None, use)
                        body["choices"] = []
                        yield line(body)
                break
        try:
            event = await events.__anext__()
        except StopAsyncIteration:
            break
    yield "data: [DONE]\n\n"

"""The OpenAI-compatible HTTP surface as plain code: `OpenAIServing` holds what every route
does, `build_openai_app(serving)` wires it into a FastAPI app.

The same app runs inside the Serve ingress deployment (its backend reaches `LLMServer`
replicas through a DeploymentHandle) and in-process in tests (its backend is an `LLMServer`
object), so the tests exercise the real routes.

A route checks the API key, validates the body against `cluster.protocol` (a bad one is a 400
with OpenAI's error JSON before anything reaches an engine), checks the model name, tokenizes
off the event loop (a huge prompt must not stall other clients; one whose byte length alone
proves it too long is refused before tokenizing), and forwards token ids to the backend. The
replica validates against the model (prompt too long, ids outside the vocabulary): its first
stream event says `Accepted` or `Rejected`, so a client's mistake is a 400 before any byte of the
response is sent. Leaving a stream early (the client disconnected) cancels the backend call,
which aborts the engine requests and frees their KV blocks.

The admin routes `POST /pause`, `POST /resume` and `GET /is_paused` (vLLM's) check the API key
too and act on every replica of the backend; each answers with every replica's status.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from tokenflow.cluster.chat_output import ChatOptions, ChatOutputParser
from tokenflow.cluster.errors import (
    OpenAIError,
    bad_request,
    install_error_handlers,
    internal_error,
    not_found,
    unauthorized,
)
from tokenflow.cluster.messages import Accepted, Finished, Rejected, Resend, StreamEvent
from tokenflow.cluster.prompts import PromptRenderer
from tokenflow.cluster.protocol import (
    SSE_DONE,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    PauseRequest,
    PauseStatusResponse,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
    parse_request,
)
from tokenflow.cluster.reasoning import reasoning_parser
from tokenflow.cluster.responses import ChatFormatter, CompletionFormatter, Formatter
from tokenflow.cluster.responses_api import ResponsesRequest
from tokenflow.cluster.responses_formatter import ResponsesFormatter
from tokenflow.cluster.tools import ToolPlan
from tokenflow.scheduler.pause import PauseState
from tokenflow.scheduler.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class GenerationStream(Protocol):
    """One request's stream of `StreamEvent`s from a backend; `cancel` abandons it."""

    def __aiter__(self) -> AsyncIterator[StreamEvent]: ...

    async def __anext__(self) -> StreamEvent: ...

    def cancel(self) -> None: ...


class GenerationBackend(Protocol):
    """Where requests go: `LLMServer` replicas, through a Serve handle or in-process."""

    def generate(self, prompts: list[list[int]], params: SamplingParams, request_id: str,
                 priority: int, received_time: float,
                 kv_transfer_params: dict[str, Any] | None = None,
                 streamed: bool = True) -> GenerationStream:
        """`streamed`: the client gets the answer as a stream (its response starts at once);
        a request that is not has had no byte of its answer until it ends."""

    async def model_info(self) -> dict[str, Any]: ...

    async def check_health(self) -> None:
        """Raise if no engine can serve requests; must answer at once, whatever the load."""

    async def pause(self, mode: PauseState) -> list[dict[str, Any]]:
        """Pause every replica (`LLMServer.pause`); returns each one's `pause_status()`."""

    async def resume(self) -> list[dict[str, Any]]:
        """Resume every replica; returns each one's `pause_status()`."""

    async def pause_status(self) -> list[dict[str, Any]]:
        """Every replica's `pause_status()`."""

    async def lora_adapters(self) -> list[list[str]]:
        """Each replica's registered LoRA adapters (`LLMServer.lora_adapters`)."""

    async def load_lora(self, name: str, path: str) -> list[dict[str, Any]]:
        """Register an adapter on every replica (`LLMServer.load_lora`)."""

    async def unload_lora(self, name: str) -> list[dict[str, Any]]:
        """Forget an adapter on every replica (`LLMServer.unload_lora`)."""


class _LocalStream:
    """A `GenerationStream` over an in-process async generator of events."""

    def __init__(self, events: AsyncIterator[StreamEvent]) -> None:
        self._events = events

    def __aiter__(self) -> AsyncIterator[StreamEvent]:
        return self

    async def __anext__(self) -> StreamEvent:
        return await self._events.__anext__()

    def cancel(self) -> None:
        # Closing the generator cancels its engine streams (aborts and frees the requests).
        asyncio.get_running_loop().create_task(self._events.aclose())  # type: ignore[attr-defined]


class LocalBackend:
    """A backend that is an `LLMServer` object in this process (tests, and a replica that is
    its own HTTP ingress)."""

    def __init__(self, server: Any, unstreamed_resend: Resend = Resend.NEVER) -> None:
        """`unstreamed_resend`: whether what stands before this replica sends a request
        again when this replica's process dies before the first byte of its answer (HAProxy
        does: `Resend.TO_A_PEER`), as for every request that is not streamed."""
        self._server = server
        self._unstreamed_resend = unstreamed_resend

    def generate(self, prompts: list[list[int]], params: SamplingParams, request_id: str,
                 priority: int, received_time: float,
                 kv_transfer_params: dict[str, Any] | None = None,
                 streamed: bool = True) -> _LocalStream:
        return _LocalStream(self._server.generate(
            prompts, params, request_id, priority, received_time, kv_transfer_params,
            resend=Resend.NEVER if streamed else self._unstreamed_resend))

    async def model_info(self) -> dict[str, Any]:
        return self._server.model_info()

    async def check_health(self) -> None:
        self._server.check_health()

    async def pause(self, mode: PauseState) -> list[dict[str, Any]]:
        return [await self._server.pause(mode)]

    async def resume(self) -> list[dict[str, Any]]:
        return [await self._server.resume()]

    async def pause_status(self) -> list[dict[str, Any]]:
        return [self._server.pause_status()]

    async def lora_adapters(self) -> list[list[str]]:
        return [await self._server.lora_adapters()]

    async def load_lora(self, name: str, path: str) -> list[dict[str, Any]]:
        return [await self._server.load_lora(name, path)]

    async def unload_lora(self, name: str) -> list[dict[str, Any]]:
        return [await self._server.unload_lora(name)]


def _json(model: BaseModel, status_code: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code, media_type="application/json")


async def _pause_args(request: Request) -> dict[str, Any] | bytes:
    """`/pause`'s arguments: the query string's `mode` if given, else the body (may be empty)."""
    if "mode" in request.query_params:
        return {"mode": request.query_params["mode"]}
    body = await request.body()
    return body if body.strip() else {}


# A request body this small tokenizes (or renders its chat template) in under half a
# millisecond, less than the hop to a worker thread and back: it does so on the event loop.
# A larger one goes to a thread, so that one long prompt does not hold up the other streams.
INLINE_TOKENIZE_BYTES = 2048
_T = TypeVar("_T")


async def _tokenize(body_size: int, fn: Callable[..., _T], *args: Any) -> _T:
    if body_size <= INLINE_TOKENIZE_BYTES:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


async def _first_event(stream: GenerationStream) -> Accepted:
    """Wait for the replica's verdict on the input: a Rejected one is the client's 400."""
    try:
        event = await stream.__anext__()
    except BaseException:
        stream.cancel()
        raise
    if isinstance(event, Rejected):
        if event.status_code != 400:
            raise OpenAIError(event.message, event.status_code, param=event.param,
                              retry_after_s=event.retry_after_s)
        raise bad_request(event.message, event.param)
    assert isinstance(event, Accepted), f"unexpected first event {event!r}"
    return event


async def _sse(stream: GenerationStream, fmt: Formatter) -> AsyncIterator[str]:
    """The SSE body. On any early exit (disconnect, failure), cancel the backend call."""
    complete = False
    try:
        for event in fmt.start_events():
            yield event
        async for item in stream:
            if isinstance(item, Finished):
                complete = True
                for event in fmt.done_events(item):
                    yield event
                return
            # One body chunk per item, however many events it holds: each chunk is a trip
            # through the ASGI stack and a write.
            events = fmt.stream_events(item)
            if SSE_DONE in events:  # a choice failed: the stream ends here
                yield "".join(events[:events.index(SSE_DONE) + 1])
                return
            if events:
                yield "".join(events)
    except asyncio.CancelledError:
        # The client went away: normal, and not worth a traceback.
        logger.debug("client disconnected from stream %s; its request is aborted", fmt.id)
        raise
    except Exception as exc:  # the backend broke mid-stream: tell the client, end cleanly
        yield fmt.error_event(exc)
        yield SSE_DONE
    finally:
        if not complete:
            stream.cancel()


async def _collect(stream: GenerationStream, fmt: Formatter) -> Response:
    """A whole (non-streamed) response; cancelled callers cancel the backend call too."""
    complete = False
    try:
        async for item in stream:
            if isinstance(item, Finished):
                complete = True
                return _json(fmt.response(item))
            fmt.add(item)
    except asyncio.CancelledError:
        logger.debug("client disconnected from request %s; it is aborted", fmt.id)
        raise
    finally:
        if not complete:
            stream.cancel()
    raise internal_error("the generation stream ended without its usage totals")


class OpenAIServing:
    """Owns the HTTP surface's logic: auth, validation, the model-name check, tokenization and
    the translation between OpenAI requests/responses and a backend's streams. Holds the
    tokenizer, no model weights."""

    def __init__(self, backend: GenerationBackend, model_name: str,
                 api_key: str | None = None, tokenizer: str | None = None,
                 chat: ChatOptions | None = None) -> None:
        self._chat = chat or ChatOptions()
        self._prompts = PromptRenderer(tokenizer or model_name, self._chat.chat_template)
        self._backend = backend
        self._model = model_name
        self._api_key = api_key or None
        self._max_model_len: int | None = None
        self._dynamic_loras = False  # model_info: unknown names may be adapters on disk
        self._adapters: set[str] = set()  # adapter names seen registered (refreshed on a miss)

    # ---------------------------------------------------------------------------- routes
    async def health(self) -> Response:
        """200 while an engine can serve; open without an API key (load balancers probe it)."""
        try:
            await self._backend.check_health()
        except Exception as exc:
            raise OpenAIError(f"the engine is not healthy: {exc}", 503,
                              retry_after_s=5) from exc
        return Response(status_code=200)

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        max_len = await self._get_max_model_len()
        self._adapters = await self._registered_adapters()
        cards = [ModelCard(id=self._model, root=self._model, max_model_len=max_len)]
        cards += [ModelCard(id=name, root=name, parent=self._model, max_model_len=max_len)
                  for name in sorted(self._adapters)]
        return _json(ModelList(data=cards))

    async def completions(self, request: Request) -> Response:
        received = time.time()
        self._authorize(request)
        body = await request.body()
        req = parse_request(CompletionRequest, body)
        params = req.to_sampling_params(default_max_tokens=None)
        params = dataclasses.replace(params, lora=await self._adapter(req.model))
        fmt = CompletionFormatter(params.lora or self._model, len(req.prompts) * req.n,
                                  req.include_usage,
                                  req.logprobs is not None)
        limit = await self._get_max_model_len()
        prompt_ids = await _tokenize(len(body), self._prompts.encode_all, req.prompts, limit)
        stream = self._backend.generate(prompt_ids, params, fmt.id, req.priority, received,
                                        req.kv_transfer_params, req.stream)
        return await self._respond(stream, fmt, req.stream)

    async def chat_completions(self, request: Request) -> Response:
        received = time.time()
        self._authorize(request)
        body = await request.body()
        req = parse_request(ChatCompletionRequest, body)
        tools = req.tool_plan(self._chat.tool_call_parser)
        params = req.to_sampling_params(default_max_tokens=None, tools=tools)
        params = dataclasses.replace(params, lora=await self._adapter(req.model))
        fmt = ChatFormatter(params.lora or self._model, req.n, req.include_usage, req.logprobs,
                            lambda: self.output_parser(tools, req.chat_template_kwargs))
        limit = await self._get_max_model_len()
        prompt_ids = await _tokenize(
            len(body), self._prompts.render_chat, req.conversation(), req.add_generation_prompt,
            req.chat_template_kwargs, limit, tools.template_tools)
        stream = self._backend.generate([prompt_ids], params, fmt.id, req.priority, received,
                                        req.kv_transfer_params, req.stream)
        return await self._respond(stream, fmt, req.stream)

    async def responses(self, request: Request) -> Response:
        """`POST /v1/responses`, OpenAI's Responses API (cluster/responses_api.py): one chat
        turn, its output as typed items. Nothing is stored: `store` is accepted and ignored,
        `previous_response_id` is a 400."""
        received = time.time()
        self._authorize(request)
        body = await request.body()
        req = parse_request(ResponsesRequest, body)
        tools = req.tool_plan(self._chat.tool_call_parser)
        params = req.to_sampling_params(tools)
        params = dataclasses.replace(params, lora=await self._adapter(req.model))
        fmt = ResponsesFormatter(req, params.lora or self._model, self.output_parser(tools))
        limit = await self._get_max_model_len()
        prompt_ids = await _tokenize(len(body), self._prompts.render_chat, req.chat_messages(),
                                     True, None, limit, tools.template_tools)
        stream = self._backend.generate([prompt_ids], params, fmt.id, 0, received,
                                        streamed=req.stream)
        return await self._respond(stream, fmt, req.stream)

    async def tokenize(self, request: Request) -> Response:
        self._authorize(request)
        req = parse_request(TokenizeRequest, await request.body())
        await self._adapter(req.model)
        messages = (None if req.messages is None
                    else [{"role": m.role, "content": m.text()} for m in req.messages])
        ids = await asyncio.to_thread(self._prompts.tokenize, req.prompt, messages,
                                      req.add_special_tokens, req.add_generation_prompt)
        return _json(TokenizeResponse(tokens=ids, count=len(ids),
                                      max_model_len=await self._get_max_model_len()))

    async def detokenize(self, request: Request) -> Response:
        self._authorize(request)
        req = parse_request(DetokenizeRequest, await request.body())
        await self._adapter(req.model)
        text = await asyncio.to_thread(self._prompts.detokenize, req.tokens)
        return _json(DetokenizeResponse(prompt=text))

    # ----------------------------------------------------------------------- LoRA routes
    async def load_lora_adapter(self, request: Request) -> Response:
        """`POST /v1/load_lora_adapter` (vLLM's): the adapter on every replica, or a 400 that
        says why not (already loaded, no adapter there, a rank or module the engine cannot
        take); then `model` may name it."""
        self._authorize(request)
        req = parse_request(LoadLoRAAdapterRequest, await request.body())
        if req.lora_name == self._model:
            raise bad_request(f"`{req.lora_name}` is the base model's name", "lora_name")
        results = await self._backend.load_lora(req.lora_name, req.lora_path)
        if errors := [r["error"] for r in results if r.get("error")]:
            raise bad_request(errors[0], "lora_path")
        self._adapters.add(req.lora_name)
        return Response(f"Success: LoRA adapter '{req.lora_name}' added successfully.",
                        media_type="text/plain")

    async def unload_lora_adapter(self, request: Request) -> Response:
        """`POST /v1/unload_lora_adapter` (vLLM's): a 404 when no replica had it."""
        self._authorize(request)
        req = parse_request(UnloadLoRAAdapterRequest, await request.body())
        results = await self._backend.unload_lora(req.lora_name)
        self._adapters.discard(req.lora_name)
        if not any(r.get("removed") for r in results):
            raise not_found(f"The lora adapter '{req.lora_name}' cannot be found.",
                            "lora_name", "lora_not_found")
        return Response(f"Success: LoRA adapter '{req.lora_name}' removed successfully.",
                        media_type="text/plain")

    # ---------------------------------------------------------------------- admin routes
    async def pause(self, request: Request) -> Response:
        """`POST /pause`, the mode (`new`, the default, or `all`) as `?mode=` or as the JSON
        body `{"mode": ...}`: pause every replica (`scheduler.PauseState`)."""
        self._authorize(request)
        req = parse_request(PauseRequest, await _pause_args(request))
        statuses = await self._backend.pause(PauseState.from_mode(req.mode))
        return _json(PauseStatusResponse.of(statuses))

    async def resume(self, request: Request) -> Response:
        """`POST /resume`: every replica schedules normally again."""
        self._authorize(request)
        return _json(PauseStatusResponse.of(await self._backend.resume()))

    async def is_paused(self, request: Request) -> Response:
        """`GET /is_paused`: whether every replica is paused, and whether all are idle."""
        self._authorize(request)
        return _json(PauseStatusResponse.of(await self._backend.pause_status()))

    # --------------------------------------------------------------------------- helpers
    def output_parser(self, tools: ToolPlan | None = None,
                      chat_template_kwargs: dict[str, Any] | None = None) -> ChatOutputParser:
        """A new parser of one choice's output: the configured reasoning parser (told whether
        the template was asked not to think), then the tool parser `tools` asks for
        (tokenflow/cluster/chat_output.py)."""
        reasoning = None
        if self._chat.reasoning_parser is not None:
            reasoning = reasoning_parser(self._chat.reasoning_parser, chat_template_kwargs)
        return ChatOutputParser(reasoning, None if tools is None else tools.output_parser())

    async def _get_max_model_len(self) -> int:
        if self._max_model_len is None:
            info = await self._backend.model_info()
            self._dynamic_loras = bool(info.get("dynamic_lora_path"))
            self._max_model_len = int(info["max_model_len"])
        return self._max_model_len

    def _authorize(self, request: Request) -> None:
        if self._api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise unauthorized("Missing API key: send it as 'Authorization: Bearer <key>'.")
        if not hmac.compare_digest(token.strip().encode(), self._api_key.encode()):
            raise unauthorized()

    async def _adapter(self, model: str | None) -> str | None:
        """The LoRA adapter a request's `model` names (vLLM's convention), None for the base
        model; a 404 for a name that is neither (an adapter under the engine's
        `dynamic_lora_path` is let through: the engine loads it, or refuses it, by name)."""
        if model is None or model == self._model:
            return None
        if model in self._adapters:
            return model
        await self._get_max_model_len()  # also reads whether adapters load on first use
        if self._dynamic_loras:
            return model
        self._adapters = await self._registered_adapters()
        if model in self._adapters:
            return model
        raise not_found(f"The model `{model}` does not exist.", "model", "model_not_found")

    async def _registered_adapters(self) -> set[str]:
        return {name for names in await self._backend.lora_adapters() for name in names}

    async def _respond(self, stream: GenerationStream, fmt: Formatter,
                       streaming: bool) -> Response:
        await _first_event(stream)
        if streaming:
            return StreamingResponse(_sse(stream, fmt), media_type="text/event-stream")
        return await _collect(stream, fmt)


def build_openai_app(serving: OpenAIServing) -> FastAPI:  # noqa: C901 (a def per route)
    """The FastAPI app of the OpenAI routes, each delegating to `serving`."""
    app = FastAPI(title="tokenflow", description="OpenAI-compatible API on Ray Serve")
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        return await serving.health()

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await serving.models(request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serving.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serving.chat_completions(request)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await serving.responses(request)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await serving.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await serving.detokenize(request)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        return await serving.load_lora_adapter(request)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        return await serving.unload_lora_adapter(request)

    @app.post("/pause")
    async def pause(request: Request) -> Response:
        return await serving.pause(request)

    @app.post("/resume")
    async def resume(request: Request) -> Response:
        return await serving.resume(request)

    @app.get("/is_paused")
    async def is_paused(request: Request) -> Response:
        return await serving.is_paused(request)

    return app

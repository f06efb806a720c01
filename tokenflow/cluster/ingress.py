"""`OpenAIIngress`: the OpenAI-compatible HTTP front door, a FastAPI app on Ray Serve.

It checks the API key, validates each body against `cluster.protocol` (a bad one is a 400 with
OpenAI's error JSON, before anything reaches an engine), checks the model name, tokenizes (and
renders chat templates), and forwards token ids to an `LLMServer` replica through a streaming
handle (DESIGN §1). The replica validates against the model (prompt too long, ids outside the
vocabulary, ...): its first stream event says `Accepted` or `Rejected`, so that a client's
mistake is a 400 before any byte of the response is sent. Routes read the raw body and validate it after the key check, so a request
without a valid key gets a 401 whatever its body.

Leaving a stream early (the client disconnected, or a choice failed) cancels the replica call,
which aborts the engine requests and frees their KV blocks.
"""

# No `from __future__ import annotations` here: FastAPI resolves route annotations at runtime,
# against the globals Serve captured when it pickled the routes; a string `"Request"` would not
# resolve there and FastAPI would take `request` for a query parameter.
import asyncio
import hmac
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from tokenflow.cluster.errors import (
    OpenAIError,
    bad_request,
    install_error_handlers,
    internal_error,
    not_found,
    unauthorized,
)
from tokenflow.cluster.messages import Accepted, Finished, Rejected
from tokenflow.cluster.prompts import PromptRenderer
from tokenflow.cluster.protocol import (
    SSE_DONE,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    parse_request,
)
from tokenflow.cluster.responses import ChatFormatter, CompletionFormatter, Formatter

HEALTH_TIMEOUT_S = 10.0

app = FastAPI(title="tokenflow", description="OpenAI-compatible API on Ray Serve")
install_error_handlers(app)


def _json(model: BaseModel, status_code: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code, media_type="application/json")


async def _first_event(stream: DeploymentResponseGenerator) -> Accepted:
    """Wait for the replica's verdict on the input: a Rejected one is the client's 400."""
    try:
        event = await stream.__anext__()
    except BackPressureError as exc:
        raise OpenAIError(f"the server is overloaded, retry later: {exc}", 503) from exc
    except BaseException:
        stream.cancel()
        raise
    if isinstance(event, Rejected):
        raise bad_request(event.message, event.param)
    return event


async def _sse(stream: DeploymentResponseGenerator, fmt: Formatter) -> AsyncIterator[str]:
    """The SSE body. On any early exit (disconnect, failure), cancel the replica call."""
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
            for event in fmt.stream_events(item):
                yield event
                if event == SSE_DONE:  # a choice failed: the stream ends here
                    return
    except Exception as exc:  # the replica call broke mid-stream: tell the client, end cleanly
        yield fmt.error_event(exc)
        yield SSE_DONE
    finally:
        if not complete:
            stream.cancel()


async def _collect(stream: DeploymentResponseGenerator, fmt: Formatter) -> Response:
    """A whole (non-streamed) response; cancelled callers cancel the replica call too."""
    complete = False
    try:
        async for item in stream:
            if isinstance(item, Finished):
                complete = True
                return _json(fmt.response(item))
            fmt.add(item)
    finally:
        if not complete:
            stream.cancel()
    raise internal_error("the generation stream ended without its usage totals")


# The helpers above must precede the class: `serve.ingress` pickles the routes by value when
# the class is decorated, capturing only the module globals that exist at that moment.
@serve.ingress(app)
class OpenAIIngress:
    """Owns the HTTP surface: auth, request validation, model-name check, tokenization, and the
    translation between OpenAI requests/responses and an LLMServer's streams. Holds the
    tokenizer, no model weights."""

    def __init__(self, server: DeploymentHandle, model_name: str,
                 api_key: str | None = None, tokenizer: str | None = None) -> None:
        self._prompts = PromptRenderer(tokenizer or model_name)
        self._server = server
        self._streaming = server.options(stream=True)
        self._model = model_name
        self._api_key = api_key or None
        self._max_model_len: int | None = None

    # ---------------------------------------------------------------------------- routes
    @app.get("/health")
    async def health(self) -> Response:
        """200 while an engine answers; open without an API key (load balancers probe it)."""
        try:
            await asyncio.wait_for(self._server.check_health.remote(), HEALTH_TIMEOUT_S)
        except Exception as exc:
            raise OpenAIError(f"the engine is not healthy: {type(exc).__name__}", 503) from exc
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        self._authorize(request)
        card = ModelCard(id=self._model, root=self._model,
                         max_model_len=await self._get_max_model_len())
        return _json(ModelList(data=[card]))

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        received = time.time()
        self._authorize(request)
        req = parse_request(CompletionRequest, await request.body())
        self._check_model(req.model)
        params = req.to_sampling_params(default_max_tokens=None)
        fmt = CompletionFormatter(self._model, len(req.prompts) * req.n, req.include_usage,
                                  req.logprobs is not None)
        prompt_ids = [self._prompts.encode(p) for p in req.prompts]
        stream = self._streaming.generate.remote(prompt_ids, params, fmt.id, req.priority,
                                                 received)
        return await self._respond(stream, fmt, req.stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        received = time.time()
        self._authorize(request)
        req = parse_request(ChatCompletionRequest, await request.body())
        self._check_model(req.model)
        params = req.to_sampling_params(default_max_tokens=None)
        fmt = ChatFormatter(self._model, req.n, req.include_usage, req.logprobs)
        prompt_ids = self._prompts.render_chat(req.conversation(), req.add_generation_prompt,
                                               req.chat_template_kwargs)
        stream = self._streaming.generate.remote([prompt_ids], params, fmt.id, req.priority,
                                                 received)
        return await self._respond(stream, fmt, req.stream)

    @app.post("/tokenize")
    async def tokenize(self, request: Request) -> Response:
        self._authorize(request)
        req = parse_request(TokenizeRequest, await request.body())
        self._check_model(req.model)
        messages = (None if req.messages is None
                    else [{"role": m.role, "content": m.text()} for m in req.messages])
        ids = self._prompts.tokenize(req.prompt, messages, req.add_special_tokens,
                                     req.add_generation_prompt)
        return _json(TokenizeResponse(tokens=ids, count=len(ids),
                                      max_model_len=await self._get_max_model_len()))

    @app.post("/detokenize")
    async def detokenize(self, request: Request) -> Response:
        self._authorize(request)
        req = parse_request(DetokenizeRequest, await request.body())
        self._check_model(req.model)
        return _json(DetokenizeResponse(prompt=self._prompts.detokenize(req.tokens)))

    # --------------------------------------------------------------------------- helpers
    async def _get_max_model_len(self) -> int:
        if self._max_model_len is None:
            info = await self._server.model_info.remote()
            self._max_model_len = info["max_model_len"]
        return self._max_model_len

    def _authorize(self, request: Request) -> None:
        if self._api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise unauthorized("Missing API key: send it as 'Authorization: Bearer <key>'.")
        if not hmac.compare_digest(token.strip().encode(), self._api_key.encode()):
            raise unauthorized()

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self._model:
            raise not_found(f"The model `{model}` does not exist.", "model", "model_not_found")

    async def _respond(self, stream: DeploymentResponseGenerator, fmt: Formatter,
                       streaming: bool) -> Response:
        await _first_event(stream)
        if streaming:
            return StreamingResponse(_sse(stream, fmt), media_type="text/event-stream")
        return await _collect(stream, fmt)

"""`OpenAIIngress`: the OpenAI-compatible HTTP front door as a Ray Serve deployment.

The routes are `openai_serving.build_openai_app`; this module only supplies their backend, the
`LLMServer` replicas behind a DeploymentHandle, and translates Ray's failures into what an HTTP
client can act on. A request whose replica dies mid-stream goes on on another replica
(`cluster.resume`) where it can; otherwise a dead or unreachable replica is a 503 with
`Retry-After` (the client may retry), an overloaded deployment (Serve's `max_queued_requests`)
likewise.

The admin routes (`/pause`, `/resume`, `/is_paused`) reach every `LLMServer` replica with
`DeploymentHandle.broadcast`: all replicas running when the call is made. Serve starts a new
replica (autoscaling, or replacing a dead one) unpaused; `/is_paused` shows it, and pausing
again reaches it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from tokenflow.cluster.chat_output import ChatOptions
from tokenflow.cluster.errors import OpenAIError, service_unavailable
from tokenflow.cluster.messages import Resend, StreamEvent
from tokenflow.cluster.openai_serving import OpenAIServing, build_openai_app
from tokenflow.cluster.resume import ResumingStream
from tokenflow.scheduler.pause import PauseState
from tokenflow.scheduler.sampling_params import SamplingParams

# A replica that died is replaced by Serve within seconds; an overload clears sooner.
REPLICA_GONE_RETRY_S = 5
OVERLOADED_RETRY_S = 1
# Every replica answers an admin call from its event loop at once, whatever its load.
ADMIN_TIMEOUT_S = 30
_REPLICA_GONE = (RayActorError, ActorUnavailableError, DeploymentUnavailableError)


def _replica_gone(exc: BaseException) -> OpenAIError:
    return service_unavailable(
        f"the model replica serving this request stopped ({type(exc).__name__}); retry the "
        "request", REPLICA_GONE_RETRY_S)


class _HandleStream:
    """One request's stream from one `LLMServer` replica, Serve's overload made HTTP's (a dead
    replica's errors go up as they are: `ResumingStream` decides what they become)."""

    def __init__(self, response: DeploymentResponseGenerator) -> None:
        self._response = response

    def __aiter__(self) -> AsyncIterator[StreamEvent]:
        return self

    async def __anext__(self) -> StreamEvent:
        try:
            return await self._response.__anext__()
        except BackPressureError as exc:
            raise service_unavailable(f"the server is overloaded, retry later: {exc}",
                                      OVERLOADED_RETRY_S) from exc

    def cancel(self) -> None:
        self._response.cancel()


class _HandleBackend:
    """Sends requests to the `LLMServer` deployment through its handle."""

    def __init__(self, server: DeploymentHandle) -> None:
        self._server = server
        self._streaming = server.options(stream=True)

    def generate(self, prompts: list[list[int]], params: SamplingParams, request_id: str,
                 priority: int, received_time: float,
                 kv_transfer_params: dict[str, Any] | None = None,
                 streamed: bool = True) -> ResumingStream:
        """The request's stream; should its replica die mid-stream, it goes on on another
        (`cluster.resume`), unless it carries KV-transfer parameters (a P/D leg). Streamed or
        not, the same: a replica that can serve no more ends its process under the request
        rather than fail it, and the request goes on elsewhere."""
        # A request for a LoRA adapter goes to a replica that holds it (adapter_routing).
        streaming = (self._streaming.options(multiplexed_model_id=params.lora) if params.lora
                     else self._streaming)

        def open_stream(prompts: list[list[int]], params: SamplingParams, request_id: str,
                        transfer: dict[str, Any] | None) -> _HandleStream:
            return _HandleStream(streaming.generate.remote(
                prompts, params, request_id, priority, received_time,
                transfer or kv_transfer_params, resend=Resend.ANYWHERE))

        return ResumingStream(open_stream, prompts, params, request_id, _REPLICA_GONE,
                              _replica_gone, enabled=kv_transfer_params is None)

    async def model_info(self) -> dict[str, Any]:
        return await self._server.model_info.remote()

    async def check_health(self) -> None:
        """Ask Serve's controller, not a replica: a call through the handle would queue behind
        every request when the replicas are busy. The controller health-checks each replica
        on its own channel and counts those that pass."""
        status = await asyncio.to_thread(serve.status)
        app = serve.get_replica_context().app_name
        deployment = status.applications[app].deployments[self._server.deployment_name]
        running = deployment.replica_states.get("RUNNING", 0)
        if not running:
            raise RuntimeError(f"no running {self._server.deployment_name} replica "
                               f"({deployment.status}: {deployment.message or 'no message'})")

    async def pause(self, mode: PauseState) -> list[dict[str, Any]]:
        return await broadcast(self._server, "pause", mode)

    async def resume(self) -> list[dict[str, Any]]:
        return await broadcast(self._server, "resume")

    async def pause_status(self) -> list[dict[str, Any]]:
        return await broadcast(self._server, "pause_status")

    async def lora_adapters(self) -> list[list[str]]:
        return await broadcast(self._server, "lora_adapters")

    async def load_lora(self, name: str, path: str) -> list[dict[str, Any]]:
        return await broadcast(self._server, "load_lora", name, path)

    async def unload_lora(self, name: str) -> list[dict[str, Any]]:
        return await broadcast(self._server, "unload_lora", name)


async def broadcast(server: DeploymentHandle, method: str, *args: Any) -> list[Any]:
    """Call `method` on every replica of `server`'s deployment. A replica that is gone, or no
    answer in time, is a 503: the calls are idempotent, so the client retries them all."""
    try:
        return await server.broadcast(method, *args).results_async(timeout_s=ADMIN_TIMEOUT_S)
    except _REPLICA_GONE as exc:
        raise service_unavailable(f"a model replica is unavailable ({type(exc).__name__}); "
                                  "retry", REPLICA_GONE_RETRY_S) from exc
    except TimeoutError as exc:
        raise service_unavailable(f"a model replica did not answer {method} within "
                                  f"{ADMIN_TIMEOUT_S} s; retry", REPLICA_GONE_RETRY_S) from exc


@serve.ingress()
class OpenAIIngress:
    """Owns the OpenAI routes of one application and their backend, the LLMServer handle.

    Serve builds the FastAPI app on the replica, after `__init__`, through
    `__serve_build_asgi_app__`."""

    def __init__(self, server: DeploymentHandle, model_name: str,
                 api_key: str | None = None, tokenizer: str | None = None,
                 chat: ChatOptions | None = None) -> None:
        self._serving = OpenAIServing(_HandleBackend(server), model_name, api_key, tokenizer,
                                      chat)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_openai_app(self._serving)

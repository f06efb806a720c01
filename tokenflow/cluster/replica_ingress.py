"""The LLMServer replica as its own HTTP ingress (serving modes `proxy` and `haproxy`).

`IngressLLMServer` is an `LLMServer` that also serves the OpenAI routes
(`openai_serving.build_openai_app`) on its event loop, over a backend that is the replica
itself: tokenization and chat templates run here, off the engine thread, and each stream's
events go straight from the engine's output queue to the HTTP response. No Ray message per
token, no second Python process.

`ReplicaRouter` is the ingress request router of the `haproxy` mode: HAProxy calls its
`POST /internal/route` once per request and forwards the request to the replica port it names.
The choice is the LLMServer deployment's own Serve request router
(`DeploymentHandle.choose_replica`), so whatever router that deployment is configured with
decides, in every mode.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from ray import serve
from ray.serve.exceptions import DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle

from tokenflow.cluster.adapter_routing import adapter_of
from tokenflow.cluster.chat_output import ChatOptions
from tokenflow.cluster.ingress import broadcast
from tokenflow.cluster.messages import Resend
from tokenflow.cluster.openai_serving import LocalBackend, OpenAIServing, build_openai_app
from tokenflow.cluster.server import LLMServer
from tokenflow.scheduler.pause import PauseState


class _ReplicaBackend(LocalBackend):
    """Generation, model info and health from this replica; the admin calls (pause, resume,
    their status) act on every replica of the deployment, as through the separate ingress."""

    def __init__(self, server: LLMServer, unstreamed_resend: Resend) -> None:
        super().__init__(server, unstreamed_resend)
        self._deployment: DeploymentHandle | None = None

    def _all_replicas(self) -> DeploymentHandle:
        if self._deployment is None:
            context = serve.get_replica_context()
            self._deployment = serve.get_deployment_handle(context.deployment,
                                                           context.app_name)
        return self._deployment

    async def pause(self, mode: PauseState) -> list[dict[str, Any]]:
        return await broadcast(self._all_replicas(), "pause", mode)

    async def resume(self) -> list[dict[str, Any]]:
        return await broadcast(self._all_replicas(), "resume")

    async def pause_status(self) -> list[dict[str, Any]]:
        return await broadcast(self._all_replicas(), "pause_status")

    async def lora_adapters(self) -> list[list[str]]:
        return await broadcast(self._all_replicas(), "lora_adapters")

    async def load_lora(self, name: str, path: str) -> list[dict[str, Any]]:
        return await broadcast(self._all_replicas(), "load_lora", name, path)

    async def unload_lora(self, name: str) -> list[dict[str, Any]]:
        return await broadcast(self._all_replicas(), "unload_lora", name)


@serve.ingress()
class IngressLLMServer(LLMServer):
    """An LLMServer replica that owns the OpenAI HTTP routes too (and their tokenizer).

    Serve builds the FastAPI app on the replica after `__init__`, through
    `__serve_build_asgi_app__`; the engine is loaded by then."""

    def __init__(self, engine_config: dict[str, Any], model_name: str,
                 api_key: str | None = None, tokenizer: str | None = None,
                 behind_haproxy: bool = False, **server_kwargs: Any) -> None:
        """`behind_haproxy`: the `haproxy` mode, whose HAProxy sends a request again when
        this process dies before the first byte of its answer. When the replica can serve no
        more, a request that is not streamed then waits for its process to end (and goes to
        another replica) instead of failing with a 503; behind Serve's proxy, which sends
        nothing again, it gets the 503."""
        super().__init__(engine_config, **server_kwargs)
        resend = Resend.TO_A_PEER if behind_haproxy else Resend.NEVER
        self._serving = OpenAIServing(_ReplicaBackend(self, resend), model_name,
                                      api_key, tokenizer,
                                      ChatOptions.from_engine(engine_config))

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_openai_app(self._serving)


@serve.ingress()
class ReplicaRouter:
    """Owns the choice of LLMServer replica for HAProxy (`POST /internal/route`): asks the
    deployment's Serve request router and answers with that replica's HTTP endpoint."""

    def __init__(self, server: DeploymentHandle, base_model: str = "",
                 reads_body: bool = True) -> None:
        """`base_model`: the base model's served name; any other `model` a request body
        names is a LoRA adapter, routed to a replica that holds it (`adapter_routing`).
        `reads_body`: whether the deployment's router uses the request (the prompt, the
        adapter); HAProxy sends the body either way, and a router balancing on load alone
        leaves it unparsed."""
        self._server = server
        self._server._init()  # the router must be running before the first route call
        self._base_model = base_model
        self._reads_body = reads_body

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = FastAPI(title="tokenflow ingress request router")

        @app.post("/internal/route")
        async def route(request: Request) -> dict[str, Any]:
            return await self.route(await request.body())

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok"}

        return app

    async def route(self, body: bytes) -> dict[str, Any]:
        """The replica for one request. HAProxy sends the client's body (with
        RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY=1, which `tokenflow serve` sets); where
        the router reads it, it sees the parsed request as its argument (a prefix-aware
        router needs the prompt; a request for a LoRA adapter goes where the adapter is
        held), else it balances on load alone."""
        args = _routing_args(body) if self._reads_body else ()
        server = self._server
        if args and (adapter := adapter_of(args[0], self._base_model)):
            server = server.options(multiplexed_model_id=adapter)
        # _reserve=False: the request itself goes through HAProxy, not this handle, so no
        # slot is reserved on the replica (the replica's own queue bound applies there).
        # `selection._replica` (Serve's, internal): the only place the replica's HTTP port is.
        try:
            async with server.choose_replica(*args, _reserve=False) as selection:
                replica = selection._replica
                endpoint = replica.backend_http_endpoint
                if endpoint is None:
                    raise HTTPException(503, f"replica {selection.replica_id} has no HTTP port")
                host, port = endpoint
                return {"host": host, "port": port,
                        "replica_id": replica.replica_id.to_full_id_str()}
        except DeploymentUnavailableError as exc:
            raise HTTPException(503, str(exc)) from exc


def _routing_args(body: bytes) -> tuple[Any, ...]:
    if not body:
        return ()
    try:
        data = json.loads(body)
    except ValueError:  # truncated by HAProxy's buffer, or not JSON: route on load
        return ()
    return (data,) if isinstance(data, dict) else ()

"""One pydantic config tree, end to end: YAML preset -> AppConfig -> Serve args -> EngineConfig.

Nothing here runs anything; the configs are frozen so that a component can hold one without
worrying that another changes it underneath.
"""

from __future__ import annotations

import logging
from enum import Enum
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

logger = logging.getLogger(__name__)

SCHEDULING_POLICIES = ("fcfs", "priority")
DEFAULT_MODEL = "tokenflow-tiny"


class ServingMode(str, Enum):
    """How HTTP requests reach the engine replicas (`cluster/serving_mode.py` has the Ray
    cluster switches each one needs)."""

    PROXY_INGRESS = "proxy_ingress"
    PROXY_INGRESS_GRPC = "proxy_ingress_grpc"
    PROXY = "proxy"
    HAPROXY = "haproxy"

    @property
    def replica_is_ingress(self) -> bool:
        """The LLMServer deployment serves HTTP itself (no OpenAIIngress deployment)."""
        return self in (ServingMode.PROXY, ServingMode.HAPROXY)

    def describe(self) -> str:
        return {
            ServingMode.PROXY_INGRESS: "Serve proxy -> OpenAIIngress -> LLMServer",
            ServingMode.PROXY_INGRESS_GRPC: "Serve proxy -> OpenAIIngress -> LLMServer, gRPC "
                                            "between deployments",
            ServingMode.PROXY: "Serve proxy -> LLMServer (its own HTTP ingress)",
            ServingMode.HAPROXY: "HAProxy -> LLMServer's own HTTP port (direct ingress), "
                                 "replica chosen by the Serve request router",
        }[self]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelConfig(_Frozen):
    """Which weights and tokenizer to load, and in which dtype."""

    model: str = DEFAULT_MODEL
    tokenizer: str | None = None
    served_model_name: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # auto: what the model's files hold (safetensors or gguf; dummy for tokenflow-tiny).
    load_format: Literal["auto", "safetensors", "gguf", "dummy"] = "auto"
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # CPU threads for the model's matmuls. None: every core this process may use. (Ray sets
    # OMP_NUM_THREADS to an actor's num_cpus, which would leave a replica single-threaded;
    # several replicas on one machine should each get their share.)
    num_threads: int | None = Field(default=None, ge=1)
    # Weight-only quantization of the linear layers on CPU (replica/models/quantized.py):
    # none keeps float weights; int8 (a scale per row) or int4 (groups of 32 with scale and
    # zero) keep the weights quantized and multiply them with bfloat16 inputs. auto: what the
    # weights are stored as, on CPU (a GGUF file of 4-bit blocks: int4; of 8-bit ones: int8),
    # none otherwise (float checkpoints, the GPU).
    quantization: Literal["auto", "none", "int8", "int4"] = "auto"
    # Compile each stage's layers with torch.compile (inductor) at startup: one graph for a
    # single token, one for each range of batch sizes the quantized layers switch kernels at
    # (replica/worker/compile.py). Off: eager PyTorch, as the tests run.
    compile: bool = False
    # A token's result never depends on what else the step holds (vLLM's
    # VLLM_BATCH_INVARIANT, made the default here): a request's greedy text is the same alone
    # or in any batch, with or without a prefix hit, chunked or whole, after an engine restart.
    # On the CPU every quantized layer multiplies any number of rows through one kernel whose
    # per-row arithmetic is fixed (no dense copy for large batches), and every query row,
    # decode or prompt, attends through the same kernel arithmetic. False: large batches take
    # the dense bfloat16 copies and decodes their own kernel (faster prompts; bench/README,
    # "Batch invariance"). Float (unquantized) layers multiply through oneDNN either way.
    batch_invariant: bool = True

    @property
    def name(self) -> str:
        return self.served_model_name or self.model


class CacheConfig(_Frozen):
    """Paged KV cache geometry: block size and either a block count or a memory budget."""

    block_size: int = Field(default=16, ge=1)
    num_blocks: int | None = Field(default=None, ge=1)
    kv_cache_memory_bytes: int = Field(default=512 * 1024 * 1024, ge=1)
    enable_prefix_caching: bool = True
    # The cache's element type (as vLLM's kv_cache_dtype). `auto`: the model's. `bfloat16` under
    # a float32 model halves what a decode step reads (K/V rounded as they are stored; every
    # path attends over the stored values, so paths stay token-exact with each other, not
    # with a float32 cache).
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"


class SchedulerConfig(_Frozen):
    """The token budget and the limits of one scheduling step."""

    max_num_batched_tokens: int = Field(default=2048, ge=1)
    # The model runner's request slots: no more requests than this are ever RUNNING.
    max_num_seqs: int = Field(default=128, ge=1)
    # The cap on admission into RUNNING (vLLM's max_num_active_seqs), at most max_num_seqs;
    # None: max_num_seqs. Lower, it admits fewer requests without resizing the runner.
    max_num_active_seqs: int | None = Field(default=None, ge=1)
    # None: take the model's max_position_embeddings (resolved by the engine).
    max_model_len: int | None = Field(default=None, ge=2)
    enable_chunked_prefill: bool = True
    # 0 disables the cap; otherwise no request prefills more than this many tokens in one step.
    long_prefill_token_threshold: int = Field(default=0, ge=0)
    policy: str = "fcfs"
    # A streaming-input session idle this long after its turn ends frees its KV blocks.
    session_idle_timeout_s: float = Field(default=60.0, gt=0)
    # "module:Class" of another scheduler with the same interface.
    scheduler_cls: str | None = None
    # Schedule step N+1 while step N runs (AsyncScheduler): the model never waits for the
    # scheduler and the output processing. One pipeline stage, no speculative decoding.
    async_scheduling: bool = False

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        if value not in SCHEDULING_POLICIES:
            raise ValueError(
                f"unknown scheduling policy {value!r}; valid: {', '.join(SCHEDULING_POLICIES)}"
            )
        return value

    @model_validator(mode="after")
    def _active_within_slots(self) -> SchedulerConfig:
        if self.max_num_active_seqs is not None and self.max_num_active_seqs > self.max_num_seqs:
            raise ValueError(f"max_num_active_seqs={self.max_num_active_seqs} exceeds "
                             f"max_num_seqs={self.max_num_seqs}: every running request "
                             "takes one of the runner's slots")
        return self

    @property
    def active_seqs_limit(self) -> int:
        """How many requests may be RUNNING at once."""
        return self.max_num_active_seqs or self.max_num_seqs


class ParallelConfig(_Frozen):
    """How a replica's layers are split over pipeline stages, and where the stages run."""

    pipeline_parallel_size: int = Field(default=1, ge=1)
    # auto: in this process for one stage, Ray actors (one per stage) for more.
    executor: Literal["auto", "inproc", "ray"] = "auto"
    # Layers per stage, first stage first (must sum to the model's layers); None: even split.
    stage_layers: list[int] | None = None
    # PACK keeps the stages on as few nodes as possible; SPREAD puts them on different nodes.
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    # What each stage actor reserves: CPUs on CPU, one GPU (and these CPUs) on GPU.
    stage_num_cpus: float = Field(default=1.0, ge=0)
    # auto: nccl when the stages run on GPUs, gloo on CPUs.
    distributed_backend: Literal["auto", "gloo", "nccl"] = "auto"
    # A stage that has not answered a step for this long is taken for dead.
    step_timeout_s: float = Field(default=600.0, gt=0)
    # A dead stage is built again in place (its requests start over from their tokens) at
    # most this many times a minute; one more death fails the requests and the replica (a
    # request or memory that kills it would otherwise do so forever). 0: never rebuild.
    stage_rebuilds_per_minute: int = Field(default=3, ge=0)
    # How the engine sends each step to the stages. compiled_graph (a Ray Compiled Graph)
    # answers in well under a millisecond, but its reads spin: the driver burns a whole core
    # while it waits. actor_calls (plain Ray calls) cost a few ms a step and no idle CPU.
    # auto: compiled_graph when the stages run on GPUs (a spare core is cheap there),
    # actor_calls on CPUs, where the spinning core is one the stages need (bench/README.md).
    pipeline_control: Literal["auto", "compiled_graph", "actor_calls"] = "auto"

    @model_validator(mode="after")
    def _stage_layers_match(self) -> ParallelConfig:
        if self.stage_layers is not None:
            if len(self.stage_layers) != self.pipeline_parallel_size:
                raise ValueError(f"stage_layers has {len(self.stage_layers)} entries for "
                                 f"pipeline_parallel_size={self.pipeline_parallel_size}")
            if min(self.stage_layers) < 1:
                raise ValueError("every stage needs at least one layer")
        return self

    @property
    def uses_ray(self) -> bool:
        return self.executor == "ray" or (self.executor == "auto"
                                          and self.pipeline_parallel_size > 1)


class SpeculativeConfig(_Frozen):
    """Speculative decoding: who drafts, and how many tokens a step verifies at most. `ngram`
    (prompt lookup) drafts the tokens that followed the last occurrence of the request's latest
    n tokens, n from `prompt_lookup_max` down to `prompt_lookup_min`."""

    method: Literal["ngram"] | None = None
    num_speculative_tokens: int = Field(default=4, ge=1)
    prompt_lookup_min: int = Field(default=2, ge=1)
    prompt_lookup_max: int = Field(default=4, ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> SpeculativeConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must be <= prompt_lookup_max")
        return self


class KVTransferConfig(_Frozen):
    """Moving KV blocks between engines (prefill/decode disaggregation): which connector, this
    engine's role, and how long transfers may take and published blocks may wait."""

    # "torch_p2p", "ray_object_store", or "module:Class" of a user's connector; None: off.
    connector: str | None = None
    role: Literal["producer", "consumer", "both"] = "both"
    # A load that takes longer fails (the consumer then computes the prompt itself).
    load_timeout_s: float = Field(default=30.0, gt=0)
    # A producer keeps a finished request's published blocks this long for its consumer.
    lease_s: float = Field(default=30.0, gt=0)


class KVOffloadConfig(_Frozen):
    """A second KV tier for prefix blocks evicted from the primary pool (kv/connector/
    offload_*.py): `cpu`, a pool in process memory (pinned on a GPU replica); `disk`, one file
    per block under `path`. `size_gb` bounds the tier of each pipeline stage (its layers'
    share of every block). A later request whose prefix was evicted loads it back from here
    instead of recomputing it; none: off."""

    backend: Literal["none", "cpu", "disk"] = "none"
    size_gb: float = Field(default=4.0, gt=0)
    # The disk tier's directory (each stage of each engine writes a subdirectory of its own,
    # removed at shutdown); required with backend: disk.
    path: str | None = None

    @model_validator(mode="after")
    def _disk_needs_a_path(self) -> KVOffloadConfig:
        if self.backend == "disk" and not self.path:
            raise ValueError("kv_offload.backend: disk needs kv_offload.path (a directory)")
        return self

    @property
    def enabled(self) -> bool:
        return self.backend != "none"


class KVEventsConfig(_Frozen):
    """Publishing KV-cache events (blocks stored, removed, all cleared) in vLLM's wire format:
    msgpack batches on a ZeroMQ PUB socket, as vLLM's `KVEventsConfig` sets them up. A replica
    advertises the endpoints it bound, with its node's IP (`LLMServer.kv_events_endpoints`)."""

    enabled: bool = False
    # Bound on every interface; port 0 picks a free one (several replicas share a node).
    endpoint: str = "tcp://*:0"
    # A ROUTER socket that resends buffered batches from a requested sequence number; None: off.
    replay_endpoint: str | None = None
    topic: str = ""
    # How many past batches (one per engine step with events) the replay socket can resend.
    buffer_steps: int = Field(default=10_000, ge=1)
    # ZeroMQ's high-water mark of the PUB socket (messages queued per slow subscriber).
    hwm: int = Field(default=100_000, ge=1)

    @model_validator(mode="after")
    def _tcp_endpoints(self) -> KVEventsConfig:
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"{name} must be a ZeroMQ address (tcp://host:port, ipc://, "
                                 f"inproc://), got {value!r}")
        return self


class StructuredOutputsConfig(_Frozen):
    """Grammar-constrained decoding (JSON schema, regex, choice, EBNF) with xgrammar: how JSON
    may be laid out, and how many threads compile grammars (off the engine thread)."""

    backend: Literal["xgrammar"] = "xgrammar"
    # vLLM's option: JSON on one line with ", " and ": " separators, no other whitespace.
    disable_any_whitespace: bool = False
    # Otherwise at most this many whitespace characters between JSON elements: a model must
    # not be able to fill its whole budget with newlines (weak and random models do).
    max_whitespace: int = Field(default=8, ge=1)
    compile_threads: int = Field(default=2, ge=1)


class LoRAConfig(_Frozen):
    """Multi-LoRA serving: PEFT adapters over the base weights, requests of different adapters
    (and of the base model) in one batch. Adapter weights live in `max_loras` slots per
    pipeline stage (loaded on demand, least recently used evicted to CPU memory, which holds
    `max_cpu_loras` and drops the least recently used: read again from disk). `max_loras` is
    also the most distinct adapters one step runs (the scheduler holds back the rest). 0: off."""

    max_loras: int = Field(default=0, ge=0)
    # Adapters of a larger rank are refused; smaller ones are zero-padded to it.
    max_lora_rank: int = Field(default=16, ge=1)
    max_cpu_loras: int | None = Field(default=None, ge=1)  # None: max_loras
    # Adapters registered at start: name -> local PEFT directory (adapter_config.json and
    # adapter_model.safetensors).
    lora_modules: dict[str, str] = Field(default_factory=dict)
    # A directory whose subdirectories are adapters: a request naming an unknown adapter
    # found there as `<dir>/<name>` registers it on first use.
    dynamic_lora_path: str | None = None

    @model_validator(mode="after")
    def _needs_slots(self) -> LoRAConfig:
        if (self.lora_modules or self.dynamic_lora_path) and not self.max_loras:
            raise ValueError("lora.lora_modules / dynamic_lora_path need lora.max_loras >= 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError("lora.max_cpu_loras must be >= lora.max_loras")
        return self

    @property
    def enabled(self) -> bool:
        return self.max_loras > 0

    @property
    def cpu_loras(self) -> int:
        return self.max_cpu_loras or self.max_loras


class EngineConfig(_Frozen):
    """Everything one engine replica needs to build its scheduler, cache and workers."""

    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    parallel: ParallelConfig = ParallelConfig()
    kv_transfer: KVTransferConfig = KVTransferConfig()
    kv_offload: KVOffloadConfig = KVOffloadConfig()
    kv_events: KVEventsConfig = KVEventsConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()
    structured_outputs: StructuredOutputsConfig = StructuredOutputsConfig()
    lora: LoRAConfig = LoRAConfig()
    # The chat side of the OpenAI API (the ingress renders prompts and parses outputs; the
    # engine never reads these). chat_template: a .jinja file, or a template shipped in
    # tokenflow/assets/chat_templates by name (`smollm2-tools`: SmolLM2's own template plus
    # tools), in place of the model's; None: the model's own.
    chat_template: str | None = None
    # How `tool_choice: auto` output becomes tool calls: `hermes` (<tool_call>{...}</tool_call>,
    # SmolLM2, Qwen, Hermes) or `llama3_json` (a bare {"name", "parameters"} object, Llama 3.x).
    tool_call_parser: Literal["hermes", "llama3_json"] = "hermes"
    # Split <think>...</think> into `reasoning_content`: `qwen3` or `deepseek_r1`; None: off.
    reasoning_parser: Literal["qwen3", "deepseek_r1"] | None = None
    # Where AsyncEngine (a served replica) runs the step loop: a thread of the serving process,
    # or a process of its own (the engine and the HTTP event loop then use two cores, not one
    # GIL: bench/README.md). The process runs the model itself, so not with Ray stage actors or
    # the Ray object-store connector; auto: the process wherever it can.
    engine_loop: Literal["auto", "thread", "process"] = "auto"

    @model_validator(mode="after")
    def _engine_loop_fits(self) -> EngineConfig:
        if self.engine_loop == "process" and self._needs_ray_in_the_engine:
            raise ValueError("engine_loop: process runs the model in an engine process without "
                             "Ray; pipeline stages on Ray actors and the ray_object_store "
                             "connector need engine_loop: thread (or auto)")
        return self

    @property
    def _needs_ray_in_the_engine(self) -> bool:
        return self.parallel.uses_ray or self.kv_transfer.connector == "ray_object_store"

    @property
    def uses_engine_process(self) -> bool:
        """Whether AsyncEngine runs the step loop in a process of its own."""
        return self.engine_loop == "process" or (self.engine_loop == "auto"
                                                 and not self._needs_ray_in_the_engine)

    @model_validator(mode="after")
    def _async_scheduling_supported(self) -> EngineConfig:
        # A step scheduled ahead feeds the token its own worker sampled a step before: the
        # first stage of a pipeline never sees it, and drafts are verified a step too late.
        if self.scheduler.async_scheduling:
            if self.parallel.uses_ray:
                raise ValueError("async_scheduling runs with the in-process executor (one "
                                 "stage; a pipeline keeps a batch in flight per stage anyway)")
            if self.speculative.method is not None:
                raise ValueError("async_scheduling does not support speculative decoding")
        return self


def resolve_max_model_len(config: EngineConfig, model_max_len: int, num_blocks: int) -> int:
    """The engine's one context limit: the configured value (default: the model's), capped by
    what the KV cache can ever hold and, without chunked prefill, by one step's token budget
    (a preempted request recomputes all its tokens in one step)."""
    sched = config.scheduler
    wanted = sched.max_model_len
    if wanted is not None and wanted > model_max_len:
        raise ValueError(f"max_model_len={wanted} exceeds the model's "
                         f"max_position_embeddings={model_max_len}")
    limit = min(wanted or model_max_len, num_blocks * config.cache.block_size)
    if not sched.enable_chunked_prefill:
        limit = min(limit, sched.max_num_batched_tokens)
    if wanted is not None and limit < wanted:
        logger.warning("max_model_len lowered from %d to %d: the KV cache of %d blocks (or, "
                       "without chunked prefill, one step's budget) cannot hold more",
                       wanted, limit, num_blocks)
    return limit


class AutoscalingConfig(_Frozen):
    """Ray Serve autoscaling: Serve's knobs (a subset of serve.config.AutoscalingConfig) and
    which policy decides. `llm` (`cluster.autoscaling.LLMAutoscalingPolicy`) scales on what the
    engines report: running and waiting requests, KV-cache usage and recent TTFT against
    `ttft_slo_s`. `ongoing_requests` is Serve's default policy (ongoing requests per replica
    against target_ongoing_requests only)."""

    min_replicas: int = Field(default=1, ge=0)
    max_replicas: int = Field(default=2, ge=1)
    initial_replicas: int | None = Field(default=None, ge=0)
    policy: Literal["llm", "ongoing_requests"] = "llm"
    # Running + waiting requests a replica should hold (both policies).
    target_ongoing_requests: float = Field(default=8.0, gt=0)
    # `llm` only: more waiting requests per replica than this adds a replica whatever the rest
    # says; KV usage and TTFT (90th percentile over the last 10 s) have targets of their own;
    # scale down only to a count that keeps every signal under downscale_headroom x target.
    max_waiting_per_replica: float = Field(default=2.0, ge=0)
    target_kv_cache_usage: float = Field(default=0.8, gt=0, le=1)
    ttft_slo_s: float | None = Field(default=2.0, gt=0)
    downscale_headroom: float = Field(default=0.6, gt=0, lt=1)
    upscale_delay_s: float = Field(default=5.0, ge=0)
    downscale_delay_s: float = Field(default=30.0, ge=0)
    # How often replicas report to the controller, and the window Serve averages them over.
    metrics_interval_s: float = Field(default=2.0, gt=0)
    look_back_period_s: float = Field(default=10.0, gt=0)

    @model_validator(mode="after")
    def _ordered(self) -> AutoscalingConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must be <= max_replicas")
        if self.look_back_period_s <= self.metrics_interval_s:
            raise ValueError("look_back_period_s must be longer than metrics_interval_s")
        return self

    def serve_options(self) -> dict[str, Any]:
        """The deployment's `autoscaling_config` for Serve."""
        options = self.model_dump(include={
            "min_replicas", "max_replicas", "initial_replicas", "target_ongoing_requests",
            "upscale_delay_s", "downscale_delay_s", "metrics_interval_s", "look_back_period_s"},
            exclude_none=True)
        if self.policy == "llm":
            options["policy"] = {
                "policy_function": "tokenflow.cluster.autoscaling:LLMAutoscalingPolicy",
                "policy_kwargs": self.model_dump(include={
                    "target_ongoing_requests", "max_waiting_per_replica",
                    "target_kv_cache_usage", "ttft_slo_s", "downscale_headroom"})}
        return options


class DeploymentConfig(_Frozen):
    """How the LLMServer deployment is replicated and placed."""

    num_replicas: int | None = Field(default=1, ge=1)
    autoscaling_config: AutoscalingConfig | None = None
    # Serve queues a request at the handle (router) once each replica holds this many. High by
    # default: the engine's waiting queue is the real queue, and anything queued at the handle
    # (health checks and stats calls included) would wait behind every request.
    max_ongoing_requests: int = Field(default=1024, ge=1)
    # Backpressure: requests a replica holds beyond the max_num_seqs it can run; one more is
    # refused at once with a 503 and Retry-After (OpenAI's error shape), in every serving
    # mode, instead of waiting without limit. None: no bound.
    max_queued_requests: int | None = Field(default=None, ge=0)
    # The Serve request router that picks each request's replica: Serve's power of two
    # choices, or the prefix-aware one (`cluster.prefix_router`), which keeps requests with a
    # common prompt prefix on the replica that caches it while the load stays balanced: it
    # falls back to power of two choices while the busiest replica holds more than
    # `router_imbalanced_threshold` requests beyond the idlest. Or, in the `haproxy` serving
    # mode only, no Serve request router: HAProxy sends each request to the replica with the
    # fewest open connections itself, without its per-request call to the ingress request
    # router (0.5-1.5 ms of TTFT at concurrency 1 on 2 cores; bench/README.md), and without prefix affinity.
    # kv_aware (`cluster.kv_router`): by where the replicas' own KV-cache events say each
    # prefix is cached, weighed against their KV load (it turns engine.kv_events on, with
    # replay, for the deployment's replicas).
    request_router: Literal["power_of_two", "prefix_aware", "kv_aware",
                            "least_connections"] = "power_of_two"
    router_imbalanced_threshold: int = Field(default=8, ge=0)
    # kv_aware: the weight of a block to prefill against a block held by the replica's
    # requests; a prompt cached whole is worth this many requests of imbalance (bench/README.md,
    # "The KV-aware router": 8 kept 83% of prompt tokens cached where 4 kept 73%).
    router_overlap_weight: float = Field(default=8.0, ge=0)
    ray_actor_options: dict[str, Any] = Field(default_factory=lambda: {"num_cpus": 1})

    @property
    def router_reads_prompt(self) -> bool:
        """Whether the request router routes on the prompt (and so needs it from HAProxy)."""
        return self.request_router in ("prefix_aware", "kv_aware")

    @model_validator(mode="after")
    def _one_of(self) -> DeploymentConfig:
        if self.autoscaling_config is not None and self.num_replicas not in (None, 1):
            raise ValueError("set either num_replicas or autoscaling_config, not both")
        return self


class PrefillConfig(_Frozen):
    """The prefill side of a disaggregated application: its own engine and deployment."""

    engine: EngineConfig = EngineConfig()
    deployment: DeploymentConfig = DeploymentConfig()


class AppConfig(_Frozen):
    """One application: the engine, how it is deployed, and the HTTP front door. With
    `prefill`, `engine`/`deployment` are the decode side and the prefill side runs apart."""

    engine: EngineConfig = EngineConfig()
    deployment: DeploymentConfig = DeploymentConfig()
    prefill: PrefillConfig | None = None
    api_key: str | None = None
    # How HTTP reaches the replicas (`cluster.serving_mode`): a property of the Ray cluster
    # too, which `tokenflow serve` sets up and a cluster started otherwise must match.
    serving_mode: ServingMode = ServingMode.HAPROXY
    # Streams send the first token at once, then at most one chunk per interval (0: each step).
    stream_interval_s: float = Field(default=0.0, ge=0)
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    route_prefix: str = "/"

    @property
    def router_reads_body(self) -> bool:
        """Whether the request router reads the request's body (HAProxy sends it in every
        `haproxy` app): to route on the prompt, or on the LoRA adapter it names."""
        return self.deployment.router_reads_prompt or self.engine.lora.max_loras > 0

    @model_validator(mode="after")
    def _router_fits_the_mode(self) -> AppConfig:
        if (self.deployment.request_router == "least_connections"
                and self.serving_mode is not ServingMode.HAPROXY):
            raise ValueError("deployment.request_router least_connections is HAProxy's own "
                             "balancing: it needs serving_mode haproxy")
        if (self.prefill is not None
                and self.prefill.deployment.request_router == "least_connections"):
            raise ValueError("prefill.deployment.request_router: the prefill replicas are "
                             "called through a Serve handle, which needs a Serve request "
                             "router (power_of_two, prefix_aware or kv_aware)")
        return self

    @model_validator(mode="after")
    def _disaggregation_is_consistent(self) -> AppConfig:
        if self.prefill is None:
            return self
        decode, prefill = self.engine.kv_transfer, self.prefill.engine.kv_transfer
        if decode.connector is None or decode.connector != prefill.connector:
            raise ValueError("with prefill, engine.kv_transfer.connector and "
                             "prefill.engine.kv_transfer.connector must name the same connector")
        if prefill.role == "consumer" or decode.role == "producer":
            raise ValueError("the prefill engine produces KV (role producer or both) and the "
                             "decode engine consumes it (role consumer or both)")
        if self.prefill.engine.model.model != self.engine.model.model:
            raise ValueError("prefill and decode must serve the same model")
        return self


class ConfigError(ValueError):
    """A config file that does not validate; the message names each bad field by its path."""


def _format_errors(err: ValidationError, source: str) -> str:
    lines = [f"invalid config {source}:"]
    for item in err.errors():
        path = ".".join(str(p) for p in item["loc"]) or "<root>"
        lines.append(f"  {path}: {item['msg']}")
    return "\n".join(lines)


def load_app_config(source: str | Path | dict[str, Any] | None) -> AppConfig:
    """Validate a YAML file path or a dict into an AppConfig; errors name the field path."""
    if source is None:
        return AppConfig()
    if isinstance(source, dict):
        data, name = source, "<dict>"
    else:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        data, name = yaml.safe_load(path.read_text()) or {}, str(path)
        if not isinstance(data, dict):
            raise ConfigError(f"invalid config {name}: top level must be a mapping")
    try:
        return AppConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_errors(err, name)) from None


# Flat overrides accepted next to a config: name -> path in the AppConfig.
FLAT_OVERRIDES: dict[str, tuple[str, ...]] = {
    "model": ("engine", "model", "model"),
    "api_key": ("api_key",),
}


def app_config_from_args(args: dict[str, Any] | None) -> AppConfig:
    """Validate Serve-style `args` into an AppConfig; errors name the bad field's path."""
    args = dict(args or {})
    overrides = {k: args.pop(k) for k in list(args) if k in FLAT_OVERRIDES}
    path = args.pop("config", None)
    if path is not None and args:
        raise ConfigError(f"give either 'config' or an inline config, not both "
                          f"(also got: {', '.join(sorted(args))})")
    config = load_app_config(path if path is not None else args)
    if not overrides:
        return config
    data = config.model_dump(exclude_unset=True)
    for key, value in overrides.items():
        if value is not None:
            _set_path(data, FLAT_OVERRIDES[key], value)
    return load_app_config(data)


def _set_path(data: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        data = data.setdefault(key, {})
    data[path[-1]] = value

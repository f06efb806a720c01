"""The KV-transfer connector API, split as vLLM V1 splits it: a scheduler half that decides
what moves, and a worker half (one per pipeline stage) that moves it.

Vocabulary. A *producer* engine computes a prompt's KV for another engine (its request carries
`kv_transfer_params={"do_remote_decode": True}`); it *publishes* the request's blocks when its
prefill completes and returns where they are in the request's `kv_transfer_params`. A
*consumer* engine receives a request carrying those params (`do_remote_prefill`); instead of
computing the prompt it *loads* the blocks, asynchronously, while the request waits in
WAITING_FOR_REMOTE_KVS.

Everything here is plain data or an interface: no torch, no Ray (the transports import them).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

SpecT = TypeVar("SpecT")


class RemoteRequest(Protocol):
    """The request fields a connector reads (kv/ never imports the scheduler)."""

    request_id: str
    num_prompt_tokens: int
    num_computed_tokens: int
    num_tokens: int
    kv_transfer_params: dict[str, Any] | None


@dataclass
class LoadSpec:
    """Load blocks [first_block, first_block + len(block_ids)) of a remote request's prompt
    into this engine's `block_ids`."""

    req_id: str
    block_ids: list[int]
    first_block: int
    remote: dict[str, Any]  # the producer's kv_transfer_params


@dataclass
class SaveSpec:
    """Publish the blocks holding a request's first `num_tokens` tokens (its prompt)."""

    req_id: str
    block_ids: list[int]
    num_tokens: int


@dataclass
class ConnectorMeta:
    """What the workers must start loading and publishing in one step (pickles small)."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    releases: list[str] = field(default_factory=list)  # published requests to forget

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves or self.releases)


@dataclass
class KVConnectorOutput:
    """What one worker (one stage) reports after a step: transfers that ended, and what it
    published. The scheduler half merges the reports of every stage."""

    # Published requests whose every layer on this stage its consumers finished reading (all
    # the consumer's stages that read them, not just one); each stage reports a request once.
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: dict[str, str] = field(default_factory=dict)  # req_id -> why
    published: dict[str, dict[str, Any]] = field(default_factory=dict)  # req_id -> descriptor
    bytes_received: int = 0
    seconds_receiving: float = 0.0

    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.failed_recving
                    or self.published)


@dataclass
class LoadResult:
    """How a request's remote load ended, once every stage reported."""

    req_id: str
    ok: bool
    reason: str = ""


@dataclass
class PendingLoad(Generic[SpecT]):
    """One request's load while its stages report: the scheduler half of every connector
    that loads (transfers, the offload tier) keeps one per request."""

    spec: SpecT
    started: bool = False  # a worker has it
    cancelled: bool = False
    done: int = 0  # stages that reported
    failures: list[str] = field(default_factory=list)

    def stage_reported(self, failure: str | None, num_stages: int) -> bool:
        """Count one stage's report; True once every stage reported."""
        self.done += 1
        if failure is not None:
            self.failures.append(failure)
        return self.done >= num_stages

    def result(self, req_id: str) -> LoadResult:
        return LoadResult(req_id, not self.failures and not self.cancelled,
                          "; ".join(self.failures))


class KVConnectorScheduler(ABC):
    """The scheduler half: which tokens of a request can come from elsewhere, what the workers
    must load and publish each step, and when a producer may free a finished request's blocks.
    """

    @abstractmethod
    def get_num_new_matched_tokens(self, request: RemoteRequest,
                                   num_computed: int) -> tuple[int, bool]:
        """Tokens past `num_computed` (local prefix hits) available remotely, and whether they
        load asynchronously (the request then waits in WAITING_FOR_REMOTE_KVS)."""

    @abstractmethod
    def update_state_after_alloc(self, request: RemoteRequest, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        """The request now holds `block_ids` (its whole table); the remote tokens go there."""

    @abstractmethod
    def build_connector_meta(self, sched_out: Any) -> ConnectorMeta:
        """This step's loads and publishes, for the workers (`sched_out.kv_connector_metadata`)."""

    @abstractmethod
    def request_finished(self, request: RemoteRequest, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """A request finished: whether its blocks must outlive it (a consumer will read them),
        and the `kv_transfer_params` to return to the client."""

    @abstractmethod
    def update_connector_output(self, outputs: list[KVConnectorOutput]) -> None:
        """Fold in one step's worker reports (one per stage)."""

    @abstractmethod
    def take_finished_loads(self) -> list[LoadResult]:
        """Loads that ended (every stage reported) since the last call."""

    @abstractmethod
    def take_releasable(self, now: float) -> list[str]:
        """Finished requests whose blocks may now be freed: read in full by their consumer (by
        every consumer stage that reads them), or past their lease."""

    @abstractmethod
    def cancel_load(self, req_id: str) -> bool:
        """Forget a load the request no longer wants; True if workers may still be writing its
        blocks (free them only once the load is reported finished)."""

    @abstractmethod
    def has_pending_transfers(self) -> bool:
        """Loads in flight or blocks held for a consumer: the engine must keep stepping."""

    def take_stats(self) -> tuple[int, float, int]:
        """(bytes received, seconds spent receiving, failed loads) since the last call."""
        return 0, 0.0, 0


class KVConnectorWorker(ABC):
    """The worker half, in every stage: moves this stage's layers' blocks."""

    # Whether `start_load_kv` copies out blocks the step evicts (before the forward, or a
    # transfer's loads, may write over them): such a part starts first in a composite.
    stores_evicted_blocks = False

    @abstractmethod
    def register_kv_caches(self, kv_caches: list[Any], layer_range: tuple[int, int]) -> None:
        """The stage's cache tensors, `[2, num_blocks, block_size, kv_heads, head_dim]` each,
        for layers [start, end) of the model."""

    @abstractmethod
    def start_load_kv(self, meta: ConnectorMeta) -> None:
        """Start this step's loads (they finish in the background)."""

    def wait_for_layer_load(self, layer: int) -> None:
        """Block until `layer`'s loads landed. Loads here complete before their request is
        scheduled (it waits in WAITING_FOR_REMOTE_KVS), so by the time a layer runs there is
        nothing to wait for."""
        return None

    @abstractmethod
    def save_kv_layer(self, layer: int, meta: ConnectorMeta) -> None:
        """`layer` has written this step's KV: take what this step must publish from it."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Finish this step's publishes (after the forward, before the step returns)."""

    @abstractmethod
    def get_finished(self, wait_s: float = 0.0) -> KVConnectorOutput:
        """Transfers that ended since the last call, and this step's publishes.

        `wait_s`: how long the call may block for a transfer to end when none has yet. The
        worker passes 0 in a step that computed something (return at once), and a little in a
        step that only polls transfers, so that an engine waiting on loads does not spin. An
        implementation may return as soon as it has something, or ignore it and never wait.
        """

    def shutdown(self) -> None:
        """Stop background work (threads, servers)."""
        return None

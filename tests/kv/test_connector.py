"""The KV-transfer connector's halves on their own, without engines or Ray: a producer frees
published blocks only once every consumer stage that reads them is done, and a user's connector,
written to the base classes and named `module:Class`, is loaded and driven as tokenflow's are."""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.checkpoints import write_checkpoint
from tests.replica.test_engine import with_tokenizer
from tokenflow.config import (
    CacheConfig,
    EngineConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
)
from tokenflow.kv.connector import (
    ConnectorMeta,
    KVConnectorOutput,
    KVConnectorScheduler,
    KVConnectorWorker,
    LoadSpec,
    SaveSpec,
    create_scheduler_connector,
    create_worker_connector,
)
from tokenflow.kv.connector.scheduler_side import TransferScheduler
from tokenflow.kv.connector.torch_p2p import TorchP2PTransport
from tokenflow.kv.connector.worker_side import TransferWorker
from tokenflow.replica.engine.llm import LLM
from tokenflow.scheduler import SamplingParams

LAYERS, BLOCK, KV_HEADS, HEAD_DIM, NUM_BLOCKS = 4, 4, 2, 8, 8


def _caches(num_layers: int, seed: int | None) -> list[torch.Tensor]:
    """Random caches (a producer's), or zeros (seed None: a consumer's)."""
    shape = (2, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)
    if seed is None:
        return [torch.zeros(shape) for _ in range(num_layers)]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for _ in range(num_layers)]


def _worker(layers: tuple[int, int], seed: int | None) -> TransferWorker:
    worker = TransferWorker(TorchP2PTransport("gloo", 10.0), 10.0)
    worker.register_kv_caches(_caches(layers[1] - layers[0], seed), layers)
    return worker


def _publish(producer: TransferWorker, req_id: str, block_ids: list[int]) -> dict[str, Any]:
    """Run the producer's publish of one request as a step that completes its prompt does."""
    meta = ConnectorMeta(saves=[SaveSpec(req_id, block_ids, len(block_ids) * BLOCK)])
    for layer in range(*producer.layer_range):
        producer.save_kv_layer(layer, meta)
    producer.wait_for_save()
    return producer.get_finished().published[req_id]


def _load(consumer: TransferWorker, spec: LoadSpec) -> None:
    """Load `spec` on one consumer stage and wait until it reports the load finished."""
    consumer.start_load_kv(ConnectorMeta(loads=[spec]))
    deadline = time.monotonic() + 30
    out = KVConnectorOutput()
    while spec.req_id not in out.finished_recving:
        assert time.monotonic() < deadline, "the load never finished"
        out = consumer.get_finished(0.05)
        assert not out.failed_recving, out.failed_recving
    _barrier(consumer, spec.remote["stages"][0])


def _barrier(consumer: TransferWorker, stage: dict[str, Any]) -> None:
    """Return once the producer saw every done `consumer` sent it: a control connection's
    messages are handled in order, so it has once it answered another pull (of no layers,
    which reads nothing)."""
    consumer.transport.fetch(stage, [0], 10.0, (0, 0))


def test_a_producer_frees_only_once_every_consumer_stage_read_its_layers() -> None:
    """A one-stage producer, a consumer of two stages (layers [0, 2) and [2, 4)): both read the
    producer's one stage; the first one's done must not free the blocks the second still
    reads."""
    producer = _worker((0, LAYERS), seed=0)
    consumers = [_worker((0, 2), None), _worker((2, LAYERS), None)]
    try:
        descriptor = _publish(producer, "r", [1, 2, 3])
        spec = LoadSpec("r", [5, 6, 7], 0, {"stages": [descriptor]})
        _load(consumers[0], spec)
        assert "r" not in producer.get_finished().finished_sending
        _load(consumers[1], spec)
        assert producer.get_finished().finished_sending == {"r"}
        source = torch.stack(producer.kv_caches)[:, :, [1, 2, 3]]
        loaded = torch.cat([torch.stack(c.kv_caches) for c in consumers])[:, :, [5, 6, 7]]
        assert torch.equal(loaded, source)
        # Reported once: a later done (a retry) does not count it again.
        _load(consumers[0], spec)
        assert "r" not in producer.get_finished().finished_sending
    finally:
        for worker in [producer, *consumers]:
            worker.shutdown()


def test_released_blocks_are_no_longer_tracked() -> None:
    """A request released (its lease expired) before anyone read it is never reported."""
    producer, consumer = _worker((0, LAYERS), seed=1), _worker((0, LAYERS), None)
    try:
        descriptor = _publish(producer, "r", [1, 2])
        producer.start_load_kv(ConnectorMeta(releases=["r"]))
        consumer.start_load_kv(ConnectorMeta(loads=[LoadSpec("r", [3, 4], 0,
                                                             {"stages": [descriptor]})]))
        deadline = time.monotonic() + 30
        while not consumer.get_finished(0.05).failed_recving:  # zeros: checksums fail
            assert time.monotonic() < deadline, "the load never ended"
        _barrier(consumer, descriptor)
        assert not producer.get_finished().finished_sending
    finally:
        producer.shutdown()
        consumer.shutdown()


# ------------------------------------------------------------------ a user's connector
class RecordingWorker(KVConnectorWorker):
    """A user's worker half written to the base class: moves nothing, records every wait the
    worker passed to `get_finished`."""

    def __init__(self) -> None:
        self.waits: list[float] = []
        self.layer_range = (0, 0)

    def register_kv_caches(self, kv_caches: list[Any], layer_range: tuple[int, int]) -> None:
        self.layer_range = layer_range

    def start_load_kv(self, meta: ConnectorMeta) -> None:
        return None

    def save_kv_layer(self, layer: int, meta: ConnectorMeta) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, wait_s: float = 0.0) -> KVConnectorOutput:
        self.waits.append(wait_s)
        return KVConnectorOutput()


WORKERS: list[RecordingWorker] = []  # every worker half built, for the tests to look at


class UserConnector:
    """A connector as a user names it (`module:Class`): tokenflow's scheduler half, which
    finds nothing remote for plain requests, and the recording worker half."""

    def scheduler(self, config: KVTransferConfig, *, block_size: int, num_stages: int,
                  get_block_ids: Callable[[str], list[int]]) -> KVConnectorScheduler:
        return TransferScheduler(name="user", engine_id="user", block_size=block_size,
                                 num_stages=num_stages, lease_s=config.lease_s,
                                 holds_blocks=False, get_block_ids=get_block_ids)

    def worker(self, config: KVTransferConfig, backend: str) -> KVConnectorWorker:
        WORKERS.append(RecordingWorker())
        return WORKERS[-1]


USER_CONNECTOR = f"{__name__}:UserConnector"


def test_get_finished_takes_the_wait_the_worker_passes() -> None:
    """worker.py calls `get_finished(wait)`: the base class declares that argument, so a
    connector written to it accepts the call."""
    signature = inspect.signature(KVConnectorWorker.get_finished)
    signature.bind(RecordingWorker(), 0.01)  # as the worker calls it
    signature.bind(RecordingWorker())  # and without a wait
    assert signature.parameters["wait_s"].default == 0.0


def test_a_user_connector_named_module_and_class_is_loaded() -> None:
    config = KVTransferConfig(connector=USER_CONNECTOR)
    scheduler = create_scheduler_connector(config, block_size=16, num_stages=1,
                                           get_block_ids=lambda req_id: [])
    assert isinstance(scheduler, TransferScheduler) and scheduler.name == "user"
    worker = create_worker_connector(config, "gloo")
    assert worker is WORKERS[-1]
    with pytest.raises(ValueError, match="module:Class"):
        create_worker_connector(KVTransferConfig(connector="no_such_connector"), "gloo")


def test_an_engine_drives_a_user_connector(tmp_path) -> None:
    """An engine runs with the user's connector as with none, calling its worker half every
    step, with the waits worker.py passes."""
    path = with_tokenizer(write_checkpoint(tmp_path, "llama", num_hidden_layers=2))

    def run(connector: str | None) -> list[int]:
        llm = LLM(config=EngineConfig(
            model=ModelConfig(model=str(path), num_threads=1),
            cache=CacheConfig(block_size=16, num_blocks=32),
            scheduler=SchedulerConfig(max_model_len=128),
            kv_transfer=KVTransferConfig(connector=connector)))
        try:
            [out] = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=4, ignore_eos=True,
                                                                   temperature=0.0),
                                 use_tqdm=False)
        finally:
            llm.shutdown()
        return out.outputs[0].token_ids

    built = len(WORKERS)
    assert run(USER_CONNECTOR) == run(None)
    assert len(WORKERS) == built + 1
    waits = WORKERS[-1].waits
    assert len(waits) >= 4 and all(isinstance(w, float) for w in waits)

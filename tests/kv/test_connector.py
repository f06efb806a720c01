"""The KV-transfer connector's halves on their own, without engines or Ray: a producer frees
published blocks only once every consumer stage that reads them is done."""

from __future__ import annotations

import time
from typing import Any

import torch

from tokenflow.kv.connector import (
    ConnectorMeta,
    KVConnectorOutput,
    LoadSpec,
    SaveSpec,
)
from tokenflow.kv.connector.torch_p2p import TorchP2PTransport
from tokenflow.kv.connector.worker_side import TransferWorker

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

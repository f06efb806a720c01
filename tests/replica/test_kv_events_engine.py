"""An engine publishes its KV-cache events on real ZeroMQ sockets, as vLLM does: one batch per
step with events, consecutive sequence numbers, block hashes a router can compute from the
prompt, and a replay socket that resends what a dropped subscriber missed."""

from __future__ import annotations

import time
from typing import Any

import pytest
import zmq

from tests.kv.test_kv_events import VllmAllBlocksCleared, VllmKVEventBatch
from tokenflow.config import EngineConfig
from tokenflow.kv.hashing import extend_block_hashes
from tokenflow.replica.engine.kv_event_publisher import END_OF_REPLAY, advertised
from tokenflow.replica.engine.llm import LLM
from tokenflow.scheduler import SamplingParams

BLOCK = 16
TOPIC = "kv@test"


@pytest.fixture(scope="module")
def llm():
    config = EngineConfig.model_validate({
        "model": {"model": "tokenflow-tiny"},
        "cache": {"num_blocks": 24, "block_size": BLOCK},
        "scheduler": {"max_model_len": 256},
        "kv_events": {"enabled": True, "endpoint": "tcp://127.0.0.1:0",
                      "replay_endpoint": "tcp://127.0.0.1:0", "topic": TOPIC,
                      "buffer_steps": 1000}})
    llm = LLM(config=config)
    yield llm
    llm.shutdown()


def _subscribe(endpoint: str) -> zmq.Socket:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
    sub.connect(endpoint)
    time.sleep(0.3)  # a PUB socket drops what it sends before the subscription arrives
    return sub


def _receive(sub: zmq.Socket, timeout_s: float = 5.0) -> list[tuple[int, Any]]:
    """Every message until none arrives for a while: (seq, decoded batch)."""
    decoder = _decoder()
    got = []
    while sub.poll(int(timeout_s * 1000 if not got else 500)):
        topic, seq, payload = sub.recv_multipart()
        assert topic == TOPIC.encode()
        got.append((int.from_bytes(seq, "big"), decoder.decode(payload)))
    return got


def _decoder():
    import msgspec

    return msgspec.msgpack.Decoder(type=VllmKVEventBatch)


def _prompt_hashes(llm: LLM, prompt: str) -> list[int]:
    hashes: list[int] = []
    extend_block_hashes(hashes, llm.tokenizer.encode(prompt), BLOCK)
    return hashes


def test_steps_publish_their_events_in_order(llm: LLM) -> None:
    endpoint, _ = llm.engine.kv_events.endpoint, llm.engine.kv_events.replay_endpoint
    sub = _subscribe(endpoint)
    try:
        prompt = "the quick brown fox jumps over the lazy dog " * 8
        llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        got = _receive(sub)
    finally:
        sub.close(linger=0)
    assert got, "no event batch arrived"
    seqs = [seq for seq, _ in got]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # consecutive
    stored = [e for _, batch in got for e in batch.events if type(e).__name__.endswith("Stored")]
    hashes = [h for e in stored for h in e.block_hashes]
    # What a router computes from the prompt's tokens is what the replica announces.
    assert hashes[:len(_prompt_hashes(llm, prompt))] == _prompt_hashes(llm, prompt)
    assert stored[0].parent_block_hash is None and stored[0].medium == "CPU"
    assert all(batch.data_parallel_rank == 0 and batch.ts > 0 for _, batch in got)


def test_a_dropped_subscriber_replays_what_it_missed(llm: LLM) -> None:
    endpoint, replay = llm.engine.kv_events.endpoint, llm.engine.kv_events.replay_endpoint
    assert replay is not None
    sub = _subscribe(endpoint)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    try:
        llm.generate(["one two three four five six " * 6], params, use_tqdm=False)
        first = _receive(sub)
    finally:
        sub.close(linger=0)  # the subscriber drops out...
    last_seen = first[-1][0]
    # ...while the engine goes on: enough prompts to evict blocks and clear nothing.
    missed_prompts = [f"prompt number {i} says " * 10 for i in range(6)]
    llm.generate(missed_prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.reset_prefix_cache()
    llm.generate(["after the reset " * 5], params, use_tqdm=False)

    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(replay)
    try:
        dealer.send_multipart((b"", (last_seen + 1).to_bytes(8, "big")))
        replayed = []
        while True:
            assert dealer.poll(5000), "the replay did not end"
            _, seq, payload = dealer.recv_multipart()
            if seq == END_OF_REPLAY:
                assert payload == b""
                break
            replayed.append((int.from_bytes(seq, "big"), _decoder().decode(payload)))
    finally:
        dealer.close(linger=0)
    seqs = [seq for seq, _ in replayed]
    assert seqs == list(range(last_seen + 1, last_seen + 1 + len(seqs)))
    events = [e for _, batch in replayed for e in batch.events]
    kinds = {type(e).__name__ for e in events}
    assert {"VllmBlockStored", "VllmBlockRemoved", "VllmAllBlocksCleared"} <= kinds
    cleared_at = next(i for i, e in enumerate(events) if isinstance(e, VllmAllBlocksCleared))
    # The prompts it missed are all in the replay, before the reset.
    stored_before = {h for e in events[:cleared_at] if type(e).__name__ == "VllmBlockStored"
                     for h in e.block_hashes}
    for prompt in missed_prompts:
        assert set(_prompt_hashes(llm, prompt)) <= stored_before


def test_an_advertised_endpoint_names_the_node_not_the_wildcard() -> None:
    assert advertised("tcp://0.0.0.0:5557", "10.1.2.3") == "tcp://10.1.2.3:5557"
    assert advertised("tcp://127.0.0.1:5557", "10.1.2.3") == "tcp://127.0.0.1:5557"
    assert advertised("ipc:///tmp/kv", "10.1.2.3") == "ipc:///tmp/kv"

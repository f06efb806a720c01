"""Prefill/decode disaggregation between two real engines: a producer computes each prompt and
publishes its KV, a consumer loads it and decodes. The tokens are those of one engine doing
both, on both transports, through chunked prefill, prefix hits on both sides and PP=2 on one
side; a failed transfer (dead producer, timeout, wrong checksum) is recomputed, and neither side
leaks a block."""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from tests.checkpoints import write_checkpoint
from tests.conftest import Cluster
from tests.replica.engine_state import kv_blocks
from tests.replica.test_engine import make_prompts, with_tokenizer
from tokenflow.config import (
    CacheConfig,
    EngineConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from tokenflow.replica.engine.llm import LLM
from tokenflow.scheduler import RequestStatus, SamplingParams

NUM_NEW = 10


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("pd"), "llama", num_hidden_layers=4)
    return with_tokenizer(path)


def engine(path, connector: str | None = None, *, budget: int = 4096, pp: int = 1,
           async_scheduling: bool = False, **transfer) -> LLM:
    return LLM(config=EngineConfig(
        model=ModelConfig(model=str(path), num_threads=1),
        cache=CacheConfig(block_size=16, num_blocks=128),
        scheduler=SchedulerConfig(max_model_len=256, max_num_batched_tokens=budget,
                                  async_scheduling=async_scheduling),
        parallel=ParallelConfig(pipeline_parallel_size=pp, stage_num_cpus=0.5),
        kv_transfer=KVTransferConfig(connector=connector, **transfer)))


def params_for(prompts: list) -> list[SamplingParams]:
    """Greedy for most prompts, seeded sampling for every third."""
    return [SamplingParams(max_tokens=NUM_NEW, ignore_eos=True, temperature=0.9, seed=11 + i)
            if i % 3 == 2 else SamplingParams(max_tokens=NUM_NEW, ignore_eos=True,
                                              temperature=0.0)
            for i in range(len(prompts))]


def prefill(producer: LLM, prompts: list, params: list[SamplingParams]) -> list[dict]:
    """Run each prompt's prefill on the producer; the params a consumer needs to load it."""
    first = [dataclasses.replace(p, max_tokens=1) for p in params]
    outs = producer.generate(prompts, first, use_tqdm=False,
                             kv_transfer_params={"do_remote_decode": True})
    transfers = []
    for out in outs:
        assert out.kv_transfer_params is not None, "the producer did not publish the prompt"
        transfers.append({**out.kv_transfer_params, "first_token_ids": out.outputs[0].token_ids})
    return transfers


def assert_all_free(*llms: LLM, timeout_s: float = 60) -> None:
    """Step each engine until every KV block is free again (a consumer's loads ended, a
    producer's published blocks were read or their lease ran out). The ray_object_store
    producer frees its blocks at once and keeps only the copy until its lease ends; that is
    tests/replica/test_ray_store.py's to check, not waited for here."""
    for llm in llms:
        deadline = time.monotonic() + timeout_s
        while True:
            free, total = kv_blocks(llm.engine)
            if free == total:
                break
            assert time.monotonic() < deadline, f"{total - free} blocks never freed"
            if llm.engine.has_unfinished_requests():
                llm.engine.step()
            else:
                time.sleep(0.01)


@pytest.fixture(scope="module")
def colocated(checkpoint):
    llm = engine(checkpoint)
    prompts = make_prompts()
    outs = llm.generate(prompts, params_for(prompts), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@contextlib.contextmanager
def stepping(llm: LLM) -> Iterator[None]:
    """Keep `llm` stepping in the background, as a served engine does, so that it frees what
    its consumer is done with while the consumer still loads (`LLM.generate` steps only its
    own engine)."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            if llm.engine.has_unfinished_requests():
                llm.engine.step()
            else:
                time.sleep(0.005)

    thread = threading.Thread(target=loop, name="producer-loop", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=60)


def _disaggregated(checkpoint, colocated, connector: str, budget: int, producer_pp: int = 1,
                   consumer_pp: int = 1, serve_producer: bool = False,
                   async_scheduling: bool = False) -> None:
    producer = engine(checkpoint, connector, budget=budget, pp=producer_pp, role="producer",
                      async_scheduling=async_scheduling)
    consumer = engine(checkpoint, connector, budget=budget, pp=consumer_pp, role="consumer",
                      async_scheduling=async_scheduling)
    try:
        prompts = make_prompts()
        warm = [prompts[-1][:40] + [99]]  # the shared prefix, cached on both sides
        producer.generate(warm, SamplingParams(max_tokens=1), use_tqdm=False)
        consumer.generate(warm, SamplingParams(max_tokens=1), use_tqdm=False)
        params = params_for(prompts)
        transfers = prefill(producer, prompts, params)
        with stepping(producer) if serve_producer else contextlib.nullcontext():
            outs = consumer.generate(prompts, params, use_tqdm=False,
                                     kv_transfer_params=transfers)
        assert [o.outputs[0].token_ids for o in outs] == colocated
        totals = consumer.totals
        assert totals.kv_transfer_bytes > 0 and totals.kv_transfer_failures == 0
        assert outs[-1].num_cached_tokens >= 32  # the consumer's own prefix hit
        assert_all_free(producer, consumer)
    finally:
        producer.shutdown()
        consumer.shutdown()


@pytest.mark.parametrize("budget", [4096, 32], ids=["whole-prompts", "chunked-prefill"])
def test_pd_over_torch_p2p_is_token_exact(checkpoint, colocated, budget) -> None:
    _disaggregated(checkpoint, colocated, "torch_p2p", budget)


@pytest.mark.parametrize("budget", [4096, 32], ids=["whole-prompts", "chunked-prefill"])
def test_pd_with_async_scheduling_on_both_sides_is_token_exact(checkpoint, colocated,
                                                               budget) -> None:
    # The consumer schedules a loaded request's next step while its last one runs.
    _disaggregated(checkpoint, colocated, "torch_p2p", budget, async_scheduling=True)


@pytest.mark.slow
def test_pd_over_the_ray_object_store_is_token_exact(cluster: Cluster, checkpoint,
                                                     colocated) -> None:
    _disaggregated(checkpoint, colocated, "ray_object_store", 32)


@pytest.mark.slow
def test_pd_with_a_two_stage_producer_is_token_exact(cluster: Cluster, checkpoint,
                                                     colocated) -> None:
    # Each producer stage publishes its own layers; the one-stage consumer loads from both.
    _disaggregated(checkpoint, colocated, "torch_p2p", 4096, producer_pp=2)


@pytest.mark.slow
@pytest.mark.parametrize("connector", ["torch_p2p", "ray_object_store"])
def test_pd_with_a_two_stage_consumer_is_token_exact(cluster: Cluster, checkpoint, colocated,
                                                     connector) -> None:
    # Both consumer stages read the one producer stage: the producer, stepping meanwhile as a
    # served one does, must keep the blocks until both are done, or the later stage's load
    # fails its checksum and the prompt is recomputed.
    _disaggregated(checkpoint, colocated, connector, 4096, consumer_pp=2, serve_producer=True)


# -------------------------------------------------------------------------- failures
def _hanging_endpoint() -> tuple[socket.socket, int]:
    """A port that accepts connections and never answers (a producer that hangs)."""
    server = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=lambda: [server.accept() for _ in range(8)], daemon=True).start()
    return server, server.getsockname()[1]


@pytest.mark.parametrize("failure", ["checksum", "dead-producer", "timeout"])
def test_a_failed_transfer_is_recomputed(checkpoint, colocated, failure) -> None:
    # A short lease: blocks that no consumer reads (the timeout case) are freed by its expiry
    # (a load that outlives it fails too, as it should here).
    producer = engine(checkpoint, "torch_p2p", role="producer", lease_s=3.0)
    # Every prompt's load waits out the timeout against the hanging endpoint, one by one.
    consumer = engine(checkpoint, "torch_p2p", role="consumer",
                      load_timeout_s=0.5 if failure == "timeout" else 2.0)
    server, port = _hanging_endpoint()
    try:
        prompts = make_prompts()
        params = params_for(prompts)
        transfers = prefill(producer, prompts, params)
        for transfer in transfers:
            stage = transfer["stages"][0]
            if failure == "checksum":
                stage["checksums"] = [c ^ 1 for c in stage["checksums"]]
            elif failure == "timeout":
                stage["control_port"] = port
        if failure == "dead-producer":
            producer.shutdown()
        outs = consumer.generate(prompts, params, use_tqdm=False, kv_transfer_params=transfers)
        assert [o.outputs[0].token_ids for o in outs] == colocated
        assert consumer.totals.kv_transfer_failures == len(prompts)
        assert_all_free(consumer)
        if failure != "dead-producer":
            assert_all_free(producer)
    finally:
        server.close()
        producer.shutdown()
        consumer.shutdown()


def test_an_expired_lease_frees_the_producer_and_a_late_read_is_detected(
        checkpoint, colocated) -> None:
    producer = engine(checkpoint, "torch_p2p", role="producer", lease_s=0.2)
    consumer = engine(checkpoint, "torch_p2p", role="consumer")
    try:
        prompts = make_prompts()
        params = params_for(prompts)
        transfers = prefill(producer, prompts, params)
        time.sleep(0.3)
        assert_all_free(producer)  # nobody read them: the lease freed the blocks
        # The freed blocks get other KV before the consumer reads: checksums catch it.
        producer.generate([[7] * 200], SamplingParams(max_tokens=1), use_tqdm=False)
        outs = consumer.generate(prompts, params, use_tqdm=False, kv_transfer_params=transfers)
        assert [o.outputs[0].token_ids for o in outs] == colocated
        assert consumer.totals.kv_transfer_failures > 0
        assert_all_free(producer, consumer)
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_an_abort_while_waiting_for_remote_kv_frees_everything(checkpoint) -> None:
    consumer = engine(checkpoint, "torch_p2p", role="consumer", load_timeout_s=1.0)
    server, port = _hanging_endpoint()
    producer = engine(checkpoint, "torch_p2p", role="producer")
    try:
        prompt = make_prompts()[3]
        [transfer] = prefill(producer, [prompt], params_for([prompt])[:1])
        transfer["stages"][0]["control_port"] = port
        core = consumer.engine
        core.add_request("r", prompt, SamplingParams(max_tokens=5),)
        core.abort_request("r")  # before it ever ran: nothing to wait for
        processed = core.process_inputs("w", prompt, SamplingParams(max_tokens=5),
                                        kv_transfer_params=transfer)
        core.add_processed(processed)
        [request] = processed.sequences
        while request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            core.step()
        assert kv_blocks(core)[0] < kv_blocks(core)[1]  # it holds its blocks
        core.abort_request("w")
        assert_all_free(consumer)  # freed once the (hanging) load gave up
    finally:
        server.close()
        producer.shutdown()
        consumer.shutdown()


def test_params_without_the_first_token_load_all_but_the_last_prompt_token(
        checkpoint, colocated) -> None:
    """What a router that forwards only the producer's `kv_transfer_params` (as vLLM's API
    returns them) sends: the consumer computes the last prompt token and samples the first
    token itself."""
    producer = engine(checkpoint, "torch_p2p", role="producer")
    consumer = engine(checkpoint, "torch_p2p", role="consumer")
    try:
        prompts = make_prompts()
        params = [dataclasses.replace(p, temperature=0.0, seed=None) for p in params_for(prompts)]
        transfers = prefill(producer, prompts, params)
        for transfer in transfers:
            del transfer["first_token_ids"]
        outs = consumer.generate(prompts, params, use_tqdm=False, kv_transfer_params=transfers)
        greedy = engine(checkpoint).generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in greedy]
        assert consumer.totals.kv_transfer_bytes > 0
        assert consumer.totals.kv_transfer_failures == 0
        assert_all_free(producer, consumer)
    finally:
        producer.shutdown()
        consumer.shutdown()

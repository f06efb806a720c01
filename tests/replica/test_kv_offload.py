"""The offload tier on real engines: with a primary pool so small that prefixes are evicted,
greedy tokens with the tier (CPU memory or disk) equal those without it on every path (whole
prompts, chunked prefill, preemption, P/D, two pipeline stages), the tier is actually hit,
a corrupt or missing offloaded block is recomputed (never served), and no block leaks."""

from __future__ import annotations

import random

import pytest
import torch

from tests.checkpoints import write_checkpoint
from tests.conftest import Cluster
from tests.replica.engine_state import kv_blocks
from tests.replica.test_engine import make_prompts, with_tokenizer
from tests.replica.test_kv_transfer import assert_all_free, params_for, prefill
from tokenflow.config import (
    CacheConfig,
    EngineConfig,
    KVOffloadConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
)
from tokenflow.kv.connector.offload_worker import OffloadWorker
from tokenflow.replica.engine.llm import LLM
from tokenflow.scheduler import SamplingParams

NUM_NEW = 6
# Small pools, so that the second round's prefixes were evicted by the fillers between.
SCENARIOS = {
    "plain": dict(max_num_batched_tokens=4096, num_blocks=24, block_size=16),
    "chunked_prefill": dict(max_num_batched_tokens=32, num_blocks=24, block_size=16),
    "preemption": dict(max_num_batched_tokens=64, num_blocks=24, block_size=4),
    "async_scheduling": dict(max_num_batched_tokens=4096, num_blocks=24, block_size=16,
                             async_scheduling=True),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("offload"), "llama", num_hidden_layers=4)
    return with_tokenizer(path)


def _tier(backend: str, tmp_path) -> dict | None:
    if backend == "none":
        return None
    return {"backend": backend, "size_gb": 0.05, "path": str(tmp_path / "tier")}


def rounds(seed: int = 0) -> list[list[list[int]]]:
    """The prompts, prompts that evict them, the prompts again (now only in the tier)."""
    rng = random.Random(seed + 1)
    fillers = [[rng.randrange(3, 512) for _ in range(n)] for n in (70, 50, 64, 45, 80)]
    prompts = make_prompts(seed)
    return [prompts, fillers, prompts]


def run_rounds(llm: LLM, batched: bool) -> list[list[int]]:
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    tokens = []
    for prompts in rounds():
        if batched:
            outs = llm.generate(prompts, params, use_tqdm=False)
        else:  # one by one: every prompt's blocks are free (cached) when the next comes
            outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        tokens += [o.outputs[0].token_ids for o in outs]
    return tokens


def build(checkpoint, scenario: str, tier: dict | None, **more) -> LLM:
    return LLM(str(checkpoint), max_model_len=256, num_threads=1, kv_offload=tier,
               **SCENARIOS[scenario], **more)


@pytest.fixture(scope="module")
def without_tier(checkpoint):
    out = {}
    for scenario in SCENARIOS:
        llm = build(checkpoint, scenario, None)
        out[scenario] = run_rounds(llm, batched=scenario == "preemption")
        llm.shutdown()
    return out


@pytest.mark.parametrize("backend", ["cpu", "disk"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_the_tier_is_hit_and_token_exact(checkpoint, without_tier, tmp_path, scenario,
                                         backend) -> None:
    llm = build(checkpoint, scenario, _tier(backend, tmp_path))
    try:
        tokens = run_rounds(llm, batched=scenario == "preemption")
        assert tokens == without_tier[scenario]
        totals = llm.totals
        assert totals.kv_offload_stored_blocks > 0
        assert totals.kv_offload_hit_tokens >= 64, "the last round's prefixes came from the tier"
        assert totals.kv_offload_failures == 0
        if scenario == "preemption":
            assert totals.num_preemptions > 0
        llm.engine.check_idle()
    finally:
        llm.shutdown()


def _tier_worker(llm: LLM) -> OffloadWorker:
    worker = llm.engine.executor.worker.connector
    assert isinstance(worker, OffloadWorker)
    worker._io.submit(lambda: None).result()  # every store queued so far is written
    return worker


@pytest.mark.parametrize("damage", ["memory", "disk-bytes", "disk-missing"])
def test_a_corrupt_or_missing_block_is_recomputed(checkpoint, without_tier, tmp_path,
                                                  damage) -> None:
    llm = build(checkpoint, "plain", _tier("cpu" if damage == "memory" else "disk", tmp_path))
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    try:
        first, fillers, again = rounds()
        tokens = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids
                  for p in first + fillers]
        store = _tier_worker(llm).store
        if damage == "memory":
            store.data.view(torch.uint8)[:, 0, 0, 0, 0] ^= 0x5A  # one byte of every slot
        else:
            files = sorted(store.dir.iterdir())
            assert files
            for path in files:
                if damage == "disk-missing":
                    path.unlink()
                else:
                    raw = bytearray(path.read_bytes())
                    raw[len(raw) // 2] ^= 0x5A
                    path.write_bytes(bytes(raw))
        tokens += [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids
                   for p in again]
        assert tokens == without_tier["plain"]
        totals = llm.totals
        assert totals.kv_offload_failures > 0
        llm.engine.check_idle()
    finally:
        llm.shutdown()


def test_pd_with_the_tier_on_both_sides_is_token_exact(checkpoint, tmp_path) -> None:
    def engine(role: str, tier: dict | None) -> LLM:
        return LLM(config=EngineConfig(
            model=ModelConfig(model=str(checkpoint), num_threads=1),
            cache=CacheConfig(block_size=16, num_blocks=24),
            scheduler=SchedulerConfig(max_model_len=256),
            kv_transfer=KVTransferConfig(connector="torch_p2p", role=role),
            kv_offload=KVOffloadConfig(**tier) if tier else KVOffloadConfig()))

    prompts, fillers, _ = rounds()
    params = params_for(prompts)
    colocated = LLM(str(checkpoint), max_model_len=256, num_threads=1)
    expected = [o.outputs[0].token_ids
                for o in colocated.generate(prompts, params, use_tqdm=False)]
    colocated.shutdown()
    producer = engine("producer", _tier("cpu", tmp_path))
    consumer = engine("consumer", _tier("disk", tmp_path))
    try:
        # Both sides see the prompts (and the producer then evicts them to its tier).
        warm = SamplingParams(max_tokens=1)
        for llm in (producer, consumer):
            for p in prompts + fillers:
                llm.generate([p], warm, use_tqdm=False)
        transfers = prefill(producer, prompts, params)
        outs = consumer.generate(prompts, params, use_tqdm=False, kv_transfer_params=transfers)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert producer.totals.kv_offload_hit_tokens > 0, "the producer's prefills hit its tier"
        assert consumer.totals.kv_transfer_bytes > 0 and consumer.totals.kv_transfer_failures == 0
        # The consumer's own tier serves plain requests beside the transfers, once the
        # fillers evicted the prompts it loaded.
        for p in fillers:
            consumer.generate([p], warm, use_tqdm=False)
        again = consumer.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == expected
        assert consumer.totals.kv_offload_hit_tokens > 0
        assert_all_free(producer, consumer)
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_pp2_with_the_tier_is_token_exact(cluster: Cluster, checkpoint, without_tier,
                                          tmp_path) -> None:
    for backend in ("cpu", "disk"):
        llm = build(checkpoint, "plain", _tier(backend, tmp_path), pipeline_parallel_size=2,
                    stage_num_cpus=0.5)
        try:
            assert run_rounds(llm, batched=False) == without_tier["plain"]
            assert llm.totals.kv_offload_hit_tokens >= 64
            free, total = kv_blocks(llm.engine)
            assert free == total
        finally:
            llm.shutdown()

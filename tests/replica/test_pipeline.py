"""Pipeline parallelism on real Ray actors and a real gloo group: PP=2 gives the tokens of PP=1
and of transformers on every scheduling path, a dead stage is rebuilt and its requests go on
(a second death fails them instead of hanging), and nothing is left behind."""

from __future__ import annotations

import re
import time

import pytest
import ray

from tests.checkpoints import write_checkpoint
from tests.conftest import Cluster
from tests.replica.engine_state import kv_blocks
from tests.replica.test_engine import SCENARIOS, _load_hf, hf_greedy, make_prompts, with_tokenizer
from tokenflow.replica.engine.llm import LLM
from tokenflow.replica.worker.pipeline import stage_layer_ranges
from tokenflow.scheduler import SamplingParams
from tokenflow.scheduler.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.slow

NUM_NEW = 10
# Half a CPU per stage: the session's cluster (4 CPUs) also runs Serve apps.
PP2 = {"pipeline_parallel_size": 2, "stage_num_cpus": 0.5, "num_threads": 1,
       "max_model_len": 256}


def test_stage_layer_ranges() -> None:
    assert stage_layer_ranges(30, 2) == [(0, 15), (15, 30)]
    assert stage_layer_ranges(5, 3) == [(0, 2), (2, 4), (4, 5)]
    assert stage_layer_ranges(4, 2, [1, 3]) == [(0, 1), (1, 4)]
    with pytest.raises(ValueError, match="add up to"):
        stage_layer_ranges(4, 2, [1, 2])
    with pytest.raises(ValueError, match="3 pipeline stages"):
        stage_layer_ranges(2, 3)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # 4 layers, so each stage holds two.
    path = write_checkpoint(tmp_path_factory.mktemp("pp"), "llama", num_hidden_layers=4)
    return with_tokenizer(path)


@pytest.fixture(scope="module")
def reference(checkpoint):
    hf = _load_hf(checkpoint)
    return [hf_greedy(hf, p, NUM_NEW)[0] for p in make_prompts()]


def _live_actors_and_groups() -> tuple[int, int]:
    """Stage actors alive and placement groups not removed, as the GCS reports them."""
    actors = [a for a in ray._private.state.actors().values()
              if a["State"] == "ALIVE" and a["ActorClassName"] == "StageWorker"]
    groups = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
    return len(actors), len(groups)


@pytest.mark.parametrize("scenario,control", [
    ("plain", "auto"), ("chunked_prefill", "auto"), ("preemption", "auto"),
    # The other way to send steps (auto is actor calls on CPU): a Ray Compiled Graph.
    ("plain", "compiled_graph"), ("preemption", "compiled_graph")])
def test_pp2_is_token_exact(cluster: Cluster, checkpoint, reference, scenario, control) -> None:
    llm = LLM(str(checkpoint), **{**SCENARIOS[scenario], **PP2}, pipeline_control=control)
    try:
        params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
        prompts = make_prompts()
        # Warm the prefix cache with the shared prefix, so the last two prompts hit it.
        llm.generate([prompts[-1][:40] + [99]], SamplingParams(max_tokens=1), use_tqdm=False)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == reference
        if scenario == "plain":
            assert outputs[-1].num_cached_tokens >= 32
        if scenario == "preemption":
            assert llm.totals.num_preemptions > 0
        free, total = kv_blocks(llm.engine)
        assert free == total
    finally:
        llm.shutdown()


def test_pp2_sampling_stops_n_and_aborts_match_pp1(cluster: Cluster, checkpoint) -> None:
    prompts = make_prompts()[:6]
    params = [SamplingParams(max_tokens=12, temperature=0.9, seed=7 + i, n=1 + i % 2,
                             ignore_eos=True) for i in range(len(prompts))]
    one = LLM(str(checkpoint), max_model_len=256, num_blocks=128)
    expected = one.generate(prompts, params, use_tqdm=False)
    tokenizer = one.tokenizer
    # A stop string from a greedy continuation: it must cut both engines at the same place.
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    text = one.generate([prompts[0]], greedy, use_tqdm=False)[0].outputs[0].text
    stop = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[text[4:7]])
    expected_stop = one.generate([prompts[0]], stop, use_tqdm=False)[0].outputs[0]
    two = LLM(str(checkpoint), num_blocks=128, **PP2)
    try:
        got = two.generate(prompts, params, use_tqdm=False)
        for a, b in zip(expected, got, strict=True):
            assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        got_stop = two.generate([prompts[0]], stop, use_tqdm=False)[0].outputs[0]
        assert (got_stop.text, got_stop.finish_reason) == (expected_stop.text, "stop")
        # Structured output: the last stage applies the grammar bitmask it is sent.
        regex = StructuredOutputsParams(regex=r"[a-z]{2,6}-[0-9]{1,3}")
        structured = SamplingParams(max_tokens=30, temperature=0.9, seed=3,
                                    structured_outputs=regex)
        want = [o.outputs[0].text for o in one.generate(prompts[:3], structured, use_tqdm=False)]
        assert [o.outputs[0].text for o in two.generate(prompts[:3], structured,
                                                        use_tqdm=False)] == want
        assert all(re.fullmatch(regex.regex, text) for text in want), want
        # An abort while batches are in flight frees everything.
        engine = two.engine
        engine.add_request("a", prompts[3], SamplingParams(max_tokens=50, ignore_eos=True))
        engine.add_request("b", prompts[4], SamplingParams(max_tokens=5, ignore_eos=True))
        engine.step()
        engine.step()
        engine.abort_request("a")
        while engine.has_unfinished_requests():
            engine.step()
        free, total = kv_blocks(engine)
        assert free == total
        assert tokenizer.decode(expected_stop.token_ids) is not None
    finally:
        two.shutdown()


def _run_to_the_end(engine, tokens: dict[str, list[int]] | None = None,
                    deadline_s: float = 180) -> dict:
    """Step until done; returns the finished outputs by id, adding each delta's tokens to
    `tokens`."""
    finished = {}
    deadline = time.monotonic() + deadline_s
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine hangs on a dead stage"
        for out in engine.step():
            if tokens is not None:
                tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            if out.finished:
                finished[out.request_id] = out
    return finished


def test_a_dead_stage_is_rebuilt_once_and_its_requests_go_on(cluster: Cluster,
                                                           checkpoint) -> None:
    """Stage 0 dies mid-generation: the executor builds both stages again in the same bundles
    and every request starts over from its tokens, ending with the tokens it would have had
    (greedy). One death more than `stage_rebuilds_per_minute` (here 1) allows fails the
    requests, and nothing hangs."""
    from tokenflow.replica.worker.ray_executor import StageDiedError

    before = _live_actors_and_groups()
    llm = LLM(str(checkpoint), num_blocks=128, stage_rebuilds_per_minute=1, **PP2)
    try:
        engine = llm.engine
        executor = engine.executor
        assert _live_actors_and_groups() == (before[0] + 2, before[1] + 1)
        prompts = make_prompts()[:4]
        greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        expected = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy,
                                                                  use_tqdm=False)]
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, greedy)
        tokens: dict[str, list[int]] = {}
        for _ in range(6):  # past the prefills, into the decodes
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
        assert 0 < sum(map(len, tokens.values())) < 4 * 40
        first_stages = list(executor._actors)
        ray.kill(first_stages[0], no_restart=True)  # stage 0 dies mid-generation
        finished = _run_to_the_end(engine, tokens)
        assert engine.num_worker_restarts == 1
        assert not set(first_stages) & set(executor._actors)  # new stages
        assert [tokens[str(i)] for i in range(4)] == expected
        assert all(out.outputs[0].finish_reason == "length" for out in finished.values())
        engine.check_health()  # a rebuilt pipeline is healthy
        engine.check_idle()
        assert _live_actors_and_groups() == (before[0] + 2, before[1] + 1)

        # Again within the window: the requests fail, and the replica reports unhealthy.
        for i, prompt in enumerate(prompts):
            engine.add_request(f"again{i}", prompt, SamplingParams(max_tokens=150,
                                                                   ignore_eos=True))
        engine.step()
        ray.kill(executor._actors[1], no_restart=True)
        finished = _run_to_the_end(engine)
        assert sorted(finished) == [f"again{i}" for i in range(4)]
        for out in finished.values():
            assert out.outputs[0].finish_reason == "error"
            assert "pipeline stage" in out.error and "of 2 died" in out.error
        assert engine.num_worker_restarts == 1
        with pytest.raises(StageDiedError, match="pipeline stage"):
            engine.check_health()
    finally:
        llm.shutdown()
    deadline = time.monotonic() + 60
    while _live_actors_and_groups() != before:
        assert time.monotonic() < deadline, f"left behind: {_live_actors_and_groups()}"
        time.sleep(0.5)


def test_cli_generate_with_two_stages_prints_what_one_stage_prints() -> None:
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}

    def generate(pp: int) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "tokenflow.cli", "generate", "--model", "tokenflow-tiny",
             "--max-tokens", "8", "--num-blocks", "64", "--max-model-len", "256",
             "--pipeline-parallel-size", str(pp), "Hello, my name is"],
            capture_output=True, text=True, timeout=600, env=env)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout

    assert generate(2) == generate(1)

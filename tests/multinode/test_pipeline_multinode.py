"""Pipeline parallelism across real nodes: with SPREAD, the two stages of PP=2 run on two
namespace nodes, so the activations cross a veth link, and the tokens are those of PP=1."""

from __future__ import annotations

import json

import pytest

from tests.checkpoints import write_checkpoint
from tests.multinode.netns import NamespaceCluster
from tests.replica.test_engine import SCENARIOS, make_prompts, with_tokenizer
from tokenflow.replica.engine.llm import LLM
from tokenflow.scheduler import SamplingParams

pytestmark = pytest.mark.multinode

NUM_NEW = 10
DRIVER = f"""
import json, os, ray
from tokenflow import LLM, SamplingParams
from tests.replica.test_engine import SCENARIOS, make_prompts

ray.init(log_to_driver=False)
params = SamplingParams(max_tokens={NUM_NEW}, temperature=0.0, ignore_eos=True)
result = {{}}
for scenario in ("plain", "preemption"):
    llm = LLM(os.environ["TF_CHECKPOINT"], max_model_len=256, pipeline_parallel_size=2,
              placement_strategy="SPREAD", stage_num_cpus=1, num_threads=1,
              **SCENARIOS[scenario])
    outputs = llm.generate(make_prompts(), params, use_tqdm=False)
    result[scenario] = {{"tokens": [o.outputs[0].token_ids for o in outputs],
                        "stage_nodes": llm.engine.executor.stage_nodes,
                        "preemptions": llm.totals.num_preemptions}}
    llm.shutdown()
print(json.dumps(result))
"""


def test_pp2_across_two_nodes_is_token_exact(netns_cluster: NamespaceCluster,
                                             tmp_path_factory) -> None:
    checkpoint = with_tokenizer(write_checkpoint(tmp_path_factory.mktemp("ppmn"), "llama",
                                                 num_hidden_layers=4))
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    local = LLM(str(checkpoint), max_model_len=256, **SCENARIOS["plain"])
    expected = [o.outputs[0].token_ids for o in local.generate(make_prompts(), params,
                                                                use_tqdm=False)]
    out = netns_cluster.run_driver(DRIVER, env={"TF_CHECKPOINT": str(checkpoint)},
                                   timeout_s=900).json()
    node_ips = {n.ip for n in netns_cluster.nodes}
    for scenario, result in out.items():
        assert result["tokens"] == expected, scenario
        stage_nodes = result["stage_nodes"]
        assert len(set(stage_nodes)) == 2 and set(stage_nodes) <= node_ips, stage_nodes
    assert out["preemption"]["preemptions"] > 0
    print(json.dumps({k: v["stage_nodes"] for k, v in out.items()}))

"""Prefill/decode disaggregation across real nodes: the prefill replica on one namespace node,
the decode replica on another, so the prompts' KV crosses a veth link, on both transports. The
served text equals a colocated engine's, and the decode replica's KV-cache events reach a
subscriber on another node, and the kv_aware router's feed there replays what it holds."""

from __future__ import annotations

import json

import pytest

from tests.cluster.conftest import ENGINE_ARGS
from tests.multinode.netns import NamespaceCluster
from tokenflow.config import EngineConfig
from tokenflow.kv.hashing import extend_block_hashes
from tokenflow.replica.engine.llm import LLM
from tokenflow.scheduler import SamplingParams

pytestmark = pytest.mark.multinode

# Several full KV blocks each (block size 16, ~50 tokens), so every prompt's KV crosses the link.
_STORY = ("the old mill stood by the river where the children watched the wheel turn from "
          "morning until evening and the water ran quietly")
PROMPTS = [f"{start} {_STORY}" for start in (
    "Hello, my name is", "The capital of France is", "def fibonacci(n):",
    "Once upon a time there was")]
NUM_NEW = 10
DRIVER = """
import json, os, time, httpx, ray, zmq
from ray import serve
from tests.cluster.conftest import pd_app_args
from tokenflow.cluster.app import build_app
from tokenflow.cluster.kv_router import KVEventFeed
from tokenflow.kv.events import BlockStored, decoder

ray.init(log_to_driver=False)
nodes = json.loads(os.environ["TF_NODES"])
# Every address of the node (its veth and loopback): HAProxy on the head reaches the replicas'
# own ports on the other nodes (serving mode haproxy).
serve.start(http_options={"host": "0.0.0.0", "port": 8000})
prompts, num_new = json.loads(os.environ["TF_PROMPTS"]), int(os.environ["TF_NUM_NEW"])
result = {}
for connector in ("torch_p2p", "ray_object_store"):
    args = pd_app_args(connector)
    pin = lambda node: {"num_cpus": 0.25, "resources": {nodes[node]["resource"]: 0.01}}
    args["deployment"]["ray_actor_options"] = pin("w2")              # decode on w2
    args["prefill"]["deployment"] = {"num_replicas": 1, "ray_actor_options": pin("w1")}
    with_events = connector == "torch_p2p"
    if with_events:  # the decode replica publishes its KV-cache events
        args["engine"]["kv_events"] = {"enabled": True, "replay_endpoint": "tcp://*:0"}
    serve.run(build_app(args), name="pd", route_prefix="/")
    decode = serve.get_deployment_handle("LLMServer", app_name="pd")
    if with_events:  # subscribed from this node (the head) across the link
        endpoints = decode.kv_events_endpoints.remote().result()
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoints["endpoint"])
        time.sleep(0.5)
    texts = []
    for prompt in prompts:
        r = httpx.post("http://127.0.0.1:8000/v1/completions", timeout=300,
                       headers={"Authorization": "Bearer " + args["api_key"]},
                       json={"prompt": prompt, "max_tokens": num_new, "temperature": 0,
                             "ignore_eos": True})
        r.raise_for_status()
        texts.append(r.json()["choices"][0]["text"])
    prefill = serve.get_deployment_handle("PrefillServer", app_name="pd")
    where = {name: handle.node_ip.remote().result() for name, handle in
             (("decode", decode), ("prefill", prefill))}
    result[connector] = {"texts": texts, "stats": decode.stats.remote().result(),
                         "where": where}
    if with_events:
        stored = []
        while sub.poll(3000):
            _, _, payload = sub.recv_multipart()
            stored += [h for e in decoder().decode(payload).events
                       if isinstance(e, BlockStored) for h in e.block_hashes]
        sub.close(linger=0)
        # The kv_aware router's feed, started here after the fact: it learns from the
        # replica's replay socket, across the link, what the replica holds.
        feed = KVEventFeed()
        feed.watch("decode", endpoints["endpoint"], endpoints["replay_endpoint"])
        deadline = time.monotonic() + 30
        while not feed.caught_up("decode") and time.monotonic() < deadline:
            time.sleep(0.1)
        with feed.lock:
            indexed = sorted(feed.index.hashes("decode"))
        feed.shutdown()
        result[connector]["kv_events"] = {**endpoints, "stored": stored, "indexed": indexed}
    serve.delete("pd")
serve.shutdown()
print(json.dumps(result))
"""


def test_prefill_and_decode_on_two_nodes(netns_cluster: NamespaceCluster) -> None:
    llm = LLM(config=EngineConfig.model_validate(ENGINE_ARGS))
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    expected = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    out = netns_cluster.run_driver(DRIVER, timeout_s=900, env={
        "TF_PROMPTS": json.dumps(PROMPTS), "TF_NUM_NEW": str(NUM_NEW)}).json()
    for connector, result in out.items():
        assert result["texts"] == expected, connector
        assert result["where"] == {"decode": netns_cluster.node("w2").ip,
                                   "prefill": netns_cluster.node("w1").ip}, connector
        stats = result["stats"]
        shown = f"{connector}: {json.dumps(stats)}"
        assert stats["prefill_fallbacks"] == 0, shown
        assert stats["kv_transfer_bytes"] > 0 and stats["kv_transfer_failures"] == 0, shown
    # KV-cache events: the decode replica advertises its node's address (not loopback or the
    # wildcard), a subscriber on another node receives them, and they announce the blocks of
    # every prompt (loaded from the prefill replica) under the hashes a router computes.
    events = out["torch_p2p"]["kv_events"]
    w2 = netns_cluster.node("w2").ip
    assert events["endpoint"].startswith(f"tcp://{w2}:"), events
    assert events["replay_endpoint"].startswith(f"tcp://{w2}:"), events
    for prompt in PROMPTS:
        hashes: list[int] = []
        extend_block_hashes(hashes, llm.engine.process_inputs("x", prompt).prompt_token_ids, 16)
        assert hashes and set(hashes) <= set(events["stored"]), prompt
        assert set(hashes) <= set(events["indexed"]), prompt  # the late router's index

"""KV transfer: bandwidth of each transport against a plain TCP socket, and the decode
interference that prefill/decode disaggregation removes.

`bandwidth`: the same blocks (`--blocks` of the bench model's KV: 8 layers x 2 x 16 tokens x 8
KV heads x 64, float32 = 512 KiB a block) moved on loopback (1) by the torch point-to-point
transport (pull from a producer's cache over a pairwise gloo group, checksums verified), (2)
through the Ray object store (put by a producer actor, got by the driver), and (3) as raw bytes
over a TCP socket between two threads. Prints MB/s and each against TCP.

`interference`: a served load where decode streams run while long prompts keep arriving;
inter-token latency p50/p99 of the decode streams, TTFT of the long prompts and throughput,
for a colocated app (one replica, 2 threads) and the P/D app (one prefill and one decode
replica, 1 thread each: equal total cores), side by side in one run.

    python bench/kv_transfer.py bandwidth --blocks 256
    python bench/kv_transfer.py interference --long-prompts 12 --decodes 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 8, 8, 64, 16


# ------------------------------------------------------------------------- bandwidth
def _caches(num_blocks: int) -> list[Any]:
    import torch

    gen = torch.Generator().manual_seed(0)
    return [torch.randn((2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM), generator=gen)
            for _ in range(LAYERS)]


def _torch_p2p(num_blocks: int, rounds: int) -> float:
    from tokenflow.kv.connector.torch_p2p import TorchP2PTransport
    from tokenflow.kv.connector.worker_side import TransferWorker

    producer, consumer = TransferWorker(TorchP2PTransport(), 60), TransferWorker(
        TorchP2PTransport(), 60)
    producer.register_kv_caches(_caches(num_blocks), (0, LAYERS))
    consumer.register_kv_caches(_caches(num_blocks), (0, LAYERS))
    ids = list(range(num_blocks))
    blocks = producer.gather(ids)
    descriptor = producer.transport.publish("bench", ids, blocks)
    descriptor.update(layers=[0, LAYERS], block_shape=list(blocks.shape[1:]), dtype="float32")
    consumer.transport.fetch(descriptor, ids[:1], 60)  # opens the pair group
    seconds = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        consumer.transport.fetch(descriptor, ids, 60)
        seconds.append(time.perf_counter() - t0)
    producer.shutdown()
    consumer.shutdown()
    return blocks.numel() * 4 / statistics.median(seconds)


def _ray_store(num_blocks: int, rounds: int) -> float:
    import ray

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        @ray.remote(num_cpus=0)
        class Producer:
            def publish(self, n: int) -> str:
                import torch

                from tokenflow.kv.connector.ray_store import RayObjectTransport

                self.transport = RayObjectTransport()
                blocks = torch.stack(_caches(n)).permute(2, 0, 1, 3, 4, 5).contiguous()
                return json.dumps(self.transport.publish("bench", list(range(n)), blocks))

        from tokenflow.kv.connector.ray_store import RayObjectTransport

        producer = Producer.remote()
        consumer = RayObjectTransport()
        seconds = []
        for _ in range(rounds):  # a new object each round: no caching in the driver
            descriptor = json.loads(ray.get(producer.publish.remote(num_blocks)))
            t0 = time.perf_counter()
            blocks = consumer.fetch(descriptor, list(range(num_blocks)), 60)
            seconds.append(time.perf_counter() - t0)
        return blocks.numel() * 4 / statistics.median(seconds)
    finally:
        ray.shutdown()


def _tcp(num_bytes: int, rounds: int) -> float:
    server = socket.create_server(("127.0.0.1", 0))
    payload = os.urandom(num_bytes)

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            for _ in range(rounds):
                conn.recv(1)
                conn.sendall(payload)

    threading.Thread(target=serve, daemon=True).start()
    seconds = []
    with socket.create_connection(server.getsockname()) as sock:
        buffer = bytearray(num_bytes)
        for _ in range(rounds):
            t0 = time.perf_counter()
            sock.sendall(b"x")
            view, got = memoryview(buffer), 0
            while got < num_bytes:
                got += sock.recv_into(view[got:])
            seconds.append(time.perf_counter() - t0)
    server.close()
    return num_bytes / statistics.median(seconds)


def bandwidth(args: argparse.Namespace) -> dict[str, Any]:
    num_bytes = args.blocks * LAYERS * 2 * BLOCK * KV_HEADS * HEAD_DIM * 4
    tcp = _tcp(num_bytes, args.rounds)
    result = {"bytes": num_bytes, "tcp_MBps": tcp / 1e6,
              "torch_p2p_MBps": _torch_p2p(args.blocks, args.rounds) / 1e6,
              "ray_object_store_MBps": _ray_store(args.blocks, args.rounds) / 1e6}
    print(f"{num_bytes / 2**20:.0f} MiB on loopback: TCP socket {result['tcp_MBps']:.0f} MB/s; "
          f"torch_p2p {result['torch_p2p_MBps']:.0f} MB/s "
          f"({result['torch_p2p_MBps'] / result['tcp_MBps']:.2f}x TCP); ray_object_store "
          f"{result['ray_object_store_MBps']:.0f} MB/s "
          f"({result['ray_object_store_MBps'] / result['tcp_MBps']:.2f}x TCP)")
    return result


# ---------------------------------------------------------------------- interference
async def _stream(client: Any, url: str, body: dict[str, Any]) -> tuple[float, list[float]]:
    """(TTFT, gaps between chunks) of one streamed completion."""
    t0 = time.perf_counter()
    stamps = []
    async with client.stream("POST", url, json={**body, "stream": True}) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return stamps[0] - t0, gaps


async def _interference_load(base_url: str, args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    url = base_url + "/v1/completions"
    decode = {"prompt": "Tell me a long story", "max_tokens": args.decode_tokens,
              "temperature": 0, "ignore_eos": True}
    long = {"prompt": [7 + i % 500 for i in range(args.long_len)], "max_tokens": 8,
            "temperature": 0, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        decodes = [asyncio.create_task(_stream(client, url, decode))
                   for _ in range(args.decodes)]
        longs = []
        for _ in range(args.long_prompts):
            await asyncio.sleep(args.long_interval)
            longs.append(asyncio.create_task(_stream(client, url, long)))
        decoded = await asyncio.gather(*decodes)
        prefilled = await asyncio.gather(*longs)
        elapsed = time.perf_counter() - t0
    gaps = sorted(g for _, gs in decoded for g in gs)
    ttfts = sorted(t for t, _ in prefilled)
    tokens = args.decodes * args.decode_tokens + args.long_prompts * 8
    return {"itl_p50_ms": 1000 * statistics.median(gaps),
            "itl_p99_ms": 1000 * gaps[int(0.99 * (len(gaps) - 1))],
            "long_ttft_p50_ms": 1000 * statistics.median(ttfts),
            "throughput_tok_s": tokens / elapsed}


def interference(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray
    from ray import serve

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.cluster.conftest import ENGINE_ARGS, free_port, pd_app_args
    from tokenflow.cluster.app import build_app

    port = free_port()
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    engine = {**ENGINE_ARGS, "scheduler": {**ENGINE_ARGS["scheduler"], "max_model_len": 2048,
                                           "max_num_batched_tokens": 2048},
              "cache": {"block_size": 16, "num_blocks": 1024}}
    colocated = {"engine": {**engine, "model": {"model": "tokenflow-tiny", "num_threads": 2}},
                 "deployment": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 1}}}
    pd = pd_app_args()
    pd.pop("api_key")
    for side in (pd, pd["prefill"]):
        side["engine"] = {**engine, "model": {"model": "tokenflow-tiny", "num_threads": 1},
                          "kv_transfer": side["engine"]["kv_transfer"]}
    result = {}
    try:
        for name, app in (("colocated", colocated), ("pd", pd)):
            serve.run(build_app(app), name=name, route_prefix=f"/{name}")
            result[name] = asyncio.run(_interference_load(
                f"http://127.0.0.1:{port}/{name}", args))
            serve.delete(name)
    finally:
        serve.shutdown()
        ray.shutdown()
    c, p = result["colocated"], result["pd"]
    print(f"decode ITL p99 {c['itl_p99_ms']:.0f} ms colocated vs {p['itl_p99_ms']:.0f} ms P/D "
          f"(p50 {c['itl_p50_ms']:.0f} vs {p['itl_p50_ms']:.0f}); long-prompt TTFT p50 "
          f"{c['long_ttft_p50_ms']:.0f} vs {p['long_ttft_p50_ms']:.0f} ms; throughput "
          f"{c['throughput_tok_s']:.0f} vs {p['throughput_tok_s']:.0f} tok/s")
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    b = sub.add_parser("bandwidth")
    b.add_argument("--blocks", type=int, default=256)
    b.add_argument("--rounds", type=int, default=5)
    i = sub.add_parser("interference")
    i.add_argument("--decodes", type=int, default=8)
    i.add_argument("--decode-tokens", type=int, default=200)
    i.add_argument("--long-prompts", type=int, default=12)
    i.add_argument("--long-len", type=int, default=1500)
    i.add_argument("--long-interval", type=float, default=0.5)
    for sp in (b, i):
        sp.add_argument("--out", help="write the result JSON to this file")
    args = p.parse_args(argv)
    result = bandwidth(args) if args.what == "bandwidth" else interference(args)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()

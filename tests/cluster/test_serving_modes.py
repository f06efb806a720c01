"""Every serving mode, end to end: `tokenflow serve` (its own Ray cluster, set up for the mode)
answers the official `openai` client token-exactly, streams with usage, enforces its API key and
gives OpenAI's error shape; the default mode with two replicas spreads requests over both.

The default mode also runs every test of `test_serve.py` (the session cluster is set up for it,
`tests/conftest.py`); here each other mode gets the same core checks.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import csv
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest
import yaml

from tests.cluster.conftest import free_port
from tests.cluster.serve_process import ServeProcess
from tests.lora_adapters import write_tiny_adapter
from tokenflow.cluster.serving_mode import FORWARD_BODY, check_cluster_env, switches
from tokenflow.config import AppConfig, ConfigError, EngineConfig, ServingMode, load_app_config
from tokenflow.ops.cluster_env import cluster_env, release_cluster_env
from tokenflow.replica.engine.llm import LLM
from tokenflow.scheduler import SamplingParams

API_KEY = "modes-test-key"
MODEL = "tokenflow-tiny"
ENGINE: dict[str, Any] = {
    "model": {"model": MODEL, "num_threads": 1},
    "cache": {"block_size": 16, "num_blocks": 128},
    "scheduler": {"max_model_len": 256, "max_num_batched_tokens": 256},
}
PROMPTS = ["The quick brown fox", "Ray Serve replicas"]
# A configured chat template (engine.chat_template, a file) that shows tools: short, so that a
# request with tools fits the tiny context. Every mode's ingress must render with it.
TOOLS_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
                  "{% if tools %}<|tools|>{{ tools | map(attribute='function.name') | join(',') }}"
                  "{% endif %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
LOOKUP = {"type": "function", "function": {
    "name": "lookup", "parameters": {"type": "object", "properties": {"q": {"type": "string"}},
                                     "required": ["q"]}}}
MAX_TOKENS = 240  # of each stream of the resume test (max_model_len is 256)
READY = "serving the OpenAI API"


# ------------------------------------------------------------------------- the config field


def test_serving_mode_is_validated_by_name() -> None:
    assert load_app_config({"serving_mode": "proxy"}).serving_mode is ServingMode.PROXY
    with pytest.raises(ConfigError, match="serving_mode"):
        load_app_config({"serving_mode": "fast"})


def test_each_mode_sets_every_switch_explicitly() -> None:
    names = {"RAY_SERVE_ENABLE_HA_PROXY", "RAY_SERVE_ENABLE_DIRECT_INGRESS",
             "RAY_SERVE_USE_GRPC_BY_DEFAULT"}
    for mode in ServingMode:
        assert set(switches(mode)) == names
    assert switches(ServingMode.HAPROXY)["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    assert switches(ServingMode.PROXY_INGRESS_GRPC)["RAY_SERVE_USE_GRPC_BY_DEFAULT"] == "1"
    assert set(switches(ServingMode.PROXY).values()) == {"0"}


def test_two_haproxy_clusters_get_their_own_files_and_ports() -> None:
    first, second = cluster_env(ServingMode.HAPROXY), cluster_env(ServingMode.HAPROXY)
    for name in ("RAY_SERVE_HAPROXY_CONFIG_FILE_LOC", "RAY_SERVE_HAPROXY_SOCKET_PATH",
                 "RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT"):
        assert first[name] != second[name]
    # HAProxy refuses a stats socket path over 97 characters; Ray nests a 56-character
    # directory under the base.
    assert len(first["RAY_SERVE_HAPROXY_SOCKET_PATH"]) + 57 <= 97
    files = Path(first["RAY_SERVE_HAPROXY_CONFIG_FILE_LOC"]).parent
    assert files.is_dir()
    for env in (first, second):
        release_cluster_env(env)
    assert not files.exists()


def test_clusters_of_two_processes_get_their_own_replica_ports() -> None:
    """Serve gives replicas ports from one range per cluster; two clusters in that range, each
    reusing ports the other freed, route requests to each other's replicas."""
    lo, hi = "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT", "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"
    here = cluster_env(ServingMode.HAPROXY)
    mine = range(int(here[lo]), int(here[hi]))
    assert len(mine) >= 64 and mine.stop <= 32768  # below the kernel's ephemeral ports
    script = ("from tokenflow.config import ServingMode; "
              "from tokenflow.ops.cluster_env import cluster_env, release_cluster_env as release; env = cluster_env(ServingMode.HAPROXY); "
              f"print(env['{lo}'], env['{hi}']); release(env)")
    other = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           check=True, timeout=120).stdout.split()
    theirs = range(int(other[0]), int(other[1]))
    assert not set(mine) & set(theirs)
    release_cluster_env(here)


def test_a_cluster_without_the_modes_switches_is_refused(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "0")
    with pytest.raises(ValueError, match="RAY_SERVE_ENABLE_HA_PROXY=1"):
        check_cluster_env(ServingMode.HAPROXY)
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "1")
    monkeypatch.setenv(FORWARD_BODY, "0")  # the retries need HAProxy to hold each request
    with pytest.raises(ValueError, match=f"{FORWARD_BODY}=1"):
        check_cluster_env(ServingMode.HAPROXY)
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "0")
    monkeypatch.setenv("RAY_SERVE_USE_GRPC_BY_DEFAULT", "1")
    with pytest.raises(ValueError, match="RAY_SERVE_USE_GRPC_BY_DEFAULT=0"):
        check_cluster_env(ServingMode.PROXY)


def test_the_default_mode_is_the_one_the_test_cluster_runs() -> None:
    """tests/conftest.py sets up the session's cluster for AppConfig's default mode."""
    check_cluster_env(AppConfig().serving_mode)


# ------------------------------------------------------------------------------- end to end


# The Ray temp dirs `_start` made (short paths in /tmp: Ray's socket paths must stay under 108
# bytes), removed after each test.
_RAY_TMP_DIRS: list[str] = []


@pytest.fixture(autouse=True)
def _remove_ray_tmp_dirs() -> Iterator[None]:
    yield
    while _RAY_TMP_DIRS:
        shutil.rmtree(_RAY_TMP_DIRS.pop(), ignore_errors=True)


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(config=EngineConfig.model_validate(ENGINE))


def _start(mode: ServingMode, num_replicas: int, tmp_path: Path,
           engine: dict[str, Any] | None = None, cli_args: tuple[str, ...] = (),
           cluster_env: dict[str, str] | None = None,
           **deployment: Any) -> tuple[ServeProcess, str]:
    port = free_port()
    config = tmp_path / f"{mode.value}.yaml"
    template = tmp_path / "tools.jinja"
    template.write_text(TOOLS_TEMPLATE)
    config.write_text(yaml.safe_dump({
        "engine": {**ENGINE, "chat_template": str(template), **(engine or {})},
        "serving_mode": mode.value,
        "deployment": {"num_replicas": num_replicas,
                       "ray_actor_options": {"num_cpus": 0.25}, **deployment}}))
    ray_tmp = tempfile.mkdtemp(prefix="tf-", dir="/tmp")  # its own cluster, its own files
    _RAY_TMP_DIRS.append(ray_tmp)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=ray_tmp, PYTHONPATH=str(Path(__file__).resolve().parents[2]),
               **(cluster_env or {}))
    server = ServeProcess(["--config", str(config), "--port", str(port), "--api-key",
                           API_KEY, "--no-dashboard", *cli_args], env)
    return server, f"http://127.0.0.1:{port}"


def _check_the_api(base_url: str, offline: LLM) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0)
    assert [m.id for m in client.models.list().data if m.parent is None] == [MODEL]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = [o.outputs[0].token_ids
                for o in offline.generate(PROMPTS, params, use_tqdm=False)]
    tok = offline.tokenizer
    for prompt, ids in zip(PROMPTS, expected, strict=True):
        whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                          temperature=0, extra_body={"ignore_eos": True})
        assert whole.choices[0].text == tok.decode(ids)  # token-exact against offline
        chunks = list(client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
        assert chunks[-1].usage.completion_tokens == 8
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.usage.completion_tokens <= 4 and chat.choices[0].message.role == "assistant"
    # Tools reach the configured template, and a required call is a valid one.
    called = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "find fox"}], tools=[LOOKUP],
        tool_choice="required", max_tokens=64, temperature=0)
    assert called.choices[0].message.tool_calls[0].function.name == "lookup"
    response = client.responses.create(model=MODEL, input="hi", max_output_tokens=4)
    assert response.usage.output_tokens <= 4 and isinstance(response.output_text, str)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="x", max_tokens=-1)
    assert bad.value.status_code == 400 and "max_tokens" in str(bad.value)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base_url}/v1", api_key="wrong",
                      max_retries=0).models.list()
    tokens = httpx.post(f"{base_url}/tokenize", json={"prompt": PROMPTS[0]},
                        headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30).json()
    assert tokens["tokens"] == tok.encode(PROMPTS[0])


@pytest.mark.slow
# proxy_ingress: test_proxy_ingress_serves_the_api_and_resumes_streams_whose_replica_dies checks
# the API on its server (one cluster less).
@pytest.mark.parametrize("mode", [m for m in ServingMode if m not in (
    AppConfig().serving_mode, ServingMode.PROXY_INGRESS)], ids=lambda m: m.value)
def test_every_other_mode_serves_the_api(mode: ServingMode, offline: LLM,
                                         tmp_path: Path) -> None:
    server, url = _start(mode, 1, tmp_path)
    try:
        server.wait_for(READY)
        assert f"serving mode {mode.value}:" in server.output
        _check_the_api(url, offline)
    finally:
        server.stop()


@pytest.mark.slow
def test_default_mode_with_two_replicas(offline: LLM, tmp_path: Path) -> None:
    """Two replicas behind two KV-aware routers (which read the prompt HAProxy forwards, as
    the prefix-aware one does): unrelated requests spread over both (by load), and requests
    that share a long prefix all go where it is cached, also while one router's process is
    dead (HAProxy asks the other: nothing is refused) and after Serve has replaced it (the
    new one learns from the replicas' KV-event replay). Requests for a LoRA adapter go to
    the replica that holds it. Each replica's engine
    runs in a child process of the replica (`engine_loop: auto`, the default), and the API is
    the same, token-exact, also for each of three LoRA adapters the config names (as the
    offline engine with them gives). `/pause` and `/resume` reach both replicas, and SIGTERM
    drains: a request under way runs to its end before the server exits."""
    mode = AppConfig().serving_mode
    adapters = {f"tiny-{i}": str(write_tiny_adapter(tmp_path / f"adapter-{i}", seed=i))
                for i in (1, 2, 3)}
    lora = {"max_loras": 2, "lora_modules": adapters}
    server, url = _start(mode, 2, tmp_path, {"lora": lora},
                         cli_args=("--drain-timeout", "120"), request_router="kv_aware",
                         cluster_env={"RAY_SERVE_INGRESS_ROUTER_REPLICAS_PER_NODE": "2"})
    try:
        server.wait_for(READY)
        assert f"serving mode {mode.value}:" in server.output
        assert "engine loop: an engine process" in server.output
        replicas = _replica_processes(server)
        assert len(replicas) == 2
        for replica in replicas:
            assert any("spawn_main" in " ".join(p.cmdline()) for p in replica.children())
        _check_the_api(url, offline)
        _check_adapters(url, adapters)
        # The Serve request router sent requests to both replicas (once HAProxy has both).
        _wait_for_haproxy_servers_up(server, 2)
        assert len(_busy_replicas(url)) == 2
        # Requests for an adapter go to the replica that holds it (each adapter has been
        # served once, on one replica, by _check_adapters), though load alone (and the
        # KV-aware cost: these prompts are cached nowhere under these adapters) would spread
        # them as the base model's above.
        held = {name: _busy_replicas(url, 6, model=name) for name in ("tiny-1", "tiny-2")}
        assert all(len(replicas) == 1 for replicas in held.values()), held
        assert _busy_replicas(url, 6, model="tiny-1") == held["tiny-1"]

        # One system prompt of several blocks, then each user's own question. Power of two
        # choices would put each request on the replica without the prefix half the time.
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
        system = "You are the assistant of a large shop and answer questions about orders, " * 3
        cached = []
        for user in range(8):
            done = client.completions.create(model=MODEL, prompt=f"{system} user {user} asks",
                                             max_tokens=2, temperature=0)
            cached.append(done.usage.prompt_tokens_details.cached_tokens)
        system_blocks = len(offline.tokenizer.encode(system)) // 16
        assert system_blocks >= 3
        assert cached[0] == 0 and all(c >= 16 * system_blocks for c in cached[1:]), cached

        # One router's process dies. At once, before Serve or HAProxy know: HAProxy's call to
        # it fails to connect and it asks the other, which knows where the prefix is.
        def routers() -> list[psutil.Process]:  # (a busy one's title names its method)
            return [p for p, _ in server.descendants("ray::ServeReplica:tokenflow:ReplicaRouter")]

        def cached_tokens(users: range) -> list[int]:
            return [client.completions.create(model=MODEL, prompt=f"{system} user {user} asks",
                                              max_tokens=2, temperature=0
                                              ).usage.prompt_tokens_details.cached_tokens
                    for user in users]

        first, second = routers()
        first.kill()
        first.wait(timeout=30)
        during = cached_tokens(range(8, 12))
        assert all(c >= 16 * system_blocks for c in during), during
        # Serve starts another, which knows nothing of its own and replays what each replica
        # holds: the prefix still goes where it is cached, whichever router HAProxy asks.
        deadline = time.monotonic() + 180
        while not [p for p in routers() if p.pid not in (first.pid, second.pid)]:
            assert time.monotonic() < deadline, "no router came back"
            time.sleep(0.5)
        time.sleep(5)  # HAProxy learns of it
        after = cached_tokens(range(12, 18))
        assert all(c >= 16 * system_blocks for c in after), after
        _pause_resume_and_drain(server, url)
    finally:
        server.stop()


def _check_adapters(base_url: str, adapters: dict[str, str]) -> None:
    """Each adapter by name gives the offline engine's text with that adapter (itself equal
    to transformers + peft: tests/replica/test_lora.py), and differs from the base model's."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0)
    listed = {m.id: m.parent for m in client.models.list().data}
    assert listed == {MODEL: None, **dict.fromkeys(adapters, MODEL)}
    tuned = LLM(config=EngineConfig.model_validate(
        {**ENGINE, "lora": {"max_loras": 3, "lora_modules": adapters}}))
    try:
        names = [None, *adapters]
        outs = tuned.generate([PROMPTS[0]] * len(names),
                              [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                              lora=name) for name in names], use_tqdm=False)
    finally:
        tuned.shutdown()
    texts = {name: out.outputs[0].text for name, out in zip(names, outs, strict=True)}
    assert len(set(texts.values())) == len(names)  # every adapter changes the text
    for name in adapters:
        done = client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=8,
                                         temperature=0, extra_body={"ignore_eos": True})
        assert done.model == name and done.choices[0].text == texts[name], name


def _pause_resume_and_drain(server: ServeProcess, base: str) -> None:
    """`/pause` and `/resume` reach both replicas; SIGTERM lets a request under way finish."""
    auth = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.post(f"{base}/pause", timeout=60).status_code == 401
    paused = httpx.post(f"{base}/pause", params={"mode": "all"}, headers=auth,
                        timeout=60).json()
    assert paused["is_paused"] is True
    assert [r["state"] for r in paused["replicas"]] == ["paused_all"] * 2
    assert len({r["replica"] for r in paused["replicas"]}) == 2
    status = httpx.get(f"{base}/is_paused", headers=auth, timeout=60).json()
    assert status["is_paused"] is True and len(status["replicas"]) == 2
    resumed = httpx.post(f"{base}/resume", headers=auth, timeout=60).json()
    assert resumed["is_paused"] is False
    assert [r["state"] for r in resumed["replicas"]] == ["unpaused"] * 2
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 200, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, headers=auth,
                      timeout=120) as resp:
        assert resp.status_code == 200
        events = (line for line in resp.iter_lines() if line.startswith("data: "))
        received = [next(events)]
        server.proc.send_signal(signal.SIGTERM)
        received += list(events)
    assert received[-1] == "data: [DONE]"
    usage = json.loads(received[-2][len("data: "):])["usage"]
    assert usage["completion_tokens"] == 200
    assert server.proc.wait(timeout=120) == 0
    assert "draining" in server.output and "drained" in server.output, server.output


@pytest.mark.slow
def test_haproxy_balances_by_itself_with_least_connections(offline: LLM,
                                                           tmp_path: Path) -> None:
    """`request_router: least_connections`: no ingress request router (no ReplicaRouter
    deployment, no call per request); HAProxy spreads requests over both replicas itself."""
    server, url = _start(ServingMode.HAPROXY, 2, tmp_path, request_router="least_connections")
    try:
        server.wait_for(READY)
        deployments = " ".join(cmdline for _, cmdline in server.descendants())
        assert "ServeReplica:tokenflow:LLMServer" in deployments
        assert "ReplicaRouter" not in deployments
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        expected = offline.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0].text
        done = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8,
                                         temperature=0, extra_body={"ignore_eos": True})
        assert done.choices[0].text == expected
        # Serve is ready once both replicas are; HAProxy sends traffic to the second only once
        # it has reloaded its config and its health checks passed.
        _wait_for_haproxy_servers_up(server, 2)
        assert len(_busy_replicas(url)) == 2
    finally:
        server.stop()


def _wait_for_haproxy_servers_up(server: ServeProcess, num: int, timeout_s: float = 60) -> None:
    """Until the cluster's HAProxy reports `num` replica servers UP (its admin socket's
    `show stat`; the socket lies beside the config file that HAProxy's command line names)."""
    deadline, up = time.monotonic() + timeout_s, []
    while time.monotonic() < deadline:
        up = []
        for _, cmdline in server.descendants("haproxy"):
            args = cmdline.split()
            if Path(args[0]).name == "haproxy" and "-f" in args:
                sock = Path(args[args.index("-f") + 1]).parent / "admin.sock"
                up += [row for row in _haproxy_stat(sock)
                       if row["svname"] not in ("FRONTEND", "BACKEND")
                       and row["status"] == "UP" and row["bck"] == "0"]
        if len(up) >= num:
            return
        time.sleep(0.2)
    raise AssertionError(f"HAProxy has {len(up)} servers UP, not {num}")


def _haproxy_stat(sock: Path) -> list[dict[str, str]]:
    """HAProxy's `show stat` CSV as rows (empty while the socket is not there yet)."""
    try:
        with socket.socket(socket.AF_UNIX) as conn:
            conn.connect(str(sock))
            conn.sendall(b"show stat\n")
            data = b"".join(iter(lambda: conn.recv(65536), b""))
    except OSError:
        return []
    lines = data.decode().lstrip("# ").splitlines()
    return list(csv.DictReader(lines)) if lines else []


def _busy_replicas(url: str, num: int = 16, model: str = MODEL) -> set[str]:
    """Send `num` requests for `model` at once; the replicas they went to (every request must
    succeed).
    The replicas are paused meanwhile, so that they hold every request until all have
    arrived: running, the test model finishes a replica's share in a fraction of a second,
    sooner than a loaded machine lets this process look (seen: 1 == 2)."""
    auth = {"Authorization": f"Bearer {API_KEY}"}

    def long_request(i: int) -> int:
        body = {"model": model, "prompt": f"request {i}", "max_tokens": 120,
                "ignore_eos": True}
        return httpx.post(f"{url}/v1/completions", json=body, headers=auth,
                          timeout=300).status_code

    paused = httpx.post(f"{url}/pause", params={"mode": "all"}, headers=auth, timeout=60)
    assert paused.status_code == 200 and paused.json()["is_paused"], paused.text
    with concurrent.futures.ThreadPoolExecutor(num) as pool:
        futures = [pool.submit(long_request, i) for i in range(num)]
        deadline = time.monotonic() + 120
        while True:
            status = httpx.get(f"{url}/is_paused", headers=auth, timeout=30).json()
            if sum(r["waiting"] for r in status["replicas"]) == num:
                break
            assert time.monotonic() < deadline and not any(f.done() for f in futures), status
            time.sleep(0.05)
        busy = {r["replica"] for r in status["replicas"] if r["waiting"]}
        assert httpx.post(f"{url}/resume", headers=auth, timeout=60).status_code == 200
        assert [f.result() for f in futures] == [200] * num
    return busy


def _replica_processes(server: ServeProcess) -> list[psutil.Process]:
    return [p for p, _ in server.descendants("ServeReplica:tokenflow:LLMServer")]


def _engine_processes(replica: psutil.Process) -> list[psutil.Process]:
    """The replica's engine process (`engine_loop: process`): its multiprocessing child."""
    found = []
    for child in replica.children():
        with contextlib.suppress(psutil.Error):
            if "spawn_main" in " ".join(child.cmdline()):
                found.append(child)
    return found


def _run_briefly(url: str, auth: dict[str, str], run_s: float = 0.05) -> dict[str, Any]:
    """Resume the paused replicas, let them run `run_s`, pause them again (mode `all`); the
    pause's status. From a process of its own: in this one, the threads reading 16 streams
    hold the GIL so long that the two calls lie a second apart, in which the test model's
    replicas finish every stream."""
    script = (
        "import httpx, json, sys, time\n"
        "url, auth, run_s = sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3])\n"
        "httpx.post(f'{url}/resume', headers=auth, timeout=60).raise_for_status()\n"
        "time.sleep(run_s)\n"
        "paused = httpx.post(f'{url}/pause', params={'mode': 'all'}, headers=auth, timeout=60)\n"
        "paused.raise_for_status()\n"
        "print(paused.text)\n")
    done = subprocess.run([sys.executable, "-c", script, url, json.dumps(auth), str(run_s)],
                          capture_output=True, text=True, timeout=180, check=True)
    return json.loads(done.stdout)


def _streams(url: str, num: int, max_tokens: int, on_progress: Any = None
             ) -> list[tuple[str, list[str], int]]:
    """`num` greedy streams at once; each one's (text, tokens from its logprobs, usage's
    completion tokens). `on_progress(tokens_so_far)` runs in the caller's thread meanwhile."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=300)
    progress = [0] * num

    def one(i: int) -> tuple[str, list[str], int]:
        text, tokens, used = "", [], 0
        for chunk in client.completions.create(
                model=MODEL, prompt=f"stream {i} of the resume test", max_tokens=max_tokens,
                temperature=0, logprobs=1, stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True}):
            if chunk.usage is not None:
                used = chunk.usage.completion_tokens
            if chunk.choices:
                text += chunk.choices[0].text
                tokens += (chunk.choices[0].logprobs.tokens if chunk.choices[0].logprobs
                           else [])
                progress[i] = len(tokens)
        return text, tokens, used

    with concurrent.futures.ThreadPoolExecutor(num) as pool:
        futures = [pool.submit(one, i) for i in range(num)]
        while on_progress is not None and not all(f.done() for f in futures):
            if on_progress(list(progress)):
                on_progress = None
            time.sleep(0.05)
        return [f.result() for f in futures]


@pytest.mark.slow
def test_proxy_ingress_serves_the_api_and_resumes_streams_whose_replica_dies(
        offline: LLM, tmp_path: Path) -> None:
    """The API in the proxy_ingress mode. Then kill one of 2 replicas under 16 greedy streams:
    each stream goes on on the other one and ends token-identical to an uninterrupted run. The
    same when a replica gives up (its engine process died twice in a row) and ends its own
    process. A request that cannot resume (n=2) gets the ingress's 503 with Retry-After in
    OpenAI's shape instead."""
    # One stream at a time on a replica: a replica is busy for ~4 s (quiet machine) with its
    # 8, time enough for `_run_briefly` to pause it mid-way even on a loaded machine (two at
    # a time, ~2 s, was once too short beside two busy processes and a benchmark); the
    # others wait, accepted.
    server, url = _start(ServingMode.PROXY_INGRESS, 2, tmp_path,
                         engine={"scheduler": {**ENGINE["scheduler"], "max_num_seqs": 1}})
    auth = {"Authorization": f"Bearer {API_KEY}"}
    try:
        server.wait_for(READY)
        assert "serving mode proxy_ingress:" in server.output
        _check_the_api(url, offline)
        # Long streams (the test model is quick): the kill must find the victim mid-way.
        uninterrupted = _streams(url, 16, MAX_TOKENS)
        assert all(used == MAX_TOKENS == len(tokens) for _, tokens, used in uninterrupted)

        # Kill a replica in the middle of its streams, on a loaded machine too. The streams
        # start while both replicas are paused (so that all are accepted: a request its dead
        # replica had not accepted yet is not resumed, issue 22); they run for a moment and
        # are paused again, and the replica running the most dies while paused. Its streams
        # resume on the other replica (or its replacement) and everything runs again.
        killed: list[int] = []

        def call(method: str, path: str, **params: str) -> dict[str, Any]:
            deadline = time.monotonic() + 120
            while (resp := httpx.request(method, f"{url}{path}", params=params, headers=auth,
                                         timeout=60)).status_code != 200:
                assert time.monotonic() < deadline, resp.text  # 503 while a replica is dead
                time.sleep(0.2)
            return resp.json()

        call("POST", "/pause", mode="all")

        def kill_a_busy_replica(progress: list[int]) -> bool:
            if sum(r["waiting"] for r in call("GET", "/is_paused")["replicas"]) < len(progress):
                return False  # not all accepted yet
            # On a loaded machine a moment's run may schedule nothing yet: run another.
            for _ in range(20):
                busy = max(_run_briefly(url, auth)["replicas"], key=lambda r: r["running"])
                if busy["running"]:
                    break
            [victim] = [p for p in _replica_processes(server) if p.pid == busy["pid"]]
            killed.append(busy["running"])
            victim.kill()  # a process this test started (through tokenflow serve)
            victim.wait(60)
            call("POST", "/resume")
            return True

        resumed = _streams(url, 16, MAX_TOKENS, on_progress=kill_a_busy_replica)
        assert killed and killed[0] > 0, "no stream was running on the killed replica"
        # At least one stream went on mid-way (the ingress logs each resume).
        resumes = [int(n) for n in re.findall(r"lost its replica \(\w+\) after (\d+) tokens",
                                              server.worker_stderr())]
        assert resumes and max(resumes) > 0, resumes
        for i, ((text, tokens, used), (text0, tokens0, used0)) in enumerate(
                zip(resumed, uninterrupted, strict=True)):
            first = next((j for j, (a, b) in enumerate(zip(tokens, tokens0, strict=False))
                          if a != b), None)
            assert (len(tokens), first, used) == (len(tokens0), None, used0), (i, tokens)
            assert text == text0, i

        def wait_for_two_replicas() -> None:  # the killed replica's replacement
            deadline = time.monotonic() + 120
            while True:
                status = httpx.get(f"{url}/is_paused", headers=auth, timeout=30)
                if status.status_code == 200 and len(status.json()["replicas"]) == 2:
                    break
                assert time.monotonic() < deadline, status.text
                time.sleep(0.5)

        # A replica whose engine process dies, and dies again right after its restart, can
        # serve no more and ends its own process: the streams it holds wait for that instead
        # of failing, and go on on the other replica, token-exact.
        wait_for_two_replicas()
        call("POST", "/pause", mode="all")
        gave_up: list[int] = []

        def kill_an_engine_twice(progress: list[int]) -> bool:
            if sum(r["waiting"] for r in call("GET", "/is_paused")["replicas"]) < len(progress):
                return False
            for _ in range(20):
                busy = max(_run_briefly(url, auth)["replicas"], key=lambda r: r["running"])
                if busy["running"]:
                    break
            [victim] = [p for p in _replica_processes(server) if p.pid == busy["pid"]]
            [engine] = _engine_processes(victim)
            engine.kill()  # the replica starts another and its streams go on there...
            engine.wait(60)
            deadline = time.monotonic() + 120
            while not (restarted := [p for p in _engine_processes(victim)
                                     if p.pid != engine.pid]):
                assert time.monotonic() < deadline, "the engine process was not restarted"
                time.sleep(0.05)
            restarted[0].kill()  # ...until it dies again at once: the replica gives up
            victim.wait(60)  # and ends its process
            gave_up.append(busy["running"])
            call("POST", "/resume")
            return True

        again = _streams(url, 16, MAX_TOKENS, on_progress=kill_an_engine_twice)
        assert gave_up and gave_up[0] > 0, "no stream was running on the replica that gave up"
        for i, ((text, tokens, used), (text0, tokens0, used0)) in enumerate(
                zip(again, uninterrupted, strict=True)):
            assert (tokens, used, text) == (tokens0, used0, text0), i

        # n=2 cannot resume: with every replica gone, the ingress answers a 503.
        wait_for_two_replicas()
        body = {"model": MODEL, "prompt": "twice", "max_tokens": 200, "n": 2,
                "ignore_eos": True}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            request = pool.submit(httpx.post, f"{url}/v1/completions", json=body,
                                  headers=auth, timeout=120)
            while not any(r["running"] for r in httpx.get(
                    f"{url}/is_paused", headers=auth, timeout=30).json()["replicas"]):
                assert not request.done(), request.result().text
                time.sleep(0.05)
            for replica in _replica_processes(server):
                replica.kill()
            resp = request.result()
        assert resp.status_code == 503, resp.text
        assert int(resp.headers["retry-after"]) > 0
        assert resp.json()["error"]["type"] == "service_unavailable_error"
    finally:
        server.stop()

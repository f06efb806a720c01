"""Multi-LoRA through the OpenAI API, in-process (`TestClient`, the official `openai` client on
top, no Ray): `model` names the base model or an adapter (vLLM's convention), `/v1/models`
lists the adapters with their `parent`, `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`
add and remove them at run time, and each adapter's text is what transformers + peft generate
with it."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from fastapi.testclient import TestClient

from tests.checkpoints import write_checkpoint
from tests.lora_adapters import load_with_adapter, write_adapter
from tests.replica.test_engine import _load_hf, hf_greedy, with_tokenizer
from tokenflow.cluster.openai_serving import LocalBackend, OpenAIServing, build_openai_app
from tokenflow.cluster.server import LLMServer

pytest.importorskip("peft")
BASE = "base-llama"
API_KEY = "lora-test-key"
PROMPT = [5, 17, 33, 60, 9, 48, 100, 7, 250, 31, 12]
NUM_NEW = 8
ADAPTERS = {"attn": dict(seed=1, rank=8, targets=("q_proj", "v_proj")),
            "all": dict(seed=2, rank=16),
            "mlp": dict(seed=3, rank=4, targets=("o_proj", "gate_proj", "up_proj", "down_proj"))}


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Iterator[tuple]:
    """A checkpoint, three adapters (two configured at start, one loaded later), each one's
    peft greedy tokens, and the API over an LLMServer in this process."""
    tmp = tmp_path_factory.mktemp("lora-api")
    # The tokenizer's whole vocabulary, so that a chat template's token ids fit too.
    path = with_tokenizer(write_checkpoint(tmp, "llama", vocab_size=2304))
    hf = _load_hf(path)
    adapters = {n: write_adapter(hf, tmp / n, **kw) for n, kw in ADAPTERS.items()}
    expected = {None: hf_greedy(hf, PROMPT, NUM_NEW)[0]}
    for name, adapter in adapters.items():
        model = load_with_adapter(hf, adapter)
        model.generation_config.eos_token_id = None
        expected[name] = hf_greedy(model, PROMPT, NUM_NEW)[0]
    assert len({tuple(t) for t in expected.values()}) == 4  # every adapter changes the output
    server = LLMServer({"model": {"model": str(path), "served_model_name": BASE},
                        "cache": {"num_blocks": 256}, "scheduler": {"max_model_len": 256},
                        "lora": {"max_loras": 2, "max_lora_rank": 16,
                                 "lora_modules": {n: str(adapters[n]) for n in ("attn", "all")}}})
    app = build_openai_app(OpenAIServing(LocalBackend(server), BASE, API_KEY, str(path)))
    with TestClient(app, raise_server_exceptions=False) as http:
        client = openai.OpenAI(base_url=f"{http.base_url}/v1", api_key=API_KEY,
                               http_client=http, max_retries=0)
        yield client, http, adapters, expected, server
    server.engine.shutdown()


def _tokens(server: LLMServer, text: str) -> list[int]:
    return server.engine.tokenizer.encode(text, add_special_tokens=False)


def _complete(client: openai.OpenAI, model: str) -> str:
    done = client.completions.create(model=model, prompt=PROMPT, max_tokens=NUM_NEW,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert done.model == model
    return done.choices[0].text


def test_each_adapter_by_name_gives_peft_text_and_models_lists_them(setup) -> None:
    client, _, _, expected, server = setup
    listed = {m.id: m for m in client.models.list().data}
    assert set(listed) == {BASE, "attn", "all"}
    assert listed["attn"].parent == BASE and listed[BASE].parent is None
    tokenizer = server.engine.tokenizer
    for name in (None, "attn", "all"):
        text = _complete(client, name or BASE)
        assert text == tokenizer.decode(expected[name]), name
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        _complete(client, "mlp")  # not loaded yet


def test_an_adapter_loaded_at_run_time_serves_and_unloads(setup) -> None:
    client, http, adapters, expected, server = setup
    body = {"lora_name": "mlp", "lora_path": str(adapters["mlp"])}
    assert http.post("/v1/load_lora_adapter", json=body).status_code == 401  # no API key
    auth = {"Authorization": f"Bearer {API_KEY}"}
    loaded = http.post("/v1/load_lora_adapter", json=body, headers=auth)
    assert loaded.status_code == 200, loaded.text
    assert _complete(client, "mlp") == server.engine.tokenizer.decode(expected["mlp"])
    assert "mlp" in {m.id for m in client.models.list().data}
    # Loading it again, or from a directory that holds no adapter: a 400 that says why.
    again = http.post("/v1/load_lora_adapter", json=body, headers=auth)
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    nowhere = http.post("/v1/load_lora_adapter", headers=auth,
                        json={"lora_name": "x", "lora_path": str(adapters["mlp"].parent / "no")})
    assert nowhere.status_code == 400 and nowhere.json()["error"]["param"] == "lora_path"
    unloaded = http.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"}, headers=auth)
    assert unloaded.status_code == 200
    with pytest.raises(openai.NotFoundError):
        _complete(client, "mlp")
    gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"}, headers=auth)
    assert gone.status_code == 404
    # The others still serve.
    assert _complete(client, "all") == server.engine.tokenizer.decode(expected["all"])


def test_a_chat_names_its_adapter_too(setup) -> None:
    client, _, _, _, _ = setup
    base = client.chat.completions.create(model=BASE, max_tokens=6, temperature=0,
                                          messages=[{"role": "user", "content": "hello"}])
    tuned = client.chat.completions.create(model="all", max_tokens=6, temperature=0,
                                           messages=[{"role": "user", "content": "hello"}])
    assert tuned.model == "all"
    assert tuned.choices[0].message.content != base.choices[0].message.content

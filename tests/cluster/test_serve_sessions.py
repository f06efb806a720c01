"""Streaming-input sessions through real Ray Serve (the default serving mode): the session
fields travel from the ingress to the replica, and each turn reuses the previous one's KV."""

from __future__ import annotations

import openai

from tests.cluster.conftest import App, Cluster

MODEL = "tokenflow-tiny"


def test_a_session_reuses_its_kv_through_serve(cluster: Cluster, main_app: App) -> None:
    client = openai.OpenAI(base_url=f"{main_app.base_url}/v1", api_key=main_app.api_key,
                           timeout=120)
    prompt, cached, prompt_tokens = "Sessions keep their KV between turns.", [], []
    for k in range(3):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6,
                                      temperature=0.0,
                                      extra_body={"ignore_eos": True, "session_id": "serve-1",
                                                  "session_close": k == 2})
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        prompt_tokens.append(r.usage.prompt_tokens)
        prompt += r.choices[0].text + f" Turn {k}, go on."
    assert cached[0] == 0
    for k in (1, 2):  # the previous prompt and all its outputs but the last
        assert cached[k] == prompt_tokens[k - 1] + 5, (cached, prompt_tokens)
    try:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                  extra_body={"session_close": True})
    except openai.BadRequestError as exc:
        assert exc.status_code == 400 and "session_close" in str(exc)
    else:
        raise AssertionError("session_close without session_id was accepted")

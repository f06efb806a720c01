"""Structured output through the OpenAI API (real Serve, real HTTP, the `openai` client):
`response_format` (json_schema, json_object), vLLM's `structured_outputs` and the older
`guided_*` fields, streamed or not, colocated and prefill/decode disaggregated; the
embedded model's random weights make every valid completion the grammar's doing. A bad
schema is a 400 and the server goes on serving."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from tests.cluster.conftest import App
from tests.cluster.test_serve import auth, sync_client
from tests.replica.test_structured_output import CHOICES, PERSON, REGEX

pytestmark = pytest.mark.slow

MODEL = "tokenflow-tiny"
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


def _person_format() -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}


def test_chat_response_format_json_schema(main_app: App) -> None:
    out = sync_client(main_app).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=250, temperature=1.0, seed=11, n=3,
        response_format=_person_format())
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_chat_parse_with_a_pydantic_model(main_app: App) -> None:
    """The client's own structured-output helper: it sends the model's strict JSON schema and
    parses the reply back into the model."""

    class Pet(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=6)
        kind: Literal["cat", "dog", "fish"]
        legs: int = pydantic.Field(ge=0, le=8)
        vaccinated: bool

    out = sync_client(main_app).chat.completions.parse(
        model=MODEL, messages=MESSAGES, max_tokens=200, temperature=0.0, response_format=Pet)
    pet = out.choices[0].message.parsed
    assert isinstance(pet, Pet) and len(pet.name) <= 6 and 0 <= pet.legs <= 8


def test_streamed_regex_and_choice_through_extra_fields(main_app: App) -> None:
    client = sync_client(main_app)
    stream = client.completions.create(
        model=MODEL, prompt="Code:", max_tokens=40, temperature=1.0, seed=5, stream=True,
        extra_body={"structured_outputs": {"regex": REGEX}})
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert re.fullmatch(REGEX, text), text
    for fields in ({"structured_outputs": {"choice": CHOICES}}, {"guided_choice": CHOICES}):
        out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20,
                                             temperature=1.0, seed=3, extra_body=fields)
        assert out.choices[0].message.content in CHOICES


def test_bad_constraints_are_400s_and_the_server_goes_on(main_app: App) -> None:
    client = sync_client(main_app)
    bad_schema = {"type": "json_schema",
                  "json_schema": {"name": "bad", "schema": {"type": "strin"}}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                       response_format=bad_schema)
    assert 'Unsupported type "strin"' in err.value.message
    for body in ({"response_format": {"type": "json_object"}, "guided_regex": "a+"},
                 {"structured_outputs": {"regex": "(a"}},
                 {"structured_outputs": {"regex": "a", "choice": ["a"]}},
                 {"response_format": {"type": "xml"}}):
        response = httpx.post(f"{main_app.base_url}/v1/chat/completions", headers=auth(main_app),
                              json={"model": MODEL, "messages": MESSAGES, **body}, timeout=30)
        assert response.status_code == 400, body
        assert response.json()["error"]["type"] == "invalid_request_error"
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20,
                                         extra_body={"guided_choice": CHOICES})
    assert out.choices[0].message.content in CHOICES


def test_structured_output_with_disaggregated_prefill(pd_app: App) -> None:
    """The prefill replica samples the first token under the grammar, the decode replica
    (which also speculates) continues it."""
    out = sync_client(pd_app).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=250, temperature=0.0,
        response_format=_person_format())
    jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)

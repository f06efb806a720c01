"""Tokenizer and tokenflow-tiny assets, checked against transformers on the same files."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import jinja2
import pytest

from tokenflow.replica.loading.model_source import TINY_MODEL_NAME, tiny_model_dir
from tokenflow.replica.loading.resolve import resolve_model
from tokenflow.replica.loading.tiny_model import build_tiny_assets
from tokenflow.replica.loading.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world! The scheduler picks 42 requests.",
    "Café naïve résumé, crème brûlée à Zürich",
    "東京は日本の首都です。北京是中国的首都。",
    "emoji 😀🚀🎉 and ❤️ ok",
    "  leading spaces\n\ttabs and\r\nnewlines  ",
    "<|eot_id|> special text inside <|begin_of_text|>",
    "",
]

LLAMA3_STYLE_TEMPLATE = """{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "You are a helpful assistant." %}
{%- endif %}
{{- bos_token }}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system_message }}
{% if tools is not none %}
    Tools: {{ tools | tojson }}
{% endif %}
{{- '<|eot_id|>' }}
{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant', 'tool'] %}
        {{- raise_exception('Unknown role: ' + message['role']) }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {%- if message['content'] is string %}
        {{- message['content'] | trim }}
    {%- else %}
        {{- message['content'] | tojson }}
    {%- endif %}
    {{- '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [
        {"role": "system", "content": "  Answer briefly.  "},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And <b>\"quoted\"</b> & ünïcode?"},
    ],
    [{"role": "user", "content": {"kind": "json", "value": "<tag> é"}}],
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir())


@pytest.fixture(scope="module")
def hf_tok():  # noqa: ANN201 - a transformers tokenizer
    return transformers.AutoTokenizer.from_pretrained(str(tiny_model_dir()))


def _model_dir(tmp_path: Path, **config: object) -> Path:
    """A model dir with the tiny tokenizer.json and the given tokenizer_config.json."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    shutil.copy(tiny_model_dir() / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return tmp_path


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tok: Tokenizer, hf_tok, text: str) -> None:
    for add_special in (True, False):
        ids = tok.encode(text, add_special_tokens=add_special)
        assert ids == hf_tok.encode(text, add_special_tokens=add_special)
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(
                ids, skip_special_tokens=skip
            )
    assert tok.convert_ids_to_tokens(ids) == hf_tok.convert_ids_to_tokens(ids)


def test_byte_level_round_trips_any_string(tok: Tokenizer) -> None:
    rng = random.Random(0)
    alphabet = "aé東😀 \n\t!0ßЖ" + "".join(chr(rng.randrange(0x20, 0x2FFFF)) for _ in range(99))
    for _ in range(50):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 40)))
        text = text.encode("utf-8", "replace").decode("utf-8")  # drop lone surrogates
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_special_tokens(tok: Tokenizer, hf_tok) -> None:
    assert tok.vocab_size == len(hf_tok)
    assert tok.bos_token_id == hf_tok.bos_token_id == tok.token_to_id("<|begin_of_text|>")
    assert tok.eos_token_id == hf_tok.eos_token_id == tok.token_to_id("<|eot_id|>")
    assert tok.eos_token_ids == {tok.token_to_id("<|end_of_text|>"), tok.eos_token_id}
    assert set(hf_tok.all_special_ids) <= tok.all_special_ids
    assert len(tok.all_special_ids) == 5
    assert tok.encode("hi")[0] == tok.bos_token_id
    assert tok.decode(tok.encode("hi")) == "hi"
    assert tok.convert_ids_to_tokens(tok.encode("hi"), skip_special_tokens=True) == ["hi"]


def test_tokenizer_json_decides_special_tokens_as_transformers(tmp_path: Path) -> None:
    # transformers 5 ignores add_bos_token/add_eos_token when tokenizer.json exists.
    for add_bos, add_eos in ((False, False), (True, True), (False, True)):
        model_dir = _model_dir(
            tmp_path / f"{add_bos}{add_eos}", bos_token="<|begin_of_text|>",
            eos_token="<|end_of_text|>", add_bos_token=add_bos, add_eos_token=add_eos,
        )
        ours = Tokenizer.from_dir(model_dir)
        theirs = transformers.AutoTokenizer.from_pretrained(str(model_dir))
        assert ours.encode("a b c") == theirs.encode("a b c")
        assert ours.add_bos_token
        assert ours.encode("a b c", add_special_tokens=False) == theirs.encode(
            "a b c", add_special_tokens=False
        )


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tmp_path: Path, messages: list[dict], add_generation_prompt: bool
) -> None:
    model_dir = _model_dir(
        tmp_path, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
        chat_template=LLAMA3_STYLE_TEMPLATE,
    )
    ours = Tokenizer.from_dir(model_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    for tools in (None, [{"name": "calc", "description": "<math> & more"}]):
        expected = theirs.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        got = ours.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tools=tools
        )
        assert got == expected


def test_tiny_chat_template_matches_transformers(tok: Tokenizer, hf_tok) -> None:
    messages = CONVERSATIONS[1]
    rendered = tok.apply_chat_template(messages)
    expected = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == expected
    assert rendered.startswith("<|begin_of_text|><|start_header_id|>system")
    assert rendered.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    ids = tok.encode(rendered, add_special_tokens=False)
    assert ids.count(tok.bos_token_id) == 1
    assert tok.token_to_id("<|start_header_id|>") in ids


def test_chat_template_errors(tmp_path: Path) -> None:
    model_dir = _model_dir(tmp_path, chat_template=LLAMA3_STYLE_TEMPLATE)
    with pytest.raises(jinja2.TemplateError, match="Unknown role: robot"):
        Tokenizer.from_dir(model_dir).apply_chat_template([{"role": "robot", "content": "x"}])
    (tmp_path / "tokenizer_config.json").write_text("{}", encoding="utf-8")
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}", encoding="utf-8")
    rendered = Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])
    assert rendered == "x"


def test_sandbox_blocks_attribute_escapes(tmp_path: Path) -> None:
    model_dir = _model_dir(tmp_path, chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        Tokenizer.from_dir(model_dir).apply_chat_template([])


def test_eos_ids_from_generation_config(tmp_path: Path) -> None:
    model_dir = _model_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 1}), encoding="utf-8")
    assert Tokenizer.from_dir(model_dir).eos_token_id == 1
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [4, 1]}))
    tokenizer = Tokenizer.from_dir(model_dir)
    assert tokenizer.eos_token_id == 4
    assert tokenizer.eos_token_ids == {1, 4}


def test_missing_tokenizer_file_is_clear(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_tiny_assets_regenerate_byte_identical(tmp_path: Path) -> None:
    build_tiny_assets(tmp_path)
    packaged = tiny_model_dir()
    names = ["config.json", "tokenizer.json", "tokenizer_config.json"]
    assert sorted(p.name for p in packaged.iterdir()) == names
    for name in names:
        assert (tmp_path / name).read_bytes() == (packaged / name).read_bytes(), name
    assert sum((packaged / n).stat().st_size for n in names) < 1_000_000


def test_tiny_config_matches_tokenizer(tok: Tokenizer) -> None:
    config = json.loads((tiny_model_dir() / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["vocab_size"] == tok.vocab_size
    assert 2000 <= tok.vocab_size <= 4000
    assert (config["hidden_size"], config["num_hidden_layers"]) == (256, 4)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert config["intermediate_size"] == 704
    assert config["bos_token_id"] == tok.bos_token_id
    assert set(config["eos_token_id"]) == tok.eos_token_ids


def test_resolve_model(tmp_path: Path) -> None:
    tiny = resolve_model(TINY_MODEL_NAME)
    assert tiny.path == tiny_model_dir() and tiny.auto_load_format == "dummy"
    local = resolve_model(str(tmp_path))
    assert local.path == tmp_path.resolve() and local.auto_load_format == "safetensors"
    with pytest.raises(FileNotFoundError, match="never downloads"):
        resolve_model("meta-llama/Llama-3.1-8B-Instruct")

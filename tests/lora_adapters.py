"""PEFT LoRA adapters for tests: `write_adapter(base, out, ...)` saves one with random weights
big enough to change greedy tokens (PEFT initialises B to zero, which would change nothing)."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(base: torch.nn.Module, out: str | Path, *, seed: int, rank: int = 8,
                  alpha: float = 16.0, targets: tuple[str, ...] = ALL_TARGETS,
                  scale: float = 0.1, use_rslora: bool = False) -> Path:
    """Wrap `base` (a transformers model; left unchanged) in a LoRA of `rank` on `targets`,
    fill A and B with N(0, scale^2) values seeded by `seed`, and save it under `out`."""
    import copy

    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets),
                        lora_dropout=0.0, bias="none", use_rslora=use_rslora)
    model = get_peft_model(copy.deepcopy(base), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
    out = Path(out)
    model.save_pretrained(out)
    return out


def load_with_adapter(base: torch.nn.Module, path: str | Path, merge: bool = False
                      ) -> torch.nn.Module:
    """`base` (copied) with the adapter at `path` applied by PEFT, or merged into its weights."""
    import copy

    from peft import PeftModel

    model = PeftModel.from_pretrained(copy.deepcopy(base), str(path)).eval()
    return model.merge_and_unload().eval() if merge else model


def write_tiny_adapter(out: str | Path, seed: int = 7, rank: int = 4) -> Path:
    """An adapter for the embedded tokenflow-tiny model (its config, random base weights: an
    adapter holds only A and B, of the base's shapes)."""
    import transformers

    from tokenflow.replica.loading.model_source import tiny_model_dir

    config = transformers.AutoConfig.from_pretrained(tiny_model_dir())
    base = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return write_adapter(base, out, seed=seed, rank=rank)

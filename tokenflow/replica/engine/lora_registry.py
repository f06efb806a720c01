"""The LoRA adapters an engine serves, by name: registered at start (`lora.lora_modules`), by
`add_lora`, or on first use from `lora.dynamic_lora_path`."""

from __future__ import annotations

import threading
from pathlib import Path

from tokenflow.config import LoRAConfig
from tokenflow.replica.loading.lora import read_adapter
from tokenflow.replica.loading.resolve import resolve_model
from tokenflow.replica.models.config import ModelArchConfig
from tokenflow.scheduler.lora import LoRAAdapter
from tokenflow.scheduler.sampling_params import MAX_LORA_NAME_LEN


class LoRARegistry:
    """Owns the name -> `LoRAAdapter` table of one engine (or of the serving process that
    validates its requests); every adapter in it was checked against the base model
    (`read_adapter`: rank, targets, shapes). Safe to call from any thread."""

    def __init__(self, config: LoRAConfig, model: str) -> None:
        self.config = config
        self._model = model
        self._arch: ModelArchConfig | None = None
        self._adapters: dict[str, LoRAAdapter] = {}
        self._lock = threading.Lock()
        for name, path in config.lora_modules.items():
            self.add(name, path)

    @property
    def arch(self) -> ModelArchConfig:
        if self._arch is None:
            self._arch = resolve_model(self._model).arch_config()
        return self._arch

    def add(self, name: str, path: str | Path) -> LoRAAdapter:
        """Register (or re-register) `name`; raises ValueError if the adapter does not fit."""
        if not self.config.enabled:
            raise ValueError("this engine serves no LoRA adapters (lora.max_loras is 0)")
        if not name or len(name) > MAX_LORA_NAME_LEN or "/" in name:
            raise ValueError(f"a LoRA name is 1 to {MAX_LORA_NAME_LEN} characters, no '/'; "
                             f"got {name!r}")
        spec = read_adapter(path, self.arch, self.config.max_lora_rank)
        adapter = LoRAAdapter(name, str(spec.path.resolve()))
        with self._lock:
            self._adapters[name] = adapter
        return adapter

    def remove(self, name: str) -> bool:
        with self._lock:
            return self._adapters.pop(name, None) is not None

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._adapters)

    def adapters(self) -> list[LoRAAdapter]:
        with self._lock:
            return list(self._adapters.values())

    def resolve(self, name: str) -> LoRAAdapter:
        """The adapter a request names: registered, or found under `dynamic_lora_path` (then
        registered). Raises ValueError for any other name."""
        adapter = self._adapters.get(name)
        if adapter is not None:
            return adapter
        if not self.config.enabled:
            raise ValueError(f"unknown LoRA adapter {name!r}: this engine serves no adapters "
                             "(lora.max_loras is 0)")
        root = self.config.dynamic_lora_path
        if root is not None and "/" not in name and name not in (".", "..") \
                and (Path(root) / name).is_dir():
            return self.add(name, Path(root) / name)
        known = ", ".join(self.names()) or "none"
        raise ValueError(f"unknown LoRA adapter {name!r}; registered: {known}")

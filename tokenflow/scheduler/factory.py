"""Build the scheduler an engine asks for, including a user-supplied class."""

from __future__ import annotations

import importlib
import warnings

from tokenflow.config import CacheConfig, KVOffloadConfig, KVTransferConfig, SchedulerConfig
from tokenflow.scheduler.async_scheduler import AsyncScheduler
from tokenflow.scheduler.grammar import GrammarBackend
from tokenflow.scheduler.scheduler import Scheduler


def import_scheduler_cls(qualname: str) -> type[Scheduler]:
    """Import `"module:Class"`; the interface it must follow is `Scheduler`'s."""
    module_name, sep, cls_name = qualname.partition(":")
    if not sep or not module_name or not cls_name:
        raise ValueError(f"scheduler_cls must look like 'module:Class', got {qualname!r}")
    cls = getattr(importlib.import_module(module_name), cls_name, None)
    if not isinstance(cls, type):
        raise ValueError(f"scheduler_cls {qualname!r}: {cls_name!r} is not a class in {module_name}")
    return cls


def build_scheduler(
    scheduler_config: SchedulerConfig,
    cache_config: CacheConfig,
    num_blocks: int,
    max_model_len: int,
    kv_transfer: KVTransferConfig | None = None,
    num_stages: int = 1,
    structured_outputs: GrammarBackend | None = None,
    kv_events_medium: str | None = None,
    kv_offload: KVOffloadConfig | None = None,
    num_offload_blocks: int = 0,
) -> Scheduler:
    """The configured scheduler class (`AsyncScheduler` with async scheduling, unless a
    `scheduler_cls` is given); `structured_outputs` is the engine's grammar manager
    (a `GrammarBackend`), None where the engine has none; `kv_events_medium`: record KV-cache
    events, naming the KV cache's tier so (None: none recorded); `kv_offload`: the offload tier,
    of `num_offload_blocks` blocks (what every stage's store holds)."""
    cls: type[Scheduler] = AsyncScheduler if scheduler_config.async_scheduling else Scheduler
    if scheduler_config.scheduler_cls:
        cls = import_scheduler_cls(scheduler_config.scheduler_cls)
        warnings.warn(
            f"using custom scheduler {scheduler_config.scheduler_cls}: the scheduler interface "
            "is not stable and may change without notice", UserWarning, stacklevel=2)
    # Only when on: a user's scheduler class written before the tier still builds without it.
    tier = ({"kv_offload": kv_offload, "num_offload_blocks": num_offload_blocks}
            if kv_offload is not None and kv_offload.enabled else {})
    return cls(scheduler_config, cache_config, num_blocks, max_model_len, kv_transfer,
               num_stages, structured_outputs=structured_outputs,
               kv_events_medium=kv_events_medium, **tier)

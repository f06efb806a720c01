"""tokenflow: an LLM serving cluster on Ray Serve.

`from tokenflow import LLM, SamplingParams` gives the offline API, as vLLM users expect. Both are
imported on first use, so that importing a light part of the package (the HTTP ingress, the
configs) does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenflow.replica.llm import LLM
    from tokenflow.scheduler.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from tokenflow.replica.llm import LLM

        return LLM
    if name == "SamplingParams":
        from tokenflow.scheduler.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

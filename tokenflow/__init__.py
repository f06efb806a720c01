"""tokenflow: an LLM serving cluster on Ray Serve.

`from tokenflow import LLM, SamplingParams, StructuredOutputsParams, RepetitionDetectionParams`
gives the offline API, as vLLM users expect. They are imported on first use, so that importing a
light part of the package (the HTTP ingress, the configs) does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenflow.replica.engine.llm import LLM
    from tokenflow.scheduler.sampling_params import (
        RepetitionDetectionParams,
        SamplingParams,
        StructuredOutputsParams,
    )

__all__ = ["LLM", "RepetitionDetectionParams", "SamplingParams", "StructuredOutputsParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from tokenflow.replica.engine.llm import LLM

        return LLM
    if name in ("SamplingParams", "StructuredOutputsParams", "RepetitionDetectionParams"):
        from tokenflow.scheduler import sampling_params

        return getattr(sampling_params, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""The package's public surface and its import weight."""

from __future__ import annotations

import subprocess
import sys


def test_offline_api_from_the_top_level() -> None:
    from tokenflow import LLM, SamplingParams

    llm = LLM("tokenflow-tiny", num_blocks=64, max_model_len=128)
    (out,) = llm.generate(["Hello"], SamplingParams(max_tokens=3, ignore_eos=True),
                          use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3


def test_the_http_ingress_does_not_import_torch() -> None:
    # What an ingress replica imports; the app builder needs LLMServer, and so torch.
    code = ("import sys, tokenflow.cluster.ingress; "
            "print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300, check=True)
    assert result.stdout.strip() == "False"

"""The compiled step: a stage's layers through `torch.compile` (inductor), compiled at startup.

What is compiled is `CausalLM.run_layers`, everything between the embedding and the final norm:
the norms, rope, the residual adds, the activation and the dtype casts around the quantized
matmuls fuse into a few C++ loops per layer, and the per-op Python dispatch (~450 ops a step)
goes. Attention stays an opaque op (`tokenflow::attention`): the paged cache and the step's
metadata never enter the graph, so a new step needs no recompile. With LoRA adapters each
projection's delta is an opaque op too (`tokenflow::lora_add`, models/lora.py), for the same
reason: the slot weights and the step's mix of adapters stay outside the graph.

The graphs: one for a single token (dynamo specializes size 1), then dynamic shapes over the
ranges the quantized layers switch kernels at without batch invariance (2-8 rows through the
packed kernels, 9 and more through their dense copies): no padding to buckets, every batch
size runs its own rows. With batch invariance every graph calls the same kernels, and gives a
row the same bits as the others do (tests/replica/test_batch_invariance.py). All
are compiled before the first request (`compile_step`), and inductor's cache lives under
`tokenflow.local_cache` so a restart loads them instead of compiling.
"""

from __future__ import annotations

import logging
import os
import time

import torch
import torch._inductor.config
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from tokenflow.local_cache import cache_dir
from tokenflow.replica.attention.backends import AttentionMetadata
from tokenflow.replica.models.llama import CausalLM
from tokenflow.replica.models.quantized import DENSE_ABOVE_ROWS

log = logging.getLogger(__name__)

# Token counts whose graphs differ: one token; a few rows (packed kernels); more (dense).
WARM_UP_TOKENS = (1, 2, DENSE_ABOVE_ROWS + 1)


def compile_step(model: CausalLM, kv_caches: list[torch.Tensor], max_num_tokens: int
                 ) -> float:
    """Compile `model`'s layers and run each graph once on dummy tokens (written to the first
    cache slots, which no request has yet). Returns the seconds it took."""
    # Importing dynamo sets the variable to torch's default (/tmp/torchinductor_<user>), so
    # only a value other than that one is the user's own; inductor reads it at each lookup.
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, os.path.abspath(default_cache_dir())):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "inductor")
    # Dynamo counts graphs per code object, across models: room for several in one process
    # (tests; a replica restarted in place) at a few graphs each.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    # Dynamo checks its guards before every step's call (the model's modules, its inputs'
    # shapes): skipping a module tree whose attribute dicts are unchanged (a setattr anywhere
    # changes the tag) and checking the shape guards in C++ took the check from ~0.74 to
    # ~0.30-0.36 ms a one-token step (torch.profiler, "TorchDynamo Cache Lookup"; 2-core VM).
    torch._dynamo.config.use_recursive_dict_tags_for_guards = True
    torch._dynamo.config.enable_cpp_symbolic_shape_guards = True
    start = time.perf_counter()
    block_size, device = kv_caches[0].shape[2], kv_caches[0].device
    # Freezing makes the weights constants of the graph, which on the CPU lets inductor keep
    # each dense weight prepacked in oneDNN's blocked layout: a float model's matmuls and a
    # quantized model's bfloat16 copies (9+ rows) run ~1.3-2x faster (bench/README, "What each part ... contributes"). Safe: no
    # weight changes after startup. It costs start-up time: a restart with inductor's cache
    # warm took ~61 s against ~20 s unfrozen on a 2-core VM (freezing only the graph of 9+ rows
    # still took ~50 s). Set process-wide: `torch.compile(options=...)` does not
    # reach the freezing pass, and a graph recompiled later must freeze too.
    if device.type == "cpu":
        torch._inductor.config.freezing = True
        # The graph's caller in C++ (inductor's `cpp_wrapper`) rather than Python: a one-token
        # step calls ~10 kernels and ops a layer, each with Python's allocations and size
        # asserts around it; in C++ the step took 7.4 -> 6.5 ms, 16 decodes' ~36 -> ~34 ms
        # (bench/README, "The graph's caller in C++, and OpenMP's spin"). Its cost: C++ to
        # build, a start ~60 -> ~115 s with inductor's cache empty, ~61 -> ~68 s with it warm.
        torch._inductor.config.cpp_wrapper = True
    compiled = torch.compile(model.run_layers, fullgraph=True)
    model.use_compiled(compiled)
    dtype = next(model.parameters()).dtype  # the model's, as the runner's (not the cache's)
    for tokens in sorted({min(t, max_num_tokens) for t in WARM_UP_TOKENS}):
        meta = AttentionMetadata.build(
            slot_mapping=range(tokens), block_table=[[t // block_size] for t in range(tokens)],
            query_start_loc=range(tokens + 1), seq_lens=[t % block_size + 1
                                                         for t in range(tokens)],
            block_size=block_size, device=device, dtype=dtype)
        # Inside inference mode, as the runner's steps: dynamo guards on the tensors' kind.
        with torch.inference_mode():
            # Distinct tensors for distinct inputs: dynamo guards on aliasing too.
            ids, positions = (torch.zeros(tokens, dtype=torch.long, device=device)
                              for _ in range(2))
            hidden, residual = (None, None) if model.is_first_stage else (
                torch.zeros(tokens, model.arch.hidden_size, dtype=dtype, device=device)
                for _ in range(2))
            model(ids, positions, kv_caches, meta, hidden, residual)
    seconds = time.perf_counter() - start
    log.info("compiled layers %d-%d for %s tokens in %.1f s", model.layer_start,
             model.layer_end, WARM_UP_TOKENS, seconds)
    return seconds


"""Batched multi-LoRA: one projection's adapters in fixed slots, every token its own adapter.

For a target W (out x in) an adapter adds `(x @ A^T) @ B^T * scaling` (A: r x in, B: out x r).
A fused projection (qkv: q, k, v; gate_up: gate, up) has P parts sharing the input, so each
slot holds P blocks of `max_rank` rows of A (zero past the adapter's rank and for parts it
does not adapt) and the matching block-diagonal B, scaling folded in:

    lora_a  [S * P * R, in]     slot s, part p, rank row j at row (s * P + p) * R + j
    lora_bt [S * P * R, out]    B^T of the same rows, its part's output columns only

A step computes each token's delta with its own slot's weights only (punica's idea). On the
CPU, with float32 weights, one C++ call a projection does it (`lora_kernel`,
`lora_delta.cpp`): per token, its slot's shrink and a part-wise expand (no block-diagonal
zeros), given each token's slot (`LoRAStep.token_slots`) and each slot's rank per part
(`LoRALinear.ranks`; 0 for a part the adapter leaves alone). Elsewhere (CUDA, no compiler,
bfloat16) torch's ops do it, in two forms. A small step (decode: one token a request)
gathers its adapter tokens into one padded group per slot, `[n, L, in]` (n: slots up to the
highest in use, L: the most tokens one slot has), and runs two batched matmuls, shrink
`[n, L, in] @ [n, in, P * R]` and expand `[n, L, P * R] @ [n, P * R, out]`, adding the rows
back with `index_add_` (padding rows are zeroed between the two). A large step (a prefill
chunk) takes each slot's tokens through its own slot's A and B as two matmuls on views: the
runner orders a step's requests by adapter, so a slot's tokens are one contiguous run (no
gather, no scatter). `SEGMENT_MIN_TOKENS` decides
which form a step takes. The group indices are built once a step (`LoRAStep.set`), not per
layer; base-model tokens take no part, and a step with no adapter token skips it all. The base
layer may be a `QuantizedLinear`: the delta is float, added on top.

Compiled (`worker/compile.py`), the delta is one opaque op, `tokenflow::lora_add`, that adds it
to the base layer's output in place: the slot weights and the step's groups stay outside the
graph, so loading an adapter or a new step's mix needs no recompile, and freezing (which makes
the graph's weights constants) never sees the slot weights, which change at run time.

(An earlier form multiplied every token by every slot in use under a one-hot mask: two plain
matmuls, but n times the work a token needs, and on a 32-token decode step of 4 adapters
~466M multiply-adds where the tokens' own adapters need ~78M: bench/README, "Multi-LoRA".)
"""

from __future__ import annotations

import weakref

import numpy as np
import torch
from torch import nn

from tokenflow.replica.models import lora_kernel

# From this many tokens in a step, each slot's contiguous run of tokens goes through its own
# slot's weights as plain matmuls (no gather); fewer tokens (decode steps) go through the
# padded groups, a fixed five ops whatever the number of slots. (The threshold was measured
# against the earlier mask form, bench/README "Multi-LoRA"; not yet again for the groups.)
SEGMENT_MIN_TOKENS = 64
# Our fused projections and their PEFT parts, in the order of their output rows.
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
               "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


class LoRAStep:
    """Owns the step's per-token slot assignment, shared by a stage's `LoRALinear`s, in the
    form the step's delta takes: each token's slot for the C++ kernel (`token_slots`); else,
    for a small step the padded per-slot groups of its adapter tokens (`rows`, `valid`), for
    a large step the contiguous token runs of each slot (`segments`); none when no token of
    the step uses an adapter."""

    def __init__(self, max_rank: int, dtype: torch.dtype) -> None:
        self.max_rank, self.dtype = max_rank, dtype
        self.num_slots = 0
        self.token_slots: torch.Tensor | None = None  # [T] int32, -1: base (the C++ form)
        self.rows: torch.Tensor | None = None  # [n * L] the token of each group row
        self.valid: torch.Tensor | None = None  # [n, L, 1] 1 for a token, 0 for padding
        self.segments: list[tuple[int, int, int]] = []  # (slot, first token, end)

    def kernel_runs_on(self, device: torch.device) -> bool:
        """Whether the C++ delta serves this stage (CPU, float32 weights, a compiler)."""
        return (device.type == "cpu" and self.dtype == torch.float32
                and self.max_rank <= lora_kernel.MAX_RANK and lora_kernel.available())

    def set(self, request_slots: np.ndarray, query_lens: np.ndarray, device: torch.device,
            form: str | None = None) -> None:
        """Each request's slot (-1: the base model) and token count, in the step's order.
        `form` ("kernel", "segments", "groups"; the tests compare them): by default the
        kernel where it runs, else segments for a step of `SEGMENT_MIN_TOKENS` or more."""
        self.segments, self.rows, self.valid, self.num_slots = [], None, None, 0
        self.token_slots = None
        if not len(request_slots) or request_slots.max() < 0:
            return
        self.num_slots = n = int(request_slots.max()) + 1
        if form is None:
            form = ("kernel" if self.kernel_runs_on(device) else
                    "segments" if query_lens.sum() >= SEGMENT_MIN_TOKENS else "groups")
        if form == "kernel":
            self.token_slots = torch.from_numpy(
                np.repeat(request_slots, query_lens).astype(np.int32))
            return
        if form == "segments":
            # Runs of requests with the same slot (the runner puts an adapter's requests
            # together, so there is about one run per slot), as token ranges.
            bounds = np.concatenate([[0], np.cumsum(query_lens)])
            firsts = np.flatnonzero(np.diff(request_slots, prepend=-2))
            lasts = np.append(firsts[1:], len(request_slots))
            self.segments = [(int(request_slots[f]), int(bounds[f]), int(bounds[e]))
                             for f, e in zip(firsts, lasts, strict=True)
                             if request_slots[f] >= 0 and bounds[e] > bounds[f]]
            return
        token_slots = np.repeat(request_slots, query_lens)
        tokens = np.flatnonzero(token_slots >= 0)
        slots = token_slots[tokens]
        order = np.argsort(slots, kind="stable")
        tokens, slots = tokens[order], slots[order]
        counts = np.bincount(slots, minlength=n)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        place = np.arange(len(slots)) - starts[slots]  # each token's row in its slot's group
        rows = np.zeros((n, int(counts.max())), np.int64)  # padding: token 0, zeroed later
        valid = np.zeros(rows.shape, np.float32)
        rows[slots, place], valid[slots, place] = tokens, 1.0
        self.rows = torch.from_numpy(rows.reshape(-1)).to(device)
        self.valid = torch.from_numpy(valid).to(device=device, dtype=self.dtype)[:, :, None]


class LoRALinear(nn.Module):
    """Owns one (fused) projection's base layer and its adapters' slot weights
    (`lora_a`, `lora_bt`, see the module docstring); reads the step's token groups from
    `step`."""

    def __init__(self, base: nn.Module, part_sizes: tuple[int, ...], in_features: int,
                 num_slots: int, step: LoRAStep, device: torch.device) -> None:
        super().__init__()
        self.base, self.step = base, step
        self.part_sizes = part_sizes
        self.width = len(part_sizes) * step.max_rank  # columns of one slot
        rows = num_slots * self.width
        self.register_buffer("lora_a", torch.zeros(rows, in_features, dtype=step.dtype,
                                                   device=device))
        self.register_buffer("lora_bt", torch.zeros(rows, sum(part_sizes), dtype=step.dtype,
                                                    device=device))
        self.register_buffer("ranks", torch.zeros(num_slots, len(part_sizes), dtype=torch.int32,
                                                  device=device))  # each slot's, per part
        self.loaded: set[int] = set()  # slots with weights for this projection
        # How the compiled graph's opaque op finds this layer (a constant of the graph).
        self.handle = len(_LAYERS)
        _LAYERS.append(weakref.ref(self))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if torch.compiler.is_compiling():
            lora_add_op(x, y, self.handle)
            return y
        return self.add_delta(x, y)

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`y` (the base layer's output for `x`) plus each token's adapter delta."""
        n = self.step.num_slots
        if not n or not self.loaded:
            return y
        width = self.width
        if self.step.token_slots is not None:
            lora_kernel.lora_delta(x.contiguous(), y, self.lora_a, self.lora_bt, self.ranks,
                                   self.step.token_slots, self.part_sizes, self.step.max_rank)
            return y
        if self.step.segments:
            for slot, first, end in self.step.segments:
                if slot in self.loaded:
                    rows = slice(slot * width, (slot + 1) * width)
                    y[first:end].addmm_(torch.mm(x[first:end], self.lora_a[rows].T),
                                        self.lora_bt[rows])
            return y
        rows, valid = self.step.rows, self.step.valid
        a = self.lora_a[:n * width].view(n, width, -1)  # [n, P * R, in]
        bt = self.lora_bt[:n * width].view(n, width, -1)  # [n, P * R, out]
        group = x.index_select(0, rows).view(n, valid.shape[1], -1)  # [n, L, in]
        shrunk = torch.bmm(group, a.transpose(1, 2)).mul_(valid)  # [n, L, P * R]
        return y.index_add_(0, rows, torch.bmm(shrunk, bt).view(len(rows), -1))

    def set_slot(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None],
                 scaling: float) -> None:
        """Write an adapter into `slot`: per part, (A [r, in], B [out, r]) or None."""
        rank, first = self.step.max_rank, slot * self.width
        a = self.lora_a[first:first + self.width].zero_()
        bt = self.lora_bt[first:first + self.width].zero_()
        self.ranks[slot].zero_()
        offset = 0
        for p, (size, weights) in enumerate(zip(self.part_sizes, parts, strict=True)):
            if weights is not None:
                lora_a, lora_b = weights
                r = lora_a.shape[0]
                a[p * rank:p * rank + r] = lora_a
                bt[p * rank:p * rank + r, offset:offset + size] = (lora_b * scaling).T
                self.ranks[slot, p] = r
            offset += size
        if any(w is not None for w in parts):
            self.loaded.add(slot)
        else:
            self.loaded.discard(slot)


# Every `LoRALinear` made in this process, by handle; weak, so a dropped model goes.
_LAYERS: list[weakref.ref[LoRALinear]] = []

# `add_delta` as one opaque op for `torch.compile`, defined as the attention op is
# (attention/backends.py): through `torch.library.Library`, whose Python dispatch is cheaper
# than `custom_op`'s. It mutates `y`, the base layer's output, which inductor re-inplaces.
_LIBRARY = torch.library.Library("tokenflow", "FRAGMENT")
_LIBRARY.define("lora_add(Tensor x, Tensor(a!) y, int handle) -> ()")


def _lora_add_impl(x: torch.Tensor, y: torch.Tensor, handle: int) -> None:
    layer = _LAYERS[handle]()
    assert layer is not None, "a compiled graph outlived its LoRA layers"
    layer.add_delta(x, y)


_LIBRARY.impl("lora_add", _lora_add_impl, "CompositeExplicitAutograd")


@torch.library.register_fake("tokenflow::lora_add")
def _lora_add_fake(x: torch.Tensor, y: torch.Tensor, handle: int) -> None:
    return None


lora_add_op = torch.ops.tokenflow.lora_add.default


def wrap_lora(model: nn.Module, num_slots: int, step: LoRAStep, device: torch.device
              ) -> dict[tuple[int, str], LoRALinear]:
    """Put a `LoRALinear` around every targetable projection of the model's layers, in place.
    Returns them by (stage layer index, fused name)."""
    arch = model.arch
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    hidden, inter = arch.hidden_size, arch.intermediate_size
    shapes = {"qkv_proj": (hidden, (q, kv, kv)), "o_proj": (q, (hidden,)),
              "gate_up_proj": (hidden, (inter, inter)), "down_proj": (inter, (hidden,))}
    wrapped = {}
    for index, layer in enumerate(model.layers):
        for owner in (layer.self_attn, layer.mlp):
            for name, (d_in, parts) in shapes.items():
                base = getattr(owner, name, None)
                if base is not None:
                    lora = LoRALinear(base, parts, d_in, num_slots, step, device)
                    setattr(owner, name, lora)
                    wrapped[(index, name)] = lora
    return wrapped

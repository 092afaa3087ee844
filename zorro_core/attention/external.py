"""Attention against a key region kept from an earlier forward: the prompt-once schedule's hook side.

The schedule (zorro_core.actor.schedule) runs a step's unique prompts forward once and its
responses later, in micro-batches, against the prompts' kept keys and values. A `KeyRegion` in
the route (`route.region`) makes the hook run that way:
- capture (phase 1, the prompts): each prompt attends causally to itself; every attention layer's
  keys and values (post-rotary, as attention sees them) are kept as leaves that take gradients,
  detached from the prompts' graph, and the layer's output passes through `InjectGrad`, which in
  the prompts' backward (phase 3) hands the leaves' accumulated gradients to the graph's keys and
  values. It runs the same in the recompute of gradient checkpointing (either flavour), which is
  how checkpointing recomputes the prompts' activations in phase 3 instead of keeping them.
- attend (phase 2, the responses): the queries are response tokens; the keys are [the kept keys
  of the micro-batch's prompts | the row's own keys]; a response token sees all of its prompt and
  its own earlier tokens (a sliding window counted in positions, as the plain mask does).
Where the actor's varlen backend has a kernel pair (flash-attn's, torch's aten flash ops,
`flash_cpu`), both run the split path's varlen calls (zorro_core.attention.region_varlen): the
prompts self-causal; the responses causal over themselves, then against their prompts' kept keys in
place, merged by log-sum-exp. Elsewhere (reference, sdpa, mask mode, a window that cuts a prompt)
the attention is one masked SDPA call over the key region: exact, dense in the region (a
[Tq, Tp + Tq] mask and a [kept | own] copy of the keys).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from zorro_core.attention.region_varlen import attend_kept, capture_attention, chunk_attention, region_pair
from zorro_core.errors import UnsupportedModelError


@dataclass
class KeptPrefix:
    """The step's prompts' kept keys and values, per attention module, and their layout."""

    positions: torch.Tensor
    """[Tp] position of each token of the packed prompts row."""
    prompt_of: torch.Tensor
    """[Tp] which unique prompt (a trie node under prefix tries) each token belongs to."""
    keys: dict[nn.Module, torch.Tensor] = field(default_factory=dict)
    """Attention module -> its keys [1, Hkv, Tp, Dk], a leaf that takes gradients."""
    values: dict[nn.Module, torch.Tensor] = field(default_factory=dict)
    """Attention module -> its values [1, Hkv, Tp, Dv], a leaf that takes gradients."""

    def leaves(self) -> list[torch.Tensor]:
        return [*self.keys.values(), *self.values.values()]

    def kept_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.leaves())


@dataclass(frozen=True)
class KeptChunk:
    """What InjectGrad reads for one chunk of phase 1: the kept leaves (as long as the whole prompts
    row) and the chunk's slice [a, b) of them."""

    keys: dict
    """KeptPrefix.keys."""
    values: dict
    """KeptPrefix.values."""
    span: tuple[int, int]
    """The chunk's tokens in the packed prompts row."""


class InjectGrad(torch.autograd.Function):
    """Identity on a layer's output whose backward also hands the kept leaves' gradients to the
    keys and values of the prompts' graph (read when the backward runs: after phase 2). `kept` is
    the KeptPrefix, or a KeptChunk (a chunk of phase 1 gets its slice of the leaves' gradients)."""

    @staticmethod
    def forward(ctx, out, key, value, kept: Any, module: nn.Module):
        ctx.kept, ctx.module = kept, module
        ctx.key_meta = (key.shape, key.dtype)
        ctx.value_meta = (value.shape, value.dtype)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, dout):
        span = getattr(ctx.kept, "span", None)

        def grad(leaf: torch.Tensor, meta):
            g = leaf.grad
            if g is None:
                return torch.zeros(meta[0], dtype=meta[1], device=dout.device)
            return (g if span is None else g[:, :, span[0] : span[1]]).to(meta[1])

        gk = grad(ctx.kept.keys[ctx.module], ctx.key_meta)
        gv = grad(ctx.kept.values[ctx.module], ctx.value_meta)
        return dout, gk, gv, None, None


@dataclass
class KeyRegion:
    """One forward's attention layout under the schedule (see the module doc)."""

    kept: KeptPrefix
    """The prompts' kept keys and values (filled in capture)."""
    positions: torch.Tensor
    """[T] position of each token of this forward's row."""
    segment: torch.Tensor
    """[T] the sequence each row token belongs to (a prompt in capture, a response in attend)."""
    prompt_of: torch.Tensor
    """[T] the unique prompt each row token continues (attend); equal to segment in capture."""
    capture: bool
    """Phase 1 (keep the keys and values) or phase 2 (attend to them)."""
    prompt_span: tuple[int, int] = (0, 0)
    """Attend: the slice [p0, p1) of the packed prompts row this forward's responses need."""
    sealed: bool = False
    """Set after the forward: later capture calls are checkpointing's recompute (in backward)."""
    ancestors: Optional[torch.Tensor] = None
    """Prefix tries: [N, N] bool, node a is an ancestor-or-self of node n. `prompt_of` and
    `kept.prompt_of` are then trie nodes, and a token sees the kept tokens of its node's whole
    root-to-node path. None: a token sees its own prompt's tokens only (nodes are prompts)."""
    linear: Optional[Callable[..., Any]] = None
    """Gated DeltaNet layers: (region, route, layer) -> the layer's forward under this region
    (zorro_core.attention.external_linear.KeptLinear, set by the schedule). None: not served."""
    chunk: Optional[tuple[int, int]] = None
    """Capture in chunks (phase 1 under the budget): this forward is the slice [a, b) of the packed
    prompts row; its tokens also attend to the kept keys and values of [0, a), and its own go into
    that slice of leaves as long as the whole row. None: the whole row in one forward."""
    _captured: set = field(default_factory=set, repr=False)
    """Attention modules this forward captured (a second call of one is a shared layer: refused)."""
    _masks: dict = field(default_factory=dict, repr=False)
    _varlen: dict = field(default_factory=dict, repr=False)
    """The kernel calls' layouts (region_varlen), built once per forward."""

    def _sees(self, key_node: torch.Tensor, query_node: torch.Tensor) -> torch.Tensor:
        """Whether a query of `query_node` sees a key of `key_node` (broadcasting)."""
        if self.ancestors is None:
            return key_node == query_node
        return self.ancestors[key_node, query_node]

    def mask(self, window: Optional[int]) -> torch.Tensor:
        """[T, keys] bool: which keys each query sees, built once per window."""
        if window not in self._masks:
            pos, seg = self.positions, self.segment
            same = self._sees(seg[None, :], seg[:, None]) if self.capture else seg[:, None] == seg[None, :]
            own = same & (pos[None, :] <= pos[:, None])
            if window is not None:
                own &= pos[:, None] - pos[None, :] < window
            a = self.chunk[0] if self.capture and self.chunk is not None else 0
            if self.capture and a:
                # A later chunk: its tokens also see the kept tokens of [0, a) on their path (all earlier).
                kpos, knode = self.kept.positions[:a], self.kept.prompt_of[:a]
                pre = self._sees(knode[None, :], seg[:, None])
                if window is not None:
                    pre &= pos[:, None] - kpos[None, :] < window
                self._masks[window] = torch.cat([pre, own], dim=1)
            elif self.capture:
                self._masks[window] = own
            else:
                p0, p1 = self.prompt_span
                kpos, kprompt = self.kept.positions[p0:p1], self.kept.prompt_of[p0:p1]
                pre = self._sees(kprompt[None, :], self.prompt_of[:, None])
                if window is not None:
                    pre &= pos[:, None] - kpos[None, :] < window
                self._masks[window] = torch.cat([pre, own], dim=1)
        return self._masks[window]

    def attend(
        self,
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
        window: Optional[int],
        backend: Optional[str] = None,
    ) -> torch.Tensor:
        """q [1, Hq, T, D], k [1, Hkv, T, D], v [1, Hkv, T, Dv] -> [1, T, Hq, Dv]. `backend`: the
        actor's varlen backend in split mode (its kernel pair, if any, runs the calls), else None."""
        # A prefix trie's nodes attend to their ancestors, not to one contiguous prompt: the kernel
        # pair's calls (each prompt self-causal, each response against its own prompt) do not hold there.
        pair = None if self.ancestors is not None else region_pair(backend, query.dtype, self.positions, window)
        if self.capture:
            a = self.chunk[0] if self.chunk is not None else 0
            if a:  # a later chunk of phase 1: [kept keys of [0, a) | its own]
                if module not in self.kept.keys:
                    raise RuntimeError(
                        f"no kept keys for attention module {type(module).__name__}: an earlier chunk did not reach it"
                    )
                kept_k = self.kept.keys[module][:, :, :a].to(key.dtype)
                kept_v = self.kept.values[module][:, :, :a].to(value.dtype)
                if pair is not None:  # the kernel pair: the cut prompt's kept tokens as a second call
                    out = chunk_attention(self, query, key, value, kept_k, kept_v, scale, pair)
                else:  # the dense masked call
                    k = torch.cat([kept_k, key], dim=2)
                    v = torch.cat([kept_v, value], dim=2)
                    out = self._sdpa(query, k, v, scale, window)
            elif pair is None:
                out = self._sdpa(query, key, value, scale, window)
            else:
                out = capture_attention(self, query, key, value, scale, pair)
            if module in self._captured and not self.sealed:
                raise UnsupportedModelError(
                    f"attention module {type(module).__name__} ran twice in one forward: its kept keys and "
                    "values would be one call's; the prompt-once schedule does not serve shared attention layers"
                )
            self._captured.add(module)
            if not self.sealed:  # a checkpoint recompute (sealed) keeps the first leaves
                self._keep(module, key, value)
            if torch.is_grad_enabled() and (key.requires_grad or value.requires_grad):
                kept = self.kept if self.chunk is None else KeptChunk(self.kept.keys, self.kept.values, self.chunk)
                out = InjectGrad.apply(out, key, value, kept, module)
            return out
        if module not in self.kept.keys:
            raise RuntimeError(
                f"no kept keys for attention module {type(module).__name__}: the prompts' forward did not reach it"
            )
        p0, p1 = self.prompt_span
        kept_k = self.kept.keys[module][:, :, p0:p1].to(key.dtype)
        kept_v = self.kept.values[module][:, :, p0:p1].to(value.dtype)
        if pair is not None:
            return attend_kept(self, query, key, value, kept_k, kept_v, scale, pair)
        k = torch.cat([kept_k, key], dim=2)
        v = torch.cat([kept_v, value], dim=2)
        return self._sdpa(query, k, v, scale, window)

    def _keep(self, module: nn.Module, key: torch.Tensor, value: torch.Tensor) -> None:
        """This forward's keys and values into the kept leaves: the tensors themselves (one forward),
        or their slice of leaves as long as the whole prompts row (a chunk; written without a graph)."""
        if self.chunk is None:
            self.kept.keys[module] = key.detach().requires_grad_(True)
            self.kept.values[module] = value.detach().requires_grad_(True)
            return
        a, b = self.chunk
        total = self.kept.positions.numel()
        for store, x in ((self.kept.keys, key), (self.kept.values, value)):
            if module not in store:
                shape = (*x.shape[:2], total, *x.shape[3:])
                store[module] = torch.zeros(shape, dtype=x.dtype, device=x.device).requires_grad_(True)
            with torch.no_grad():
                store[module][:, :, a:b].copy_(x)

    def _sdpa(self, q, k, v, scale: float, window: Optional[int]) -> torch.Tensor:
        mask = self.mask(window)
        gqa = q.shape[1] != k.shape[1]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        return out.transpose(1, 2)

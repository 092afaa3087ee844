"""Gated DeltaNet layers under the prompt-once schedule: each prompt's recurrent state at its end, and
its conv window, kept as leaves (zorro_core.actor.schedule; the attention layers' side is
zorro_core.attention.external).

A gated DeltaNet layer carries a prompt forward in two things: the delta rule's state after the
prompt's last token ([Hv, Dk, Dv]) and the causal conv's inputs at its last K-1 positions (the
pre-conv q/k/v a response's first K-1 tokens convolve with). Under a KeyRegion in the route:
- capture (phase 1, the packed prompts, one segment each): the conv over each prompt's own
  inputs (zeros before its start), the delta rule per prompt from a zero state; the final states
  and the last K-1 conv inputs of each prompt are kept in the region's KeptPrefix (keys: the conv
  windows [G, K-1, C], values: the states [G, Hv, Dk, Dv]) as leaves that take gradients, and the
  layer's output passes through InjectGrad, which in phase 3 hands their accumulated gradients to
  the prompts' graph (inside a checkpointed layer too, as for attention).
- attend (phase 2, responses): a response token's conv window reaches back into its prompt's
  kept inputs; each response's delta rule starts from its prompt's kept state.
Exact: the state after a prompt and the next tokens determine every later output. A response's
chunks then start at its prompt's end, not at multiples of the chunk from the row's start as in a
one-shot run: the same sums in another order (rounding differs in low precision, as verify's
rule allows). Prefix tries (a node's state from its parent's) are not built: refused upstream.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn
from transformers.activations import ACT2FN

from zorro_core.attention.external import InjectGrad
from zorro_core.models.linear_attention import _delta_varlen, delta_rule_kernel
from zorro_core.models.linear_layout import DEFAULT_CHUNK, calls_of


def conv_with_sources(
    original: Callable,
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    activation: Optional[str],
    src: torch.Tensor,
    extra: torch.Tensor,
) -> torch.Tensor:
    """The causal depthwise conv of [1, C, T], token t over rows src[t] (oldest first) of
    cat([x, extra, a zero row]): the model's own conv over the row, then the rows whose window is
    not the row's own recomputed (before the activation, as the adapter's _dedup_conv does)."""
    x = hidden_states[0].t()  # [T, C]
    t, k = x.shape[0], weight.shape[-1]
    zero = t + extra.shape[0]
    tok = torch.arange(t, device=x.device)[:, None]
    d = torch.arange(k - 1, -1, -1, device=x.device)[None, :]
    natural = torch.where(tok - d >= 0, tok - d, zero)
    fix = (src != natural).any(1).nonzero().flatten()
    out = original(hidden_states, weight, bias, activation=None)
    if fix.numel():
        acc = torch.float64 if weight.dtype == torch.float64 else torch.float32
        xz = torch.cat([x, extra.to(x.dtype), x.new_zeros(1, x.shape[1])]).to(acc)
        rows = torch.einsum("nkc,ck->nc", xz[src[fix]], weight.to(acc))
        if bias is not None:
            rows = rows + bias.to(acc)
        out = out[0].t().index_copy(0, fix, rows.to(out.dtype)).t()[None]
    return ACT2FN[activation](out) if activation is not None else out


class KeptLinear:
    """One gated DeltaNet layer's forward under a KeyRegion (module doc)."""

    def __init__(self, region: Any, route: Any, layer: nn.Module) -> None:
        self.region, self.route, self.layer = region, route, layer
        self.window: Optional[torch.Tensor] = None
        self.state: Optional[torch.Tensor] = None

    def _prompts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([G] each prompt's length, [G] its last token's index in the packed prompts row)."""
        kept = self.region.kept
        ends = torch.nonzero(kept.positions[1:] <= kept.positions[:-1]).flatten()
        last = torch.cat([ends, ends.new_tensor([kept.positions.numel() - 1])])
        return kept.positions[last] + 1, last

    def conv(self, original: Callable, hidden_states, weight, bias, activation) -> torch.Tensor:
        r = self.region
        x = hidden_states[0].t()
        t, k = x.shape[0], weight.shape[-1]
        d = torch.arange(k - 1, -1, -1, device=x.device)[None, :]
        tok = torch.arange(t, device=x.device)[:, None]
        own = r.positions[:, None] - d  # the window's positions along the sequence
        if r.capture:
            src = torch.where(own >= 0, tok - d, t)
            out = conv_with_sources(original, hidden_states, weight, bias, activation, src, x[:0])
            lens, last = self._prompts()
            i = torch.arange(k - 1, device=x.device)[None, :]  # window row i: prompt position P - (K-1) + i
            at = torch.where(lens[:, None] - (k - 1) + i >= 0, last[:, None] - (k - 2) + i, t)
            self.window = torch.cat([x, x.new_zeros(1, x.shape[1])])[at]  # [G, K-1, C]
            if self.layer not in r.kept.keys:  # a checkpoint recompute keeps the first leaves
                r.kept.keys[self.layer] = self.window.detach().requires_grad_(True)
        else:
            lens, _ = self._prompts()
            within = r.positions - lens[r.prompt_of]  # the token's index in its response
            back = within[:, None] - d  # < 0: in the prompt, kept window row back + K - 1
            src = torch.where(back >= 0, tok - d, t + r.prompt_of[:, None] * (k - 1) + back + k - 1)
            kept = r.kept.keys[self.layer]
            out = conv_with_sources(
                original, hidden_states, weight, bias, activation, src, kept.reshape(-1, x.shape[1])
            )
        self.route.count_adapter_call("linear_conv")
        return out

    def delta_rule(self, original: Callable, query, key, value, g, beta) -> torch.Tensor:
        """[1, T, Hv, Dv]: capture, each prompt from zeros (its final state kept); attend, each
        response from its prompt's kept state."""
        r = self.region
        kernel, use_fla = delta_rule_kernel(original, query)
        x = tuple(a[0] for a in (query, key, value, g, beta))
        t = query.shape[1]
        seg = r.segment
        starts = torch.cat([seg.new_ones(1), (seg[1:] != seg[:-1]).long()]).nonzero().flatten()
        seg_len = torch.diff(torch.cat([starts, starts.new_tensor([t])]))
        calls = calls_of(torch.arange(t, device=query.device), seg_len, t)
        if r.capture:
            out, state = _delta_varlen(kernel, calls, x, None, DEFAULT_CHUNK, True, use_fla)
            self.state = state
            if self.layer not in r.kept.values:
                r.kept.values[self.layer] = state.detach().requires_grad_(True)
        else:
            init = r.kept.values[self.layer][r.prompt_of[starts]]
            out, _ = _delta_varlen(kernel, calls, x, init, DEFAULT_CHUNK, False, use_fla)
        self.route.count_adapter_call("linear_attention")
        return out[None]

    def finish(self, out: torch.Tensor) -> torch.Tensor:
        """The layer's output; in capture, through InjectGrad (phase 3 hands the kept window's and
        state's gradients to the prompts' graph)."""
        w, s = self.window, self.state
        if not self.region.capture or w is None or s is None:
            return out
        if torch.is_grad_enabled() and (w.requires_grad or s.requires_grad):
            return InjectGrad.apply(out, w, s, self.region.kept, self.layer)
        return out

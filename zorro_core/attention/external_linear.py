"""Gated DeltaNet layers under the prompt-once schedule: each prompt's recurrent state at its end, and
its conv window, kept as leaves (zorro_core.actor.schedule; the attention layers' side is
zorro_core.attention.external). The schedule puts `KeptLinear` in its KeyRegion (`region.linear`);
the gated DeltaNet adapter (zorro_core.models.linear_attention) runs the layer through it.

A gated DeltaNet layer carries a prompt forward in two things: the delta rule's state after the
prompt's last token ([Hv, Dk, Dv]) and the causal conv's inputs at its last K-1 positions (the
pre-conv q/k/v a response's first K-1 tokens convolve with). Under a KeyRegion in the route:
- capture (phase 1, the packed prompts' nodes: the prompts, or their trie's nodes): the conv over
  each node's path's inputs (zeros before its start), the delta rule level by level, each node
  from its parent's final state (a root from zeros); the final states and the last K-1 conv
  inputs along each node's path are kept in the region's KeptPrefix (keys: the conv windows
  [N, K-1, C], values: the states [N, Hv, Dk, Dv], per node) as leaves that take gradients, and
  the layer's output passes through InjectGrad, which in phase 3 hands their accumulated
  gradients to the prompts' graph (inside a checkpointed layer too, as for attention).
- attend (phase 2, responses): a response token's conv window reaches back into its prompt's
  kept inputs; each response's delta rule starts from its prompt's kept state.
Exact: the state after a prompt and the next tokens determine every later output. A response's
chunks then start at its prompt's end, not at multiples of the chunk from the row's start as in a
one-shot run: the same sums in another order (rounding differs in low precision, as verify's
rule allows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn
from transformers.activations import ACT2FN

from zorro_core.attention.external import InjectGrad
from zorro_core.models.linear_attention import delta_rule_kernel, delta_varlen
from zorro_core.models.linear_layout import DEFAULT_CHUNK, calls_of
from zorro_core.plan.segments import concat_ranges


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


@dataclass(frozen=True)
class Nodes:
    """The packed prompts row's nodes (the prompts, or their trie's nodes), read off the region."""

    start: torch.Tensor
    """[N] path position of each node's first token."""
    end: torch.Tensor
    """[N] path position after its last token (a prompt's length at its end node)."""
    first: torch.Tensor
    """[N] packed index of its first token."""
    level: torch.Tensor
    """[N] its ancestors' count."""
    parent: torch.Tensor
    """[N] its parent (-1 at a root)."""
    ancestors: torch.Tensor
    """[N, N] bool: a is an ancestor-or-self of n."""

    @classmethod
    def of(cls, region: Any) -> "Nodes":
        node, pos = region.kept.prompt_of, region.kept.positions
        t = node.numel()
        n = region.ancestors.shape[0] if region.ancestors is not None else int(node.max()) + 1
        anc = region.ancestors if region.ancestors is not None else torch.eye(n, dtype=torch.bool, device=node.device)
        idx = torch.arange(t, device=node.device)
        first = torch.full((n,), t, device=node.device).scatter_reduce(0, node, idx, "amin")
        end = torch.zeros(n, dtype=pos.dtype, device=node.device).scatter_reduce(0, node, pos + 1, "amax")
        level = anc.sum(0) - 1
        above = torch.where(anc & ~torch.eye(n, dtype=torch.bool, device=node.device), level[:, None], -1)
        parent = torch.where(level > 0, above.argmax(0), -1)
        return cls(pos[first], end, first, level, parent, anc)

    def locate(self, node: torch.Tensor, q: torch.Tensor, zero: int) -> torch.Tensor:
        """Packed index of path position `q` on `node`'s path (`zero` where q < 0), elementwise."""
        on = self.ancestors[:, node] & (self.start[:, None] <= q[None, :]) & (q[None, :] < self.end[:, None])
        a = on.to(torch.int8).argmax(0)
        return torch.where(q >= 0, self.first[a] + q - self.start[a], zero)


class KeptLinear:
    """One gated DeltaNet layer's forward under a KeyRegion (module doc)."""

    def __init__(self, region: Any, route: Any, layer: nn.Module) -> None:
        self.region, self.route, self.layer = region, route, layer
        self.nodes = Nodes.of(region)
        self.window: Optional[torch.Tensor] = None
        self.state: Optional[torch.Tensor] = None

    def conv(self, original: Callable, hidden_states, weight, bias, activation) -> torch.Tensor:
        r, nodes = self.region, self.nodes
        x = hidden_states[0].t()
        t, k = x.shape[0], weight.shape[-1]
        d = torch.arange(k - 1, -1, -1, device=x.device)[None, :]
        tok = torch.arange(t, device=x.device)[:, None]
        if r.capture:
            # A token's window: its own node's tokens, then (its first K-1 tokens) its ancestors'.
            inside = (r.positions - nodes.start[r.prompt_of])[:, None] >= d
            src = torch.where(inside, tok - d, t)
            rows, cols = (~inside).nonzero(as_tuple=True)
            src[rows, cols] = nodes.locate(r.prompt_of[rows], r.positions[rows] - d[0, cols], t)
            out = conv_with_sources(original, hidden_states, weight, bias, activation, src, x[:0])
            # Each node's last K-1 inputs along its path (window row i: position end - (K-1) + i).
            n = nodes.end.numel()
            i = torch.arange(k - 1, device=x.device)
            node_of = torch.arange(n, device=x.device).repeat_interleave(k - 1)
            at = nodes.locate(node_of, (nodes.end[:, None] - (k - 1) + i[None, :]).flatten(), t)
            self.window = torch.cat([x, x.new_zeros(1, x.shape[1])])[at].view(n, k - 1, -1)  # [N, K-1, C]
            if self.layer not in r.kept.keys:  # a checkpoint recompute keeps the first leaves
                r.kept.keys[self.layer] = self.window.detach().requires_grad_(True)
        else:
            within = r.positions - nodes.end[r.prompt_of]  # the token's index in its response
            back = within[:, None] - d  # < 0: in the prompt, kept window row back + K - 1
            src = torch.where(back >= 0, tok - d, t + r.prompt_of[:, None] * (k - 1) + back + k - 1)
            kept = r.kept.keys[self.layer]
            out = conv_with_sources(
                original, hidden_states, weight, bias, activation, src, kept.reshape(-1, x.shape[1])
            )
        self.route.count_adapter_call("linear_conv")
        return out

    def delta_rule(self, original: Callable, query, key, value, g, beta) -> torch.Tensor:
        """[1, T, Hv, Dv]: capture, level by level, each node from its parent's final state (a root
        from zeros), every node's final state kept; attend, each response from its prompt's."""
        r, nodes = self.region, self.nodes
        kernel, use_fla = delta_rule_kernel(original, query)
        x = tuple(a[0] for a in (query, key, value, g, beta))
        t = query.shape[1]
        if not r.capture:
            seg = r.segment
            starts = torch.cat([seg.new_ones(1), (seg[1:] != seg[:-1]).long()]).nonzero().flatten()
            seg_len = torch.diff(torch.cat([starts, starts.new_tensor([t])]))
            calls = calls_of(torch.arange(t, device=query.device), seg_len, t)
            init = r.kept.values[self.layer][r.prompt_of[starts]]
            out, _ = delta_varlen(kernel, calls, x, init, DEFAULT_CHUNK, False, use_fla)
            self.route.count_adapter_call("linear_attention")
            return out[None]
        n = nodes.end.numel()
        states: list[Optional[torch.Tensor]] = [None] * n
        outs, order = [], []
        for lv in range(int(nodes.level.max()) + 1):
            at = (nodes.level == lv).nonzero().flatten()
            seg_len = nodes.end[at] - nodes.start[at]
            index = concat_ranges(nodes.first[at], seg_len, int(seg_len.sum()))
            init = None if lv == 0 else torch.stack([states[p] for p in nodes.parent[at].tolist()])
            out, final = delta_varlen(kernel, calls_of(index, seg_len, t), x, init, DEFAULT_CHUNK, True, use_fla)
            for j, node in enumerate(at.tolist()):
                states[node] = final[j]
            outs.append(out)
            order.append(index)
        self.state = torch.stack(states)  # type: ignore[arg-type]
        if self.layer not in r.kept.values:
            r.kept.values[self.layer] = self.state.detach().requires_grad_(True)
        out = torch.cat(outs)[torch.argsort(torch.cat(order))]
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

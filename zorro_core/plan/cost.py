"""Analytic FLOP cost of a batch, with and without dedup -> the ideal speedup.

Counted analytically because torch's FlopCounterMode does not see flash-attn or flex ops.
Per forward, per layer:
- linear layers (q/k/v/o projections or MLA's low-rank ones, gated MLP): 2 x the parameters a
  token goes through (a MoE layer: router, its top-k routed experts and the shared experts);
- attention: 2 x heads x (qk head dim + v head dim) per attended query-key pair (QK^T and PV,
  2 FLOPs a MAC; MLA's value heads are narrower than its query/key heads);
- lm_head: 2 x hidden x vocab per position that gets logits (all packed positions with
  logits_mode "none", only the positions that predict a response token otherwise).
Backward is 2 x forward; logits_mode "memory" recomputes the lm_head forward once more.
Norms, RoPE, softmax and the embedding lookup are ignored (a few percent at most).
Sliding windows are ignored (the count is an upper bound for windowed layers).
Linear-attention (gated DeltaNet) layers: their projections (q/k/v/z, b/a, out) and MLP per token
as above, no attended pairs; their token mixing, the chunked delta rule, costs per token it runs
(`ModelShape.delta_rule_flops_per_token`), and it runs the packed tokens plus the partial chunks
the dedup layouts replay (`ForwardWork.replayed_tokens`: per extra response of a shared prompt
its tail past the last chunk boundary; per trie node the part of its parent's last chunk it
starts from). The causal conv (2 x kernel FLOPs per channel and token) is ignored.
A prefix tree (sharing="prefix") counts tokens by node and attended pairs by each node's
ancestors plus its causal self (`tree_workload`, `TriePlan.attended_pairs`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Sequence

from zorro_core.plan.prompt import PromptPlan
from zorro_core.plan.protocol import Plan
from zorro_core.plan.trie import TriePlan

COMPONENTS = ("linear", "attention", "lm_head")
DELTA_RULE_CHUNK = 64
"""Chunk of the gated delta rule (transformers' PyTorch kernel and fla's; the dedup layouts align to it)."""


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer that its FLOPs and parameter count depend on.

    A plain description: each model family builds its own from a transformers config
    (`zorro_core.models.registry.model_shape`), so that nothing here reads a config or knows a
    family's name."""

    hidden_size: int
    """Width of the residual stream."""
    intermediate_size: int
    """Width of the gated MLP of a dense layer (0 where every layer is MoE)."""
    num_layers: int
    """Decoder layers."""
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (GQA)."""
    head_dim: int
    """Width of one query/key head."""
    vocab_size: int
    """Rows of lm_head."""
    v_head_dim: int = 0
    """Width of one value head when it differs from head_dim (MLA); 0: head_dim."""
    gated_query: bool = False
    """q_proj also computes a gate of the attention output as wide as the queries (Qwen3-Next, Qwen3.5)."""

    q_lora_rank: int = 0
    """MLA: width of the latent the queries are expanded from; 0: queries projected directly from the hidden state."""
    kv_lora_rank: int = 0
    """MLA: width of the latent keys and values are expanded from per head; 0: no MLA (q/k/v/o of the head dims)."""
    qk_rope_head_dim: int = 0
    """MLA: of head_dim, the rotary part, whose key is projected from the hidden state directly, shared by the heads."""

    moe_layers: int = 0
    """Layers whose MLP is a mixture of experts (the others are dense)."""
    num_experts: int = 0
    """Routed experts of a MoE layer."""
    experts_per_token: int = 0
    """Routed experts each token goes through (top-k)."""
    moe_intermediate_size: int = 0
    """Width of one routed expert's gated MLP."""
    shared_intermediate_size: int = 0
    """Total width of a MoE layer's shared expert(s), which every token goes through."""

    num_linear_layers: int = 0
    """Of num_layers, the linear-attention (gated DeltaNet) layers; the others are softmax attention."""
    linear_key_heads: int = 0
    """Gated DeltaNet key heads."""
    linear_value_heads: int = 0
    """Gated DeltaNet value heads (the delta rule runs one state per value head)."""
    linear_key_dim: int = 0
    """Width of a gated DeltaNet key head."""
    linear_value_dim: int = 0
    """Width of a gated DeltaNet value head."""

    def __post_init__(self) -> None:
        if self.kv_lora_rank and (self.gated_query or self.num_kv_heads != self.num_heads):
            raise ValueError("an MLA shape expands keys and values for every query head and has no gated q_proj")
        if not 0 <= self.qk_rope_head_dim < self.head_dim:
            raise ValueError(f"qk_rope_head_dim {self.qk_rope_head_dim} must be in [0, head_dim={self.head_dim})")
        if not (0 <= self.moe_layers <= self.num_layers and 0 <= self.num_linear_layers <= self.num_layers):
            raise ValueError("moe_layers and num_linear_layers must be between 0 and num_layers")

    @property
    def value_head_dim(self) -> int:
        return self.v_head_dim or self.head_dim

    @property
    def attention_params_per_layer(self) -> int:
        """One layer's attention projections."""
        h, heads, d, dv = self.hidden_size, self.num_heads, self.head_dim, self.value_head_dim
        if self.kv_lora_rank:  # MLA: q (through its latent, if any), the kv latent + shared rope key, k/v up, o
            q_rank, kv_rank, rope = self.q_lora_rank, self.kv_lora_rank, self.qk_rope_head_dim
            q = h * q_rank + q_rank * heads * d if q_rank else h * heads * d
            kv = h * (kv_rank + rope) + kv_rank * heads * (d - rope + dv)
            return q + kv + heads * dv * h
        gate = h * heads * d if self.gated_query else 0
        return h * heads * (d + dv) + h * self.num_kv_heads * (d + dv) + gate  # q, o ; k, v ; the gate's half of q_proj

    @property
    def linear_params_per_layer(self) -> int:
        """Parameters of one dense layer's projections and MLP (norms and biases excluded)."""
        return self.attention_params_per_layer + 3 * self.hidden_size * self.intermediate_size

    def moe_mlp_params(self, active: bool) -> int:
        """One MoE layer's MLP: router, the routed experts (each token's top-k with `active`, all
        of them otherwise) and the shared expert(s)."""
        h = self.hidden_size
        routed = self.experts_per_token if active else self.num_experts
        return h * self.num_experts + 3 * h * (routed * self.moe_intermediate_size + self.shared_intermediate_size)

    @property
    def delta_net_params_per_layer(self) -> int:
        """One gated DeltaNet layer's projections: q/k/v/z in, the b/a gates, out."""
        h = self.hidden_size
        qk, v = self.linear_key_heads * self.linear_key_dim, self.linear_value_heads * self.linear_value_dim
        return h * (2 * qk + 2 * v) + h * 2 * self.linear_value_heads + v * h

    def linear_params(self, active: bool = False) -> int:
        """Every layer's projections and MLPs: all the parameters, or (`active`) those one token goes
        through, which is what its FLOPs count (2 per parameter). Token mixers by layer type
        (softmax attention or gated DeltaNet), MLPs by kind (dense or MoE)."""
        softmax = self.num_layers - self.num_linear_layers
        mixers = softmax * self.attention_params_per_layer + self.num_linear_layers * self.delta_net_params_per_layer
        dense = self.num_layers - self.moe_layers
        mlps = dense * 3 * self.hidden_size * self.intermediate_size + self.moe_layers * self.moe_mlp_params(active)
        return mixers + mlps

    @property
    def linear_attention_params_per_layer(self) -> int:
        """Parameters of one dense gated DeltaNet layer: its projections and a dense MLP."""
        return self.delta_net_params_per_layer + 3 * self.hidden_size * self.intermediate_size

    @property
    def delta_rule_flops_per_token(self) -> int:
        """FLOPs of the chunked delta rule per token of one layer (chunk C, dense chunk blocks as the
        PyTorch kernel computes them): per value head the in-chunk products and triangular solves,
        C x (5 dk + 3 dv), and the three state products (read, correct, update), 6 dk dv."""
        c, dk, dv = DELTA_RULE_CHUNK, self.linear_key_dim, self.linear_value_dim
        return self.linear_value_heads * (c * (5 * dk + 3 * dv) + 6 * dk * dv)


@dataclass(frozen=True)
class ForwardWork:
    """What the FLOPs of one forward depend on."""

    tokens: int
    """Tokens through the layers."""
    attended_pairs: int
    """Query-key pairs attention computes, summed over segments (per layer, per head)."""
    logit_positions: int
    """Positions that go through lm_head."""
    replayed_tokens: int = field(default=0, compare=False)
    """Tokens the delta rule of a linear-attention layer runs beyond `tokens` (replayed partial chunks).
    Left out of equality: `zorro analyze`'s closed forms from lengths (tree_workload,
    shared_prefix_workload, the harness's analyze.workload_sim) do not count it, so they equal the plans'
    workloads in everything else; tests compare it explicitly."""


@dataclass(frozen=True)
class Flops:
    """FLOPs of one forward (and of forward + backward), per component."""

    linear: float
    attention: float
    lm_head: float
    lm_head_recompute: bool = False
    """logits_mode "memory": lm_head's forward runs again in backward."""

    @property
    def forward(self) -> float:
        return self.linear + self.attention + self.lm_head

    @property
    def forward_backward(self) -> float:
        return 3 * self.forward + (self.lm_head if self.lm_head_recompute else 0.0)

    def phase(self, phase: str) -> float:
        if phase == "forward":
            return self.forward
        if phase == "forward_backward":
            return self.forward_backward
        raise ValueError(f"unknown phase {phase!r}; choose forward or forward_backward")


def flops(shape: ModelShape, work: ForwardWork, logits_mode: str = "compute") -> Flops:
    """FLOPs of one forward of `work` through a model of `shape`."""
    softmax_layers = shape.num_layers - shape.num_linear_layers
    per_pair = 2.0 * shape.num_heads * (shape.head_dim + shape.value_head_dim) * softmax_layers
    delta = shape.num_linear_layers * shape.delta_rule_flops_per_token * (work.tokens + work.replayed_tokens)
    return Flops(
        linear=2.0 * shape.linear_params(active=True) * work.tokens,
        attention=per_pair * work.attended_pairs + float(delta),
        lm_head=2.0 * shape.hidden_size * shape.vocab_size * work.logit_positions,
        lm_head_recompute=logits_mode == "memory",
    )


def causal_pairs(q_len: int, k_len: int) -> int:
    """Pairs of a causal segment of q_len queries over k_len keys, aligned bottom-right."""
    if q_len > k_len:
        raise ValueError(f"a segment cannot have more queries ({q_len}) than keys ({k_len})")
    return q_len * (k_len - q_len) + q_len * (q_len + 1) // 2


def plan_workload(plan: Plan, logits_mode: str = "compute") -> ForwardWork:
    """The workload a plan runs (the baseline's is `build_plain_plan(batch)`'s)."""
    logits = plan.num_tokens if logits_mode == "none" else int(plan.logit_index.numel())
    return ForwardWork(plan.num_tokens, plan.attended_pairs(), logits, replayed_tokens(plan))


@functools.singledispatch
def replayed_tokens(plan: Plan, chunk: int = DELTA_RULE_CHUNK) -> int:
    """Tokens a linear-attention layer's delta rule runs beyond the plan's packed tokens: the partial
    chunks its layout (zorro_core.models.linear_layout) replays so that every sequence keeps a
    one-shot run's chunk partition."""
    raise NotImplementedError(f"no delta-rule layout for a {type(plan).__name__}")


@replayed_tokens.register
def _(plan: PromptPlan, chunk: int = DELTA_RULE_CHUNK) -> int:
    # Every response of a shared prompt but the first replays the prompt's tail past its last boundary.
    extra = (plan.group_size - 1).clamp(min=0) * (plan.prompt_lens % chunk)
    return int(extra.sum())


@replayed_tokens.register
def _(plan: TriePlan, chunk: int = DELTA_RULE_CHUNK) -> int:
    c, f, _ = plan.chunk_segments(chunk)
    return int((f - c).sum()) - plan.num_tokens


def shape_workloads(
    prompt_lens: Sequence[int],
    group_sizes: Sequence[int],
    response_lens: Sequence[Sequence[int]],
    logits_mode: str = "compute",
) -> tuple[ForwardWork, ForwardWork]:
    """(baseline, dedup) workloads from lengths alone: group g has a prompt of prompt_lens[g]
    tokens shared by group_sizes[g] responses of response_lens[g][i] tokens."""
    if not (len(prompt_lens) == len(group_sizes) == len(response_lens)):
        raise ValueError("prompt_lens, group_sizes and response_lens need one entry per group")
    b_tok = b_pairs = d_tok = d_pairs = n_resp = d_replay = 0
    for p, n, rs in zip(prompt_lens, group_sizes, response_lens):
        if len(rs) != n:
            raise ValueError(f"group of size {n} has {len(rs)} response lengths")
        if p < 1 or n < 1 or any(r < 1 for r in rs):
            raise ValueError("prompt and response lengths and group sizes must be >= 1")
        for r in rs:
            b_tok += p + r
            b_pairs += causal_pairs(p + r, p + r)
        n_resp += sum(rs)
        d_tok += p + sum(rs)
        if n == 1:
            d_pairs += causal_pairs(p + rs[0], p + rs[0])
        else:
            d_pairs += causal_pairs(p, p) + sum(causal_pairs(r, p + r) for r in rs)
            d_replay += (n - 1) * (p % DELTA_RULE_CHUNK)
    logit_b = b_tok if logits_mode == "none" else n_resp
    logit_d = d_tok if logits_mode == "none" else n_resp
    return ForwardWork(b_tok, b_pairs, logit_b), ForwardWork(d_tok, d_pairs, logit_d, d_replay)


def tree_workload(nodes: Sequence[tuple[int, int]], logit_positions: int) -> ForwardWork:
    """Workload of a token trie given as (depth, length) per node: each node's tokens are computed
    once and attend to their ancestors' `depth` tokens and causally to themselves. The delta rule's
    replayed partial chunks (< 64 tokens per node) are not counted: which nodes have children is
    not in the input (`plan_workload` of a TriePlan counts them)."""
    tok = pairs = 0
    for depth, length in nodes:
        if depth < 0 or length < 1:
            raise ValueError(f"a node needs depth >= 0 and length >= 1, got ({depth}, {length})")
        tok += length
        pairs += causal_pairs(length, depth + length)
    return ForwardWork(tok, pairs, logit_positions)


def shared_prefix_workload(
    prompt_len: int,
    prompts: int,
    responses: int,
    response_len: int,
    shared_prefix_len: int,
    logits_mode: str = "compute",
) -> ForwardWork:
    """The trie's workload of `prompts` prompts of `prompt_len` tokens whose first `shared_prefix_len`
    tokens are the same (then they differ), each with `responses` responses of `response_len` tokens
    that share nothing: [system prefix] -> [rest of each prompt] -> [each response]."""
    if not 0 <= shared_prefix_len < prompt_len:
        raise ValueError(f"shared_prefix_len must be in [0, prompt_len={prompt_len}), got {shared_prefix_len}")
    if min(prompt_len, prompts, responses, response_len) < 1:
        raise ValueError("prompt and response lengths and counts must be >= 1")
    # Closed form of tree_workload over the nodes (depth, length): the head (0, H) once, then per
    # prompt (H, P - H) and `responses` x (P, R), or (H, P + R - H) for a lone response.
    p, r = prompt_len, response_len
    head = shared_prefix_len if prompts > 1 else 0
    tokens = pairs = 0
    if head:
        tokens, pairs = head, causal_pairs(head, head)
    if responses == 1:
        tokens += prompts * (p + r - head)
        pairs += prompts * causal_pairs(p + r - head, p + r)
    else:
        tokens += prompts * (p - head + responses * r)
        pairs += prompts * (causal_pairs(p - head, p) + responses * causal_pairs(r, p + r))
    return ForwardWork(tokens, pairs, tokens if logits_mode == "none" else prompts * responses * r)


def uniform_workloads(
    prompt_len: int, prompts: int, responses: int, response_len: int, logits_mode: str = "compute"
) -> tuple[ForwardWork, ForwardWork]:
    """`shape_workloads` of `prompts` groups of `responses` responses, every prompt `prompt_len` and
    every response `response_len` tokens: the same sums in closed form (constant time)."""
    if min(prompt_len, prompts, responses, response_len) < 1:
        raise ValueError("prompt and response lengths and counts must be >= 1")
    p, r, rows = prompt_len, response_len, prompts * responses
    b_tok, b_pairs, n_resp = rows * (p + r), rows * causal_pairs(p + r, p + r), rows * r
    d_tok = prompts * (p + responses * r)
    if responses == 1:
        d_pairs = prompts * causal_pairs(p + r, p + r)
    else:
        d_pairs = prompts * (causal_pairs(p, p) + responses * causal_pairs(r, p + r))
    d_replay = prompts * (responses - 1) * (p % DELTA_RULE_CHUNK)
    none = logits_mode == "none"
    return ForwardWork(b_tok, b_pairs, b_tok if none else n_resp), ForwardWork(
        d_tok, d_pairs, d_tok if none else n_resp, d_replay
    )


@dataclass(frozen=True)
class Comparison:
    """Baseline vs dedup FLOPs, and the speedup they imply."""

    baseline: Flops
    dedup: Flops

    def ideal_speedup(self, phase: str = "forward_backward") -> float:
        """Baseline FLOPs / dedup FLOPs of a phase."""
        return self.baseline.phase(phase) / self.dedup.phase(phase)

    def component_speedup(self, component: str) -> float:
        """Baseline / dedup FLOPs of one component ("linear", "attention", "lm_head")."""
        if component not in COMPONENTS:
            raise ValueError(f"unknown component {component!r}; choose one of {COMPONENTS}")
        d = getattr(self.dedup, component)
        return getattr(self.baseline, component) / d if d else float("nan")

    def speedups(self) -> dict[str, float]:
        """The ideal speedup of each component, then of the whole forward and forward+backward
        (the `ideal_speedup` entry of `zorro analyze`'s reports)."""
        return {
            **{c: self.component_speedup(c) for c in COMPONENTS},
            "total_forward": self.ideal_speedup("forward"),
            "total_forward_backward": self.ideal_speedup("forward_backward"),
        }


def compare(shape: ModelShape, baseline: ForwardWork, dedup: ForwardWork, logits_mode: str = "compute") -> Comparison:
    return Comparison(flops(shape, baseline, logits_mode), flops(shape, dedup, logits_mode))


def compare_plans(shape: ModelShape, baseline_plan: Plan, dedup_plan: Plan, logits_mode: str = "compute") -> Comparison:
    """Cost of the two plans of one batch (baseline: `dedup=False`)."""
    return compare(
        shape, plan_workload(baseline_plan, logits_mode), plan_workload(dedup_plan, logits_mode), logits_mode
    )

"""What every plan of a batch onto one packed row is asked for: the `Plan` protocol.

Two plans implement it: `PromptPlan` (zorro_core.plan.prompt, `sharing="prompt"`: identical prompts
grouped) and `TriePlan` (zorro_core.plan.trie, `sharing="prefix"`: a token trie over whole rows).
The actor, the hook, the model adapters, the cost model and the verifier ask a plan only for what
is declared here; where an upper layer needs the plan's own structure (split attention's calls, a
flex BlockMask, a planted bug), it dispatches on the plan's type (functools.singledispatch), never
on a flag.

`PackedPlan` is the base both dataclasses share: the properties that follow from their fields in
the same way, and the per-plan cache of what adapters derive from it.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

import torch

from zorro_core.plan.segments import Segments


@runtime_checkable
class Plan(Protocol):
    """A batch mapped onto one packed row of unique tokens, and the maps back to its [B, R] layout."""

    batch_size: int
    """B, rows of the batch."""
    response_width: int
    """R, padded width of the responses."""
    deduplicated: bool
    """Whether rows share computed tokens (False: the plain plan, every row on its own)."""
    sharing: str
    """The sharing mode that built the plan: "prompt" or "prefix"."""
    input_ids: torch.Tensor
    """[T] packed token ids."""
    position_ids: torch.Tensor
    """[T] position of each packed token in its row."""
    logit_index: torch.Tensor
    """[U] packed positions whose output predicts a response token."""
    labels: torch.Tensor
    """[U] the token predicted at each of those positions."""
    response_flat_index: torch.Tensor
    """[N] index of each real response token in the flattened [B*R] layout."""
    logical_tokens: int
    """Real tokens of the batch before dedup."""
    logical_prompt_tokens: int
    """Real prompt tokens of the batch before dedup."""
    unique_prompt_tokens: int
    """Prompt tokens in the packed row."""

    @property
    def num_tokens(self) -> int: ...

    @property
    def prompt_dedup_ratio(self) -> float: ...

    @property
    def token_redundancy(self) -> float: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def causal(self) -> Segments:
        """The first split-mode call: self-causal segments at the start of the packed row."""
        ...

    def scatter_responses(self, values: torch.Tensor) -> torch.Tensor:
        """[U] values at `logit_index` -> the batch's [B, R] layout (0 at padding), differentiable."""
        ...

    def attention_mask(self) -> torch.Tensor:
        """[T, T] bool: may query i attend key j (mask mode; quadratic, small inputs only)."""
        ...

    def token_multiplicity(self) -> torch.Tensor:
        """[T] float64: batch rows that contain each packed token (the MoE aux loss's weights)."""
        ...

    def attended_pairs(self) -> int:
        """Query-key pairs one attention layer computes over the packed row (the cost model's)."""
        ...

    def derived(self, key: tuple, build: Callable[[], Any]) -> Any:
        """`build()` once per `key` for this plan, the same object afterwards (adapters' layouts)."""
        ...


class PackedPlan:
    """Properties shared by the plans; the fields they read are the subclass's."""

    input_ids: torch.Tensor
    logical_tokens: int
    logical_prompt_tokens: int
    unique_prompt_tokens: int
    _derived: dict

    @property
    def num_tokens(self) -> int:
        """T, tokens in the packed row (unique tokens)."""
        return self.input_ids.numel()

    @property
    def prompt_dedup_ratio(self) -> float:
        """1 - unique prompt tokens / all prompt tokens."""
        return 1.0 - self.unique_prompt_tokens / self.logical_prompt_tokens

    @property
    def token_redundancy(self) -> float:
        """1 - unique tokens / all tokens."""
        return 1.0 - self.num_tokens / self.logical_tokens

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def derived(self, key: tuple, build: Callable[[], Any]) -> Any:
        """What a layer adapter derives from the plan alone (e.g. the linear-attention layout):
        `build()` on the first call for `key`, the same object afterwards, for every layer."""
        if key not in self._derived:
            self._derived[key] = build()
        return self._derived[key]

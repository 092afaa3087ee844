"""What both plans of a batch onto one packed row (DedupPlan, TriePlan) report the same way:
their token count, device, and how much deduplication saves. A base class with no fields: each
plan is a dataclass holding `input_ids`, `logical_tokens`, `logical_prompt_tokens` and
`unique_prompt_tokens`."""

from __future__ import annotations

import torch


class PackedPlan:
    """Properties shared by the plans; the fields they read are the subclass's."""

    input_ids: torch.Tensor
    logical_tokens: int
    logical_prompt_tokens: int
    unique_prompt_tokens: int

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

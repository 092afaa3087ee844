"""A trainer's value model (a decoder base plus a value head) as zorro's actor reads a model.

PPO critics (OpenRLHF's `get_llm_for_sequence_regression(..., "critic")`, verl's
`AutoModelForTokenClassification` with one label) hold a decoder base under `base_model_prefix` and a
linear value head beside it, with no lm_head. `DeduplicatedActor.response_hidden` needs only the base;
`ValueModel` presents the critic's base to it without copying or re-parenting any parameter, so the
critic's parameters, state dict and (FSDP / DeepSpeed) wrapping stay the trainer's.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["ValueModel"]


class ValueModel(nn.Module):
    """A critic as zorro's actor reads a model: its base model (shared, not copied) and the config.

    zorro's plan checks token ids against the lm_head's rows; the critic has none, so a head of the
    vocabulary's size on the meta device stands in: never computed (`response_hidden` runs no lm_head),
    never a submodule (no parameter of it is seen)."""

    def __init__(self, critic: Any) -> None:
        super().__init__()
        self.config = critic.config
        self.base_model_prefix = critic.base_model_prefix
        setattr(self, critic.base_model_prefix, getattr(critic, critic.base_model_prefix))
        hidden, vocab = int(critic.config.hidden_size), int(critic.config.vocab_size)
        object.__setattr__(self, "_vocab_rows", nn.Linear(hidden, vocab, bias=False, device="meta"))
        object.__setattr__(self, "_critic", critic)  # not a submodule either

    @property
    def critic(self) -> Any:
        """The trainer's critic whose base this presents."""
        return self.__dict__["_critic"]

    def get_output_embeddings(self) -> nn.Linear:
        return self.__dict__["_vocab_rows"]

    def set_attn_implementation(self, name: str) -> None:
        """What zorro's attention registration calls: on the critic itself (a transformers PreTrainedModel),
        so the critic's own forward dispatches the same way (its original attention, outside zorro's calls)."""
        self.__dict__["_critic"].set_attn_implementation(name)

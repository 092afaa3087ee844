"""The vision-language actors: per-sequence log-probs of a MultimodalBatch.

VisionLanguageActor groups rows by the whole prompt (text and images by content), runs the vision
tower once per distinct image of the call, places the embeddings once into each unique prompt of
the packed row, gives the row the model's own 3-D mRoPE positions (zorro_core.plan.multimodal)
and runs the text decoder through the attention hook as for text. With `sharing="prefix"` rows
share the longest runs of equal text and equal images (a token trie whose image placeholders are
keyed by their image's content), each row's positions its own numbering by the model. A
RolloutBatch (no images) goes the text actor's way. BaselineVisionLanguageActor is the plain computation on the same path:
every row its own prompt, every image occurrence encoded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from zorro_core.actor.actor import DeduplicatedActor
from zorro_core.actor.fsdp import as_root_forward
from zorro_core.actor.output import ActorOutput
from zorro_core.attention.hook import Route, route_mask
from zorro_core.distributed.ulysses import SequenceParallel
from zorro_core.errors import UnsupportedModelError
from zorro_core.models.families import aux_loss_of, forward_kwargs
from zorro_core.models.parts import check_layers_served, check_trainable_state
from zorro_core.models.vision import (
    VisionFamily,
    check_images,
    encode_images,
    image_tokens,
    prompt_positions,
    vision_family,
)
from zorro_core.plan.batch import RolloutBatch
from zorro_core.plan.multimodal import (
    Image,
    MultimodalBatch,
    distinct_images,
    given_positions,
    image_slots,
    image_trie_plan,
    mrope_positions,
    trie_mrope_positions,
    whole_prompt_groups,
)
from zorro_core.plan.prompt import PromptPlan, build_prompt_plan
from zorro_core.plan.trie import TriePlan

__all__ = ["BaselineVisionLanguageActor", "ImageCounts", "VisionLanguageActor"]


@dataclass(frozen=True)
class ImageCounts:
    """The images of one call: as the rows hold them, and as the vision tower encoded them."""

    images: int
    """Image occurrences over the rows (what the plain computation encodes)."""
    encoded_images: int
    """Images through the vision tower (each distinct image once; all of them in the baseline)."""
    patches: int
    """Image patches over the rows (the vision tower's input in the plain computation)."""
    encoded_patches: int
    """Patches through the vision tower."""
    vision_tokens: int
    """Image tokens (after the spatial merge) over the rows."""
    encoded_vision_tokens: int
    """Image tokens of the encoded images."""

    @classmethod
    def of(cls, rows: Sequence[Sequence[Image]], encoded: Sequence[Image], config: Any) -> "ImageCounts":
        merge = config.vision_config.spatial_merge_size
        every = [img for row in rows for img in row]
        return cls(
            len(every),
            len(encoded),
            sum(i.pixel_values.shape[0] for i in every),
            sum(i.pixel_values.shape[0] for i in encoded),
            sum(image_tokens(i, merge) for i in every),
            sum(image_tokens(i, merge) for i in encoded),
        )


class VisionLanguageActor(DeduplicatedActor):
    """Each unique prompt (text and images) computed once, each distinct image encoded once.

    `last_images` holds the image counts of the latest call with images (None before one)."""

    last_images: Optional[ImageCounts] = None

    def forward(
        self,
        batch: RolloutBatch | MultimodalBatch,
        temperature: float = 1.0,
        calculate_entropy: bool = False,
        sequence_parallel: Optional[SequenceParallel] = None,
        router_aux_loss: Optional[bool] = None,
    ) -> ActorOutput:
        """Log-probs (and optionally entropy) of every response token of `batch`, differentiable."""
        if isinstance(batch, RolloutBatch):
            return super().forward(batch, temperature, calculate_entropy, sequence_parallel, router_aux_loss)
        if not isinstance(batch, MultimodalBatch):
            raise TypeError(
                f"a vision-language actor takes a MultimodalBatch or a RolloutBatch, got {type(batch).__name__}"
            )
        family = vision_family(self.model)
        if sequence_parallel is not None and sequence_parallel.size > 1:
            raise UnsupportedModelError("images under Ulysses sequence parallelism are not served")
        self.check_call(temperature, batch.batch, calculate_entropy)
        check_trainable_state(self.model)
        self.install_hooks()
        rows = batch.batch.to(self.device)
        config: Any = self.model.config
        check_images(rows, batch.images, config)
        distinct, image_ids = distinct_images(batch.images, share=self.dedup)
        groups = whole_prompt_groups(rows, image_ids, self.dedup, batch.positions)
        self.last_images = ImageCounts.of(batch.images, distinct, config)
        if self.dedup and self.config.sharing == "prefix":
            merge = config.vision_config.spatial_merge_size
            slots = image_slots(rows, image_ids, [image_tokens(i, merge) for i in distinct], config.image_token_id)
            plan: PromptPlan | TriePlan
            plan, token_slot = image_trie_plan(
                rows, slots, config.image_token_id, self.vocab_size, self.config.min_shared_tokens
            )
            image_rows = token_slot[token_slot >= 0]
        else:
            plan = build_prompt_plan(rows, dedup=self.dedup, vocab_size=self.vocab_size, group_of_row=groups)
            image_rows = self._prompt_image_rows(plan, distinct, image_ids, config)
        route = Route(self.route_spec, plan)
        lp, ent, aux = as_root_forward(
            self.model,
            lambda: self._compute_images(
                plan,
                route,
                rows,
                family,
                distinct,
                image_ids,
                groups,
                image_rows,
                temperature,
                calculate_entropy,
                router_aux_loss,
                batch.positions,
            ),
        )
        return ActorOutput(
            plan.scatter_responses(lp), plan.scatter_responses(ent) if ent is not None else None, plan, aux
        )

    __call__ = forward

    def forward_backward(self, batch: RolloutBatch, loss_fn: Any, *args: Any, **kwargs: Any) -> Any:
        """The text actor's forward_backward for a RolloutBatch; images are refused by name (TypeError)."""
        if isinstance(batch, MultimodalBatch):
            raise TypeError(
                "images (a MultimodalBatch) are not served by forward_backward, which micro-batches text rows "
                "(a zorro_core.RolloutBatch): call actor.forward(batch) on each micro-batch of images and "
                "backward its loss"
            )
        return super().forward_backward(batch, loss_fn, *args, **kwargs)

    @staticmethod
    def _prompt_image_rows(plan: PromptPlan, distinct: list, image_ids: list[list[int]], config: Any) -> torch.Tensor:
        """The row of the distinct images' embeddings (concatenated) for each image placeholder of the
        packed row, in order: unique prompts are packed by group, each its images in order."""
        merge = config.vision_config.spatial_merge_size
        offset = [0]
        for img in distinct:
            offset.append(offset[-1] + image_tokens(img, merge))
        order = [i for r in plan.group_rep_row.tolist() for i in image_ids[r]]
        ranges = [torch.arange(offset[i], offset[i + 1]) for i in order]
        return torch.cat(ranges).to(plan.device) if ranges else torch.zeros(0, dtype=torch.long, device=plan.device)

    def _positions(
        self,
        plan: PromptPlan | TriePlan,
        rows: RolloutBatch,
        distinct: list,
        image_ids: list[list[int]],
        groups,
        given: Optional[Sequence[torch.Tensor]] = None,
    ) -> torch.Tensor:
        """[3, T] the 3-D positions of the packed row: the trainer's own of every row where it gives them
        (verl's), laid as they are; else the model's own, get_rope_index once per unique whole prompt
        (text and images), responses continued as the model numbers a whole row."""
        if given is not None:
            if isinstance(plan, TriePlan):
                return trie_mrope_positions(plan, [g.to(self.device) for g in given])
            return given_positions(plan, given, rows.prompt_mask.bool().sum(1))
        base: Any = self.parts.base
        group_list = groups.tolist()
        reps = list(dict.fromkeys(group_list))  # groups in order of first appearance
        first_row = {g: group_list.index(g) for g in reps}
        positions, nexts = {}, {}
        for g in reps:
            r = first_row[g]
            prompt = rows.prompts[r][rows.prompt_mask[r].bool()].long()
            positions[g], nexts[g] = prompt_positions(base, prompt, [distinct[i].grid_thw for i in image_ids[r]])
        if isinstance(plan, TriePlan):
            lens = rows.response_mask.bool().sum(1).tolist()
            row_positions = [
                torch.cat([positions[g], (nexts[g] + torch.arange(n, device=self.device)).expand(3, n)], 1)
                for g, n in zip(group_list, lens)
            ]
            return trie_mrope_positions(plan, row_positions)
        reps_of_plan = [group_list[r] for r in plan.group_rep_row.tolist()]
        return mrope_positions(
            plan,
            [positions[g] for g in reps_of_plan],
            torch.tensor([nexts[g] for g in reps_of_plan], device=self.device),
        )

    def _compute_images(
        self,
        plan: PromptPlan | TriePlan,
        route: Route,
        rows: RolloutBatch,
        family: VisionFamily,
        distinct: list,
        image_ids: list[list[int]],
        groups: torch.Tensor,
        image_rows: torch.Tensor,
        temperature: float,
        calculate_entropy: bool,
        router_aux_loss: Optional[bool],
        given: Optional[tuple[torch.Tensor, ...]] = None,
    ):
        base: Any = self.parts.base
        config: Any = self.model.config
        position_ids = self._positions(plan, rows, distinct, image_ids, groups, given)
        embeds, deep = encode_images(base, distinct, family)
        inputs_embeds = base.get_input_embeddings()(plan.input_ids[None])
        extra = {}
        if image_rows.numel():
            # Each image placeholder of the packed row takes its image's embedding row, as the model's
            # masked_scatter places them (a shared or recurring image is gathered, its gradient summed).
            mask = (plan.input_ids == config.image_token_id)[None]
            feats = torch.cat(embeds)[image_rows].to(inputs_embeds.device, inputs_embeds.dtype)
            inputs_embeds = inputs_embeds.masked_scatter(mask[..., None], feats)
            if family.deepstack and deep:
                extra = dict(
                    visual_pos_masks=mask,
                    deepstack_visual_embeds=[torch.cat(layer)[image_rows] for layer in deep],
                )
        outputs = base.language_model(
            input_ids=None,
            inputs_embeds=inputs_embeds,
            position_ids=position_ids[:, None, :],
            attention_mask=route_mask(self.device),
            use_cache=False,
            zorro_route=route,
            **extra,
            **forward_kwargs(self.parts, self.model.config, router_aux_loss),
        )
        check_layers_served(self.parts, route)
        # The MoE router aux loss over the packed row's tokens, weighted as for text (Qwen3.5-MoE).
        aux = aux_loss_of(
            self.parts, self.model.config, outputs, plan, self.config.router_aux_weighting, router_aux_loss, self
        )
        hidden = outputs.last_hidden_state[0]
        lp, ent = self.logprobs_at(hidden, plan.logit_index, plan.labels, temperature, calculate_entropy)
        return lp, ent, aux


class BaselineVisionLanguageActor(VisionLanguageActor):
    """Every row its own prompt and every image occurrence encoded: the plain computation, packed."""

    dedup = False

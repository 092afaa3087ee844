"""The independent reference for images: each row run alone through the unmodified model.

No zorro code computes it: the model's own forward on one [prompt + response] row with that
row's own pixel_values, image_grid_thw and mm_token_type_ids (as the processor gives them), the
model's own positions, log-softmax by hand. The vision-language equivalence tests compare
against this.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zorro_core.plan.multimodal import MultimodalBatch


def _row(model: nn.Module, ids: list[int], images, n_prompt: int, response: list[int], temperature: float):
    config: Any = model.config
    x = torch.tensor([ids])
    types = (x == config.image_token_id).long() + 2 * (x == config.video_token_id).long()
    kwargs = {}
    if images:
        kwargs = dict(
            pixel_values=torch.cat([img.pixel_values for img in images]),
            image_grid_thw=torch.tensor([img.grid_thw for img in images]),
        )
    out = model(input_ids=x, mm_token_type_ids=types, use_cache=False, **kwargs)
    logits = out.logits[0, n_prompt - 1 : n_prompt - 1 + len(response)]
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logp = torch.log_softmax(logits.to(acc) / temperature, dim=-1)
    lp = logp.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


def vision_per_sequence(model: nn.Module, mm: MultimodalBatch, temperature: float = 1.0, weights=None):
    """log-probs [B, R], entropy [B, R] and {param: grad} of sum(w_lp*lp) + sum(w_ent*ent), one row at a time."""
    prompts, responses = mm.batch.to_lists()
    b, r = mm.batch.responses.shape
    acc = torch.float64 if next(model.parameters()).dtype == torch.float64 else torch.float32
    lp_out, ent_out = torch.zeros(b, r, dtype=acc), torch.zeros(b, r, dtype=acc)
    model.zero_grad(set_to_none=True)
    for i, (p, resp) in enumerate(zip(prompts, responses)):
        lp, ent = _row(model, p + resp, mm.images[i], len(p), resp, temperature)
        if weights is not None:
            w_lp, w_ent = weights
            loss = (w_lp[i, : len(resp)].to(lp) * lp).sum() + (w_ent[i, : len(resp)].to(ent) * ent).sum()
            loss.backward()
        lp_out[i, : len(resp)] = lp.detach()
        ent_out[i, : len(resp)] = ent.detach()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return lp_out, ent_out, grads

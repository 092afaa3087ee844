"""What a benchmark case computes on: the model's config and the case's batch (no weights).

Shared by the single-process runner and the data-parallel cases (zorro_harness.bench.distributed),
so both build the same batch from the same case.
"""

from __future__ import annotations

from transformers import AutoConfig

from zorro_core.models.local_files import hub_offline, local_checkpoint
from zorro_core.models.presets import PRESETS, preset_config
from zorro_core.plan.batch import create_dummy_batch
from zorro_harness.bench.suite import Case


def model_config(name: str):
    """The config of a preset, a local checkpoint or a model in the local HF cache (no download, no
    code from the checkpoint: zorro_core.models.local_files)."""
    if name in PRESETS:
        return preset_config(name)
    path = local_checkpoint(name)
    if path is None:
        raise ValueError(
            f"cannot resolve model {name!r} (not a preset, a local checkpoint or in the local HF cache; "
            f"nothing is downloaded). Presets: {', '.join(PRESETS)}"
        )
    try:
        with hub_offline():
            return AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as e:
        raise ValueError(f"cannot read the config of model {name!r} in {path} ({type(e).__name__}: {e})") from e


def make_batch(case: Case, vocab_size: int, device: str = "cpu"):
    return create_dummy_batch(
        batch_size=case.batch_size,
        num_unique_prompts=case.unique_prompts,
        prompt_len=case.prompt_len,
        response_len=case.response_len,
        vocab_size=vocab_size,
        device=device,
        seed=case.seed,
        vary_lengths=case.padding,
        shared_prefix_len=case.shared_prefix_len,
    )

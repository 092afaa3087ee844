"""verl's synchronous V1 trainer with whole prompt groups on each data-parallel rank.

`DedupPPOTrainerSync` is verl's `PPOTrainerSync` (verl 0.9.1, `verl/trainer/ppo/v1/trainer_sync.py`)
with one method replaced, `_balance_batch`: verl's upsampling to the required batch multiple is
kept (`upsample_batch_to_divisible_size`), then the rows are ordered by
`zorro_core.integrations.verl.balance` instead of by `get_seqlen_balanced_partitions`, so that
each rank receives whole groups (the n responses of a prompt), balanced by what zorro's engine
computes, and each PPO mini-batch of a rank holds whole groups. verl's dispatch, mini-batch
split, loss normalisation (global token and sample counts) and metrics are untouched; verl's
balance metrics (`global_seqlen/...`) are logged for the new partition with verl's own function,
beside zorro's (`zorro/balance/...`).

Which rows share a PPO mini-batch changes (as verl's own balance changes it, by length); with
`actor.shuffle=True` (or `critic.shuffle=True`) verl's worker draws mini-batches at random and
only the ranks' groups are kept whole.

verl's V1 trainer also compares the trainer-mode *string* with "sync" (verl 0.9.1's
`trainer_base.py`: the replay buffer class, `data.gen_batch_size`, how prompts are persisted in
TransferQueue, the async checkpoint/restore of TransferQueue state; its rollout cache reads the
mode's `parameter_sync_step` from the config). The name "zorro_sync" only selects this class: its
constructor sets `trainer.v1.trainer_mode` back to "sync" before verl's constructor reads it, so
every one of those decisions (and every later reader of the config: workers, rollout cache) is
verl's sync trainer's. The verl suite (tests/integrations/verl/test_integrations_verl_sync_mode.py) compares those
choices with plain verl's sync trainer and scans the installed verl for every read of the mode,
failing on any reader or comparison verl 0.9.1 does not have.

Turning it on: zorro's package registers the name with verl's plugin group (`plugin`), so
one line selects it, beside the engine's `external_lib`::

    trainer.v1.trainer_mode=zorro_sync
    actor_rollout_ref.model.external_lib=zorro_core.integrations.verl.engine
"""

from __future__ import annotations

import logging
import math
from typing import Any, Optional

import zorro_core.integrations.verl.needs  # noqa: F401 -- first: refuses a missing or too old verl

# isort: split
import ray
import verl
from omegaconf import OmegaConf, open_dict
from verl.single_controller.base.worker import Worker
from verl.single_controller.base.worker_group import WorkerGroup
from verl.trainer.ppo.padding_utils import upsample_batch_to_divisible_size
from verl.trainer.ppo.utils import Role
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils.seqlen_balancing import log_seqlen_unbalance

from zorro_core.integrations.core import require_assigned, require_attributes, require_parameters
from zorro_core.integrations.deprecated import renamed
from zorro_core.integrations.verl.balance import Balance, balance_tags, group_of_keys, split_key

__all__ = [
    "DedupPPOTrainerSync",
    "SYNC_MODE",
    "TRAINER_NAME",
    "balance_metrics",
    "mini_batch_rows",
    "share_external_lib",
]
# The old names of the renamed classes (Zorro... -> Dedup..., the trainer class each replaces).
__getattr__ = renamed(__name__, {"ZorroPPOTrainerSync": "DedupPPOTrainerSync"}, globals())

TRAINER_NAME = "zorro_sync"
"""The name that selects this trainer (`trainer.v1.trainer_mode`)."""
SYNC_MODE = "sync"
"""The mode verl sees once the trainer is selected: verl's own sync trainer's."""

_RELEASE, _TESTED, _READER = f"verl {verl.__version__}", "verl 0.9.1", "zorro_core.integrations.verl.trainer"
require_parameters(
    PPOTrainerSync._balance_batch,
    ("self", "batch", "metrics", "logging_prefix", "keep_minibatch"),
    _RELEASE,
    _TESTED,
    _READER,
)
# The constructor rewrites the mode before verl's reads it (module doc).
require_parameters(PPOTrainerSync.__init__, ("self", "config"), _RELEASE, _TESTED, _READER)
require_attributes(
    PPOTrainerSync, ("_get_required_batch_multiple", "_init_resource_pool_mgr"), _RELEASE, _TESTED, _READER
)
# The critic's worker class, swapped after verl's _init_resource_pool_mgr fills the mapping.
require_assigned(PPOTrainerSync, ("_init_resource_pool_mgr",), ("role_worker_mapping",), _RELEASE, _TESTED, _READER)
# The actor's data-parallel size, read as verl's own _balance_batch reads it.
require_assigned(WorkerGroup, ("__init__",), ("_dispatch_info",), _RELEASE, _TESTED, _READER)
require_attributes(Worker, ("_query_dispatch_info",), _RELEASE, _TESTED, _READER)  # bound onto the worker group

_log = logging.getLogger(__name__)


def mini_batch_rows(config: Any, dp_size: int, use_critic: bool, updates_actor: bool) -> Optional[int]:
    """Rows of one PPO mini-batch on one rank that every update of this step cuts at (None: no
    update cuts in order). verl's worker cuts a rank's rows into chunks of
    `ppo_mini_batch_size * rollout.n / dp_size`, in order unless the role shuffles."""
    n = config.actor_rollout_ref.rollout.n
    sizes = []
    if use_critic and not config.critic.get("shuffle", False):
        sizes.append(config.critic.ppo_mini_batch_size * n)
    if updates_actor and not config.actor_rollout_ref.actor.get("shuffle", False):
        sizes.append(config.actor_rollout_ref.actor.ppo_mini_batch_size * n)
    if not sizes:
        return None
    rows = math.gcd(*sizes)
    if rows % dp_size:
        return None
    return rows // dp_size


def balance_metrics(balance: Balance) -> dict[str, float]:
    """zorro's balance figures for the step's metrics."""
    mean = sum(balance.costs) / len(balance.costs)
    return {
        "zorro/balance/prompt_dedup_batch": balance.batch_prompt_dedup,
        "zorro/balance/prompt_dedup_rank_min": min(balance.prompt_dedup),
        "zorro/balance/prompt_dedup_rank_mean": sum(balance.prompt_dedup) / len(balance.prompt_dedup),
        "zorro/balance/split_groups": float(len(balance.split)),
        "zorro/balance/cost_max_over_mean": max(balance.costs) / mean if mean > 0 else 1.0,
        "zorro/balance/mini_batches_per_rank": float(balance.slots),
    }


def share_external_lib(config: Any) -> None:
    """Give the critic's model config the actor's `external_lib` when it names none (inside `open_dict`): the
    critic worker (`critic_worker.DedupCriticWorker`) imports it, so the line that turns zorro on for the actor
    serves the critic too, with the options that module installed."""
    critic_model = OmegaConf.select(config, "critic.model")
    actor_libs = OmegaConf.select(config, "actor_rollout_ref.model.external_lib")
    if critic_model is not None and actor_libs is not None and critic_model.get("external_lib") is None:
        critic_model.external_lib = actor_libs


def _group_names(keys: list[str]) -> dict[int, str]:
    names: dict[int, str] = {}
    for key, g in zip(keys, group_of_keys(keys)):
        parsed = split_key(key)
        names.setdefault(g, parsed[0] if parsed else key)
    return names


@register_trainer(TRAINER_NAME)
class DedupPPOTrainerSync(PPOTrainerSync):
    """verl's sync trainer; `_balance_batch` keeps prompt groups whole on each rank (module doc)."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any):
        selected = config.trainer.v1.trainer_mode
        if selected not in (TRAINER_NAME, SYNC_MODE):
            raise ValueError(
                f"zorro: DedupPPOTrainerSync is selected by trainer.v1.trainer_mode={TRAINER_NAME!r}, got {selected!r}"
            )
        # verl decides by the mode string (module doc): from here on it is verl's sync mode.
        with open_dict(config):
            config.trainer.v1.trainer_mode = SYNC_MODE
            share_external_lib(config)
        if selected != SYNC_MODE:
            _log.info("zorro: trainer %r runs as verl's %r trainer with zorro's balance", selected, SYNC_MODE)
        self.selected_trainer_mode = selected
        super().__init__(config, *args, **kwargs)

    def _init_resource_pool_mgr(self):
        super()._init_resource_pool_mgr()
        if Role.Critic in self.role_worker_mapping:
            # verl's TrainingWorker, importing the critic's external_lib first (critic_worker's doc).
            from zorro_core.integrations.verl.critic_worker import DedupCriticWorker

            self.role_worker_mapping[Role.Critic] = ray.remote(DedupCriticWorker)

    def _actor_dp_size(self) -> int:
        # verl's _balance_batch reads the actor's data-parallel size this way.
        role, worker_group = "actor", self.actor_rollout_wg
        if role not in worker_group._dispatch_info:
            worker_group._dispatch_info[role] = worker_group._query_dispatch_info(role)
        return max(worker_group._dispatch_info[role]) + 1

    def _prompts_for_grouping(self, batch) -> Optional[list[list[int]]]:
        """The rows' prompt token ids when some key is not verl's `{uid}_{session_id}_{index}` (a custom
        agent loop): those rows are grouped by prompt content. None when every key names its uid."""
        if all(split_key(k) is not None for k in batch.keys):
            return None
        import transfer_queue as tq

        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["prompts"])
        prompts = data["prompts"]
        rows = prompts.unbind() if prompts.is_nested else list(prompts)
        return [row.tolist() for row in rows]

    def _balance_batch(self, batch, metrics, logging_prefix="global_seqlen", keep_minibatch=False):
        dp_size = self._actor_dp_size()
        batch = upsample_batch_to_divisible_size(
            batch, self._get_required_batch_multiple(dp_size), self.tokenizer.eos_token_id
        )
        updates_actor = self.config.trainer.critic_warmup <= self.global_steps
        rows = mini_batch_rows(self.config, dp_size, self.use_critic, updates_actor)
        balance = balance_tags(batch.keys, batch.tags, dp_size, rows, prompts=self._prompts_for_grouping(batch))
        keys = list(batch.keys)
        seqlen = [tag["seq_len"] for tag in batch.tags]
        batch.reorder(balance.order)
        metrics.update(log_seqlen_unbalance(seqlen_list=seqlen, partitions=balance.ranks, prefix=logging_prefix))
        metrics.update(balance_metrics(balance))
        if balance.split:
            names = _group_names(keys)
            _log.info(
                "zorro: %d group(s) split across ranks by the batch's sizes: %s",
                len(balance.split),
                ", ".join(f"{names[g]} on ranks {ranks}" for g, ranks in balance.split.items()),
            )
        return batch

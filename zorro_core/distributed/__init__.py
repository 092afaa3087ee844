"""Many processes: rows regrouped across data-parallel ranks (torch.distributed), FSDP2 models.

local, restore = regroup(batch)          # collective: every row of a prompt on one rank
out = actor.forward(local)               # the model may be sharded with fully_shard
log_probs = restore(out.log_probs)       # [B, R] in this rank's own rows, differentiable
"""

from zorro_core.distributed.regroup import RegroupInfo, Restore, prompt_key, regroup
from zorro_core.distributed.routing import Routing, plan_routing

__all__ = ["RegroupInfo", "Restore", "Routing", "plan_routing", "prompt_key", "regroup"]

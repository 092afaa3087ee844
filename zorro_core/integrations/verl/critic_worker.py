"""verl's critic worker, made to import the critic's `external_lib` before it builds its engine.

verl 0.9.1's V1 trainer runs the critic as a `TrainingWorker` (`verl/workers/engine_workers.py`) that builds
its engine in its constructor, from an `HFModelConfig` made in the driver. verl imports a model config's
`external_lib` only in that config's `__post_init__`, so in the driver: the critic's worker process never
imports it, and, colocated with the actor (verl's default: one resource pool), builds its engine before the
actor's `init_model` imports the actor's `external_lib`. So the engine zorro registers for value models
(`zorro_core.integrations.verl.critic.DedupValueEngine`) would never be chosen for the critic.

`DedupCriticWorker` is verl's `TrainingWorker` whose constructor first imports the modules its model config
names in `external_lib` (with verl's own `import_external_libs`, as `HFModelConfig` does), then, when those
imported zorro's engine, `zorro_core.integrations.verl.critic` (which registers the critic's engine), then
is verl's.
zorro's sync trainer (`trainer.v1.trainer_mode=zorro_sync`) runs the critic with it and gives the critic's
model config the actor's `external_lib` when it names none, so the README's two lines serve the critic too.
This module imports nothing of zorro's engine itself: a worker imports zorro only where the user's config
names it.
"""

from __future__ import annotations

import sys
from typing import Any

import zorro_core.integrations.verl.needs  # noqa: F401 -- first: refuses a missing or too old verl

# isort: split
import verl
from verl.utils.import_utils import import_external_libs
from verl.workers.engine_workers import TrainingWorker

from zorro_core.integrations.core import require_parameters

__all__ = ["DedupCriticWorker", "ENGINE", "register_critic_engine"]

ENGINE = "zorro_core.integrations.verl.engine"
"""zorro's verl engine module: once an external_lib imported it, the critic engine is registered too."""

require_parameters(TrainingWorker.__init__, ("self", "config"), f"verl {verl.__version__}", "verl 0.9.1", __name__)


class DedupCriticWorker(TrainingWorker):
    """verl's `TrainingWorker` that imports its model config's `external_lib` before building its engine."""

    def __init__(self, config: Any) -> None:
        libs = getattr(config.model_config, "external_lib", None)
        if libs is not None and not isinstance(libs, str):
            libs = [str(m) for m in libs]  # a ListConfig from the driver's config, as a list verl imports
        import_external_libs(libs)
        if ENGINE in sys.modules:
            # zorro is on in this process (the external_lib imported its engine): serve the critic too.
            register_critic_engine()
        super().__init__(config)


def register_critic_engine() -> None:
    """Import zorro's critic module, which registers `DedupValueEngine` for verl's value models."""
    import zorro_core.integrations.verl.critic  # noqa: F401

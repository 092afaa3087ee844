"""Where a test needs a newer transformers than the declared floor (scripts/version_ends.sh measured it).

Qwen3-Next: up to transformers 5.14 the gated DeltaNet layer calls the conv and the delta rule it
bound at construction (self.causal_conv1d_fn / self.chunk_gated_delta_rule, an nn.Conv1d when
causal-conv1d is absent), not the module-level functions the adapter wraps; from 5.15 it calls
the module's causal_conv1d_fn / torch_chunk_gated_delta_rule. Below 5.15 the actor refuses the
model (its call count sees the layers bypass the adapter): tests/models/test_version_gates.py.
Qwen3.5 (qwen3_5, qwen3_5_moe; present from the declared floor, 5.6) switched at the same release
(read in the 5.6.0, 5.10.4, 5.14.0 and 5.15.0 wheels): the same gate serves both.
"""

import pytest
import transformers
from packaging.version import Version

QWEN3_NEXT_MIN = Version("5.15.0")
QWEN3_NEXT_ADAPTABLE = Version(transformers.__version__) >= QWEN3_NEXT_MIN
QWEN3_NEXT_REASON = (
    f"transformers {transformers.__version__}: the Qwen3-Next adapter needs >= {QWEN3_NEXT_MIN} "
    "(older releases call the kernels bound on the layer); the actor refuses the model"
)


def skip_module_without_qwen3_next_adapter() -> None:
    if not QWEN3_NEXT_ADAPTABLE:
        pytest.skip(QWEN3_NEXT_REASON, allow_module_level=True)

"""Qwen3-Next's delta rule when flash-linear-attention is importable (issue 22).

transformers resolves its module-level `torch_chunk_gated_delta_rule` to fla's kernel at import
whenever fla is importable, on every device (its fallback wrapper keeps the PyTorch function as
`__wrapped__`); fla's Triton kernels cannot take CPU tensors. zorro's adapter chooses by the
tensors' device (zorro_core.models.linear_attention.delta_rule_kernel); a forward outside any
actor runs transformers' code as it is, so on CPU it fails where fla is installed. The tests
whose reference is such a forward use `pytorch_delta_rule_on_cpu` (what transformers would run on
CPU if it looked at the device); test_fla_device.py checks zorro's own choice without it.
"""

import functools
import inspect
import sys

import torch


def qwen3_next_module():
    import transformers.models.qwen3_next.modeling_qwen3_next  # noqa: F401 - registers the module

    return sys.modules["transformers.models.qwen3_next.modeling_qwen3_next"]


def device_aware(kernel):
    """`kernel` on CUDA tensors, the PyTorch function behind it on any other device.

    Built around transformers' function even where zorro's adapter already wraps the module's
    (`zorro_original`), and without copying the wrapper's attributes, so that the next actor
    wraps the dispatcher again instead of being bypassed by it."""
    kernel = getattr(kernel, "zorro_original", None) or kernel
    pytorch = inspect.unwrap(kernel)

    @functools.wraps(kernel, updated=())
    def dispatch(query, *args, **kwargs):
        return (kernel if query.is_cuda else pytorch)(query, *args, **kwargs)

    return dispatch


def pytorch_delta_rule_on_cpu(monkeypatch) -> None:
    """Where fla is importable, give route-less CPU forwards of Qwen3-Next the PyTorch kernel (no-op otherwise)."""
    from zorro_core.models.linear_attention import fla_available

    if fla_available() is None:
        mod = qwen3_next_module()
        monkeypatch.setattr(mod, "torch_chunk_gated_delta_rule", device_aware(mod.torch_chunk_gated_delta_rule))


class FakeFla:
    """Stands in for transformers' delta rule resolved to fla: functools.wraps of the PyTorch
    function (as transformers' wrapper), refusing CPU tensors as fla's Triton kernels do."""

    def __init__(self, pytorch):
        self.calls = 0
        functools.update_wrapper(self, pytorch)

    def __call__(self, query, *args, **kwargs):
        self.calls += 1
        if not query.is_cuda:
            raise RuntimeError("0 active drivers ([]). There should only be one.")  # Triton's, on CPU
        raise AssertionError("a CUDA call in a CPU test")


def simulate_fla(monkeypatch) -> FakeFla:
    """fla importable and transformers' delta rule resolved to it, on a machine without fla."""
    from zorro_core.models import linear_attention

    mod = qwen3_next_module()
    fake = FakeFla(inspect.unwrap(mod.torch_chunk_gated_delta_rule))
    monkeypatch.setattr(mod, "torch_chunk_gated_delta_rule", fake)
    monkeypatch.setattr(linear_attention, "fla_available", lambda: None)
    return fake


def assert_refuses_cpu(kernel) -> None:
    q = k = torch.zeros(1, 4, 1, 8)
    try:
        kernel(q, k, torch.zeros(1, 4, 1, 8), g=torch.zeros(1, 4, 1), beta=torch.zeros(1, 4, 1))
    except Exception:  # noqa: BLE001 - fla's failure on CPU is Triton's, whatever its type
        return
    raise AssertionError("the module's delta rule ran on CPU: transformers did not resolve it to fla")

"""The gated DeltaNet families' delta rule (Qwen3-Next, Qwen3.5) when flash-linear-attention is importable.

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

import torch

KERNEL = "torch_chunk_gated_delta_rule"


def family_module(preset: str = "tiny-qwen3-next"):
    """transformers' modeling module of `preset`'s family (whose module-level kernel its layers call)."""
    from zorro_core.models.presets import PRESETS
    from zorro_core.verify.delta_rule import modeling_module

    return modeling_module(PRESETS[preset][0])


def qwen3_next_module():
    return family_module("tiny-qwen3-next")


def exact_kernels(monkeypatch) -> None:
    """The float64 delta rule (zorro_core.verify.delta_rule) in every gated DeltaNet family's module."""
    from zorro_core.verify.delta_rule import chunk_gated_delta_rule_exact, linear_family_modules

    for mod in linear_family_modules():
        monkeypatch.setattr(mod, KERNEL, chunk_gated_delta_rule_exact)


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
    """Where fla is importable, give route-less CPU forwards of the gated DeltaNet families the PyTorch kernel (no-op otherwise)."""
    from zorro_core.models.linear_attention import fla_available
    from zorro_core.verify.delta_rule import linear_family_modules

    if fla_available() is None:
        for mod in linear_family_modules():
            monkeypatch.setattr(mod, KERNEL, device_aware(getattr(mod, KERNEL)))


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


def simulate_fla(monkeypatch, preset: str = "tiny-qwen3-next") -> FakeFla:
    """fla importable and transformers' delta rule (of `preset`'s family) resolved to it, on a machine without fla."""
    from zorro_core.models import linear_attention

    mod = family_module(preset)
    fake = FakeFla(inspect.unwrap(getattr(mod, KERNEL)))
    monkeypatch.setattr(mod, KERNEL, fake)
    monkeypatch.setattr(linear_attention, "fla_available", lambda: None)
    return fake


def cpu_fallback_by_device(kernel) -> bool:
    """Whether transformers' wrapper of the module kernel runs the PyTorch function for CPU tensors itself
    (5.25's `use_kernel_func_from_hub_with_fallback` checks the inputs' device against fla's devices)."""
    try:
        from transformers.integrations import hub_kernels
    except ImportError:
        return False
    devices = getattr(hub_kernels, "_PACKAGE_SUPPORTED_DEVICES", {}).get("fla")
    return devices is not None and "cpu" not in devices


def assert_refuses_cpu(kernel) -> None:
    q = k = torch.zeros(1, 4, 1, 8)
    try:
        kernel(q, k, torch.zeros(1, 4, 1, 8), g=torch.zeros(1, 4, 1), beta=torch.zeros(1, 4, 1))
    except Exception:  # noqa: BLE001 - fla's failure on CPU is Triton's, whatever its type
        return
    raise AssertionError("the module's delta rule ran on CPU: transformers did not resolve it to fla")

"""OpenRLHF's Ray trainer on CPU (zorro_core.integrations.openrlhf.cpu): every workaround still answers a gap of
the installed OpenRLHF/vLLM (a probe reading the call it answers; one that is no longer needed fails here, so
that it is removed), and the CPU weight-sync group carries a tensor as OpenRLHF's broadcast does. Runs in the
end-to-end venv (.ci/openrlhf_e2e: vLLM's CPU wheel); the whole trainer: examples/openrlhf/cpu_e2e.py."""

import importlib.util
import socket
import threading

import pytest
import torch
from openrlhf_setup import OPENRLHF_MISSING

pytestmark = pytest.mark.skipif(
    OPENRLHF_MISSING is not None or importlib.util.find_spec("vllm") is None,
    reason=OPENRLHF_MISSING or "vLLM is not installed (.ci/openrlhf_e2e installs its CPU wheel)",
)


def test_every_workaround_is_still_needed():
    from zorro_core.integrations.openrlhf import cpu

    needed = cpu.needed()
    assert sorted(needed) == sorted(cpu.WORKAROUNDS)
    stale = [name for name, still in needed.items() if not still]
    assert not stale, f"OpenRLHF/vLLM no longer have these gaps: remove their workarounds {stale}"


def test_cpu_weight_group_broadcasts():
    from zorro_core.integrations.openrlhf.cpu import CpuWeightGroup

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sent = torch.randn(3, 5, dtype=torch.bfloat16)
    got = torch.empty(3, 5, dtype=torch.bfloat16)
    groups = {}

    def make(rank):
        groups[rank] = CpuWeightGroup("127.0.0.1", port, rank, 2)

    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    receiver = threading.Thread(target=lambda: groups[1].broadcast(got, src=0))
    receiver.start()
    groups[0].broadcast(sent, src=0, stream=None)
    receiver.join(60)
    assert torch.equal(got, sent)

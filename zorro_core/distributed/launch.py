"""Start N ranks of a function on this machine, or join the ranks torchrun started.

`launch(fn, nproc, *args)` spawns `nproc` fresh processes (torch.multiprocessing, "spawn"),
each with a process group over TCP on 127.0.0.1 (gloo on CPU, NCCL with one GPU per rank), runs
`fn(*args)` in each (each rank ends with the launching process,
however it ends) and returns the ranks' return values in rank order. A rank that raises stops
the others (they would wait forever in their next collective) and the error is re-raised here.
`under_torchrun()` tells whether this process is one of torchrun's ranks (RANK, WORLD_SIZE and
MASTER_ADDR set); then `init_from_env` joins its process group instead.
"""

from __future__ import annotations

import os
import queue as queue_mod
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zorro_core.distributed.lifetime import children_ignore_sigint, die_with


def default_backend(device: str) -> str:
    """gloo for CPU tensors, nccl for CUDA tensors."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


GLOO_FSDP2_TORCH = (2, 7)
"""FSDP2 (fully_shard) on gloo needs ReduceOp.AVG and reduce_scatter on gloo: torch 2.7."""


def check_fsdp_backend(backend: str) -> None:
    """Refuse FSDP2 on gloo with a torch older than GLOO_FSDP2_TORCH (it would fail mid-backward)."""
    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if backend == "gloo" and version < GLOO_FSDP2_TORCH:
        raise RuntimeError(
            f"FSDP2 on gloo (CPU) needs torch >= 2.7 (reduce_scatter and ReduceOp.AVG on gloo); "
            f"this is torch {torch.__version__}"
        )


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


RANK_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def rank_variables_problem() -> Optional[str]:
    """Why the rank variables in the environment name no process group this process could join
    (None when they could): RANK and WORLD_SIZE integers with 0 <= RANK < WORLD_SIZE, LOCAL_RANK
    (if set) >= 0, MASTER_ADDR not empty, MASTER_PORT in 1..65535. Checked before joining: a bad
    set waits for ranks that never come, then dumps c10d's stack frames."""
    env = os.environ

    def number(name: str) -> Optional[int]:
        try:
            return int(env[name])
        except ValueError:
            return None

    for name in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK"):
        if name in env and number(name) is None:
            return f"{name}={env[name]!r} in the environment is not an integer"
    rank, world, port = number("RANK"), number("WORLD_SIZE"), number("MASTER_PORT")
    if world is not None and world < 1:
        return f"WORLD_SIZE={world} in the environment: a process group has at least 1 rank"
    if rank is not None and rank < 0:
        return f"RANK={rank} in the environment: ranks count from 0"
    if rank is not None and world is not None and rank >= world:
        return f"RANK={rank} with WORLD_SIZE={world} in the environment: ranks are 0 to {world - 1}"
    if "LOCAL_RANK" in env and (number("LOCAL_RANK") or 0) < 0:
        return f"LOCAL_RANK={env['LOCAL_RANK']} in the environment: ranks count from 0"
    if port is not None and not 1 <= port <= 65535:
        return f"MASTER_PORT={port} in the environment: a port is 1 to 65535"
    if "MASTER_ADDR" in env and not env["MASTER_ADDR"].strip():
        return "MASTER_ADDR in the environment is empty: it names the host of rank 0"
    return None


def set_by_torchrun() -> bool:
    """Whether torchrun's agent started this process (it sets TORCHELASTIC_RUN_ID): rank
    variables without it may be stale ones exported in a shell, naming ranks that never come."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def init_from_env(backend: str, timeout_s: float = 300.0) -> None:
    """Join the process group torchrun describes in the environment (no-op if already joined)."""
    check_fsdp_backend(backend)
    if not dist.is_initialized():
        why = rank_variables_problem()
        if why:
            raise ValueError(f"{why}; unset the rank variables or fix them")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(
    rank: int, world: int, port: int, backend: str, threads: int, init: bool, fn, args, results, parent: int
) -> None:
    # A rank ends with the process that launched it, however that one ends (a sweep killed with
    # SIGKILL or SIGTERM): otherwise it is re-parented to PID 1 and computes on.
    die_with(parent)
    # torchrun's environment, so that a trainer's launcher (accelerate) joins the same group.
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    try:
        torch.set_num_threads(threads)
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        if init:
            dist.init_process_group(
                backend,
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=world,
                timeout=timedelta(seconds=300),
            )
        try:
            out = fn(*args)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        results.put((rank, True, out))
    except Exception:  # noqa: BLE001 -- reported to the parent, which stops the other ranks
        results.put((rank, False, traceback.format_exc()))


def launch(
    fn: Callable[..., Any],
    nproc: int,
    *args: Any,
    backend: str = "gloo",
    threads: int = 1,
    timeout_s: float = 600.0,
    init_process_group: bool = True,
) -> list[Any]:
    """`fn(*args)` on `nproc` new ranks (module doc); `fn` must be importable (spawn pickles it by name).
    `init_process_group=False`: the ranks get torchrun's environment only and `fn` joins the group
    itself (as accelerate does)."""
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    if backend == "nccl" and torch.cuda.device_count() < 1:
        raise RuntimeError("backend nccl needs a CUDA device")
    check_fsdp_backend(backend)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(r, nproc, port, backend, threads, init_process_group, fn, args, results, os.getpid()),
            daemon=False,
        )
        for r in range(nproc)
    ]
    with children_ignore_sigint():  # Ctrl-C is the launcher's to handle: it stops the ranks below
        for p in procs:
            p.start()
    out: dict[int, Any] = {}
    try:
        deadline = time.monotonic() + timeout_s
        while len(out) < nproc:
            try:
                # Short waits: a rank that dies before it can report (it could not even unpickle `fn`)
                # is seen at once, not after the whole timeout.
                rank, ok, value = results.get(timeout=min(2.0, max(0.0, deadline - time.monotonic())))
            except queue_mod.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(procs) if r not in out and p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(
                        f"rank(s) {', '.join(f'{r} (exit code {code})' for r, code in dead)} ended without a "
                        "result: see its error output above (spawn imports `fn` by its module name)"
                    ) from None
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{nproc - len(out)} rank(s) gave no result within {timeout_s:.0f} s") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10 if len(out) == nproc else 0.1)
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
    return [out[r] for r in range(nproc)]

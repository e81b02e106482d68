"""Run a function on P local processes joined in a ``torch.distributed`` group —
for examples, tests and benchmarks on one machine (``torchrun`` does the same job
for real jobs).

>>> from attnkit.distributed.launch import free_port
>>> 1024 <= free_port() < 65536
True
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, fn, world, port, backend, threads, outdir, args):
    import torch
    import torch.distributed as dist

    if threads is not None:
        torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(outdir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    # Leave without interpreter finalization: gloo's C++ threads can still hold
    # finished work (and the tensors of its sends) when Python tears down, and
    # releasing those then aborts the process ("terminate called without an active
    # exception", SIGABRT) now and then — after the results are already written.
    # See pytorch/pytorch#179291.
    import sys
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn: Callable[..., Any], world: int, *args: Any, backend: str = "gloo",
          threads: int | None = None) -> list[Any]:
    """Start ``world`` processes (multiprocessing "spawn"), join them in one process
    group over TCP on a free local port, call ``fn(rank, world, *args)`` in each and
    return the ``world`` results in rank order. ``fn`` and its results must pickle
    (define ``fn`` at module level). ``threads`` sets torch's intra-op threads per
    process; ``backend="nccl"`` puts rank r on ``cuda:r``. A failure in any process
    raises here (``torch.multiprocessing.ProcessRaisedException``).
    """
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="attnkit-ring-") as outdir:
        mp.spawn(_entry, args=(fn, world, free_port(), backend, threads, outdir, args),
                 nprocs=world, join=True)
        results = []
        for r in range(world):
            with open(os.path.join(outdir, f"{r}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    return results

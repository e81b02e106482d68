"""Ring attention over 4 processes, checked against one process.

    torchrun --nproc-per-node 4 examples/ring_attention.py      # gloo on CPU
    python examples/ring_attention.py                           # spawns 4 processes itself
    python examples/ring_attention.py --world 2 --length 4096

Every rank builds the same full sequence (same seed), keeps only its zigzag shard
(rank r holds chunks r and 2P-1-r of 2P), runs causal ring attention forward and
backward on it, and gathers the shards on rank 0, which compares them with
single-process ``attnkit.attention`` on the whole sequence.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import attnkit
from attnkit.distributed import ring_attention, unshard, zigzag_shard


def main(rank, world, args):
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, L, D = 1, 8, 2, args.length, 64          # GQA: 8 query heads, 2 kv heads
    q = torch.randn(B, H, L, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hkv, L, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hkv, L, D, generator=g, dtype=torch.float64)
    dout = torch.randn(B, H, L, D, generator=g, dtype=torch.float64)

    # this rank's shard: (B, H, L/P, D); no rank holds more of the sequence
    q_r, k_r, v_r = (zigzag_shard(x, rank, world).requires_grad_() for x in (q, k, v))
    ring_attention(q_r[..., :2, :], k_r[..., :2, :], v_r[..., :2, :])  # untimed warm-up: first-call imports
    t = time.perf_counter()
    out_r = ring_attention(q_r, k_r, v_r, causal=True, layout="zigzag")
    out_r.backward(zigzag_shard(dout, rank, world))
    seconds = time.perf_counter() - t

    def gather(x):
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous())
        return unshard(parts, layout="zigzag")

    got = {name: gather(x.detach()) for name, x in
           (("out", out_r), ("dq", q_r.grad), ("dk", k_r.grad), ("dv", v_r.grad))}
    if rank == 0:                                         # the same thing on one process
        full = [x.clone().requires_grad_() for x in (q, k, v)]
        out = attnkit.attention(*full, causal=True)
        out.backward(dout)
        want = {"out": out.detach(), "dq": full[0].grad, "dk": full[1].grad, "dv": full[2].grad}
        errors = {name: float((got[name] - want[name]).abs().max()) for name in got}
        print(f"ring attention on {world} processes ({dist.get_backend()}), causal zigzag, "
              f"q {tuple(q.shape)} split into shards of {tuple(q_r.shape)}: "
              f"forward+backward {seconds * 1e3:.0f} ms on rank 0")
        print("max |ring - single process|: " + ", ".join(f"{n} {e:.1e}" for n, e in errors.items()))
        ok = all(e <= 1e-10 for e in errors.values())
        print("OK: equal to single-process attnkit.attention" if ok else "MISMATCH")
        return ok
    return True


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=4, help="processes when not under torchrun")
    p.add_argument("--length", type=int, default=2048, help="global sequence length L (= S)")
    return p.parse_args()


def _spawned(rank, world, args):
    return main(rank, world, args)


if __name__ == "__main__":
    args = parse()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:       # under torchrun
        dist.init_process_group("gloo")
        try:
            ok = main(dist.get_rank(), dist.get_world_size(), args)
        finally:
            dist.destroy_process_group()
    else:
        from attnkit.distributed.launch import spawn
        ok = all(spawn(_spawned, args.world, args, threads=max(1, (os.cpu_count() or 1) // args.world)))
    raise SystemExit(0 if ok else 1)

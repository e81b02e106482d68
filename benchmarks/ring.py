"""Ring attention: time per training step (forward + backward) and scaling over
P = 1, 2, 4 processes on one machine.

    .venv/bin/python benchmarks/ring.py                      # gloo on CPU
    .venv/bin/python benchmarks/ring.py --length 8192 --dtype float32 --worlds 1 2 4

With CUDA devices present the same script runs NCCL with one GPU per rank
(``--backend nccl`` forces it; P is capped by the device count). Every rank holds
its shard of a fixed global sequence (strong scaling); for each layout and P it
first checks the result against single-process ``attnkit.attention`` (validate
first, then time), then times ``repeats`` steps between barriers (the median).
CPU threads are shared out: each process gets max(1, cores // P) torch and flash
threads, so P beyond the core count oversubscribes the machine — the table says so.

Columns: ms per step (forward, forward+backward), GFLOP/s from the one FLOP formula
(4·B·H·L·S·D, ×0.5 causal, ×2.5 backward) over the whole machine, speedup against
P = 1 ring (itself measured against single-process attnkit.attention in the
same run), the ideal speedup for the hardware in use (P for one GPU per rank; on a
CPU, where P = 1 already runs on every core, the ratio of cores busy: 1 until the
machine has more cores than P = 1 used) and efficiency = speedup / ideal.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def _step(rank, world, cfg, layout, device, repeats, check):
    import torch
    import torch.distributed as dist

    import attnkit
    from attnkit.distributed import ring_attention, shard, unshard

    g = torch.Generator().manual_seed(0)
    B, H, Hkv, L, D = cfg["B"], cfg["H"], cfg["Hkv"], cfg["L"], cfg["D"]
    dt = getattr(torch, cfg["dtype"])
    q = torch.randn(B, H, L, D, generator=g).to(dt)
    k = torch.randn(B, Hkv, L, D, generator=g).to(dt)
    v = torch.randn(B, Hkv, L, D, generator=g).to(dt)
    dout = torch.randn(B, H, L, D, generator=g).to(dt)
    q_r, k_r, v_r, dout_r = (shard(x, rank, world, layout=layout).to(device).contiguous()
                             for x in (q, k, v, dout))
    q_r, k_r, v_r = (x.requires_grad_() for x in (q_r, k_r, v_r))

    def fwd():
        return ring_attention(q_r, k_r, v_r, causal=cfg["causal"], layout=layout)

    def sync():
        if device != "cpu":
            torch.cuda.synchronize()
        dist.barrier()

    out = fwd()                                  # warm up, and validate
    out.backward(dout_r)
    err = None
    if check:
        parts = [torch.empty_like(out) for _ in range(world)]
        dist.all_gather(parts, out.detach().contiguous())
        if rank == 0:
            want = attnkit.attention(q, k, v, causal=cfg["causal"])
            err = float((unshard([p.cpu() for p in parts], layout=layout).double() - want.double()).abs().max())
        tol = {"float64": 1e-10, "float32": 1e-4}.get(cfg["dtype"], 3e-2)
        ok = torch.tensor([1 if err is None or err <= tol else 0])
        dist.broadcast(ok, 0)                    # validate first: no rank times a wrong answer
        if not ok.item():
            raise RuntimeError(f"ring {layout}: output differs from one process by {err} > {tol}")
    times = {"fwd": [], "step": []}
    for _ in range(repeats):
        q_r.grad = k_r.grad = v_r.grad = None
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            fwd()
        sync()
        t1 = time.perf_counter()
        fwd().backward(dout_r)
        sync()
        t2 = time.perf_counter()
        times["fwd"].append(t1 - t0)
        times["step"].append(t2 - t1)
    return {name: statistics.median(ts) for name, ts in times.items()} | {"err": err}


def _worker(rank, world, cfg, layouts, repeats, threads, backend):
    import torch

    from attnkit import flash

    flash.set_threads(threads)
    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    res = {layout: _step(rank, world, cfg, layout, device, repeats, check=True) for layout in layouts}
    if world == 1 and backend == "gloo":         # the peer: plain single-process attention
        import attnkit
        g = torch.Generator().manual_seed(0)
        dt = getattr(torch, cfg["dtype"])
        q = torch.randn(cfg["B"], cfg["H"], cfg["L"], cfg["D"], generator=g).to(dt).requires_grad_()
        k = torch.randn(cfg["B"], cfg["Hkv"], cfg["L"], cfg["D"], generator=g).to(dt).requires_grad_()
        v = torch.randn(cfg["B"], cfg["Hkv"], cfg["L"], cfg["D"], generator=g).to(dt).requires_grad_()
        attnkit.attention(q, k, v, causal=cfg["causal"]).sum().backward()
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            attnkit.attention(q, k, v, causal=cfg["causal"]).sum().backward()
            ts.append(time.perf_counter() - t0)
        res["single"] = {"step": statistics.median(ts)}
    return res


def main():
    import torch

    from attnkit.distributed.launch import spawn
    from attnkit.spec import flops

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--no-causal", action="store_true")
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--layouts", nargs="+", default=["zigzag", "contiguous"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--backend", choices=["gloo", "nccl"], default=None)
    a = p.parse_args()

    backend = a.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    worlds = a.worlds
    if backend == "nccl":
        worlds = [w for w in worlds if w <= torch.cuda.device_count()]
    cfg = dict(B=a.batch, H=a.heads, Hkv=a.kv_heads, L=a.length, D=a.dim, dtype=a.dtype,
               causal=not a.no_causal)
    shape = (cfg["B"], cfg["H"], cfg["L"], cfg["L"], cfg["D"])
    f_step = flops(*shape, causal=cfg["causal"]) + flops(*shape, causal=cfg["causal"], backward=True)
    machine = (torch.cuda.get_device_name(0) if backend == "nccl" else f"{cores} CPU cores")
    print(f"ring attention, {backend}, {machine}; B={cfg['B']} H={cfg['H']} Hkv={cfg['Hkv']} "
          f"L=S={cfg['L']} D={cfg['D']} {cfg['dtype']} {'causal' if cfg['causal'] else 'full'}; "
          f"median of {a.repeats}")
    rows, base = [], {}
    for world in worlds:
        threads = max(1, cores // world) if backend == "gloo" else 1
        res = spawn(_worker, world, cfg, a.layouts, a.repeats, threads, backend, backend=backend,
                    threads=threads)[0]
        if "single" in res:
            rows.append(("single process attnkit.attention", 1, threads, None, res["single"]["step"], None))
        for layout in a.layouts:
            r = res[layout]
            base.setdefault(layout, r["step"])
            rows.append((f"ring {layout}", world, threads, r["fwd"], r["step"], r["err"]))
    single = next((r[4] for r in rows if r[0].startswith("single")), None)
    print(f"{'':34} {'P':>2} {'thr/P':>5} {'fwd ms':>8} {'step ms':>8} {'GFLOP/s':>8} "
          f"{'speedup':>7} {'ideal':>5} {'eff.':>5} {'max err':>8} {'vs single':>9}")
    thr1 = max(1, cores // min(worlds)) if backend == "gloo" else 1
    for name, world, threads, fwd, step, err in rows:
        layout = name.split()[-1]
        speed = base[layout] / step if name.startswith("ring") else float("nan")
        ideal = world if backend == "nccl" else min(world * threads, cores) / min(thr1, cores)
        over = "  (oversubscribed)" if backend == "gloo" and world > cores else ""
        print(f"{name:34} {world:>2} {threads:>5} {'' if fwd is None else f'{fwd * 1e3:8.0f}':>8} "
              f"{step * 1e3:8.0f} {f_step / step / 1e9:8.1f} {speed:7.2f} {ideal:5.2f} {speed / ideal:5.2f} "
              f"{'' if err is None else f'{err:8.1e}':>8} "
              f"{'' if single is None else f'{single / step:8.2f}x':>9}{over}")


if __name__ == "__main__":
    main()

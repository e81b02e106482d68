"""Sinks, ALiBi and dropout on the CPU: what each costs over plain attention in
attnkit, and attnkit next to PyTorch given the same term the way torch users give it,
in one run (float32, B=1, H=8, L=S=4096, D=64, forward).

- sinks:   PyTorch has none in SDPA — its peer is the eager formula (a sink column
           concatenated to the scores, softmax, the column dropped, weights @ v).
- ALiBi:   PyTorch's peer is SDPA with the ALiBi bias as a float (H, L, S) mask.
- dropout: SDPA with dropout_p = 0.1 (attnkit: dropout=0.1, a fixed seed).

Targets (the issue's): sinks and ALiBi cost ≤ 10% over plain attnkit, dropout ≤ 25%,
and each forward ≥ 1.0× its PyTorch peer.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/terms.py
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import attnkit
from attnkit import flash
from attnkit.bench import interleaved
from attnkit.testing import error_budget, make_qkv, max_error

H, L, D = 8, 4096, 64
COST = {"sinks": 1.10, "alibi": 1.10, "dropout": 1.25}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--L", type=int, default=L)
    args = p.parse_args(argv)
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(flash.get_threads())
    n = args.L
    q, k, v = make_qkv((1, H, n, D), (1, H, n, D), dtype="float32", seed=0)
    sinks = np.linspace(-1, 1, H).astype(np.float32)
    slopes = (2.0 ** -np.arange(1, H + 1)).astype(np.float32)
    terms = {"plain": {}, "sinks": dict(sinks=sinks), "alibi": dict(alibi_slopes=slopes),
             "dropout": dict(dropout=0.1, seed=1)}
    small = tuple(x[:, :, :300] for x in (q, k, v))           # the check: every term against the reference
    for name, kw in terms.items():
        kw_small = kw
        got = attnkit.attention(*small, backend="flash", **kw_small)
        oracle = attnkit.attention(*(x.astype(np.float64) for x in small), backend="reference", **kw_small)
        same = attnkit.attention(*small, backend="reference", **kw_small)
        err = max_error(got, oracle) / error_budget(oracle, same)
        if not err <= 1:
            raise SystemExit(f"attnkit with {name} failed its check ({err:.2f}× the budget): not timed")
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    ts = torch.from_numpy(sinks)
    dist = (torch.arange(n)[:, None] - torch.arange(n)[None, :]).abs().float()
    alibi_mask = -torch.from_numpy(slopes)[:, None, None] * dist

    def torch_sinks():
        s = tq @ tk.transpose(-1, -2) / D ** 0.5
        w = torch.softmax(torch.cat([s, ts[None, :, None, None].expand(1, H, n, 1)], -1), -1)[..., :-1]
        return w @ tv

    runs = {f"attnkit {t}": (lambda kw=kw: attnkit.attention(q, k, v, backend="flash", **kw))
            for t, kw in terms.items()}
    runs.update({"torch plain": lambda: F.scaled_dot_product_attention(tq, tk, tv),
                 "torch sinks": torch_sinks,
                 "torch alibi": lambda: F.scaled_dot_product_attention(tq, tk, tv, attn_mask=alibi_mask),
                 "torch dropout": lambda: F.scaled_dot_product_attention(tq, tk, tv, dropout_p=0.1)})
    t = {k_: min(v_) for k_, v_ in interleaved(runs, args.repeats, gap_s=0.5).items()}
    print(f"# attnkit terms, forward, float32, B=1 H={H} L=S={n} D={D} ({flash.get_threads()} workers)\n")
    print("| term | attnkit ms | cost over plain | target | torch peer ms | attnkit ÷ torch | target |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in terms:
        ours, theirs = t[f"attnkit {name}"], t[f"torch {name}"]
        cost = ours / t["attnkit plain"]
        ct = "" if name == "plain" else f"≤ {COST[name]:.2f} {'meets' if cost <= COST[name] else 'MISSES'}"
        vs = theirs / ours
        print(f"| {name} | {ours * 1e3:.0f} | {cost:.2f}× | {ct} | {theirs * 1e3:.0f} | {vs:.2f}× | "
              f"≥ 1.00 {'meets' if vs >= 1 else 'MISSES'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

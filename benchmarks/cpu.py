"""CPU benchmark of the flash rung: validate every provider, then time them in one run.

Providers, all float32 on the CPU:

- ``attnkit`` — ``attnkit.attention`` (the NumPy flash rung) and ``attention_backward``
- ``torch``   — ``torch.nn.functional.scaled_dot_product_attention`` (backward by autograd)
- ``seed``    — the seed's NumPy formula, one head at a time, with the full L × S matrix:
  ``softmax(Q Kᵀ / √d_k) V`` (forward only; causal through its boolean mask)

Each provider is first checked against the float64 reference on a small problem (the
DESIGN.md §6 rule: error ≤ 2 × the reference's own float32 error + 1e-5); a provider
that fails is not timed. Throughput uses one FLOP formula, ``attnkit.spec.flops``
(4·B·H·L·S·D forward, ×0.5 causal, ×2.5 backward) and the ratios compare providers
measured in this same run (best of ``--repeats``, providers interleaved in a shuffled order each round,
with an idle gap before each run so that one provider's spinning worker threads do not slow the next). The last
part measures peak extra memory of one forward at L = S = 65,536 (H = 1, D = 64) in
a fresh process: the tracemalloc peak of NumPy's allocations and the growth of the
process's peak RSS.

Run for the record (the README table)::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/cpu.py --repeats 7

Quicker: ``--quick`` (D = 64, L = 2048, memory at L = 16,384), or pick parts with
``--D``, ``--L``, ``--passes``, ``--no-memory``, ``--memory-L``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np

import attnkit
from attnkit import flash, reference
from attnkit.bench import interleaved
from attnkit.spec import flops, validate
from attnkit.testing import error_budget, max_error

GAP_S = 0.5  # seconds of idle time before each timed run
# each timed run right after an untimed one of the same provider: after the idle gap the
# shared virtual machines here take milliseconds to bring the second core back, which
# timed alone made a 36 ms causal call as slow as a 57 ms full one (Intel host, 2026-12-03)
SETTLE = True

TARGETS = {  # (D, pass, causal) -> minimum attnkit / torch throughput ratio (the issue's)
    (64, "fwd", False): 0.8,
    (128, "fwd", False): 1.0,
    (64, "fwd+bwd", False): 0.8,
}


# ---- providers ---------------------------------------------------------------------


def seed_formula(Q, K, V, mask=None):
    """The seed's formula on 2-D arrays: full L × S scores, mask True = -1e9."""
    d_k = Q.shape[-1]
    scores = Q @ K.T / np.sqrt(d_k)
    if mask is not None:
        scores = np.where(mask, -1e9, scores)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    return weights @ V, weights


def seed_forward(q, k, v, causal):
    """(B, H, L, D) inputs, one head at a time (the seed is 2-D)."""
    mask = np.triu(np.ones((q.shape[-2], k.shape[-2]), dtype=bool), 1) if causal else None
    out = np.empty(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype)
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            out[b, h] = seed_formula(q[b, h], k[b, h], v[b, h], mask)[0]
    return out


def attnkit_run(q, k, v, dout, causal, backward):
    # backend="flash", not "auto": auto may pick the reference rung for small problems
    out, lse = attnkit.attention(q, k, v, causal=causal, return_lse=True, backend="flash")
    if backward:
        return out, attnkit.attention_backward(dout, q, k, v, out, lse, causal=causal, backend="flash")
    return out, None


# Blocks smaller than the validation size (L = S = 300), so that validation also runs
# what the timed sizes run: several query/key blocks, causal row strips (SUB_M = 128)
# and the fused diagonal tiles, forward and backward.
SMALL_BLOCKS = dict(block_m=128, block_n=64)


def attnkit_small_blocks(spec, dout):
    out, lse, _ = flash.rung_forward(spec, **SMALL_BLOCKS)
    return out, flash.rung_backward(spec, dout, out, lse, **SMALL_BLOCKS)[:3]


def torch_run(tq, tk, tv, tdout, causal, backward):
    import torch.nn.functional as F
    for t in (tq, tk, tv):
        t.grad = None
    out = F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
    if backward:
        out.backward(tdout)
        return out, (tq.grad, tk.grad, tv.grad)
    return out, None


CEILING = ("sgemm", False, "numpy")  # the key of the BLAS ceiling in time_all's result
CEILING_N = 4096                     # its matrices: n × n, n = min(L, CEILING_N)


def blas_ceiling(n):
    """A run of NumPy's float32 matmul, n × n by n × n on all BLAS threads: what this
    machine's BLAS reaches at its best. Every FLOP counted for the forward
    (4·B·H·L·S·D) is a matmul FLOP, so no attention forward can go faster than this."""
    rng = np.random.default_rng(1)
    a, b = (rng.standard_normal((n, n), dtype=np.float32) for _ in range(2))
    c = np.empty((n, n), dtype=np.float32)
    return lambda: np.matmul(a, b, out=c)


# ---- validation ----------------------------------------------------------------------


def validate_providers(D, have_torch):
    """Every provider against the float64 reference on a small problem; returns
    {provider: (ok, worst error / budget)} with forward and backward checked. attnkit
    is checked with its default blocks and with SMALL_BLOCKS (multi-block paths)."""
    rng = np.random.default_rng(D)
    L = S = 300
    q, k, v = (rng.standard_normal((1, 2, n, D)).astype(np.float32) for n in (L, S, S))
    dout = rng.standard_normal((1, 2, L, D)).astype(np.float32)
    result = {}
    for causal in (False, True):
        # top-left = bottom-right here (L == S), so torch's is_causal is the same mask
        s32 = validate(q, k, v, causal=causal)
        s64 = validate(*(x.astype(np.float64) for x in (q, k, v)), causal=causal)
        o64, l64, _ = reference.rung_forward(s64)
        o32, l32, _ = reference.rung_forward(s32)
        g64 = reference.rung_backward(s64, dout.astype(np.float64), o64, l64)
        g32 = reference.rung_backward(s32, dout, o32, l32)
        fwd_budget = error_budget(o64, o32)
        bwd_budgets = [error_budget(a, b) for a, b in zip(g64[:3], g32[:3])]

        def score(name, out, grads):
            worst = max_error(out, o64) / fwd_budget
            if grads is not None:
                worst = max(worst, *(max_error(g, r) / bud for g, r, bud in zip(grads, g64, bwd_budgets)))
            ok, prev = result.get(name, (True, 0.0))
            result[name] = (ok and worst <= 1.0, max(prev, worst))

        out, grads = attnkit_run(q, k, v, dout, causal, True)
        score("attnkit", out, grads)
        out, grads = attnkit_small_blocks(s32, dout)
        score("attnkit", out, grads)
        score("seed", seed_forward(q, k, v, causal), None)
        if have_torch:
            import torch
            tq, tk, tv = (torch.from_numpy(x.copy()).requires_grad_() for x in (q, k, v))
            out, grads = torch_run(tq, tk, tv, torch.from_numpy(dout), causal, True)
            score("torch", out.detach().numpy(), [g.numpy() for g in grads])
    return result


# ---- timing --------------------------------------------------------------------------


def time_all(D, L, H, passes, repeats, have_torch, validated):
    """{(pass, causal, provider): [seconds per round]}."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, H, L, D)).astype(np.float32) for _ in range(3))
    dout = rng.standard_normal((1, H, L, D)).astype(np.float32)
    runs = {}
    for p in passes:
        backward = p == "fwd+bwd"
        for causal in (False, True):
            if validated.get("attnkit", (False,))[0]:
                runs[(p, causal, "attnkit")] = lambda c=causal, b=backward: attnkit_run(q, k, v, dout, c, b)
            if have_torch and validated.get("torch", (False,))[0]:
                import torch
                tq, tk, tv = (torch.from_numpy(x).requires_grad_(backward) for x in (q, k, v))
                tdout = torch.from_numpy(dout)
                runs[(p, causal, "torch")] = (lambda c=causal, b=backward, t=(tq, tk, tv, tdout):
                                              torch_run(*t[:3], t[3], c, b))
            if not backward and validated.get("seed", (False,))[0]:
                runs[(p, causal, "seed")] = lambda c=causal: seed_forward(q, k, v, c)
    if runs:
        runs[CEILING] = blas_ceiling(min(L, CEILING_N))
    # interleaved, so load changes hit all alike, in a new order each round (no run
    # always follows the same one, e.g. the seed's memory sweep); the seed is not warmed
    # up before the rounds (its settling run is its warm-up)
    times = interleaved(runs, repeats, GAP_S, warmup=[key for key in runs if key[2] != "seed"], settle=SETTLE)
    return times


def report(D, L, H, times):
    """Table of best times and two ratios per peer: of the best times, and the median
    of the per-round ratios (each round runs the providers back to back)."""
    times = dict(times)
    ceiling_s = times.pop(CEILING, None)
    n = min(L, CEILING_N)
    ceiling = 2.0 * n ** 3 / min(ceiling_s) / 1e9 if ceiling_s else None
    if not times:                                        # every provider failed validation
        print(f"\n## D = {D}: nothing timed (no provider passed validation)\n")
        return []
    best = {key: min(ts) for key, ts in times.items()}
    print(f"\n## D = {D}: float32, B = 1, H = {H}, L = S = {L} (best of {len(next(iter(times.values())))})\n")
    print("| pass | mask | provider | seconds | GFLOP/s | attnkit ÷ provider (best; median per round) |")
    print("|---|---|---|---:|---:|---:|")
    checks = []

    def ratio(p, causal, prov):
        mine = times.get((p, causal, "attnkit"))
        theirs = times.get((p, causal, prov))
        if not mine or not theirs:
            return None, None
        return best[(p, causal, prov)] / best[(p, causal, "attnkit")], float(np.median(np.divide(theirs, mine)))

    for (p, causal, prov), t in best.items():
        f = flops(1, H, L, L, D, causal=causal) + (flops(1, H, L, L, D, causal=causal, backward=True)
                                                   if p == "fwd+bwd" else 0.0)
        r_best, r_med = ratio(p, causal, prov)
        shown = f"{r_best:.2f}×; {r_med:.2f}×" if r_best and prov != "attnkit" else ""
        print(f"| {p} | {'causal' if causal else 'full'} | {prov} | {t:.3f} | {f / t / 1e9:.1f} | {shown} |")
    print()
    for p in dict.fromkeys(k[0] for k in best):
        for prov in ("attnkit", "torch"):
            full, causal = best.get((p, False, prov)), best.get((p, True, prov))
            if full and causal:
                med = float(np.median(np.divide(times[(p, False, prov)], times[(p, True, prov)])))
                print(f"- {prov} {p}: causal is {full / causal:.2f}× faster than full "
                      f"(median per round {med:.2f}×)")
                if prov == "attnkit" and p == "fwd":
                    checks.append((f"causal fwd ≥ 1.7× faster than full (D={D}; per-round median {med:.2f})",
                                   full / causal, 1.7))
    for (d, p, causal), need in TARGETS.items():
        r_best, r_med = ratio(p, causal, "torch")
        if d == D and r_best:
            checks.append((f"{p} ≥ {need}× torch (D={D}; per-round median {r_med:.2f})", r_best, need))
    r_best, r_med = ratio("fwd", False, "seed")
    if r_best:
        checks.append((f"fwd ≥ 8× the seed formula (D={D}; per-round median {r_med:.2f})", r_best, 8.0))
    if ceiling:
        print(f"- BLAS ceiling: NumPy float32 matmul {n}×{n}×{n} on all threads runs at {ceiling:.1f} GFLOP/s "
              f"(best of {len(ceiling_s)}, timed in the same rounds)")
        seed = best.get(("fwd", False, "seed"))
        if seed:
            need = 8.0 * flops(1, H, L, L, D) / seed / 1e9
            print(f"- 8× the seed formula means {need:.1f} GFLOP/s here: "
                  f"{need / ceiling:.2f}× the BLAS ceiling{' (out of reach for any implementation)' if need > ceiling else ''}")
    return checks


# ---- memory --------------------------------------------------------------------------


def _rss():
    """Resident memory of this process now, in bytes (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def memory_child(L, D):
    """Run in a fresh process: one forward at L = S, H = 1; prints JSON. Peak RSS is
    sampled every 5 ms by a thread during the call."""
    import threading
    import tracemalloc
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, L, D), dtype=np.float32) for _ in range(3))
    attnkit.attention(q[:, :256], k[:, :256], v[:, :256])   # compile / start the pool first
    rss0, peak_rss, done = _rss(), [0], threading.Event()

    def sample():
        while not done.wait(0.005):
            peak_rss[0] = max(peak_rss[0], _rss())

    sampler = threading.Thread(target=sample)
    tracemalloc.start()
    sampler.start()
    t0 = time.perf_counter()
    out, lse = attnkit.attention(q, k, v, return_lse=True)
    seconds = time.perf_counter() - t0
    done.set()
    sampler.join()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    print(json.dumps(dict(L=L, D=D, seconds=seconds, tracemalloc_peak=peak, rss_growth=max(peak_rss[0], _rss()) - rss0,
                          out_bytes=out.nbytes + lse.nbytes, finite=bool(np.isfinite(out).all()))))


def memory(L, D):
    res = subprocess.run([sys.executable, __file__, "--memory-child", str(L), str(D)],
                         capture_output=True, text=True, check=True)
    r = json.loads(res.stdout.strip().splitlines()[-1])
    mib = 2.0 ** 20
    print(f"\n## Peak extra memory: one forward, float32, H = 1, L = S = {L}, D = {D}\n")
    print(f"- tracemalloc peak (NumPy allocations during the call): {r['tracemalloc_peak'] / mib:.1f} MiB "
          f"(of which out + lse {r['out_bytes'] / mib:.1f} MiB)")
    print(f"- peak resident memory growth during the call (sampled every 5 ms): {r['rss_growth'] / mib:.1f} MiB")
    print(f"- one L × S float32 score matrix would be {L * L * 4 / mib:.0f} MiB; "
          f"the call took {r['seconds']:.1f} s ({flops(1, 1, L, L, D) / r['seconds'] / 1e9:.1f} GFLOP/s)")
    return [(f"peak extra memory ≤ 256 MiB at L = {L} (MiB, tracemalloc)", r["tracemalloc_peak"] / mib, -256.0),
            (f"peak extra memory ≤ 256 MiB at L = {L} (MiB, RSS)", max(r["rss_growth"], 0) / mib, -256.0)]


# ---- main ----------------------------------------------------------------------------


def machine():
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    print(f"- CPU: {cpu}, {flash.get_threads()} flash workers, {os.cpu_count()} logical CPUs")
    print(f"- Python {platform.python_version()}, NumPy {np.__version__}", end="")
    try:
        import torch
        print(f", torch {torch.__version__} ({torch.get_num_threads()} threads)", end="")
    except ImportError:
        pass
    kern = flash.compiled_kernels()
    print(f"\n- flash float32 kernels: {'numba ' + __import__('numba').__version__ if kern else 'NumPy (numba not installed)'}")
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        print("- BLAS: threadpoolctl not installed (flash runs its tiles on one thread)")
    else:
        for lib in threadpool_info():
            print(f"- {lib['user_api']}: {lib['internal_api']} {lib.get('version')} "
                  f"kernel={lib.get('architecture')} threads={lib['num_threads']} ({os.path.basename(lib['filepath'])})")
    for var in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OMP_NUM_THREADS"):
        if var in os.environ:
            print(f"- note: {var}={os.environ[var]} is set")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--D", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--L", type=int, default=4096)
    ap.add_argument("--H", type=int, default=8)
    ap.add_argument("--passes", nargs="+", choices=["fwd", "fwd+bwd"], default=["fwd", "fwd+bwd"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--memory-L", type=int, default=65536)
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--quick", action="store_true", help="D=64, L=2048, 2 repeats, memory at L=16384")
    ap.add_argument("--memory-child", nargs=2, type=int, help=argparse.SUPPRESS)
    if "--quick" in (sys.argv[1:] if argv is None else argv):
        ap.set_defaults(D=[64], L=2048, repeats=2, memory_L=16384)
    a = ap.parse_args(argv)
    if a.memory_child:
        return memory_child(*a.memory_child)
    have_torch = not a.no_torch
    if have_torch:
        try:
            import torch  # noqa: F401
        except ImportError:
            have_torch = False

    print("# attnkit CPU benchmark\n")
    machine()
    checks = []
    for D in a.D:
        validated = validate_providers(D, have_torch)
        print(f"\nvalidation vs the float64 reference (D = {D}, forward and backward, causal and not): " +
              ", ".join(f"{n} {'ok' if ok else 'FAILED'} (worst error {w:.2f} of budget)"
                        for n, (ok, w) in validated.items()))
        times = time_all(D, a.L, a.H, a.passes, a.repeats, have_torch, validated)
        checks += report(D, a.L, a.H, times)
    if not a.no_memory:
        checks += memory(a.memory_L, 64)
    print("\n## Targets\n")
    for what, got, need in checks:
        ok = got <= -need if need < 0 else got >= need
        print(f"- {what}: {got:.2f} {'meets' if ok else 'MISSES'} the target")


if __name__ == "__main__":
    main()

"""``attnkit bench``: how fast attention runs here, next to PyTorch's SDPA, in one run.

Each provider is first checked against the float64 reference on a small problem of
the same kind (DESIGN.md §6: error ≤ 2 × the reference's own error in that precision
+ 1e-5, forward and, with ``backward``, the gradients). attnkit must pass or nothing
is timed; PyTorch's errors are shown for comparison and it is timed either way. Then
the providers run interleaved, in a new order each round, and the best time of each
is kept; throughput uses one FLOP formula (4·B·H·L·S·D forward, ×0.5 causal, ×2.5
backward) and the ratios compare runs of this one process.

Providers:

- ``attnkit``: ``attnkit.attention`` (and ``attention_backward``) on NumPy arrays for
  the CPU (bfloat16, which NumPy lacks, goes through torch CPU tensors), on torch
  tensors with autograd for CUDA;
- ``torch``: ``torch.nn.functional.scaled_dot_product_attention`` with autograd, when
  torch is installed (CPU or CUDA, PyTorch picks its kernel).

Causal attention is timed with ``align="top_left"``, the diagonal of PyTorch's
``is_causal``, so both compute the same function when L ≠ S.

>>> r = run(B=1, H=2, L=64, S=48, D=16, repeats=1, gap_s=0, peers=False, quiet=True)
>>> r["checks"]["attnkit"]["ok"], sorted(r["times"]["fwd"])
(True, ['attnkit'])
"""

from __future__ import annotations

import sys
import time

import numpy as np

from . import api
from .spec import flops
from .testing import error_budget, make_qkv, max_error

DTYPES = ("float32", "float64", "float16", "bfloat16")
CHECK_L, CHECK_S = 97, 113          # the validation problem's lengths (capped by L and S)


def interleaved(runs: dict, repeats: int, gap_s: float = 0.5, seed: int = 0, progress=None,
                warmup=None, settle: bool = False, prepare=None) -> dict:
    """{key: [seconds per round]} for every fn in ``runs`` ({key: fn}): each warmed up
    once (only the keys in ``warmup`` when given), then ``repeats`` rounds in a shuffled
    order (no run always follows the same one), with ``gap_s`` of idle time before each
    run so that one provider's spinning worker threads do not slow the next.
    ``settle``: each timed run directly follows one untimed run of the same fn, so that
    a call of a few milliseconds is timed as a model makes it (layer after layer), not
    after an idle gap: on the shared virtual machines here an idle second core takes
    milliseconds to come back, which would be timed instead of the call.
    ``prepare`` ({key: fn}, optional): called, untimed, before each run of its key (and
    its warm-up), e.g. to switch one model to the key's implementation.
    ``progress(i, n)`` is called after each round."""
    prepare = prepare or {}
    if not prepare.keys() <= runs.keys():
        raise ValueError(f"prepare: {sorted(prepare.keys() - runs.keys())} are not among the runs {list(runs)}")
    for key, fn in runs.items():                 # compiles, thread pools, caches
        if warmup is None or key in warmup:
            if key in prepare:
                prepare[key]()
            fn()
    keys = list(runs)
    times: dict = {key: [] for key in keys}
    order = np.random.default_rng(seed)
    for r in range(repeats):
        for i in order.permutation(len(keys)):
            time.sleep(gap_s)
            if keys[i] in prepare:
                prepare[keys[i]]()
            if settle:
                runs[keys[i]]()
            t0 = time.perf_counter()
            runs[keys[i]]()
            times[keys[i]].append(time.perf_counter() - t0)
        if progress:
            progress(r + 1, repeats)
    return times


def hf_calls(run) -> int:
    """How many times attnkit's transformers attention function ran during ``run()``:
    benchmarks check with it that switching a model to ``"attnkit"`` took effect.
    attnkit's own function is registered again afterwards.

    >>> hf_calls(lambda: None)
    0
    """
    import transformers

    from . import hf
    calls: list[int] = []

    def counted(*args, **kwargs):
        calls.append(1)
        return hf.attention_forward(*args, **kwargs)
    transformers.AttentionInterface.register(hf.NAME, counted)
    try:
        run()
    finally:
        hf.register()
    return len(calls)


def _torch_inputs(arrays, dtype, device, grad):
    import torch
    return [torch.tensor(x, dtype=getattr(torch, dtype), device=device).requires_grad_(grad and i < 3)
            for i, x in enumerate(arrays)]


def _providers(dtype, device, causal, backward, backend, peers):
    """{name: fn(inputs) -> (out, grads | None)} as NumPy/float64-comparable results,
    and {name: make_inputs(arrays) -> inputs}."""
    kw = dict(causal=causal, align="top_left")
    numpy_path = device == "cpu" and dtype != "bfloat16"

    def attnkit_numpy(x):
        q, k, v, dout = x
        out, lse = api.attention(q, k, v, return_lse=True, backend=backend, **kw)
        grads = api.attention_backward(dout, q, k, v, out, lse, backend=backend, **kw) if backward else None
        return out, grads

    def autograd(fn):
        def run(x):
            q, k, v, dout = x
            for t in (q, k, v):
                t.grad = None
            out = fn(q, k, v)
            if backward:
                out.backward(dout)
            if device != "cpu":
                import torch
                torch.cuda.synchronize()
            return out, ((q.grad, k.grad, v.grad) if backward else None)
        return run

    provs = {"attnkit": attnkit_numpy if numpy_path else
             autograd(lambda q, k, v: api.attention(q, k, v, backend=backend, **kw))}
    makers = {"attnkit": (lambda a: [x.astype(dtype) for x in a]) if numpy_path else
              (lambda a: _torch_inputs(a, dtype, device, backward))}
    if peers:
        try:
            import torch.nn.functional as F
        except ImportError:
            pass
        else:
            provs["torch"] = autograd(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
            makers["torch"] = lambda a: _torch_inputs(a, dtype, device, backward)
    return provs, makers


def _as64(x):
    if hasattr(x, "detach"):
        x = x.detach().float().cpu().numpy()
    return np.asarray(x, dtype=np.float64)


def _same_precision(x, dtype):
    """A float32 reference result rounded to dtype, as float64 (torch rounds bfloat16)."""
    if dtype == "bfloat16":
        import torch
        return torch.from_numpy(np.asarray(x, dtype=np.float32)).bfloat16().double().numpy()
    return np.asarray(x).astype(dtype).astype(np.float64)


def _check(provs, makers, dtype, causal, backward, H, D, L, S):
    """{name: {"ok": bool, "worst": error / budget}} on a small problem."""
    L, S = min(L, CHECK_L), min(S, CHECK_S)
    a = list(make_qkv((1, H, L, D), (1, H, S, D), seed=1)) + [np.random.default_rng(2).standard_normal((1, H, L, D))]
    if dtype == "bfloat16":                  # the values every provider sees
        a = [_same_precision(x, dtype) for x in a]
    else:
        a = [x.astype(dtype).astype(np.float64) for x in a]
    kw = dict(causal=causal, align="top_left", backend="reference")
    acc = "float64" if dtype == "float64" else "float32"

    def ref(arrays, stored=lambda out: out):
        q, k, v, dout = arrays
        out, lse = api.attention(q, k, v, return_lse=True, **kw)
        return [out] + (list(api.attention_backward(dout, q, k, v, stored(out), lse, **kw)) if backward else [])

    oracle = ref(a)
    # the reference in the same precision stores its output in dtype before the backward
    # reads it (rowsum(dout ∘ out)), as every provider does
    same = [_same_precision(x, dtype) for x in ref([x.astype(acc) for x in a],
                                                   lambda out: _same_precision(out, dtype).astype(acc))]
    result = {}
    for name, fn in provs.items():
        out, grads = fn(makers[name](a))
        got = [_as64(out)] + ([_as64(g) for g in grads] if backward else [])
        worst = max(max_error(g, o) / error_budget(o, s) for g, o, s in zip(got, oracle, same))
        result[name] = {"ok": bool(worst <= 1.0), "worst": float(worst)}
    return result


def run(B=1, H=8, L=4096, S=None, D=64, *, dtype="float32", device="cpu", causal=False,
        backward=False, repeats=5, backend="auto", peers=True, gap_s=None, quiet=False) -> dict:
    """Check, then time; returns {"checks", "times": {pass: {name: best seconds}},
    "flops": {pass: FLOPs}, "setup"}. Prints progress on stderr unless ``quiet``."""
    S = L if S is None else S
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {DTYPES}, got {dtype!r}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device: expected 'cpu' or 'cuda', got {device!r}")
    for name, n in (("B", B), ("H", H), ("L", L), ("S", S), ("D", D), ("repeats", repeats)):
        if int(n) != n or n < 1:
            raise ValueError(f"{name}: expected a positive integer, got {n!r}")
    if device == "cpu" and dtype != "bfloat16" and backend in ("torch", "triton"):
        raise ValueError(f"backend: {backend!r} takes torch tensors; bench times NumPy arrays on the CPU "
                         "(backend auto, flash, small or reference; --device cuda runs the Triton kernels)")
    if device == "cuda" or dtype == "bfloat16":
        try:
            import torch
        except ImportError:
            raise ValueError(f"{'device cuda' if device == 'cuda' else 'dtype bfloat16'} needs torch: "
                             "pip install 'attnkit[torch]'") from None
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device: cuda was asked for but torch sees no CUDA device")
    say = (lambda *a: None) if quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    gap_s = (0.3 if device == "cpu" else 0.0) if gap_s is None else gap_s
    passes = ("fwd", "fwd+bwd") if backward else ("fwd",)
    result = {"setup": dict(B=B, H=H, L=L, S=S, D=D, dtype=dtype, device=device, causal=causal,
                            backend=backend, repeats=repeats),
              "checks": {}, "times": {}, "flops": {}}
    for p in passes:
        provs, makers = _providers(dtype, device, causal, p == "fwd+bwd", backend, peers)
        checks = _check(provs, makers, dtype, causal, p == "fwd+bwd", H, D, L, S)
        for name, c in checks.items():
            prev = result["checks"].get(name, {"ok": True, "worst": 0.0})
            result["checks"][name] = {"ok": prev["ok"] and c["ok"], "worst": max(prev["worst"], c["worst"])}
        if not checks["attnkit"]["ok"]:
            say(f"attnkit failed its check ({checks['attnkit']['worst']:.2f}× the error budget): not timed")
            return result
        dout = np.random.default_rng(3).standard_normal((B, H, L, D))
        arrays = list(make_qkv((B, H, L, D), (B, H, S, D), seed=0)) + [dout]
        inputs = {name: makers[name](arrays) for name in provs}
        del arrays
        runs = {name: (lambda f=provs[name], x=inputs[name]: f(x)) for name in provs}
        say(f"timing {p}: {', '.join(runs)}, {repeats} round{'s' if repeats > 1 else ''}")
        times = interleaved(runs, repeats, gap_s, progress=lambda i, n: say(f"  round {i}/{n}"))
        result["times"][p] = {name: min(t) for name, t in times.items()}
        f = flops(B, H, L, S, D, causal=causal)
        result["flops"][p] = f + (flops(B, H, L, S, D, causal=causal, backward=True) if p == "fwd+bwd" else 0.0)
    return result


def report(result) -> str:
    """The result of :func:`run` as a short text table."""
    s = result["setup"]
    lines = [f"attnkit bench: B={s['B']} H={s['H']} L={s['L']} S={s['S']} D={s['D']} {s['dtype']} "
             f"{s['device']}{' causal' if s['causal'] else ''}, best of {s['repeats']}"]
    for name, c in result["checks"].items():
        lines.append(f"  check {name:8} {'ok' if c['ok'] else 'FAILED'} "
                     f"(worst error {c['worst']:.2f}× the budget)")
    unit, scale = ("TFLOP/s", 1e12) if s["device"] == "cuda" else ("GFLOP/s", 1e9)
    for p, times in result["times"].items():
        lines.append(f"  {p}:")
        ours = times.get("attnkit")
        for name, t in times.items():
            ratio = f"   attnkit ÷ {name}: {t / ours:.2f}×" if name != "attnkit" and ours else ""
            lines.append(f"    {name:8} {t * 1e3:9.2f} ms {result['flops'][p] / t / scale:8.1f} {unit}{ratio}")
    return "\n".join(lines)

"""The backend ladder: which rungs exist, what each supports, and the one choice.

A rung computes attention for a validated :class:`~attnkit.spec.Spec`; every rung
satisfies :class:`Rung`. Compute rungs: ``reference`` (the definition), ``flash``
(tiled, NumPy; torch CPU tensors reach it through the torch op), ``small`` (small
calls in one pass, NumPy), ``triton`` (GPU kernels for torch tensors). Torch tensors
always run inside the torch autograd op (``attnkit.torch.op``), which carries the
chosen compute rung by name (a forward with nothing to differentiate and nothing
tracing calls the rung directly).

:func:`select` is the only place a rung is chosen — for NumPy arrays and torch
tensors, CPU and CUDA alike — and ``api`` calls it once per call.

``out`` and ``weights`` have q's dtype, ``lse`` the accumulation dtype (float32, or
float64 for float64 inputs); all in the Spec's shapes (2-D squeezing is api's job).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from math import prod
from typing import Any, NamedTuple, Protocol

from .spec import Spec


class Grads(NamedTuple):
    """What a backward pass returns: gradients in the shapes the user passed; dbias
    and dsinks are None without bias / sinks."""

    dq: Any
    dk: Any
    dv: Any
    dbias: Any = None
    dsinks: Any = None


class Rung(Protocol):
    """The interface of every rung (modules and the torch op's bound rungs)."""

    name: str

    def not_supported_reasons(self, spec: Spec) -> list[str]:
        """Why this rung cannot run spec; empty when it can."""
        ...

    def rung_forward(self, spec: Spec, need_weights: bool = False) -> tuple[Any, Any, Any]:
        """(out, lse, weights | None)."""
        ...

    def rung_backward(self, spec: Spec, dout: Any, out: Any, lse: Any, dlse: Any = None,
                      need_dbias: bool = True) -> Grads:
        """Gradients from the saved out and lse (``dlse``: a gradient for lse, or None;
        ``need_dbias=False`` lets a rung skip dbias)."""
        ...

    def rung_weights(self, spec: Spec, lse: Any = None, rows: Any = None) -> Any:
        """Exact weights for query rows ``rows`` (all if None), from lse when given."""
        ...


class CacheRung(Rung, Protocol):
    """A rung that also decodes against a KV cache (attention_kvcache)."""

    def rung_kvcache(self, kv: Any) -> tuple[Any, Any]:
        """(out, lse) of the call's queries against the (appended) cache."""
        ...


# name -> (module, what it is); fastest first within each array library
RUNGS = {
    "flash": ("attnkit.flash", "tiled online softmax on the CPU (NumPy), linear memory, threaded"),
    "small": ("attnkit.small", "small calls in one vectorised pass over every head (NumPy, CPU)"),
    "reference": ("attnkit.reference", "the definition, materialises L×S; the oracle"),
    "triton": ("attnkit.torch.triton", "GPU kernels (CUDA; CPU tensors under TRITON_INTERPRET=1)"),
}
NUMPY_RUNGS = ("flash", "small", "reference")
BRIDGE = ("attnkit.torch.op", "torch tensors: one autograd op around the chosen compute rung")
AUTO = {"numpy": ("flash", "reference"), "torch_cpu": ("flash", "reference"), "torch_cuda": ("triton",)}
AUTO_SMALL = ("small", "flash", "reference")   # NumPy and torch CPU calls that are small (below)
# "auto" runs the small rung (one vectorised pass over every head, on the calling
# thread) when all score matrices together hold at most
# SMALL_TOTAL elements and the keys and values at most SMALL_KV: there the flash rung's
# per-call planning and thread hand-offs (0.7–0.9 ms on 2 cores) cost more than the
# math. Measured crossovers (float32, 2 cores): about 1M scores for prefill-like
# calls, about 2M key and value elements (8 MB) for decoding-like ones, which stream
# the cache and gain from the flash rung's threads beyond that.
SMALL_TOTAL = 1 << 20
SMALL_KV = 1 << 21
# A paged cache (attention_kvcache with a block table) takes the same bound: the small
# rung gathers its pages in the compiled call (the kept step's, a signature's first
# call's too) into a scratch kept between calls. Measured there (Zen 5 host, pages of
# 16, steady calls at ~2M key and value elements, B = 1–8): 0.28–0.43 ms against the
# flash rung's 0.36–0.96, which reads the pages in place. (It had its own bound, 2¹⁸,
# while the gathered copy was a new array at every call: paging it in cost a call at
# 0.5M elements 0.77 ms against 0.09.)


def _per_key(spec: Spec) -> tuple[int, int]:
    """(scores, key and value elements) per key of a call of spec's sizes."""
    n = prod(spec.batch)
    return n * spec.H * spec.L, n * spec.Hkv * (spec.D + spec.Dv)


def _fits(per_key: tuple[int, int], S: int) -> bool:
    return per_key[0] * S <= SMALL_TOTAL and per_key[1] * S <= SMALL_KV


def _small(spec: Spec) -> bool:
    return _fits(_per_key(spec), spec.S)


def same_choice(spec: Spec, backend: str = "auto") -> Callable[[int], bool] | None:
    """For calls of spec's other sizes and options under "auto" (or "torch"): ``test(S)``,
    whether one with S keys gets :func:`select`'s candidates for spec (the size rule is
    the only part of the choice that reads the key length; the test reads AUTO,
    AUTO_SMALL, SMALL_TOTAL and SMALL_KV when it runs); None for a named rung, chosen
    whatever the key length."""
    order = _candidates(spec, backend)
    if backend not in ("auto", "torch") or not order:
        return None
    kind, per_key = _kind(spec), _per_key(spec)
    return lambda S: _auto_order(kind, _fits(per_key, S)) == order


def settings() -> tuple[Any, ...]:
    """What :func:`select` reads besides the call (AUTO, AUTO_SMALL, SMALL_TOTAL,
    SMALL_KV: replace them to change them, as a kept call compares these objects)."""
    return AUTO, AUTO_SMALL, SMALL_TOTAL, SMALL_KV


def key_range(ok: Callable[[int], bool], S: int, top: int = 1 << 40) -> tuple[int, int]:
    """(lo, hi): the key lengths from lo to hi, around S (ok(S) true), for which
    ``ok`` holds, by bisection with ``ok`` itself (the size rules are thresholds: ok
    changes at most once on each side of S)."""
    def edge(good: int, bad: int) -> int:
        while abs(bad - good) > 1:
            mid = (good + bad) // 2
            good, bad = (mid, bad) if ok(mid) else (good, mid)
        return good
    return 1 if ok(1) else edge(S, 1), top if ok(top) else edge(S, top)


def same_keys(spec: Spec, backend: str = "auto") -> tuple[int, int]:
    """The key lengths (lo, hi) for which a call of spec's other sizes and options gets
    :func:`select`'s candidates for spec under the current :func:`settings`."""
    test = same_choice(spec, backend)
    return (1, 1 << 40) if test is None else key_range(test, spec.S)


def _import(path: str) -> Any:
    """import_module(path), by import statements for attnkit's own modules: torch.compile
    runs an import statement while it traces (the first call of a process may be a
    compiled one) but cannot trace importlib."""
    if path == "attnkit.torch.op":
        from .torch import op
        return op
    if path == "attnkit.torch.triton":
        from .torch import triton
        return triton
    if path == "attnkit.flash":
        from . import flash
        return flash
    if path == "attnkit.reference":
        from . import reference
        return reference
    if path == "attnkit.small":
        from . import small
        return small
    return importlib.import_module(path)


def load(path: str) -> tuple[Any, str | None]:
    """The module at ``path``, or (None, reason) when it cannot be imported here. By
    an import statement (:func:`_import`), never from sys.modules: sys.modules holds a
    module another thread is still importing, half made, while an import statement
    waits for it (four threads' first calls at once failed on the half-made module)."""
    try:
        return _import(path), None
    except ImportError as e:
        return None, f"not available: {e}"


def reasons(name: str, spec: Spec, need: str | None = None) -> list[str]:
    mod, why = load(RUNGS[name][0])
    if mod is None:
        return [why or "not available"]
    r = list(mod.not_supported_reasons(spec))
    if need == "kvcache" and not hasattr(mod, "rung_kvcache"):
        r.append("has no KV-cache decoding")
    return r


def _candidates(spec: Spec, backend: str) -> tuple[str, ...]:
    if backend == "torch":
        if not spec.torch:
            return ()
        backend = "auto"
    if backend != "auto":
        return (backend,)
    return _auto_order(_kind(spec), _small(spec))


def _kind(spec: Spec) -> str:
    return ("torch_cuda" if spec.q.device.type == "cuda" else "torch_cpu") if spec.torch else "numpy"


def _auto_order(kind: str, small: bool) -> tuple[str, ...]:
    order = AUTO[kind]
    return AUTO_SMALL if order == AUTO["numpy"] and small else order


def select(spec: Spec, backend: str = "auto", need: str | None = None) -> Rung:
    """The rung to run spec on (for torch tensors: the torch op bound to the chosen
    compute rung), or ValueError listing every rung's reasons. ``need="kvcache"``:
    only rungs with KV-cache decoding (``rung_kvcache``). A NumPy rung chosen from
    some candidates is kept for later calls of the same kept check with the same
    candidates (``Spec.chosen``: NumPy rungs' reasons depend on nothing the check's
    signature leaves out; Triton's read the environment)."""
    order = _candidates(spec, backend)
    memo = spec.chosen
    if memo is not None:
        kept = memo.get((order, need))
        if kept is not None:
            return kept
    why: dict[str, list[str]] = {}
    for name in order:
        r = reasons(name, spec, need)
        if not r:
            mod, _ = load(RUNGS[name][0])
            rung = mod
            if spec.torch:
                op, _ = load(BRIDGE[0])
                rung = op.bound(mod)
            if memo is not None and name in NUMPY_RUNGS:
                memo[(order, need)] = rung
            return rung
        why[name] = r
    for name in RUNGS:
        if name not in why:
            why[name] = reasons(name, spec, need) or ["supports this call (not chosen)"]
    why["torch"] = (["the autograd op every torch-tensor call runs in, around the rungs above"] if spec.torch
                    else ["takes torch tensors (NumPy arrays use the reference, small or flash rung)"])
    lines = "\n".join(f"  {n}: {'; '.join(r)}" for n, r in why.items())
    raise ValueError(f"backend={backend!r}: no backend can run this call:\n{lines}")


def info() -> list[tuple[str, str, str]]:
    """(name, status, description) per rung and the torch bridge; status is
    'available' or the reason."""
    rows = []
    for name, (path, desc) in list(RUNGS.items()) + [("torch", BRIDGE)]:
        mod, why = load(path)
        if mod is not None and hasattr(mod, "unavailable"):
            why = mod.unavailable()  # e.g. "no CUDA device" (None when usable)
        rows.append((name, why or "available", desc))
    return rows

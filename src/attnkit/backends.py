"""The backend ladder: which rungs exist, what each supports, and the choice for "auto".

Every rung is a module with the same four functions (all take a validated Spec)::

    not_supported_reasons(spec) -> list[str]      empty = this rung can run it
    rung_forward(spec, need_weights) -> (out, lse, weights | None)
    rung_backward(spec, dout, out, lse) -> (dq, dk, dv, dbias | None)
        (the NumPy rungs also take ``dlse``, a gradient for lse, for the torch op)
    rung_weights(spec, lse, rows) -> weights

``out`` and ``weights`` have q's dtype, ``lse`` the accumulation dtype (float32, or
float64 for float64 inputs); all in the Spec's shapes (2-D squeezing is api's job).
"""

from __future__ import annotations

import importlib
import sys

from .spec import Spec

# name -> (module, what it is); listed fastest first within each array library
RUNGS = {
    "flash": ("attnkit.flash", "NumPy tiled online softmax, linear memory, threaded"),
    "reference": ("attnkit.reference", "NumPy definition, materialises L×S, the oracle"),
    "torch": ("attnkit.torch.op", "torch autograd op: CPU via the NumPy rungs, CUDA via Triton"),
    "triton": ("attnkit.torch.triton_rung", "the same torch op forced onto the Triton kernels"),
}
AUTO_ORDER = {"numpy": ("flash", "reference"), "torch": ("torch",)}
# "auto" on NumPy arrays runs the reference (vectorised over every head at once) when
# each head's L×S score matrix is this small and all of them together fit in this many
# elements: there the flash rung's per-tile bookkeeping costs more than the math
# (measured: 256 heads of L=S=8 took 58 ms on flash, 0.8 ms on the reference).
SMALL_HEAD = 128 * 128
SMALL_TOTAL = 1 << 22


def _small(spec: Spec) -> bool:
    n = 1
    for d in spec.batch:
        n *= d
    return spec.L * spec.S <= SMALL_HEAD and n * spec.H * spec.L * spec.S <= SMALL_TOTAL


def load(name):
    """The rung's module, or (None, reason) when it cannot be imported here. An
    already imported rung comes from sys.modules: torch.compile traces this function
    and cannot trace importlib."""
    path = RUNGS[name][0]
    if path in sys.modules:
        return sys.modules[path], None
    try:
        return importlib.import_module(path), None
    except ImportError as e:
        return None, f"not available: {e}"


def reasons(name, spec: Spec) -> list[str]:
    mod, why = load(name)
    if mod is None:
        return [why]
    return mod.not_supported_reasons(spec)


def select(spec: Spec, backend: str = "auto"):
    """The rung module to run spec on, or ValueError listing every rung's reasons."""
    if backend != "auto":
        names = (backend,)
    elif spec.torch:
        names = AUTO_ORDER["torch"]
    else:
        names = AUTO_ORDER["numpy"][::-1] if _small(spec) else AUTO_ORDER["numpy"]
    why = {}
    for name in names:
        r = reasons(name, spec)
        if not r:
            mod, _ = load(name)
            return mod
        why[name] = r
    for name in RUNGS:
        if name not in why:
            why[name] = reasons(name, spec) or ["supports this call (not chosen)"]
    lines = "\n".join(f"  {n}: {'; '.join(r)}" for n, r in why.items())
    raise ValueError(f"backend={backend!r}: no backend can run this call:\n{lines}")


def info(spec: Spec | None = None) -> list[tuple[str, str, str]]:
    """(name, status, description) per rung; status is 'available' or the reason."""
    rows = []
    for name, (_, desc) in RUNGS.items():
        mod, why = load(name)
        if mod is not None and hasattr(mod, "unavailable"):
            why = mod.unavailable()  # e.g. "no CUDA device" (None when usable)
        rows.append((name, why or "available", desc))
    return rows

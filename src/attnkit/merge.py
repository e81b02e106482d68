"""Combining attention over disjoint key blocks by their lse (split-KV, ring attention).

    out = Σ_b exp(lse_b − lse) · out_b,   lse = log Σ_b exp(lse_b)

Rows masked in every block (all lse_b = −inf) give out 0 and lse −inf; a NaN in any
block's lse or out makes the row NaN. Works on NumPy arrays and torch tensors
(differentiable), in the blocks' lse dtype.

>>> import numpy as np
>>> o, l = merge([np.ones((1, 2)), np.zeros((1, 2))], [np.zeros(1), np.zeros(1)])
>>> o, l.round(4)
(array([[0.5, 0.5]]), array([0.6931]))
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .nonfinite import quiet


def _xp(x: Any) -> Any:
    """The array namespace of x: numpy, or torch for tensors."""
    if isinstance(x, np.ndarray):
        return np
    import torch
    return torch


def merge(outs: list[Any], lses: list[Any]) -> tuple[Any, Any]:
    """Validated blocks (see :func:`attnkit.merge`) → (out, lse); a NaN or +inf lse
    makes its rows NaN, without a warning."""
    with quiet():
        return _merge(outs, lses)


def _merge(outs: list[Any], lses: list[Any]) -> tuple[Any, Any]:
    xp = _xp(lses[0])
    lse_b = xp.stack(list(lses))                              # (n, ..., H, L)
    m = lse_b.max(0) if xp is np else lse_b.max(0).values      # running max over blocks (NaN propagates)
    m = xp.where(m == -float("inf"), xp.zeros_like(m), m)     # all −inf: shift by 0, no NaN
    w = xp.exp(lse_b - m)                                     # (n, ..., H, L), 0 for empty blocks
    total = w.sum(0)
    empty = total == 0
    safe = xp.where(empty, xp.ones_like(total), total)
    lse = xp.where(empty, xp.full_like(m, -float("inf")), xp.log(safe) + m)
    scale = (w / safe)[..., None]                             # each block's share per row
    if xp is np:
        out = sum(scale[i] * outs[i].astype(scale.dtype) for i in range(len(outs)))
        return out.astype(outs[0].dtype), lse
    out = sum(scale[i] * outs[i].to(scale.dtype) for i in range(len(outs)))
    return out.to(outs[0].dtype), lse

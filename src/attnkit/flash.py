"""NumPy flash rung: tiled online softmax (m_i, l_i, acc), linear memory, threaded.

(Work in progress: merge is here; the tiled forward/backward follow.)
"""

from __future__ import annotations

import numpy as np


def _xp(x):
    """The array namespace of x: numpy, or torch for tensors (merge serves both)."""
    if isinstance(x, np.ndarray):
        return np
    import torch
    return torch


def merge(outs, lses):
    """Combine attention over disjoint key blocks: out = Σ_b exp(lse_b − lse) out_b,
    lse = log Σ_b exp(lse_b). Rows masked in every block (all lse_b = −inf) give
    out 0, lse −inf. Works on NumPy arrays and torch tensors (differentiable)."""
    xp = _xp(lses[0])
    lse_b = xp.stack(list(lses))                              # (n, ..., H, L)
    m = lse_b.max(0) if xp is np else lse_b.max(0).values      # running max over blocks
    m = xp.where(xp.isfinite(m), m, xp.zeros_like(m))         # all −inf: shift by 0, no NaN
    w = xp.exp(lse_b - m)                                     # (n, ..., H, L), 0 for empty blocks
    total = w.sum(0)
    safe = xp.where(total > 0, total, xp.ones_like(total))
    lse = xp.where(total > 0, xp.log(safe) + m, xp.full_like(m, -float("inf")))
    scale = (w / safe)[..., None]                             # each block's share per row
    out = sum(scale[i] * outs[i].astype(scale.dtype) if xp is np else scale[i] * outs[i].to(scale.dtype)
              for i in range(len(outs)))
    return out.astype(outs[0].dtype) if xp is np else out.to(outs[0].dtype), lse


def not_supported_reasons(spec):
    return ["the tiled rung is not built yet"]

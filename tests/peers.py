"""Independent peers for tests: PyTorch's SDPA with masks built from tril/triu, never
from attnkit's own masking code."""

from __future__ import annotations

import numpy as np


def torch_index_keep(L, S, causal, window, align):
    """Boolean (L, S) keep mask from torch.tril/triu diagonals, or None."""
    import torch
    off = S - L if align == "bottom_right" else 0
    keep = torch.ones(L, S, dtype=torch.bool)
    if causal:
        keep &= torch.ones(L, S, dtype=torch.bool).tril(diagonal=off)
    if window is not None:
        left, right = window
        if left is not None:
            keep &= torch.ones(L, S, dtype=torch.bool).triu(diagonal=off - left)
        if right is not None:
            keep &= torch.ones(L, S, dtype=torch.bool).tril(diagonal=off + right)
    return keep


def torch_sdpa(q, k, v, *, scale=None, causal=False, window=None, align="bottom_right",
               keep=None, drop=None, bias=None, requires_grad=False):
    """F.scaled_dot_product_attention on torch copies of NumPy inputs (float64 unless
    given otherwise). 2-D inputs are used as they are. Returns (out, (tq, tk, tv, tb))."""
    import torch
    import torch.nn.functional as F
    tq, tk, tv = (torch.tensor(np.asarray(x), requires_grad=requires_grad) for x in (q, k, v))
    L, S = tq.shape[-2], tk.shape[-2]
    if min(tq.ndim, tk.ndim, tv.ndim) >= 3:   # SDPA wants equal batch dims: expand (a view)
        batch = torch.broadcast_shapes(tq.shape[:-3], tk.shape[:-3], tv.shape[:-3])
        q_, k_, v_ = (t.expand(batch + t.shape[-3:]) for t in (tq, tk, tv))
    else:
        q_, k_, v_ = tq, tk, tv
    mask = None
    ik = torch_index_keep(L, S, causal, window, align) if (causal or window) else None
    boolkeep = ik
    for m, pol in ((keep, True), (drop, False)):
        if m is not None:
            t = torch.tensor(np.asarray(m))
            t = t if pol else ~t
            boolkeep = t if boolkeep is None else boolkeep & t
    tb = None
    if bias is not None:
        tb = torch.tensor(np.asarray(bias), dtype=tq.dtype, requires_grad=requires_grad)
        mask = tb
    if boolkeep is not None:
        neg = torch.zeros(boolkeep.shape, dtype=tq.dtype).masked_fill(~boolkeep, float("-inf"))
        mask = neg if mask is None else mask + neg
    gqa = q_.ndim >= 3 and k_.ndim >= 3 and q_.shape[-3] != k_.shape[-3]
    out = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out, (tq, tk, tv, tb)

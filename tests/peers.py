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


def fa_kvcache(q, k, v, starts, ends, *, causal=False, window=None, alibi_slopes=None):
    """FlashAttention's ``flash_attn_with_kvcache`` as its own tests define it, in
    float64 torch ops: q (B, H, L, D) against k, v (B, Hkv, S, D[v]) where sequence b's
    keys are slots [starts[b], ends[b]) (``cache_leftpad`` to ``cache_seqlens`` plus the
    appended keys). Positions count from the sequence's first key: key slot j is
    position j − starts[b], and query row i's diagonal is i + n_b − L (n_b = ends[b] −
    starts[b]). Causal keeps positions ≤ the diagonal; window (left, right) keeps the
    diagonal − left … the diagonal + right (either None: unbounded); ALiBi adds
    −slope · |diagonal − position| (slopes (H,) or (B, H)). A row that sees no key is 0."""
    import torch
    q, k, v = (torch.as_tensor(np.asarray(x), dtype=torch.float64) for x in (q, k, v))
    B, H, L, _ = q.shape
    g = H // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    starts, ends = (torch.as_tensor(np.asarray(x)).long().reshape(B, 1, 1, 1) for x in (starts, ends))
    slot = torch.arange(k.shape[2]).reshape(1, 1, 1, -1)
    pos = slot - starts
    diag = torch.arange(L).reshape(1, 1, -1, 1) + (ends - starts) - L
    keep = (slot >= starts) & (slot < ends)
    if causal:
        keep = keep & (pos <= diag)
    if window is not None:
        left, right = window
        if left is not None:
            keep = keep & (pos >= diag - left)
        if right is not None:
            keep = keep & (pos <= diag + right)
    if alibi_slopes is not None:
        slopes = torch.as_tensor(np.asarray(alibi_slopes), dtype=torch.float64)
        slopes = slopes.reshape(-1, H, 1, 1) if slopes.ndim == 2 else slopes.reshape(1, H, 1, 1)
        scores = scores - slopes * (diag - pos).abs()
    scores = scores.masked_fill(~keep, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)   # (a row without keys: 0)
    return (weights @ v).numpy()

"""The one FLOP formula every benchmark prints."""

from __future__ import annotations


def flops(B: int, H: int, L: int, S: int, D: int, Dv: int | None = None, *, causal: bool = False,
          backward: bool = False) -> float:
    """4·B·H·L·S·D forward (2·L·S·D for q kᵀ plus 2·L·S·Dv for weights · v, so D is
    (D + Dv) / 2 when they differ), ×0.5 causal, ×2.5 backward.

    >>> flops(1, 1, 2, 2, 4), flops(1, 1, 2, 2, 4, causal=True, backward=True)
    (64.0, 80.0)
    """
    d = D if Dv is None else (D + Dv) / 2
    f = 4.0 * B * H * L * S * d
    if causal:
        f *= 0.5
    if backward:
        f *= 2.5
    return f

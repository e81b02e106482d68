"""Helpers shipped for testing attnkit and code built on it: input makers and error
metrics by the DESIGN.md §6 rule."""

from __future__ import annotations

from typing import Any

import numpy as np


def make_qkv(shape_q: tuple[int, ...], shape_k: tuple[int, ...], Dv: int | None = None, *,
             dtype: str = "float64", seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random q, k, v from one seed.

    Parameters
    ----------
    shape_q, shape_k : tuple of int
        Shapes of q and k (v has k's shape with last dim Dv).
    Dv : int, optional
        v's last dim (default: k's).
    dtype : str
        NumPy dtype of the three arrays.
    seed : int
        Seed of NumPy's generator.
    """
    rng = np.random.default_rng(seed)
    shape_v = tuple(shape_k[:-1]) + ((shape_k[-1] if Dv is None else Dv),)
    q, k, v = (rng.standard_normal(s).astype(dtype) for s in (shape_q, shape_k, shape_v))
    return q, k, v


def max_error(a: Any, b: Any) -> float:
    """max |a − b| over finite and infinite entries alike: equal infinities count 0,
    anything else non-finite counts inf. Two-sided by construction.

    Parameters
    ----------
    a, b : arrays of the same shape
        NumPy arrays (or anything ``np.asarray`` reads, CPU tensors included).
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"max_error: shapes differ, {a.shape} vs {b.shape}")
    same = (a == b)                     # covers equal infinities
    with np.errstate(invalid="ignore"):
        d = np.where(same, 0.0, np.abs(a - b))
    d = np.where(np.isnan(d), np.inf, d)
    return float(d.max()) if d.size else 0.0


def error_budget(oracle: Any, same_precision_reference: Any) -> float:
    """The error a backend may have against the float64 oracle (the rule of attnkit's
    design, §6): 2× the error of the reference run in the same precision, plus 1e-5.

    Parameters
    ----------
    oracle : array
        The reference in float64.
    same_precision_reference : array
        The reference run in the backend's precision.
    """
    return 2.0 * max_error(oracle, same_precision_reference) + 1e-5

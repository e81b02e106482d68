"""The BLAS that NumPy itself calls, for compiled code: ``cblas_sgemm`` and
``cblas_somatcopy`` of NumPy's own OpenBLAS as ctypes functions, which the compiled
tile loop (:func:`.numba_loop.tile_tasks`) calls without the GIL.

Only NumPy's 64-bit-integer interface is taken (``scipy_cblas_sgemm64_`` in NumPy 2's
wheels, ``cblas_sgemm64_`` in NumPy 1's): its integer width is in its name. Anything
else (a NumPy built against MKL, Accelerate or a system BLAS) gives None, and the
tiles stay on ``np.matmul``. Each function is checked on one small input before use.

OpenBLAS's AVX-512 kernels (SkylakeX, Cooperlake, Sapphire Rapids: what it picks on
AVX-512 Intel and AMD Zen 4/5 machines) multiply two untransposed operands of at most
10⁶ multiply-adds (m·n·k) without packing them: 106–114 GFLOP/s on one core here
against 72–98 for the same products packed, or with the keys transposed (q kᵀ, which
OpenBLAS always packs). :func:`small_product_limit` says whether this OpenBLAS does.

>>> f = sgemm()
>>> f is None or callable(f)
True
"""

from __future__ import annotations

import ctypes
import importlib
from typing import Any

import numpy as np

ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112
_I64, _PTR, _F = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
_found: dict[str, Any] = {}                              # name → fn or None, once looked up
SMALL_KERNEL_CORES = frozenset({"skylakex", "cooperlake", "sapphirerapids"})
SMALL_PRODUCT = 1_000_000                                # their limit on m·n·k (OpenBLAS's permit)


def _numpy_library() -> ctypes.CDLL | None:
    """NumPy's core extension, whose symbol lookup also searches the BLAS it links."""
    for name in ("numpy._core._multiarray_umath", "numpy.core._multiarray_umath"):
        try:
            return ctypes.CDLL(importlib.import_module(name).__file__)
        except (ImportError, OSError, AttributeError, TypeError):
            continue
    return None


def _check_sgemm(fn: Any) -> bool:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.arange(12, dtype=np.float32).reshape(4, 3)
    c = np.full((2, 4), np.nan, dtype=np.float32)
    fn(ROW_MAJOR, NO_TRANS, TRANS, 2, 4, 3, 1.0, a.ctypes.data, 3, b.ctypes.data, 3, 0.0, c.ctypes.data, 4)
    return bool(np.array_equal(c, a @ b.T))


def _check_somatcopy(fn: Any) -> bool:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.full((3, 4), np.nan, dtype=np.float32)        # a leading dim wider than the rows
    fn(ROW_MAJOR, TRANS, 2, 3, 1.0, a.ctypes.data, 3, b.ctypes.data, 4)
    return bool(np.array_equal(b[:, :2], a.T) and np.isnan(b[:, 2:]).all())


_KINDS: dict[str, tuple[tuple[str, ...], list[Any], Any, Any]] = {
    "sgemm": (("scipy_cblas_sgemm64_", "cblas_sgemm64_"),
              [ctypes.c_int, ctypes.c_int, ctypes.c_int, _I64, _I64, _I64, _F, _PTR, _I64, _PTR, _I64, _F, _PTR, _I64],
              None, _check_sgemm),
    "somatcopy": (("scipy_cblas_somatcopy64_", "cblas_somatcopy64_"),
                  [ctypes.c_int, ctypes.c_int, _I64, _I64, _F, _PTR, _I64, _PTR, _I64], None, _check_somatcopy),
    "corename": (("scipy_openblas_get_corename64_", "openblas_get_corename64_"), [], ctypes.c_char_p, None),
}


def prototype(kind: str) -> Any:
    """The ctypes function type of ``kind`` ("sgemm", "somatcopy") as looked up here."""
    _, argtypes, restype, _ = _KINDS[kind]
    return ctypes.CFUNCTYPE(restype, *argtypes)


def _lookup(kind: str) -> Any:
    lib = _numpy_library()
    if lib is None:
        return None
    names, argtypes, restype, check = _KINDS[kind]
    for name in names:
        fn = getattr(lib, name, None)
        if fn is None:
            continue
        fn.argtypes, fn.restype = argtypes, restype
        if check is None or check(fn):
            return fn
    return None


def _get(kind: str) -> Any:
    if kind not in _found:
        _found[kind] = _lookup(kind)
    return _found[kind]


def sgemm() -> Any:
    """NumPy's ``cblas_sgemm`` (64-bit integers) as a ctypes function, or None; looked
    up once per process."""
    return _get("sgemm")


def somatcopy() -> Any:
    """NumPy's ``cblas_somatcopy`` (OpenBLAS's scaled copy with transpose, 64-bit
    integers) as a ctypes function, or None."""
    return _get("somatcopy")


def small_product_limit() -> int:
    """The largest m·n·k that NumPy's OpenBLAS multiplies unpacked (untransposed
    float32 operands) — 10⁶ on its AVX-512 kernels — or 0 where it has no such kernel
    (other cores, other BLAS libraries): the compiled loop then keeps whole tiles."""
    if "limit" not in _found:
        fn = _get("corename")
        name = fn().decode(errors="replace").lower() if fn is not None else ""
        _found["limit"] = SMALL_PRODUCT if name in SMALL_KERNEL_CORES else 0
    return int(_found["limit"])

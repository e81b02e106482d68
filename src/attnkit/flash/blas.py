"""The BLAS that NumPy itself calls, for compiled code: ``cblas_sgemm`` of NumPy's own
OpenBLAS as a ctypes function, which the compiled tile loop
(:func:`.numba_kernels.tile_loop`) calls without the GIL — the same library and the
same calls as ``np.matmul`` on the same tiles, so the same bits.

Only NumPy's 64-bit-integer interface is taken (``scipy_cblas_sgemm64_`` in NumPy 2's
wheels, ``cblas_sgemm64_`` in NumPy 1's): its integer width is in its name. Anything
else (a NumPy built against MKL, Accelerate or a system BLAS) gives None, and the
tiles stay on ``np.matmul``. The function is checked on one small product before use.

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
_NAMES = ("scipy_cblas_sgemm64_", "cblas_sgemm64_")
_found: list[Any] = []                                   # [] not looked up yet; [fn or None]


def _numpy_library() -> ctypes.CDLL | None:
    """NumPy's core extension, whose symbol lookup also searches the BLAS it links."""
    for name in ("numpy._core._multiarray_umath", "numpy.core._multiarray_umath"):
        try:
            return ctypes.CDLL(importlib.import_module(name).__file__)
        except (ImportError, OSError, AttributeError, TypeError):
            continue
    return None


def _lookup() -> Any:
    lib = _numpy_library()
    if lib is None:
        return None
    for name in _NAMES:
        fn = getattr(lib, name, None)
        if fn is None:
            continue
        i64, ptr, f = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
        fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, i64, i64, i64, f, ptr, i64, ptr, i64, f,
                       ptr, i64]
        fn.restype = None
        a = np.arange(6, dtype=np.float32).reshape(2, 3)
        b = np.arange(12, dtype=np.float32).reshape(4, 3)
        c = np.full((2, 4), np.nan, dtype=np.float32)
        fn(ROW_MAJOR, NO_TRANS, TRANS, 2, 4, 3, 1.0, a.ctypes.data, 3, b.ctypes.data, 3, 0.0, c.ctypes.data, 4)
        if np.array_equal(c, a @ b.T):
            return fn
    return None


def sgemm() -> Any:
    """NumPy's ``cblas_sgemm`` (64-bit integers) as a ctypes function, or None; looked
    up once per process."""
    if not _found:
        _found.append(_lookup())
    return _found[0]

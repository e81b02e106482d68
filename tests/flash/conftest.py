import pytest

from attnkit.flash import kernels as _kernels

_compiled = _kernels.compiled_kernels()
KERNELS = ["numpy"] + (["numba"] if _compiled is not None else []) + (
    ["numba-python-loop"] if _compiled is not None and _compiled.tile_tasks is not None else [])


@pytest.fixture(params=KERNELS)
def kernels(request, monkeypatch):
    """Runs a float32 test on the NumPy tiles, on the numba kernels (the forward's
    and the backward's tasks compiled, where NumPy's sgemm is found) and on the numba
    kernels with both loops in Python."""
    monkeypatch.setattr(_kernels, "USE_COMPILED", request.param != "numpy")
    monkeypatch.setattr(_kernels, "USE_LOOP", request.param == "numba")
    return request.param

import pytest

from attnkit.flash import kernels as _kernels

KERNELS = ["numpy"] + (["numba"] if _kernels.compiled_kernels() is not None else [])


@pytest.fixture(params=KERNELS)
def kernels(request, monkeypatch):
    """Runs a float32 test once on the NumPy tiles and once on the numba kernels."""
    monkeypatch.setattr(_kernels, "USE_COMPILED", request.param == "numba")
    return request.param

"""Every torch-op test runs three times: with "auto" choosing the flash rung (the
default for real sizes), the small rung (what "auto" picks for tiny calls) and the
reference rung (tiny calls the small rung does not take: dropout, packed) under the
op — the test shapes are tiny, so without this they would only reach the small rung.
Tests of the choice itself are marked ``real_auto`` and run once, unpatched. (The
Triton files choose their rung explicitly and run once.)"""

import pytest

from attnkit import backends


def pytest_configure(config):
    config.addinivalue_line("markers", "real_auto: run once with backend='auto' choosing as it does for users")


TWICE = ("test_op.py", "test_mha.py", "test_terms.py")


def pytest_generate_tests(metafunc):
    if (metafunc.definition.path.name in TWICE and "auto_rung" in metafunc.fixturenames
            and metafunc.definition.get_closest_marker("real_auto") is None):
        metafunc.parametrize("auto_rung", ["flash", "small", "reference"], indirect=True,
                             ids=["under-flash", "under-small", "under-reference"])


@pytest.fixture(autouse=True)
def auto_rung(request, monkeypatch):
    """backend="auto" under the op picks this rung for every call of the test."""
    rung = getattr(request, "param", None)
    if rung is not None:
        for name in ("SMALL_TOTAL", "SMALL_KV"):
            monkeypatch.setattr(backends, name, 0 if rung == "flash" else 1 << 62)
        if rung == "reference":
            monkeypatch.setattr(backends, "AUTO_SMALL", ("reference",))
    return rung


@pytest.fixture
def fast_interpreter(monkeypatch):
    """Triton's interpreter without its int32 overflow checks: a debugging aid that adds
    ~40% to the Triton tests' time (their shapes are far from int32 limits). Compiled
    kernels (the GPU tests) do not use the interpreter, so it is harmless there."""
    import dataclasses

    from triton.runtime import interpreter as ti
    builder = getattr(ti, "interpreter_builder", None)
    if builder is not None and hasattr(getattr(builder, "options", None), "sanitize_overflow"):
        monkeypatch.setattr(builder, "options", dataclasses.replace(builder.options, sanitize_overflow=False))

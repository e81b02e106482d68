"""One choice, one check: every public call validates once and passes through
backends.select once — NumPy arrays, torch CPU tensors and the Triton rung (on CPU
tensors under TRITON_INTERPRET=1, the path CUDA tensors take) — and no rung under
the dispatcher validates or selects again."""

import numpy as np
import pytest

import attnkit
from attnkit import backends
from attnkit.spec import validate as spec_validate
from attnkit.testing import make_qkv


@pytest.fixture
def counts(monkeypatch):
    seen = {"select": 0, "validate": 0}
    real_select, real_validate = backends.select, spec_validate

    def select(*a, **kw):
        seen["select"] += 1
        return real_select(*a, **kw)

    def validate(*a, **kw):
        seen["validate"] += 1
        return real_validate(*a, **kw)

    import sys
    for name, mod in list(sys.modules.items()):          # every module that imported either
        if name.startswith("attnkit"):
            if getattr(mod, "validate", None) is real_validate:
                monkeypatch.setattr(mod, "validate", validate)
            if getattr(mod, "select", None) is real_select:
                monkeypatch.setattr(mod, "select", select)
    monkeypatch.setattr(backends, "select", select)
    return seen


def _calls(lib, backend="auto"):
    q, k, v = make_qkv((1, 2, 150, 16), (1, 1, 170, 16), seed=0)
    if lib == "torch":
        torch = pytest.importorskip("torch")
        q, k, v = (torch.tensor(x, dtype=torch.float32, requires_grad=True) for x in (q, k, v))
    return q, k, v, dict(causal=True, backend=backend)


@pytest.mark.parametrize("lib,backend", [("numpy", "auto"), ("numpy", "flash"), ("numpy", "reference"),
                                         ("torch", "auto"), ("torch", "flash"), ("torch", "triton")])
def test_each_call_selects_and_validates_once(lib, backend, counts, monkeypatch):
    if backend == "triton":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v, kw = _calls(lib, backend)
    out, lse = attnkit.attention(q, k, v, return_lse=True, **kw)
    assert counts == {"select": 1, "validate": 1}
    if lib == "torch":
        out.sum().backward()                             # autograd: the op's backward, no new choice
        assert counts == {"select": 1, "validate": 1}
    else:
        attnkit.attention_backward(np.ones_like(out), q, k, v, out, lse, **kw)
        assert counts == {"select": 2, "validate": 2}
    attnkit.attention_weights(q, k, rows=[0, 3], **kw)
    assert counts["select"] == counts["validate"] == (2 if lib == "torch" else 3)


def test_kvcache_selects_once(counts):
    q = np.ones((1, 2, 1, 4))
    attnkit.attention_kvcache(q, np.zeros((1, 1, 8, 4)), np.zeros((1, 1, 8, 4)), np.array([3]))
    assert counts["select"] == 1


def test_the_rung_interface_is_one_protocol():
    from attnkit import flash, reference, small
    for mod in (flash, small, reference):
        assert isinstance(mod.name, str)
        for fn in ("not_supported_reasons", "rung_forward", "rung_backward", "rung_weights"):
            assert callable(getattr(mod, fn))
    assert callable(flash.rung_kvcache) and callable(reference.rung_kvcache)
    torch = pytest.importorskip("torch")
    from attnkit.torch import op
    r = op.bound(flash)
    assert r is op.bound(flash) and r.name == "torch (flash)"
    assert torch


def test_info_lists_every_rung():
    names = [row[0] for row in backends.info()]
    assert names == ["flash", "small", "reference", "triton", "torch"]


FIRST_CALLS_IN_THREADS = r"""
import threading, numpy as np, attnkit
q = np.random.default_rng(0).standard_normal((1, 2, 8, 16))
got, errors = [], []
def call():
    try:
        got.append(attnkit.attention(q, q, q))
    except Exception as e:
        errors.append(repr(e))
threads = [threading.Thread(target=call) for _ in range(4)]
[t.start() for t in threads]
[t.join() for t in threads]
assert not errors, errors
assert len(got) == 4 and all(np.array_equal(g, attnkit.attention(q, q, q)) for g in got)
print("ok")
"""


def test_first_calls_from_several_threads_at_once():
    """Four threads' first calls in a fresh process import the rungs together: none may
    see a rung module another thread is still importing (half made)."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", FIRST_CALLS_IN_THREADS], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]

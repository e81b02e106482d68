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


def _zeros_spec(B, H, Hkv, L, S, D, Dv):
    q = np.zeros((B, H, L, D), np.float32)
    k, v = np.zeros((B, Hkv, S, D), np.float32), np.zeros((B, Hkv, S, Dv), np.float32)
    return spec_validate(q, k, v)


def test_auto_runs_the_small_rung_up_to_both_limits_exactly():
    """backend="auto" gives a NumPy call to the small rung when the score matrices of all batches
    and heads hold at most SMALL_TOTAL elements and the keys and values of all batches
    and kv heads at most SMALL_KV — both "at most", both counted over every dim — and to
    the flash rung one key past either limit (the small rung holds every score at once:
    a count that forgot a dim, or either limit alone, would give it a large call)."""
    from attnkit import flash, small
    S = backends.SMALL_TOTAL // (2 * 4 * 256)            # B=2, H=4, L=256: SMALL_TOTAL scores
    assert 2 * 4 * 256 * S == backends.SMALL_TOTAL and 2 * 2 * (S + 1) * 12 <= backends.SMALL_KV
    assert backends.select(_zeros_spec(2, 4, 2, 256, S, 8, 4)) is small
    assert backends.select(_zeros_spec(2, 4, 2, 256, S + 1, 8, 4)) is flash
    S = backends.SMALL_KV // (2 * (48 + 16))             # Hkv=2, D + Dv = 64: SMALL_KV keys and values
    assert 2 * 64 * S == backends.SMALL_KV and 4 * (S + 1) <= backends.SMALL_TOTAL
    assert backends.select(_zeros_spec(1, 4, 2, 1, S, 48, 16)) is small
    assert backends.select(_zeros_spec(1, 4, 2, 1, S + 1, 48, 16)) is flash


def test_a_paged_cache_goes_to_the_small_rung_up_to_the_same_limit(monkeypatch):
    """The small rung gathers a paged cache (in the compiled call; the flash rung reads
    its pages in place): "auto" gives it a paged cache up to SMALL_KV key and value
    elements of the block table's capacity, as a contiguous one, and the flash rung
    past it; both give the reference's attention."""
    from attnkit import flash, small
    S = backends.SMALL_KV // (2 * (48 + 16))             # Hkv=2, D + Dv = 64
    assert 2 * 64 * S == backends.SMALL_KV
    assert backends.select(_zeros_spec(1, 4, 2, 1, S, 48, 16), need="kvcache") is small
    assert backends.select(_zeros_spec(1, 4, 2, 1, S + 1, 48, 16), need="kvcache") is flash
    ran = []
    for mod in (flash, small):
        monkeypatch.setattr(mod, "rung_kvcache", lambda kv, mod=mod, f=mod.rung_kvcache: ran.append(mod) or f(kv))
    rng = np.random.default_rng(0)
    P = 16                                               # the size rule counts the table's capacity
    q = rng.standard_normal((1, 4, 1, 48), dtype=np.float32)
    kc = rng.standard_normal((S // P + 1, 2, P, 48), dtype=np.float32)
    vc = rng.standard_normal((S // P + 1, 2, P, 16), dtype=np.float32)
    for pages, rung in ((S // P, small), (S // P + 1, flash)):
        n = pages * P - 3
        table = rng.permutation(S // P + 1)[:pages][None]
        out = attnkit.attention_kvcache(q, kc, vc, np.array([n]), block_table=table)
        assert ran.pop() is rung and not ran
        k, v = (c[table[0]].transpose(1, 0, 2, 3).reshape(1, 2, -1, c.shape[-1])[:, :, :n] for c in (kc, vc))
        assert np.abs(out - attnkit.attention(q, k, v, backend="reference")).max() <= 1e-5


def test_own_rungs_load_by_import_statements(monkeypatch):
    """backends.load imports attnkit's own rungs (and the torch bridge) by import
    statements, never through importlib: torch.compile traces an import statement but
    not importlib, and the first call of a process may be a compiled one."""
    import importlib
    import sys
    paths = []
    for p in [p for p, _ in backends.RUNGS.values()] + [backends.BRIDGE[0]]:
        try:
            importlib.import_module(p)                   # imported once, before importlib is refused
        except ImportError:                              # torch not installed here
            continue
        paths.append(p)

    def refuse(name, *a, **kw):
        raise AssertionError(f"importlib.import_module({name!r})")

    monkeypatch.setattr(importlib, "import_module", refuse)
    for p in paths:
        mod, why = backends.load(p)
        assert why is None and mod is sys.modules[p], p


@pytest.fixture
def fake_rungs(monkeypatch):
    """Two extra rungs in the ladder: 'bare' supports every call but has no KV-cache
    decoding and reports itself unusable here; 'ghost' cannot be imported."""
    import sys
    import types
    bare = types.ModuleType("attnkit_test_bare_rung")
    bare.name = "bare"
    bare.not_supported_reasons = lambda spec: []
    bare.unavailable = lambda: "no such device here"
    monkeypatch.setitem(sys.modules, bare.__name__, bare)
    monkeypatch.setitem(backends.RUNGS, "bare", (bare.__name__, "a rung without KV-cache decoding"))
    monkeypatch.setitem(backends.RUNGS, "ghost", ("attnkit_test_no_such_rung", "a rung that is not installed"))
    return bare


def test_a_rung_without_kvcache_decoding_is_refused_only_for_the_cache(fake_rungs):
    """need="kvcache" (a contiguous or paged cache) refuses a rung that has no
    rung_kvcache, saying so; every other call may run on it."""
    spec = spec_validate(*make_qkv((2, 3, 4), (2, 5, 4), seed=1))
    assert backends.reasons("bare", spec) == []
    assert backends.select(spec, "bare") is fake_rungs
    assert backends.reasons("bare", spec, "kvcache") == ["has no KV-cache decoding"]
    with pytest.raises(ValueError, match="  bare: has no KV-cache decoding\n"):
        backends.select(spec, "bare", need="kvcache")
    assert backends.reasons("flash", spec, "kvcache") == []


def test_a_rung_that_cannot_be_imported_says_why(fake_rungs):
    """A rung whose module fails to import is refused with the import error's own text
    (which module is missing), in select's error and in info."""
    spec = spec_validate(*make_qkv((2, 3, 4), (2, 5, 4), seed=1))
    why = "not available: No module named 'attnkit_test_no_such_rung'"
    assert backends.reasons("ghost", spec) == [why]
    with pytest.raises(ValueError, match=f"  ghost: {why}\n"):
        backends.select(spec, "ghost")
    assert ("ghost", why, "a rung that is not installed") in backends.info()


def test_info_reports_what_each_rung_says_of_itself(fake_rungs):
    """info: a rung's status is its unavailable() reason when it gives one (no CUDA
    device, triton missing), "available" otherwise."""
    status = {name: s for name, s, _ in backends.info()}
    assert status["bare"] == "no such device here"
    assert status["flash"] == status["small"] == status["reference"] == status["torch"] == "available"


def test_the_error_lists_the_asked_rung_first_then_every_rung():
    """When no rung can run a call, the error gives the rung asked for first with its
    reason, then every other rung in ladder order — each with its own reasons, or
    'supports this call (not chosen)' — then the torch bridge, whose line says whether
    the call had torch tensors."""
    q, k, v = make_qkv((5, 4), (5, 4), seed=1)
    packed = dict(cu_seqlens_q=np.array([0, 2, 5]), cu_seqlens_k=np.array([0, 3, 5]))
    with pytest.raises(ValueError) as e:
        attnkit.attention(q, k, v, backend="small", **packed)
    head, *lines = str(e.value).split("\n")
    assert head == "backend='small': no backend can run this call:"
    assert [line.split(":")[0].strip() for line in lines] == ["small", "flash", "reference", "triton", "torch"]
    assert lines[0] == "  small: no packed sequences (cu_seqlens: the reference and flash rungs)"
    assert lines[1] == "  flash: supports this call (not chosen)"
    assert lines[2] == "  reference: supports this call (not chosen)"
    assert lines[3].startswith("  triton: ") and "supports this call" not in lines[3]
    assert lines[4].startswith("  torch: takes torch tensors")
    torch = pytest.importorskip("torch")
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    tpacked = {n: torch.from_numpy(c) for n, c in packed.items()}
    with pytest.raises(ValueError, match=r"\n  torch: the autograd op every torch-tensor call runs in"):
        attnkit.attention(tq, tk, tv, backend="small", **tpacked)


def test_backend_torch_is_auto_for_torch_tensors_only():
    """backend="torch" means "auto" for torch tensors (the op around the rung auto picks)
    and refuses NumPy arrays, naming the torch bridge."""
    from attnkit import small
    q, k, v = make_qkv((2, 3, 4), (2, 5, 4), seed=3)
    with pytest.raises(ValueError, match=r"backend='torch'(.|\n)*\n  torch: takes torch tensors"):
        attnkit.attention(q, k, v, backend="torch")
    torch = pytest.importorskip("torch")
    from attnkit.torch import op
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    spec = spec_validate(tq, tk, tv, causal=True)
    assert backends.select(spec, "torch") is backends.select(spec) is op.bound(small)
    assert torch.equal(attnkit.attention(tq, tk, tv, causal=True, backend="torch"),
                       attnkit.attention(tq, tk, tv, causal=True))


def test_a_kept_check_keeps_its_numpy_rung_and_nothing_else_does(monkeypatch):
    """Calls that reuse a kept check (one signature) reuse the NumPy rung chosen for it,
    per candidates and need (so the limits and orders in backends still decide); a
    Spec made by any other replace (a block of ring attention, another dtype) chooses
    again, and a Triton choice is never kept (its reasons read the environment)."""
    asked = []
    real = backends.reasons
    monkeypatch.setattr(backends, "reasons", lambda name, *a, **kw: asked.append(name) or real(name, *a, **kw))
    q, k, v = make_qkv((2, 2, 3, 4), (2, 2, 5, 4), seed=0)
    first = spec_validate(q, k, v, causal=True)
    assert backends.select(first).name == "small" and asked == ["small"]
    again = spec_validate(*make_qkv((2, 2, 3, 4), (2, 2, 5, 4), seed=1), causal=True)
    assert backends.select(again).name == "small" and asked == ["small"]           # kept
    assert backends.select(again, "reference").name == "reference" and asked == ["small", "reference"]
    assert backends.select(again, "reference").name == "reference" and len(asked) == 2
    monkeypatch.setattr(backends, "AUTO_SMALL", ("reference",))   # other candidates: chosen again
    assert backends.select(again).name == "reference" and asked[-1] == "reference"
    monkeypatch.undo()
    monkeypatch.setattr(backends, "reasons", lambda name, *a, **kw: asked.append(name) or real(name, *a, **kw))
    block = again.replace(extent=(3, 5))                # ring attention's block: small refuses blocks
    assert block.chosen is None and backends.select(block).name == "flash"
    assert spec_validate(q, k, v, causal=False).chosen is not first.chosen           # another signature
    monkeypatch.setattr(backends, "NUMPY_RUNGS", ())
    fresh = spec_validate(*make_qkv((1, 2, 3, 4), (1, 2, 5, 4), seed=2))
    n = len(asked)
    backends.select(fresh), backends.select(fresh)
    assert len(asked) == n + 2                          # nothing kept for rungs outside NUMPY_RUNGS

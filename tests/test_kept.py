"""attention's kept calls: a call that repeats a signature (a decoding step in every
layer) runs the chosen rung's direct call, without the checks — the bits of the full
path, only while the full path would choose the same, and never where something
watches the call (gradients, autocast, forward-mode AD, torch function modes)."""

import ctypes
import functools
import weakref

import numpy as np
import pytest

import attnkit
from attnkit import api, backends, flash

torch = pytest.importorskip("torch")


@pytest.fixture(autouse=True)
def _fresh():
    api._KEPT.clear()
    yield
    api._KEPT.clear()


def _qkv(lib, S, L=1, seed=0, B=2, H=4, A=2, D=8, Dv=6, Bk=None):
    rng = np.random.default_rng(seed)
    Bk = B if Bk is None else Bk
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((B, H, L, D), (Bk, A, S, D), (Bk, A, S, Dv)))
    return (q, k, v) if lib == "numpy" else tuple(torch.from_numpy(x) for x in (q, k, v))


def _np(x):
    return x if isinstance(x, np.ndarray) else x.numpy()


def _refuse(*a, **kw):
    raise AssertionError("the call was checked again")


@pytest.mark.parametrize("lib", ["numpy", "torch"])
@pytest.mark.parametrize("kw", [{}, dict(causal=True), dict(window=(2, 0), causal=True), dict(softcap=3.0, scale=0.4),
                                dict(causal=True, align="top_left")])
def test_a_repeated_signature_runs_without_checks_and_gives_the_full_paths_bits(lib, kw, monkeypatch):
    """Keys growing as in decoding, two query rows for the masks: each kept call (no
    validation) gives the out and lse of the full path on the same arrays, bit for bit."""
    attnkit.attention(*_qkv(lib, 7, L=2, seed=1), **kw)                # the first call keeps it
    assert len(api._KEPT) == 1
    for S in (9, 10, 17):
        q, k, v = _qkv(lib, S, L=2, seed=S)
        with monkeypatch.context() as m:
            m.setattr(api, "validate", _refuse)
            got = attnkit.attention(q, k, v, return_lse=True, **kw)
        api._KEPT.clear()
        want = attnkit.attention(q, k, v, return_lse=True, **kw)       # the full path
        for g, w in zip(got, want):
            assert type(g) is type(w) and g.shape == w.shape and np.array_equal(_np(g), _np(w))


def test_a_kept_call_keeps_no_reference_to_the_first_calls_tensors():
    q, k, v = _qkv("torch", 5)
    attnkit.attention(q, k, v)
    refs = [weakref.ref(x) for x in (q, k, v)]
    del q, k, v
    assert api._KEPT and all(r() is None for r in refs)


def test_past_the_small_calls_key_bound_the_call_is_chosen_again(monkeypatch):
    """The kept call holds while the key length keeps the call small (select's size rule);
    a longer cache takes the full path, which chooses the flash rung."""
    B, A, D, Dv = 2, 2, 8, 6
    monkeypatch.setattr(backends, "SMALL_KV", B * A * (D + Dv) * 12)  # small up to 12 keys
    attnkit.attention(*_qkv("numpy", 8))
    ran = []
    real = flash.rung_forward
    monkeypatch.setattr(flash, "rung_forward", lambda *a, **kw: ran.append(1) or real(*a, **kw))
    attnkit.attention(*_qkv("numpy", 12, seed=3))
    assert not ran
    q, k, v = _qkv("numpy", 13, seed=4)
    out = attnkit.attention(q, k, v)
    assert ran and np.array_equal(out, attnkit.attention(q, k, v, backend="flash"))


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_after_a_kept_call_bad_input_still_gets_the_full_checks_error(lib):
    attnkit.attention(*_qkv(lib, 6))
    q, k, v = _qkv(lib, 6)
    with pytest.raises(ValueError, match="v"):
        attnkit.attention(q, k, v[..., :5, :])                         # v's keys ≠ k's
    with pytest.raises(ValueError, match="must be positive"):
        attnkit.attention(*_qkv(lib, 0))                               # no keys
    for i in range(3):                                                 # one of q, k, v in float64
        x = list(_qkv(lib, 6))
        x[i] = x[i].astype(np.float64) if lib == "numpy" else x[i].double()
        with pytest.raises((TypeError, ValueError), match="dtype"):
            attnkit.attention(*x)


def test_calls_asking_for_weights_or_two_d_are_not_kept():
    q, k, v = _qkv("numpy", 5)
    out, w = attnkit.attention(q, k, v, return_weights=True)
    attnkit.attention(q[0, 0], k[0, 0], v[0, 0])
    assert not api._KEPT
    out2, w2 = attnkit.attention(q, k, v, return_weights=True)
    assert w2.shape == (2, 4, 1, 5) and np.array_equal(out, out2)


def test_a_kept_torch_call_declines_where_something_watches_it():
    """Gradients wanted, autocast, forward-mode AD, a torch function mode: the kept call
    gives None and the call takes the full path (the op, autocast's dtype, the named
    error)."""
    q, k, v = _qkv("torch", 5)
    attnkit.attention(q, k, v)
    (kept, *_), = api._KEPT.values()
    call = functools.partial(kept, need_lse=False)
    assert call(q, k, v) is not None
    g = q.clone().requires_grad_()
    assert call(g, k, v) is None
    out = attnkit.attention(g, k, v)
    assert out.requires_grad
    out.sum().backward()
    assert g.grad is not None and g.grad.abs().sum() > 0
    with torch.no_grad():
        assert call(g, k, v) is not None                               # no gradient wanted
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert call(q, k, v) is None
        assert attnkit.attention(q, k, v).dtype == torch.bfloat16
    with torch.autograd.forward_ad.dual_level():
        assert call(q, k, v) is None
        dual = torch.autograd.forward_ad.make_dual(q, torch.ones_like(q))
        with pytest.raises(NotImplementedError, match="forward-mode"):
            attnkit.attention(dual, k, v)

    class Seen(torch.overrides.TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.calls += 1
            return func(*args, **(kwargs or {}))

    with Seen() as mode:
        assert call(q, k, v) is None
        attnkit.attention(q, k, v)
    assert mode.calls > 0

    class Ops(torch.utils._python_dispatch.TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Ops() as ops:
        assert call(q, k, v) is None
        attnkit.attention(q, k, v)
    assert any("attnkit" in op for op in ops.ops)                      # the custom op, seen


def test_the_kept_calls_are_bounded(monkeypatch):
    monkeypatch.setattr(api, "_KEPT_MAX", 3)
    for S in range(1, 6):
        attnkit.attention(*_qkv("numpy", 4, B=S))                     # five signatures
        assert 1 <= len(api._KEPT) <= 3


def test_a_kept_call_follows_the_size_rule_as_it_is_when_called(monkeypatch):
    """The size limits read when the call runs (tests and tuning change them): with no
    call small any more, a kept signature takes the full path and the flash rung."""
    attnkit.attention(*_qkv("numpy", 8))
    monkeypatch.setattr(backends, "SMALL_TOTAL", 0)
    ran = []
    real = flash.rung_forward
    monkeypatch.setattr(flash, "rung_forward", lambda *a, **kw: ran.append(1) or real(*a, **kw))
    attnkit.attention(*_qkv("numpy", 8, seed=2))
    assert ran


def _in_layout(layout, S, seed):
    """q, k, v (torch, two query rows) in a layout the kept torch call reads in place
    or copies, or (the last three) one it leaves to the full path."""
    if layout == "broadcast_batch":
        return _qkv("torch", S, L=2, seed=seed, Bk=1)
    q, k, v = _qkv("torch", S, L=2, seed=seed)
    if layout == "heads_inner":                                        # (B, L, H, D) seen as (B, H, L, D)
        return q.transpose(1, 2).contiguous().transpose(1, 2), k, v
    if layout == "heads_inner_wide":                                   # the same, rows of 2½ vectors
        q, k, v = _qkv("torch", S, L=3, seed=seed, D=40, Dv=36)
        return q.transpose(1, 2).contiguous().transpose(1, 2), k, v
    if layout == "cache_slice":                                        # a static cache's first S slots
        big = [torch.cat([x, torch.full_like(x, float("nan"))], dim=-2) for x in (k, v)]
        return q, big[0][..., :S, :], big[1][..., :S, :]
    if layout == "two_batch_dims":
        return tuple(x.reshape((1,) + x.shape) for x in (q, k, v))
    if layout == "no_batch_dim":
        return q[0], k[0], v[0]
    if layout == "d_strided":                                          # rows not of unit stride
        return q, k, torch.stack([v, v], dim=-1)[..., 0]
    if layout == "batch_no_one_stride":                                # (B, 2) of (B, 3): no single step
        return tuple(torch.stack([x, x, x], dim=1)[:, :2] for x in (q, k, v))
    assert layout == "negative_bit"
    return q, torch._neg_view(-k), v


@pytest.mark.parametrize("layout", ["heads_inner", "heads_inner_wide", "broadcast_batch", "cache_slice", "two_batch_dims",
                                    "no_batch_dim", "d_strided", "batch_no_one_stride", "negative_bit"])
def test_kept_calls_in_other_layouts_and_without_lse(layout, monkeypatch):
    """The kept torch call reads the tensors' memory: q with its heads inner
    (transformers' (B, L, H, D) seen as (B, H, L, D)), k and v broadcast over the batch
    or a static cache's first slots, any batch dims — its out (asked without lse) is the
    full path's, in the same layout, with no check run; rows not of unit stride, batch
    dims that no one stride steps through and a negative bit take the full path."""
    attnkit.attention(*_in_layout(layout, 6, 1), causal=True)
    assert len(api._KEPT) == 1
    q, k, v = _in_layout(layout, 9, 2)
    with monkeypatch.context() as m:
        if layout not in ("d_strided", "batch_no_one_stride", "negative_bit"):
            m.setattr(api, "validate", _refuse)
        got = attnkit.attention(q, k, v, causal=True)
    api._KEPT.clear()
    want = attnkit.attention(q, k, v, causal=True)
    assert torch.equal(got, want) and got.stride() == want.stride() and not got.isnan().any()


def test_a_kept_torch_call_makes_float32_whatever_torchs_default_dtype():
    """The kept call's out and lse are float32 tensors (the kernel's), not torch's
    default dtype (float64 here: a buffer of another dtype would hold other bits)."""
    q, k, v = _qkv("torch", 5, L=2)
    attnkit.attention(q, k, v, causal=True)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        got = attnkit.attention(q, k, v, causal=True, return_lse=True)
    finally:
        torch.set_default_dtype(default)
    api._KEPT.clear()
    want = attnkit.attention(q, k, v, causal=True, return_lse=True)
    assert all(g.dtype == w.dtype == torch.float32 and torch.equal(g, w) for g, w in zip(got, want))


def test_a_kept_signature_still_refuses_a_keyword_of_the_wrong_type():
    attnkit.attention(*_qkv("numpy", 6, L=2), causal=True)
    with pytest.raises(TypeError, match="causal"):
        attnkit.attention(*_qkv("numpy", 6, L=2), causal=1)


@pytest.mark.parametrize("change", ["stream_rows", "auto_small", "compiled"])
def test_a_kept_call_follows_the_settings_as_they_are_when_called(change, monkeypatch):
    """After a call is kept, settings that change the full path's choice (the rows that
    stream, the candidates of small calls, the compiled kernels) send it there."""
    from attnkit import small
    from attnkit.flash import kernels
    attnkit.attention(*_qkv("numpy", 8))
    if change == "stream_rows":
        monkeypatch.setattr(small, "STREAM_ROWS", 1)
    elif change == "auto_small":
        monkeypatch.setattr(backends, "AUTO_SMALL", ("reference",))
    else:
        monkeypatch.setattr(kernels, "USE_COMPILED", False)
    streamed = []
    real = small.streamer
    monkeypatch.setattr(small, "streamer", lambda spec: streamed.append(1) or real(spec))
    q, k, v = _qkv("numpy", 8, seed=5)
    got = attnkit.attention(q, k, v)
    assert not streamed
    api._KEPT.clear()
    assert np.array_equal(got, attnkit.attention(q, k, v))


def test_a_kept_prefill_stops_streaming_past_the_banded_bound(monkeypatch):
    """A causal prefill streams while rows × keys stay within STREAM_BANDED: kept at a
    short key length, a longer call of the same signature takes the full path (the
    products), with its bits."""
    from attnkit import small
    L = 16                                                             # 2 heads a group: 32 rows
    S_in, S_out = small.STREAM_BANDED // 32, small.STREAM_BANDED // 32 + 8
    attnkit.attention(*_qkv("numpy", S_in, L=L), causal=True)
    assert len(api._KEPT) == 1
    q, k, v = _qkv("numpy", S_out, L=L, seed=9)
    got = attnkit.attention(q, k, v, causal=True)
    api._KEPT.clear()
    want = attnkit.attention(q, k, v, causal=True)
    assert not api._KEPT and np.array_equal(got, want)


class _Layer:
    """What transformers passes as ``module``: its attention layer."""
    is_causal = True


@pytest.mark.parametrize("change", ["dtype", "scale", "batch", "heads", "causal"])
def test_a_transformers_layer_reruns_its_kept_call_for_its_signature_only(change, monkeypatch):
    """The transformers hook keeps each layer's call: a repeat (keys growing, as in
    decoding) runs it without attention's steps and gives attention's bits; the same
    layer called with another dtype, scale, batch, head count or causality (one query
    row, then two) takes the full path and gets that call's result."""
    from attnkit import hf
    hf._LAYERS.clear()
    layer = _Layer()
    hf.attention_forward(layer, *_qkv("torch", 7), None, scaling=0.5)
    assert id(layer) in hf._LAYERS
    for S in (8, 12):
        q, k, v = _qkv("torch", S, seed=S)
        with monkeypatch.context() as m:
            m.setattr(api, "attention", _refuse)
            got, weights = hf.attention_forward(layer, q, k, v, None, scaling=0.5)
        assert weights is None
        assert torch.equal(got, attnkit.attention(q, k, v, scale=0.5).transpose(1, 2))
    scale, kw, causal = 0.5, {}, False
    if change == "scale":
        scale = 0.25
    elif change == "batch":
        kw = dict(B=3)
    elif change == "heads":
        kw = dict(H=6, A=3)
    elif change == "causal":
        kw, causal = dict(L=2), True
    q, k, v = _qkv("torch", 9, seed=3, **kw)
    if change == "dtype":
        q, k, v = (x.double() for x in (q, k, v))
    calls = []
    real = api.attention
    monkeypatch.setattr(api, "attention", lambda *a, **o: calls.append(1) or real(*a, **o))
    got, _ = hf.attention_forward(layer, q, k, v, None, scaling=scale)
    want = attnkit.attention(q.double(), k.double(), v.double(), scale=scale, causal=causal, backend="reference")
    assert calls == [1] and got.dtype == q.dtype
    torch.testing.assert_close(got.double(), want.transpose(1, 2), rtol=1e-5, atol=1e-5)


def test_a_transformers_layer_checks_the_scales_type_as_attention_does():
    """A layer kept for scale 1.0 called with scale True takes the full path, which
    refuses it: the kept call skips attention's checks of the scalars, so their types
    are part of the layer's key."""
    from attnkit import hf
    hf._LAYERS.clear()
    layer = _Layer()
    for S in (5, 6):
        hf.attention_forward(layer, *_qkv("torch", S), None, scaling=1.0)
    with pytest.raises(ValueError, match="scale"):
        hf.attention_forward(layer, *_qkv("torch", 7), None, scaling=True)


def test_a_layers_tensor_test_agrees_with_the_signatures_key():
    """hf._same_tensors (the layer's cheap test of a call's tensors) says yes exactly
    where validate.tensor_key gives the first call's key: another key length or
    strides, yes; another dtype, shape, head dim, tensor type, device or layout, no."""
    from attnkit import hf
    from attnkit.spec.validate import tensor_key
    q, k, v = _qkv("torch", 5)
    same = hf._same_tensors(q, k, v)
    variants = {
        "key length": _qkv("torch", 9, seed=1), "strides": (q.transpose(1, 2).contiguous().transpose(1, 2), k, v),
        "q dtype": (q.double(), k, v), "k dtype": (q, k.half(), v), "v dtype": (q, k, v.double()),
        "batch": _qkv("torch", 5, B=3), "rows": _qkv("torch", 5, L=2), "heads": _qkv("torch", 5, H=6, A=3),
        "k batch": (q, k[:1], v), "v batch": (q, k, v[:1]), "q head dim": (q[..., :4], k, v),
        "k head dim": (q, k[..., :4], v), "value dim": (q, k, v[..., :4]),
        "v heads": (q, k, v[:, :1]), "a Parameter": (torch.nn.Parameter(q, requires_grad=False), k, v),
        "meta": (q, k.to("meta"), v), "sparse": (q, k, v.to_sparse()),
    }
    first = tensor_key(q, k, v)
    for name, xs in variants.items():
        assert same(*xs) == (tensor_key(*xs) == first) == (name in ("key length", "strides")), name
    assert hf._same_tensors(q, k, v.to_sparse()) is None and hf._same_tensors(q.to("meta"), k, v) is None


def test_a_transformers_layer_recording_attentions_takes_the_full_path(monkeypatch):
    from attnkit import hf
    hf._LAYERS.clear()
    layer = _Layer()
    hf.attention_forward(layer, *_qkv("torch", 7), None, scaling=0.5)
    q, k, v = _qkv("torch", 8, seed=8)
    out, weights = hf.attention_forward(layer, q, k, v, None, scaling=0.5, output_attentions=True)
    assert weights is not None and weights.shape == (2, 4, 1, 8)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, 1))


def test_a_transformers_layer_keeps_its_last_two_signatures(monkeypatch):
    """A prefill's signature and its decoding steps' both stay kept for the layer (the
    next generate's prefill and first step skip attention's steps too); a third
    signature drops the oldest."""
    from attnkit import hf
    hf._LAYERS.clear()
    layer = _Layer()
    prefill, step, other = dict(L=3), dict(L=1), dict(L=1, B=3)
    for kw in (prefill, step):
        hf.attention_forward(layer, *_qkv("torch", 5, **kw), None, scaling=0.5)
    calls = []
    real = api.attention
    monkeypatch.setattr(api, "attention", lambda *a, **o: calls.append(1) or real(*a, **o))
    for kw in (prefill, step, prefill, step):
        q, k, v = _qkv("torch", 6, seed=4, **kw)
        got, _ = hf.attention_forward(layer, q, k, v, None, scaling=0.5)
        want = real(q, k, v, scale=0.5, causal=kw["L"] > 1).transpose(1, 2)
        assert torch.equal(got, want)
    assert calls == []
    hf.attention_forward(layer, *_qkv("torch", 6, **other), None, scaling=0.5)   # drops the prefill's
    hf.attention_forward(layer, *_qkv("torch", 6, **prefill), None, scaling=0.5)
    hf.attention_forward(layer, *_qkv("torch", 6, **other), None, scaling=0.5)
    assert calls == [1, 1]


def _team_or_skip():
    from attnkit.flash import runtime
    if runtime.blas_controller() is None or runtime._omp_team(2) is None:
        pytest.skip("torch's OpenMP runtime is not GNU libgomp here (or no threadpoolctl)")


@pytest.mark.parametrize("kw", [dict(causal=True), dict(causal=True, window=(9, 0), softcap=2.0),
                                dict(window=(5, 5), scale=0.3), dict(causal=True, inf_key=True),
                                dict(causal=True, sinks=True)],
                         ids=["causal", "causal window, softcap", "window both ways", "an inf key", "sinks per row"])
def test_a_kept_small_prefill_runs_its_units_on_torchs_team_with_the_same_bits(monkeypatch, kw):
    """A kept small call of TEAM_WORK or more (a short prefill of a small model: 4 × 8
    heads on 2 kv heads, 32 × 32, transformers' heads-inner q) runs its (batch element,
    kv head) units on torch's team: the full path's bits and lse, on one thread or two;
    a decoding step stays on the calling thread."""
    from attnkit import small
    from attnkit.flash import runtime
    _team_or_skip()
    kw = dict(kw)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(4, 32, 8, 32, generator=gen).transpose(1, 2)
    k, v = (torch.randn(4, 2, 32, 32, generator=gen) for _ in range(2))
    if kw.pop("inf_key", False):
        k[1, 0, 5, 3] = float("inf")                        # −inf and NaN scores: the rows' key by key path
    if kw.pop("sinks", False):                              # each row's own, read by the team's threads
        kw["sinks"] = torch.randn(4, 8, 32, generator=gen)
        kw["sinks"][1, 3, :4] = float("-inf")
    sinks = kw.get("sinks")
    teams, regions = [], []
    real = runtime.native_team

    def parallel(fn, data, n, flags):                     # GOMP_parallel, counted, as the kernel calls it
        regions.append(n)
        runtime._omp[0].GOMP_parallel(fn, data, n, flags)
    spy = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint)(parallel)
    spy_at = ctypes.cast(spy, ctypes.c_void_p).value
    monkeypatch.setattr(runtime, "native_team",
                        lambda n: teams.append(n) or ((spy_at, real(n)[1]) if real(n)[0] else (0, 0)))
    with flash.threads(1):
        want, want_lse = attnkit.attention(q, k, v, return_lse=True, **kw)
    kept = api.kept_call(q, k, v, "auto", kw)[1]
    assert kept is not None and not teams
    for n in (2, 1, 2):
        with flash.threads(n):
            got = api.run_kept(kept, q, k, v, True, sinks)
        assert got is not None
        assert torch.equal(got[0].nan_to_num(7.0), want.nan_to_num(7.0))
        assert torch.equal(got[1].nan_to_num(7.0), want_lse.nan_to_num(7.0))
    assert teams == [2, 1, 2] and regions == [2, 2] and small.TEAM_WORK <= 4 * 2 * 4 * 32 * 32 * 64
    step = (q[:, :, :1], k, v)                              # a decoding step: one query row
    if sinks is not None:
        kw["sinks"] = sinks[..., :1]
    attnkit.attention(*step, **kw)
    attnkit.attention(*step, **kw)
    assert teams == [2, 1, 2]
    with flash.threads(torch.get_num_threads() + 1):      # more than torch's team: capped to it
        assert api.run_kept(kept, q, k, v, False, sinks) is not None
    assert regions[2:] == [min(torch.get_num_threads(), 8)]


def test_a_unit_the_team_left_undone_is_not_taken_for_a_result():
    """An error inside the small kernel on a team thread is printed by that thread and
    ends its part: small_rows_at then says 2 (the kept call declines, the full path
    runs) instead of returning out with that unit unwritten. Here an entry that does
    no unit stands in for a failing one."""
    numba = pytest.importorskip("numba")
    from attnkit.flash import numba_small, runtime
    _team_or_skip()

    @numba.cfunc(numba.types.void(numba.types.voidptr))
    def idle(data):
        pass

    q, o = np.zeros((1, 2, 1, 8), np.float32), np.zeros((1, 2, 1, 8), np.float32)
    k = np.zeros((1, 2, 4, 8), np.float32)

    def st(x):
        return tuple(s // 4 for s in x.strides)
    args = ((1, 2, 1, 8), 2, 4, q.ctypes.data, q.shape, st(q), k.ctypes.data, k.shape, st(k), k.ctypes.data, k.shape,
            st(k), o.ctypes.data, st(o), 0, np.float32(1), np.float32(0), 0, 0, 0, (0, 0, 0), *runtime.native_team(2))
    assert numba_small.small_rows_at(*args, idle.address) == 2
    assert numba_small.small_rows_at(*args, numba_small.small_units.address) == 0


def test_a_sinks_parameter_is_read_at_every_call_with_its_gradient():
    """A model's learned sinks (a Parameter) reuse validate's check as a plain tensor
    does: every call reads their current values and gives their gradient (the
    reference rung, on a plain copy, is the oracle)."""
    q, k, v = _qkv("torch", 16)
    sinks = torch.nn.Parameter(torch.tensor([0.5, -1.0, 2.0, 0.0]))
    for step in range(3):
        with torch.no_grad():
            sinks.add_(0.75)                             # an optimiser's step, in place
        sinks.grad = None
        out = attnkit.attention(q, k, v, sinks=sinks, causal=True)
        out.square().sum().backward()
        plain = sinks.detach().clone().requires_grad_()
        want = attnkit.attention(q, k, v, sinks=plain, causal=True, backend="reference")
        want.square().sum().backward()
        assert (out - want).abs().max() <= 1e-5, step
        assert (sinks.grad - plain.grad).abs().max() <= 1e-4, step


@pytest.mark.parametrize("lib", ["numpy", "torch"])
@pytest.mark.parametrize("shape", [(4,), (), (1, 4, 1), (2, 4, 2), (4, 2), "strided"])
def test_a_kept_call_with_sinks_reads_each_calls_sinks(lib, shape, monkeypatch):
    """Sinks are keyed by dtype and shape: a repeat (keys growing, new sink values,
    −inf, +inf and NaN among them) runs without validation and gives the full path's
    bits; torch sinks are read in place (a Parameter too), NumPy's in their normal
    form, and torch sinks not C-ordered (a strided view) take the full path."""
    rng = np.random.default_rng(5)

    def sinks(i):
        s = np.asarray(rng.standard_normal((8,) if shape == "strided" else shape) * 2, dtype=np.float32)
        if s.ndim and i == 2:
            s.reshape(-1)[:3] = (-np.inf, np.inf, np.nan)
        if shape == "strided":
            return s[::2] if lib == "numpy" else torch.from_numpy(s)[::2]
        return s if lib == "numpy" else torch.nn.Parameter(torch.from_numpy(s))
    kw, declines = dict(causal=True), shape == "strided" and lib == "torch"
    real = api.run_kept
    with torch.no_grad():
        attnkit.attention(*_qkv(lib, 7, L=2, seed=1), sinks=sinks(0), **kw)
        assert len(api._KEPT) == 1
        for i, S in enumerate((9, 10, 17), 1):
            q, k, v = _qkv(lib, S, L=2, seed=S)
            s = sinks(i)
            ran = []
            with monkeypatch.context() as m:
                if not declines:
                    m.setattr(api, "validate", _refuse)
                m.setattr(api, "run_kept", lambda *a, **o: ran.append(real(*a, **o)) or ran[-1])
                got = attnkit.attention(q, k, v, return_lse=True, sinks=s, **kw)
            assert (ran[0] is None) == declines
            api._KEPT.clear()
            want = attnkit.attention(q, k, v, return_lse=True, sinks=s, **kw)       # the full path
            for g, w in zip(got, want):
                assert type(g) is type(w) and np.array_equal(_np(g), _np(w), equal_nan=True), (i, S)


def test_a_transformers_layer_keeps_its_call_with_sinks(monkeypatch):
    """gpt-oss hands its learned sinks over as ``s_aux``: a layer's repeat runs its kept
    call, which reads the sinks at every call (an optimiser's in-place step shows), with
    attention's bits; the same layer without ``s_aux`` takes the full path."""
    from attnkit import hf
    hf._LAYERS.clear()
    layer, real = _Layer(), api.attention
    s_aux = torch.nn.Parameter(torch.tensor([0.5, -1.0, 2.0, 0.0]))
    with torch.no_grad():
        hf.attention_forward(layer, *_qkv("torch", 7), None, scaling=0.5, s_aux=s_aux)
        for S in (8, 12):
            s_aux.add_(0.75)
            q, k, v = _qkv("torch", S, seed=S)
            with monkeypatch.context() as m:
                m.setattr(api, "attention", _refuse)
                got, _ = hf.attention_forward(layer, q, k, v, None, scaling=0.5, s_aux=s_aux)
            api._KEPT.clear()
            assert torch.equal(got, real(q, k, v, scale=0.5, sinks=s_aux).transpose(1, 2))
        calls = []
        monkeypatch.setattr(api, "attention", lambda *a, **o: calls.append(1) or real(*a, **o))
        q, k, v = _qkv("torch", 9, seed=3)
        got, _ = hf.attention_forward(layer, q, k, v, None, scaling=0.5)
        assert calls == [1] and torch.equal(got, real(q, k, v, scale=0.5).transpose(1, 2))


def test_a_kept_call_with_sinks_declines_under_vmap_over_them():
    """torch.vmap over the sinks alone: the kept call (q, k, v plain) declines before it
    reads the sinks' memory (a batched tensor has none); the full path maps them."""
    q, k, v = _qkv("torch", 7)
    sinks = torch.randn(3, 4)
    with torch.no_grad():
        attnkit.attention(q, k, v, sinks=sinks[0])
    assert len(api._KEPT) == 1
    got = torch.vmap(lambda s: attnkit.attention(q, k, v, sinks=s))(sinks)
    assert torch.equal(got, torch.stack([attnkit.attention(q, k, v, sinks=s) for s in sinks]))


def _full(q, k, v, **kw):
    api._KEPT.clear()
    return attnkit.attention(q, k, v, **kw)


@pytest.mark.parametrize("case", ["float64", "negative bit", "broadcast over batch dim 1", "over batch dim 0",
                                  "grad mode"])
def test_sinks_a_kept_call_cannot_read_as_they_are_take_the_full_path(case):
    """Calls with sinks a kept call cannot read in place get the full path's result:
    another dtype (no call kept), a negative view (its memory holds −x; kept for
    float32 sinks), sinks broadcast over one of two batch dims (no call kept), and a
    Parameter with grad on after the call was kept under no_grad (the sinks' gradient
    kept)."""
    g = torch.Generator().manual_seed(2)
    batch = (2, 3) if case.startswith(("broadcast", "over")) else (2,)
    shape = {"broadcast over batch dim 1": (2, 1, 4, 1), "over batch dim 0": (1, 3, 4, 1)}.get(case, (4,))
    dtype = torch.float64 if case == "float64" else torch.float32

    def call(S, s):
        q, k, v = (torch.randn(*batch, h, n, 8, generator=g) for h, n in ((4, 1), (2, S), (2, S)))
        return q, k, v, attnkit.attention(q, k, v, sinks=s)
    with torch.no_grad():
        call(7, torch.randn(shape, dtype=dtype, generator=g))
        call(8, torch.randn(shape, dtype=dtype, generator=g))             # (kept now, where it can be)
    x = torch.randn(shape, dtype=dtype, generator=g)
    if case == "grad mode":
        p = torch.nn.Parameter(x.clone())
        q, k, v, got = call(9, p)
        got.sum().backward()
        plain = x.clone().requires_grad_()
        want = _full(q, k, v, sinks=plain)
        want.sum().backward()
        assert got.requires_grad and torch.equal(got, want) and torch.equal(p.grad, plain.grad)
        return
    with torch.no_grad():
        s = torch._neg_view(x) if case == "negative bit" else x
        q, k, v, got = call(9, s)
        assert torch.equal(got, _full(q, k, v, sinks=-x if case == "negative bit" else x))


@pytest.mark.parametrize("change", ["dtype", "shape", "device"])
def test_a_layers_s_aux_it_cannot_read_takes_the_full_path(change):
    """A layer kept with float32 ``s_aux`` of shape (H,), called with s_aux of another
    dtype, shape or device (its key says only that s_aux is given): the full path's
    result, or its error."""
    from attnkit import hf
    hf._LAYERS.clear()
    layer = _Layer()
    then = {"dtype": torch.randn(4, dtype=torch.float64), "shape": torch.tensor(0.5),
            "device": torch.randn(4, device="meta")}[change]
    with torch.no_grad():
        for S in (7, 8):
            hf.attention_forward(layer, *_qkv("torch", S, seed=S), None, scaling=0.5, s_aux=torch.randn(4))
        q, k, v = _qkv("torch", 9, seed=3)
        if change == "device":
            with pytest.raises(ValueError, match="sinks"):
                hf.attention_forward(layer, q, k, v, None, scaling=0.5, s_aux=then)
            return
        got, _ = hf.attention_forward(layer, q, k, v, None, scaling=0.5, s_aux=then)
        assert torch.equal(got, _full(q, k, v, scale=0.5, sinks=then).transpose(1, 2))


@pytest.mark.parametrize("mask", ["float", "per head", "three rows", "changed in place"])
def test_a_decoding_steps_mask_is_read_as_what_it_says(mask):
    """transformers' one-row masks read as padding (hf._one_row) only where that is
    what they say: a boolean (B, 1, 1, S) mask of one query row. A float one is a
    bias, a per-head one stays per head, one broadcast over three rows of a causal
    layer keeps that mask's rule (no causality added), and one changed in place is
    read again. Each against SDPA given the same mask."""
    from attnkit import hf
    hf._LAYERS.clear()
    L = 3 if mask == "three rows" else 1
    q, k, v = _qkv("torch", 6, L=L, Dv=8)
    keep = torch.ones(2, 4 if mask == "per head" else 1, 1, 6, dtype=torch.bool)
    if mask == "changed in place":
        hf.attention_forward(_Layer(), q, k, v, keep, scaling=0.5)      # all seen: read as none
    keep[0, -1, :, :2] = False
    m = torch.zeros(keep.shape).masked_fill(~keep, float("-inf")) if mask == "float" else keep
    got, _ = hf.attention_forward(_Layer(), q, k, v, m, scaling=0.5)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.5, enable_gqa=True)
    assert (got - want.transpose(1, 2)).abs().max() <= 1e-5

"""attention_kvcache's kept call for torch CPU tensors on a contiguous cache: the small
rung's compiled call on the tensors' memory (attnkit.small.kvcache_at, kept per
signature in KVCall.memo by TorchRung._kept_kvcache); the kept step that runs a
signature's later calls whole through it, the append included (kvcache_op.step,
kept as memo[STEP]); and the full path's append through NumPy views. Each gives the
full path's bits, declines what it cannot read, and keeps torch's version counters."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import attnkit  # noqa: E402
from attnkit import api, kvcache, small  # noqa: E402
from attnkit.spec import kvcache as kvspec  # noqa: E402
from attnkit.torch import op  # noqa: E402
from cases import checked  # noqa: E402, F401 (a fixture)

B, H, HKV, D, CAP = 3, 4, 2, 8, 24


@pytest.fixture
def spied(monkeypatch):
    """{"made": kept calls made, "ran": [each kept call's result]}."""
    seen = {"made": 0, "ran": []}
    make = small.kvcache_at

    def kvcache_at(spec, pages=None):
        seen["made"] += 1
        call = make(spec, pages)
        if call is None:
            return None

        def spy(*args):
            seen["ran"].append(call(*args))
            return seen["ran"][-1]
        return spy
    monkeypatch.setattr(small, "kvcache_at", kvcache_at)
    kvspec._SEEN.clear()
    yield seen
    kvspec._SEEN.clear()


def tensors(seed, L=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, D, generator=g, dtype=dtype)
    kc, vc = (torch.randn(B, HKV, CAP, D, generator=g, dtype=dtype) for _ in range(2))
    kn, vn = (torch.randn(B, HKV, L, D, generator=g, dtype=dtype) for _ in range(2))
    return q, kc, vc, kn, vn


def full_path(*args, **kw):
    """The same call on the full path: the kept step and call switched off, and the
    append by torch's index writes (no NumPy views)."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(api, "kept_step", lambda *a: (None, None))
        m.setattr(op.TorchRung, "_kept_kvcache", lambda self, kv: None)
        m.setattr(kvcache, "_numpy_views", lambda xs: None)
        return attnkit.attention_kvcache(*args, **kw)


OPTIONS = [{}, dict(causal=True), dict(causal=True, window=(3, 0)), dict(softcap=2.0, scale=0.3),
           dict(causal=True, align="top_left"), dict(causal=True, sinks=torch.linspace(-1.0, 2.0, H)),
           dict(window=(3, 0), sinks=torch.tensor([[[0.5]], [[-np.inf]], [[3.0]]])),    # per sequence
           dict(window=(2, 1)), dict(window=(1, 2), align="top_left"), dict(window=(None, 0))]


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: ",".join(o) or "plain")
@pytest.mark.parametrize("L", [1, 2])
def test_a_decoding_loop_on_the_kept_call_gives_the_full_paths_bits(opts, L, spied, checked):
    """Six steps, each appending L keys per sequence (lengths from 0, all different),
    against the same steps on the full path: out, lse and the caches, bit for bit. The
    first step is validated, the kept step takes the other five whole."""
    q, kc, vc, kn, vn = tensors(1, L)
    kc2, vc2 = kc.clone(), vc.clone()
    lengths = torch.tensor([0, 5, 11])
    for step in range(6):
        qs, kns, vns = (x + step for x in (q, kn, vn))
        out, lse = attnkit.attention_kvcache(qs, kc, vc, lengths, k_new=kns, v_new=vns, return_lse=True, **opts)
        want, want_lse = full_path(qs, kc2, vc2, lengths, k_new=kns, v_new=vns, return_lse=True, **opts)
        assert torch.equal(out, want) and torch.equal(lse, want_lse), step
        assert torch.equal(kc, kc2) and torch.equal(vc, vc2), step
        assert out.dtype == want.dtype and out.is_contiguous()
        lengths = lengths + L
    assert spied["made"] == 1 and spied["ran"] == [True] * 6
    assert len(checked) == 1 + 6                         # the first step, and the full path's six


@pytest.mark.parametrize("L", [1, 3])
def test_strided_queries_and_caches(L, spied):
    """q with its heads inner (read in place at L = 1, its rows copied at L = 3) and a
    cache cut from a larger one: strides the kept call reads; the full path's bits."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(B, L, H, D, generator=g).transpose(1, 2)
    big_k, big_v = (torch.randn(B + 1, HKV, CAP + 5, D, generator=g) for _ in range(2))
    kc, vc = big_k[1:, :, 2:CAP + 2], big_v[1:, :, 2:CAP + 2]
    lengths = torch.tensor([7, 0, 24])
    for _ in range(2):
        out = attnkit.attention_kvcache(q, kc, vc, lengths, causal=True)
        assert torch.equal(out, full_path(q, kc, vc, lengths, causal=True))
    assert spied["ran"] == [True, True]


def test_it_declines_what_it_cannot_read(spied):
    """A negative bit (its memory holds −x), bfloat16, dropout: the full path, with its
    results (a paged cache's calls take the kept call: tests/test_kvcache_paged_step.py)."""
    q, kc, vc, _, _ = tensors(3)
    lengths = torch.tensor([4, 9, 2])
    attnkit.attention_kvcache(q, kc, vc, lengths)
    for neg in ((torch._neg_view(q), kc, vc), (q, torch._neg_view(kc), vc), (q, kc, torch._neg_view(vc))):
        plain = [x.resolve_neg() for x in neg]
        assert torch.equal(attnkit.attention_kvcache(*neg, lengths), attnkit.attention_kvcache(*plain, lengths))
    assert spied["ran"] == [True] * 4                    # the first call and the resolved ones'
    b16 = [x.bfloat16() for x in (q, kc, vc)]
    attnkit.attention_kvcache(*b16, lengths)
    pages_k, pages_v = kc.reshape(B * 4, HKV, CAP // 4, D), vc.reshape(B * 4, HKV, CAP // 4, D)
    table = torch.arange(B * 4).reshape(B, 4)
    for _ in range(2):
        attnkit.attention_kvcache(q, pages_k, pages_v, lengths, block_table=table)
        attnkit.attention_kvcache(q, kc, vc, lengths, dropout=0.5, seed=1)
    assert spied["ran"] == [True] * 6                    # and the paged cache's two calls (its full path's too)


def test_a_change_of_settings_takes_the_full_path(spied, monkeypatch):
    q, kc, vc, _, _ = tensors(4)
    lengths = torch.tensor([4, 9, 2])
    attnkit.attention_kvcache(q, kc, vc, lengths)
    monkeypatch.setattr(small, "STREAM_ROWS", 0)         # the call no longer streams
    out = attnkit.attention_kvcache(q, kc, vc, lengths)
    assert spied["ran"] == [True, False, False]          # the kept step's try, then the full path's
    want = attnkit.attention(q.double(), kc.double(), vc.double(), kv_lengths=lengths)
    assert torch.allclose(out.double(), want, atol=1e-5)


def test_the_append_bumps_the_caches_versions():
    """Written through NumPy views, the caches' version counters move as torch's own
    write moves them: autograd refuses a graph that saved the cache before."""
    q, kc, vc, kn, vn = tensors(5)
    w = torch.ones(1, requires_grad=True)
    y = (kc * w).sum()                                   # saves kc for the backward
    before = kc._version, vc._version
    attnkit.attention_kvcache(q, kc, vc, torch.tensor([1, 2, 3]), k_new=kn, v_new=vn)
    assert kc._version > before[0] and vc._version > before[1]
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_a_bfloat16_cache_takes_torchs_writes():
    """bfloat16 (no NumPy dtype) is appended by torch: the new keys land in their slots."""
    q, kc, vc, kn, vn = tensors(6, dtype=torch.bfloat16)
    lengths = torch.tensor([0, 5, 23])
    attnkit.attention_kvcache(q, kc, vc, lengths, k_new=kn, v_new=vn)
    for b, n in enumerate(lengths.tolist()):
        assert torch.equal(kc[b, :, n], kn[b, :, 0]) and torch.equal(vc[b, :, n], vn[b, :, 0])


def test_numpy_results_are_unchanged_by_the_torch_path():
    """The kept call is the torch op's: NumPy callers keep their rung's path (and the
    torch path equals it)."""
    q, kc, vc, kn, vn = tensors(7)
    args = [x.numpy().copy() for x in (q, kc, vc)]
    lengths = np.array([3, 0, 8])
    a = attnkit.attention_kvcache(*args, lengths, k_new=kn.numpy(), v_new=vn.numpy())
    for _ in range(2):
        kc2, vc2 = kc.clone(), vc.clone()
        b = attnkit.attention_kvcache(q, kc2, vc2, torch.from_numpy(lengths), k_new=kn, v_new=vn)
    assert np.array_equal(a, b.numpy())
    assert np.array_equal(args[1], kc2.numpy())


def test_new_keys_with_a_negative_bit_are_appended_as_their_values():
    """torch._neg_view(x) holds x in memory and means −x: the cache takes −x."""
    q, kc, vc, kn, vn = tensors(8)
    attnkit.attention_kvcache(q, kc, vc, torch.tensor([0, 5, 23]), k_new=torch._neg_view(kn), v_new=vn)
    assert torch.equal(kc[1, :, 5], -kn[1, :, 0]) and torch.equal(vc[1, :, 5], vn[1, :, 0])


def test_a_call_large_enough_for_torchs_team(spied):
    """Work past small.TEAM_WORK runs on torch's OpenMP team: the same bits."""
    g = torch.Generator().manual_seed(9)
    q = torch.randn(4, 8, 1, 64, generator=g)
    kc, vc = (torch.randn(4, 2, 2048, 64, generator=g) for _ in range(2))
    lengths = torch.tensor([2048, 1, 1500, 0])
    assert 4 * 2 * 4 * (64 + 64) * 2048 >= small.TEAM_WORK
    for _ in range(2):
        out, lse = attnkit.attention_kvcache(q, kc, vc, lengths, return_lse=True)
        want, want_lse = full_path(q, kc, vc, lengths, return_lse=True)
        assert torch.equal(out, want) and torch.equal(lse, want_lse)
    assert spied["ran"] == [True, True]


def test_a_ragged_append_through_the_views_writes_what_torch_writes():
    """q_lengths with k_new: sequence b appends its first q_lengths[b] keys (the others
    untouched), as torch's index writes put them."""
    q, kc, vc, kn, vn = tensors(10, L=3)
    kc2, vc2 = kc.clone(), vc.clone()
    args = dict(k_new=kn, v_new=vn, q_lengths=torch.tensor([3, 0, 2]), causal=True)
    out = attnkit.attention_kvcache(q, kc, vc, torch.tensor([4, 9, 21]), **args)
    want = full_path(q, kc2, vc2, torch.tensor([4, 9, 21]), **args)
    assert torch.equal(out, want) and torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert not torch.equal(kc[0, :, 4:7], torch.zeros_like(kc[0, :, 4:7]))


def step_calls(lengths_list, opts=None, L=1, seed=11, **kw):
    """The same three calls (appending L keys) with the kept step and on the full path, on
    caches of their own, one lengths argument per call: (outs, lses, caches) of each."""
    q, kc, vc, kn, vn = tensors(seed, L)
    got, want = [kc.clone(), vc.clone()], [kc.clone(), vc.clone()]
    outs = []
    for lengths in lengths_list:
        a = attnkit.attention_kvcache(q, *got, lengths, k_new=kn, v_new=vn, return_lse=True, **(opts or {}), **kw)
        b = full_path(q, *want, lengths, k_new=kn, v_new=vn, return_lse=True, **(opts or {}), **kw)
        outs.append((a, b))
    return outs, got, want


@pytest.mark.parametrize("form", ["int", "0-d", "int32", "strided", "int16"])
def test_the_kept_step_reads_the_lengths_in_every_form(form, checked):
    """An int, a 0-d tensor, int32, a strided (B,) view: read by the step in place (the
    full path's bits and caches); int16 lengths: the full path."""
    make = {"int": lambda n: int(n[0]), "0-d": lambda n: torch.tensor(int(n[0])),
            "int32": lambda n: torch.tensor(n, dtype=torch.int32),
            "strided": lambda n: torch.tensor([x for m in n for x in (m, -1)])[::2],
            "int16": lambda n: torch.tensor(n, dtype=torch.int16)}[form]
    lengths = [[5, 0, 12], [6, 1, 13], [7, 2, 14]] if form not in ("int", "0-d") else [[3] * 3, [4] * 3, [23] * 3]
    outs, got, want = step_calls([make(n) for n in lengths])
    for (a, b) in outs:
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert len(checked) == 3 + (3 if form == "int16" else 1)    # the full path's three, and ours


def test_an_int_past_int64_gets_the_full_paths_error(checked):
    q, kc, vc, kn, vn = tensors(16)
    for _ in range(2):
        attnkit.attention_kvcache(q, kc, vc, 3, k_new=kn, v_new=vn)
    with pytest.raises(ValueError, match="cache_lengths"):
        attnkit.attention_kvcache(q, kc, vc, 1 << 70, k_new=kn, v_new=vn)
    assert len(checked) == 2


@pytest.mark.parametrize("bad, match", [([4, -1, 2], "non-negative"), ([4, 1, CAP], "overflows"),
                                        ([4, CAP + 3, 2], "beyond its capacity")])
def test_lengths_the_kept_step_cannot_take_get_the_full_paths_errors(bad, match, checked):
    """A negative length, an append past the capacity, a length past it, on a signature
    the kept step holds: the full path's named error, the caches untouched; then the
    step takes a good call again."""
    q, kc, vc, kn, vn = tensors(12)
    for _ in range(2):
        attnkit.attention_kvcache(q, kc, vc, torch.tensor([4, 1, 2]), k_new=kn, v_new=vn)
    before = kc.clone(), vc.clone()
    with pytest.raises(ValueError, match=match):
        attnkit.attention_kvcache(q, kc, vc, torch.tensor(bad), k_new=kn, v_new=vn)
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])
    attnkit.attention_kvcache(q, kc, vc, torch.tensor([5, 2, 3]), k_new=kn, v_new=vn)
    assert len(checked) == 2 and torch.equal(kc[0, :, 5], kn[0, :, 0])


def test_the_kept_step_checks_gradients_and_writability():
    """On a signature the kept step holds: a cache that requires grad under grad mode,
    and an inference tensor outside inference mode, get validation's errors; nothing
    is written."""
    q, kc, vc, kn, vn = tensors(13)
    lengths = torch.tensor([1, 2, 3])
    with torch.no_grad():
        for _ in range(2):
            attnkit.attention_kvcache(q, kc, vc, lengths, k_new=kn, v_new=vn)
    kc.requires_grad_(True)
    with pytest.raises(TypeError, match="forward only"):
        attnkit.attention_kvcache(q, kc, vc, lengths, k_new=kn, v_new=vn)
    with torch.inference_mode():
        ki, vi = kc.detach().clone(), vc.clone()
        for _ in range(2):
            attnkit.attention_kvcache(q, ki, vi, lengths, k_new=kn, v_new=vn)
    before = ki.clone()
    with pytest.raises(ValueError, match="read-only"):
        attnkit.attention_kvcache(q, ki, vi, lengths, k_new=kn + 1, v_new=vn)
    assert torch.equal(ki, before)


def test_the_kept_step_declines_new_keys_it_cannot_copy_and_bumps_versions(checked):
    """New keys whose rows are not of unit stride: the full path appends them. The
    caches' version counters move at every call the step takes."""
    q, kc, vc, kn, vn = tensors(14)
    strided = torch.randn(B, HKV, 1, 2 * D)[..., ::2]
    kc2, vc2 = kc.clone(), vc.clone()
    for i in range(2):
        attnkit.attention_kvcache(q, kc, vc, torch.tensor([i, 3, 4]), k_new=strided, v_new=vn)
        full_path(q, kc2, vc2, torch.tensor([i, 3, 4]), k_new=strided, v_new=vn)
    assert torch.equal(kc, kc2) and len(checked) == 4
    for i in range(2, 4):
        before = kc._version, vc._version
        out = attnkit.attention_kvcache(q, kc, vc, torch.tensor([i, 3, 4]), k_new=kn, v_new=vn)
        assert kc._version > before[0] and vc._version > before[1]
        assert torch.equal(out, full_path(q, kc2, vc2, torch.tensor([i, 3, 4]), k_new=kn, v_new=vn))
        assert torch.equal(kc, kc2)
    assert len(checked) == 4 + 2                         # (the same signature: the step's) and the full path's


def test_the_kept_step_without_lse_and_after_a_change_of_settings(monkeypatch, checked):
    """return_lse=False gives the same out; a change of select's settings sends the
    call to the full path (which keeps nothing new for the signature)."""
    q, kc, vc, _, _ = tensors(15)
    lengths = torch.tensor([4, 9, 2])
    out, _ = attnkit.attention_kvcache(q, kc, vc, lengths, return_lse=True)
    assert torch.equal(attnkit.attention_kvcache(q, kc, vc, lengths), out) and len(checked) == 1
    monkeypatch.setattr(attnkit.backends, "SMALL_KV", 0)        # the flash rung's now
    assert torch.allclose(attnkit.attention_kvcache(q, kc, vc, lengths), out, atol=1e-6)
    assert len(checked) == 2


@pytest.mark.parametrize("where", ["its own slots", "the other cache"])
def test_new_keys_in_the_caches_memory_are_appended_as_the_full_path_appends_them(where, checked):
    """k_new a view of the cache slots the append overwrites (re-appending the last two
    keys), or v_new a view of k_cache's slots that k_new's append writes: the step
    would read a row after writing it, so it declines; the full path's append (through
    NumPy views: torch's index writes refuse such a source) copies first."""
    def without_step(*args, **kw):
        with pytest.MonkeyPatch.context() as m:
            m.setattr(api, "kept_step", lambda *a: (None, None))
            return attnkit.attention_kvcache(*args, **kw)
    outs, caches = [], []
    for kept in (True, False):
        torch.manual_seed(0)
        q, kc, vc = torch.randn(1, 1, 1, 4), torch.randn(1, 1, 8, 4), torch.randn(1, 1, 8, 4)
        kn, vn = (kc[:, :, 2:4], vc[:, :, 2:4]) if where == "its own slots" else (torch.ones(1, 1, 2, 4),
                                                                                   kc[:, :, 4:6])
        run = attnkit.attention_kvcache if kept else without_step
        if kept:
            attnkit.attention_kvcache(q, kc.clone(), vc.clone(), 3, k_new=kn.clone(), v_new=vn.clone())
        outs.append(run(q, kc, vc, 3, k_new=kn, v_new=vn))
        caches.append((kc, vc))
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    assert len(checked) == 1 + 1 + 1                     # the warm-up, the declined step's, without the step

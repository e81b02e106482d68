"""attention_kvcache's kept checks: a call whose signature was seen before skips the
checks of its structure (attnkit.spec.kvcache._SEEN) — and still refuses bad lengths,
bad pages and bad state (grad, a read-only or broadcast cache) with the full check's
error, the cache untouched; its validated call is the full check's."""

import warnings

import numpy as np
import pytest

import attnkit
from attnkit.spec import kvcache as kvspec

RNG = np.random.default_rng


def caches(paged, rng):
    """(k, v, table): 2 sequences, 40 keys of capacity (pages of 8, shuffled)."""
    if paged:
        k, v = rng.standard_normal((2, 10, 1, 8, 4))
        return k, v, rng.permutation(10).reshape(2, 5)
    k, v = rng.standard_normal((2, 2, 1, 40, 4))
    return k, v, None


NEW = dict(k_new=np.ones((2, 1, 2, 4)), v_new=np.ones((2, 1, 2, 4)))
BAD_VALUES = [
    (dict(cache_lengths=np.array([41, 0])), {}, "cache_lengths: sequence 0 holds 41 keys \\+ 0 new = 41, beyond"),
    (dict(cache_lengths=np.array([0, 39])), NEW, "cache_lengths: sequence 1 .* the append overflows"),
    (dict(cache_lengths=np.array([-1, 2])), {}, "cache_lengths: expected non-negative"),
    (dict(cache_lengths=41), {}, "cache_lengths: sequence 0 holds 41"),
    (dict(cache_lengths=-3), {}, "cache_lengths: expected non-negative"),
]


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("bad,new,message", BAD_VALUES)
def test_a_kept_check_still_refuses_bad_lengths(bad, new, message, paged):
    """The same call with good lengths first (kept), then with bad ones."""
    k, v, table = caches(paged, RNG(1))
    q = np.zeros((2, 2, 1, 4))
    good = 3 if isinstance(bad["cache_lengths"], int) else np.array([3, 0])
    kvspec._SEEN.clear()
    attnkit.attention_kvcache(q, k, v, good, block_table=table, **new)
    assert len(kvspec._SEEN) == 1                        # the structure's checks kept
    before = k.copy(), v.copy()
    with pytest.raises(ValueError, match=f"^{message}"):
        attnkit.attention_kvcache(q, k, v, bad["cache_lengths"], block_table=table, **new)
    assert np.array_equal(k, before[0]) and np.array_equal(v, before[1])


@pytest.mark.parametrize("bad", [-1, 10])
def test_a_kept_check_still_refuses_pages_outside_the_cache(bad):
    k, v, table = caches(True, RNG(2))
    q = np.zeros((2, 2, 1, 4))
    attnkit.attention_kvcache(q, k, v, np.array([9, 3]), block_table=table, **NEW)
    before = k.copy()
    table = table.copy()
    table[0, 1] = bad                                    # sequence 0's second page: used from 9 keys on
    with pytest.raises(ValueError, match=rf"^block_table: sequence 0 points at page {bad} outside"):
        attnkit.attention_kvcache(q, k, v, np.array([9, 3]), block_table=table, **NEW)
    assert np.array_equal(k, before)


def test_a_kept_check_still_refuses_a_read_only_cache():
    k, v, _ = caches(False, RNG(3))
    q = np.zeros((2, 2, 1, 4))
    attnkit.attention_kvcache(q, k, v, np.array([3, 0]), **NEW)
    k.flags.writeable = False
    with pytest.raises(ValueError, match="^k_cache: the cache is read-only"):
        attnkit.attention_kvcache(q, k, v, np.array([5, 2]), **NEW)
    assert (v[0, :, 5:7] != 1).all()                     # nothing written to v either


def test_a_kept_check_still_refuses_grad_and_unwritable_tensors():
    torch = pytest.importorskip("torch")
    q, kc, vc = torch.zeros(2, 2, 1, 4), torch.zeros(2, 1, 40, 4), torch.zeros(2, 1, 40, 4)
    kn, vn = torch.ones(2, 1, 1, 4), torch.ones(2, 1, 1, 4)
    lengths = torch.tensor([3, 0])
    with torch.no_grad():
        attnkit.attention_kvcache(q, kc, vc, lengths, k_new=kn, v_new=vn)
    kc.zero_(), vc.zero_()
    with pytest.raises(TypeError, match="^q: attention_kvcache is forward only"):
        attnkit.attention_kvcache(q.requires_grad_(), kc, vc, lengths, k_new=kn, v_new=vn)
    q = q.detach()
    wide = torch.zeros(1, 1, 40, 4).expand(2, 1, 40, 4)  # one slot for both sequences
    with pytest.raises(ValueError, match="^k_cache: a broadcast"):
        attnkit.attention_kvcache(q, wide, vc, lengths, k_new=kn, v_new=vn)
    with torch.inference_mode():
        frozen = torch.zeros(2, 1, 40, 4)
    with pytest.raises(ValueError, match="^v_cache: the cache is read-only"):
        attnkit.attention_kvcache(q, kc, frozen, lengths, k_new=kn, v_new=vn)
    assert not kc.any() and not vc.any() and not wide.any()


def same(a, b):
    if hasattr(a, "numpy") and hasattr(b, "numpy"):
        return type(a) is type(b) and a.dtype == b.dtype and a.device == b.device and np.array_equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return type(a) is type(b) and a.dtype == b.dtype and np.array_equal(a, b)
    return a == b


@pytest.mark.parametrize("lib", ["numpy", "torch"])
@pytest.mark.parametrize("kind", ["contiguous", "paged", "append", "one int", "masks", "terms"])
def test_the_kept_check_gives_the_full_checks_call(kind, lib):
    """The second call of a signature (kept) returns the call the full check makes of
    the same arguments: every field, the Spec's too, equal and of the same types."""
    rng = RNG(4)
    k, v, table = caches(kind == "paged", rng)
    args = dict(q=rng.standard_normal((2, 2, 1, 4)), k_cache=k, v_cache=v, cache_lengths=np.array([3, 0]),
                block_table=table)
    if kind == "append":
        args.update(NEW)
    opts = dict(causal=True, window=(2, 0), softcap=3.0, scale=0.5) if kind == "masks" else {}
    if kind == "terms":
        opts = dict(sinks=np.array([0.5, -1.0]), alibi_slopes=np.array([[0.25, 0.5]]), causal=True)
    if lib == "torch":
        torch = pytest.importorskip("torch")
        args = {n: None if x is None else torch.from_numpy(np.asarray(x)) for n, x in args.items()}
        opts = {n: torch.from_numpy(x) if isinstance(x, np.ndarray) else x for n, x in opts.items()}
    if kind == "one int":
        args["cache_lengths"] = 7
    kvspec._SEEN.clear()
    first = kvspec.validate_kvcache(**args, **opts)
    args["cache_lengths"] = 11 if kind == "one int" else args["cache_lengths"] + 1
    kept = kvspec.validate_kvcache(**args, **opts)
    full = kvspec._validate_kvcache(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"),
                                    args.pop("cache_lengths"), args.pop("block_table"), args.pop("k_new", None),
                                    args.pop("v_new", None), "auto", opts)
    assert len(kvspec._SEEN) == 1 and first.spec.kv_lengths is not None
    for name in full.__dataclass_fields__:
        if name not in ("spec", "memo"):
            assert same(getattr(kept, name), getattr(full, name)), name
    assert kept.memo is first.memo and isinstance(kept.memo, dict)         # one per signature
    a, b = kept.spec.__dict__, full.spec.__dict__
    assert a.keys() == b.keys()
    for name in a.keys() - {"chosen", "k", "v"}:
        assert same(a[name], b[name]), name
    assert all(kept.spec.__dict__[n].shape == full.spec.__dict__[n].shape for n in ("k", "v"))


def test_a_kept_check_is_for_its_capacity_alone():
    """Caches or block tables of another capacity are another signature: each call is
    held to its own capacity."""
    q = np.zeros((2, 2, 1, 4))
    k, v, table = caches(True, RNG(5))
    attnkit.attention_kvcache(q, k, v, np.array([30, 0]), block_table=table)            # 5 pages: 40 keys
    with pytest.raises(ValueError, match="^cache_lengths: sequence 0 holds 30 keys .* capacity of 24"):
        attnkit.attention_kvcache(q, k, v, np.array([30, 0]), block_table=table[:, :3])
    k, v, _ = caches(False, RNG(5))
    attnkit.attention_kvcache(q, k, v, np.array([30, 0]))
    with pytest.raises(ValueError, match="^cache_lengths: sequence 0 holds 30 keys .* capacity of 20"):
        attnkit.attention_kvcache(q, k[:, :, :20], v[:, :, :20], np.array([30, 0]))


@pytest.mark.parametrize("kw", [dict(window=np.array([2, 0])), dict(scale=np.array(0.5)), dict(window={1: 2})])
def test_an_unhashable_keyword_gets_the_full_checks_error(kw):
    q, k = np.ones((2, 2, 1, 4)), np.ones((2, 2, 8, 4))
    name = next(iter(kw))
    with pytest.raises((TypeError, ValueError), match=f"^{name}: "):
        attnkit.attention_kvcache(q, k, k.copy(), np.array([3, 4]), **kw)


@pytest.mark.parametrize("lib", ["numpy", "torch"])
@pytest.mark.parametrize("dtype", ["int32", "int16", "uint8", "uint64"])
def test_the_append_takes_every_integer_dtype_validation_takes(dtype, lib):
    """Lengths and block tables of any integer dtype write the same slots as int64 (a
    uint8 index is a mask to torch; uint64 plus int64 is float64 to NumPy: both failed
    after validation, a review found)."""
    rng = RNG(12)
    q = rng.standard_normal((2, 2, 1, 4))
    kn, vn = rng.standard_normal((2, 1, 1, 4)), rng.standard_normal((2, 1, 1, 4))
    pages = rng.standard_normal((2, 6, 1, 4, 4))
    table, lengths = np.array([[4, 1], [0, 5]]), np.array([5, 2])
    results = []
    for dt in ("int64", dtype):
        k, v = pages[0].copy(), pages[1].copy()
        args = [q, k, v, lengths.astype(dt), table.astype(dt), kn, vn]
        if lib == "torch":
            torch = pytest.importorskip("torch")
            args = [torch.from_numpy(np.asarray(a)) for a in args]
        out = attnkit.attention_kvcache(*args[:4], block_table=args[4], k_new=args[5], v_new=args[6])
        results.append([np.asarray(x) for x in (out, args[1], args[2])])
    for a, b in zip(*results):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_a_kept_call_with_q_lengths_and_kv_starts_reads_this_calls_arrays(paged):
    """Calls with q_lengths and kv_starts are kept by those arrays' values: a repeated
    call reads its own arrays, not the first call's (changed in place since: their
    old values would be attended with), and checks each kv_starts against the lengths
    after this call's append (a first key past them: kv_starts' error, nothing
    written)."""
    rng = RNG(31)
    k, v, table = caches(paged, rng)
    q = rng.standard_normal((2, 2, 2, 4))
    new = dict(k_new=rng.standard_normal((2, 1, 2, 4)), v_new=rng.standard_normal((2, 1, 2, 4)))
    kw = {} if table is None else dict(block_table=table)
    first_q, first_s = np.array([2, 1]), np.array([1, 3])
    kvspec._SEEN.clear()
    attnkit.attention_kvcache(q, k.copy(), v.copy(), np.array([5, 9]), q_lengths=first_q, kv_starts=first_s,
                              causal=True, **kw, **new)
    first_q[:], first_s[:] = [1, 2], [0, 0]              # the first call's arrays, changed in place
    kc, vc = k.copy(), v.copy()
    got = attnkit.attention_kvcache(q, kc, vc, np.array([5, 9]), q_lengths=np.array([2, 1]),
                                    kv_starts=np.array([1, 3]), causal=True, **kw, **new)
    kvspec._SEEN.clear()
    kc2, vc2 = k.copy(), v.copy()
    want = attnkit.attention_kvcache(q, kc2, vc2, np.array([5, 9]), q_lengths=np.array([2, 1]),
                                     kv_starts=np.array([1, 3]), causal=True, **kw, **new)
    assert np.array_equal(got, want) and np.array_equal(kc, kc2) and np.array_equal(vc, vc2)
    attnkit.attention_kvcache(q, kc, vc, np.array([5, 9]), q_lengths=np.array([2, 1]),
                              kv_starts=np.array([1, 3]), causal=True, **kw, **new)     # kept again
    before = kc.copy()
    with pytest.raises(ValueError, match=r"^kv_starts: sequence 1 starts at key 3, past"):
        attnkit.attention_kvcache(q, kc, vc, np.array([5, 1]), q_lengths=np.array([2, 1]),
                                  kv_starts=np.array([1, 3]), causal=True, **kw, **new)
    assert np.array_equal(kc, before)


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_a_kept_call_with_sinks_and_slopes_reads_this_calls_values(lib):
    """Sinks and ALiBi slopes key a call by dtype and shape alone (a model's learned
    sinks: a torch Parameter): a repeated call attends with its own values, not the
    first call's (changed in place since): per head, one for all, per sequence and head."""
    rng = RNG(32)
    k, v, table = caches(True, rng)
    q = rng.standard_normal((2, 2, 1, 4))
    sinks, slopes = np.array([0.5, -1.0]), np.array([[0.25, 0.5], [1.0, 0.0]])
    wrap, lengths = np.array, np.array([9, 30])
    if lib == "torch":
        torch = pytest.importorskip("torch")
        q, k, v, table, lengths = (torch.from_numpy(x) for x in (q, k, v, table, lengths))
        wrap = lambda x: torch.nn.Parameter(torch.from_numpy(np.array(x)), requires_grad=False)  # noqa: E731
    for first in (dict(sinks=sinks), dict(sinks=sinks[0]), dict(alibi_slopes=slopes),
                  dict(sinks=sinks, alibi_slopes=slopes[1])):
        kvspec._SEEN.clear()
        kw = {n: wrap(x) for n, x in first.items()}
        attnkit.attention_kvcache(q, k, v, lengths, block_table=table, causal=True, **kw)
        for x in kw.values():
            x[...] = 7.0                                 # the first call's arrays, changed in place
        kw = {n: wrap(2 * x - 0.5) for n, x in first.items()}      # this call's: other values
        got = attnkit.attention_kvcache(q, k, v, lengths, block_table=table, causal=True, **kw)
        assert len(kvspec._SEEN) == 1
        kvspec._SEEN.clear()
        want = attnkit.attention_kvcache(q, k, v, lengths, block_table=table, causal=True, **kw)
        assert np.array_equal(np.asarray(got), np.asarray(want)), first


def test_a_kept_call_refuses_sinks_that_would_get_no_gradient():
    """attention_kvcache is forward only: sinks that require grad while grad is on are
    refused (their gradient would silently be lost), kept call or not; under
    torch.no_grad() they run."""
    torch = pytest.importorskip("torch")
    q, kc = torch.zeros(2, 2, 1, 4), torch.zeros(2, 1, 40, 4)
    sinks = torch.nn.Parameter(torch.tensor([0.5, -1.0]))
    lengths = torch.tensor([3, 5])
    kvspec._SEEN.clear()
    for _ in range(2):
        with pytest.raises(TypeError, match="^sinks: attention_kvcache is forward only"):
            attnkit.attention_kvcache(q, kc, kc, lengths, sinks=sinks)
        with torch.no_grad():
            attnkit.attention_kvcache(q, kc, kc, lengths, sinks=sinks)
    assert len(kvspec._SEEN) == 1


def test_a_kept_signature_does_not_hold_the_first_calls_sinks():
    """The kept check holds the sinks' shape alone: the first call's array (a view of a
    large tensor, say) is freed with the caller's last reference."""
    torch = pytest.importorskip("torch")
    import gc
    import weakref
    q, kc = torch.zeros(2, 4, 1, 8), torch.zeros(2, 2, 16, 8)
    big = torch.nn.Parameter(torch.randn(1000, 4), requires_grad=False)
    held = weakref.ref(big)
    kvspec._SEEN.clear()
    attnkit.attention_kvcache(q, kc, kc, torch.tensor([5, 9]), sinks=big[0])
    del big
    gc.collect()
    assert len(kvspec._SEEN) == 1 and held() is None


def test_nested_sinks_are_named_not_a_crash():
    torch = pytest.importorskip("torch")
    q, kc = torch.zeros(2, 4, 1, 8), torch.zeros(2, 2, 16, 8)
    with warnings.catch_warnings():                      # (torch: nested tensors are a prototype)
        warnings.simplefilter("ignore")
        nested = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(2)], layout=torch.strided)
    for call in (lambda: attnkit.attention_kvcache(q, kc, kc, torch.tensor([5, 9]), sinks=nested),
                 lambda: attnkit.attention(q, kc, kc, sinks=nested)):
        with pytest.raises(TypeError, match="^sinks: expected a dense tensor, got a nested tensor"):
            call()

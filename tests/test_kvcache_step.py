"""attention_kvcache's kept step for NumPy arrays (attnkit.small.kvcache_step, kept as
the signature's memo[STEP] after its first call): a float32 decoding loop's later calls
run whole — the lengths' check, the append, the attention — as one compiled call on
the arrays' memory. It gives the full path's bits and cache contents, declines what it
cannot read (the full path then runs), and bad lengths still get the full path's
errors with the cache untouched. (CPU tensors: tests/test_kvcache_direct.py.)"""

import numpy as np
import pytest

import attnkit
from attnkit import api
from attnkit.spec import kvcache as kvspec
from cases import checked  # noqa: F401 (a fixture)

B, H, HKV, D, CAP = 3, 4, 2, 8, 32


def arrays(seed, L=1, dtype=np.float32):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, L, D)).astype(dtype)
    kc, vc, kn, vn = (rng.standard_normal(shape).astype(dtype) for shape in ((B, HKV, CAP, D),) * 2 + ((B, HKV, L, D),) * 2)
    return q, kc, vc, kn, vn


def full_path(*args, **kw):
    with pytest.MonkeyPatch.context() as m:
        m.setattr(api, "kept_step", lambda *a: (None, None))
        return attnkit.attention_kvcache(*args, **kw)


OPTIONS = [{}, dict(causal=True), dict(causal=True, window=(3, 0)), dict(softcap=2.0, scale=0.3),
           dict(causal=True, align="top_left"), dict(window=(1, 2), align="top_left"),
           dict(causal=True, sinks=np.linspace(-1.0, 2.0, H, dtype=np.float32)),
           dict(window=(2, 1), sinks=np.array([[[0.5]], [[-np.inf]], [[3.0]]], dtype=np.float32))]


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: ",".join(o) or "plain")
@pytest.mark.parametrize("L", [1, 3])
def test_a_numpy_decoding_loop_on_the_kept_step_gives_the_full_paths_bits(opts, L, checked):
    """Six steps appending L keys per sequence (lengths from 0, all different): out, lse
    (their dtypes) and both caches as the full path makes them; the first step
    validated, the step takes the other five."""
    q, kc, vc, kn, vn = arrays(1, L)
    kc2, vc2 = kc.copy(), vc.copy()
    lengths = np.array([0, 5, 11])
    for step in range(6):
        qs, kns = q + np.float32(step), kn - np.float32(step)
        out, lse = attnkit.attention_kvcache(qs, kc, vc, lengths, k_new=kns, v_new=vn, return_lse=True, **opts)
        want, want_lse = full_path(qs, kc2, vc2, lengths, k_new=kns, v_new=vn, return_lse=True, **opts)
        assert np.array_equal(out, want) and np.array_equal(lse, want_lse), step
        assert out.dtype == want.dtype and lse.dtype == want_lse.dtype
        assert np.array_equal(kc, kc2) and np.array_equal(vc, vc2), step
        lengths = lengths + L
    assert len(checked) == 1 + 6                         # the first step, and the full path's six
    assert np.array_equal(attnkit.attention_kvcache(q, kc, vc, lengths, **opts),
                          attnkit.attention_kvcache(q, kc, vc, lengths, return_lse=True, **opts)[0])


FORMS = {"int": lambda n: int(n[0]), "0-d": lambda n: np.array(n[0]), "int32": lambda n: np.array(n, np.int32),
         "strided": lambda n: np.array([x for m in n for x in (m, -1)])[::2],
         "int16": lambda n: np.array(n, np.int16), "np.int64": lambda n: np.int64(n[0]),
         "huge int": lambda n: 1 << 70}


@pytest.mark.parametrize("form", list(FORMS))
def test_the_numpy_step_reads_the_lengths_in_every_form(form, checked):
    """An int, a 0-d array, int32, a strided (B,) view: read in place by the step;
    int16 and NumPy scalars: the full path; an int past int64: the full path's error."""
    q, kc, vc, kn, vn = arrays(2)
    got, want = [kc.copy(), vc.copy()], [kc.copy(), vc.copy()]
    one = form in ("int", "0-d", "np.int64")
    for n in ([3] * 3, [4] * 3, [23] * 3) if one else ([5, 0, 12], [6, 1, 13], [7, 2, 14]):
        if form == "huge int":
            attnkit.attention_kvcache(q, *got, 3, k_new=kn, v_new=vn)
            with pytest.raises(ValueError, match="cache_lengths"):
                attnkit.attention_kvcache(q, *got, FORMS[form](n), k_new=kn, v_new=vn)
            return
        a = attnkit.attention_kvcache(q, *got, FORMS[form](n), k_new=kn, v_new=vn, return_lse=True)
        b = full_path(q, *want, FORMS[form](n), k_new=kn, v_new=vn, return_lse=True)
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    assert len(checked) == 3 + (3 if form in ("int16", "np.int64") else 1)


@pytest.mark.parametrize("bad, match", [([4, -1, 2], "non-negative"), ([4, 1, CAP], "overflows"),
                                        ([4, CAP + 3, 2], "beyond its capacity"), (-2, "non-negative")])
def test_lengths_the_numpy_step_cannot_take_get_the_full_paths_errors(bad, match):
    q, kc, vc, kn, vn = arrays(3)
    kvspec._SEEN.clear()
    good = np.array([4, 1, 2]) if isinstance(bad, list) else 3
    for _ in range(2):
        attnkit.attention_kvcache(q, kc, vc, good, k_new=kn, v_new=vn)
    before = kc.copy(), vc.copy()
    with pytest.raises(ValueError, match=match):
        attnkit.attention_kvcache(q, kc, vc, np.array(bad) if isinstance(bad, list) else bad, k_new=kn, v_new=vn)
    assert np.array_equal(kc, before[0]) and np.array_equal(vc, before[1])


def test_what_the_numpy_step_declines(checked):
    """A read-only cache gets validation's error; q with a stride that is not a whole
    number of elements, sinks that are not C-ordered or not float32, and float64 calls
    (no step is made) take the full path, with its results."""
    q, kc, vc, kn, vn = arrays(4)
    lengths = np.array([1, 2, 3])
    for _ in range(2):
        attnkit.attention_kvcache(q, kc, vc, lengths, k_new=kn, v_new=vn)
    ro = kc.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        attnkit.attention_kvcache(q, ro, vc, lengths, k_new=kn, v_new=vn)
    assert len(checked) == 1
    odd = np.ndarray(q.shape, np.float32, np.zeros(q.nbytes + 2 * B, np.uint8), 2,
                     (q.strides[0] + 2,) + q.strides[1:])       # batch stride 2 bytes past whole elements
    odd[...] = q
    for _ in range(2):                                   # (the second: the step made for the first)
        assert np.array_equal(attnkit.attention_kvcache(odd, kc, vc, lengths), full_path(q, kc, vc, lengths))
    assert len(checked) == 1 + 4
    sinks = np.arange(2 * H, dtype=np.float32).reshape(H, 2)[:, 0]     # every other element
    for s in (sinks, sinks.astype(np.float64), np.ascontiguousarray(sinks)):
        for _ in range(2):
            got = attnkit.attention_kvcache(q, kc, vc, lengths, sinks=s)
            assert np.array_equal(got, full_path(q, kc, vc, lengths, sinks=s))
    assert len(checked) == 5 + 3 * 2 + 2 + 2            # the full path's six; the first two sinks' twice
    q64, k64, v64 = (x.astype(np.float64) for x in (q, kc, vc))
    for _ in range(2):
        attnkit.attention_kvcache(q64, k64, v64, lengths)
    assert len(checked) == 15 + 2


def test_new_keys_in_the_caches_memory_are_appended_as_the_full_path_appends_them():
    """k_new a view of the slots its append overwrites: the NumPy step declines too."""
    got = []
    for kept in (True, False):
        rng = np.random.default_rng(5)
        q, kc, vc = (rng.standard_normal(s).astype(np.float32) for s in ((1, 1, 1, 4), (1, 1, 8, 4), (1, 1, 8, 4)))
        run = attnkit.attention_kvcache if kept else full_path
        if kept:
            attnkit.attention_kvcache(q, kc.copy(), vc.copy(), 3, k_new=kc[:, :, 2:4].copy(), v_new=vc[:, :, 2:4].copy())
        got.append((run(q, kc, vc, 3, k_new=kc[:, :, 2:4], v_new=vc[:, :, 2:4]), kc, vc))
    assert all(np.array_equal(a, b) for a, b in zip(got[0], got[1]))


@pytest.mark.parametrize("apart", [0, 1])
def test_caches_in_one_buffer_are_appended_as_the_full_path_appends_them(apart):
    """k_cache and v_cache one array, or views one slot apart of one buffer (v's slot t
    is k's slot t + 1): the full path writes every new key before any value; the step,
    which writes key by key, declines the second (and takes the first: the same)."""
    rng = np.random.default_rng(6)
    q, kn, vn = (rng.standard_normal(s).astype(np.float32) for s in ((1, 1, 1, 4), (1, 1, 2, 4), (1, 1, 2, 4)))
    got = []
    for kept in (True, False):
        buf = np.arange(24, dtype=np.float32).reshape(1, 1, 6, 4) / 10
        kc, vc = (buf[:, :, :-1], buf[:, :, 1:]) if apart else (buf, buf)
        if kept:
            blank = np.zeros_like(kc)
            attnkit.attention_kvcache(q, blank, blank if not apart else blank.copy(), 1, k_new=kn, v_new=vn)
        got.append(((attnkit.attention_kvcache if kept else full_path)(q, kc, vc, 1, k_new=kn, v_new=vn), buf))
    assert np.array_equal(got[0][0], got[1][0]) and np.array_equal(got[0][1], got[1][1])

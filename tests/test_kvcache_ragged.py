"""attention_kvcache with q_lengths: a batch whose sequences bring different numbers of
new tokens (prefill chunks next to single decoding steps, speculative drafts of
different lengths). Sequence b's first q_lengths[b] query rows are real and, with
k_new, append that many keys; its other rows are padding (out 0, lse −inf, no sink);
causal and ALiBi align to each sequence's own last key. The Triton rung's cases are in
tests/torch/test_triton_kvcache.py."""

import numpy as np
import pytest

import attnkit
from attnkit.flash import runtime
from attnkit.testing import max_error
from test_kvcache import CASES, make_cache, one_by_one, read, write

RNG = np.random.default_rng
IDS = ["plain", "causal", "window", "softcap", "alibi", "sinks"]


def ragged_case(paged, page_size, L=4, seed=0, dtype="float64"):
    """Three sequences with 0, 17 and capacity − L cached keys; q and new keys of L rows."""
    B, H, Hkv, D, Dv = 3, 4, 2, 8, 5
    capacity = 40 if not paged else max(page_size * 2, 40)
    k, v, table = make_cache(B, Hkv, D, Dv, capacity, page_size, paged, seed=seed, dtype=dtype)
    rng = RNG(seed + 7)
    lengths = np.array([0, 17, capacity - L])
    for b in range(B):
        write(k, table, b, range(lengths[b]), rng.standard_normal((Hkv, lengths[b], D)), page_size)
        write(v, table, b, range(lengths[b]), rng.standard_normal((Hkv, lengths[b], Dv)), page_size)
    q = rng.standard_normal((B, H, L, D)).astype(dtype)
    new = dict(k_new=rng.standard_normal((B, Hkv, L, D)).astype(dtype),
               v_new=rng.standard_normal((B, Hkv, L, Dv)).astype(dtype))
    return q, k, v, table, lengths, new


def alone(q, k, v, table, lengths, q_lengths, page_size, kw):
    """Each sequence's real rows against its own keys (after the append), by hand."""
    H, Hkv = q.shape[1], k.shape[1]
    total = lengths + q_lengths
    keys = [np.repeat(read(k, table, b, total[b], page_size), H // Hkv, axis=0) for b in range(len(q))]
    values = [np.repeat(read(v, table, b, total[b], page_size), H // Hkv, axis=0) for b in range(len(q))]
    out, lse = [], []
    for b in range(len(q)):
        if q_lengths[b] == 0:                              # no query: nothing to compare
            out.append(np.zeros((H, 0, v.shape[-1]))), lse.append(np.zeros((H, 0)))
            continue
        o, s = one_by_one(q[b:b + 1, :, :q_lengths[b]], keys[b:b + 1], values[b:b + 1],
                          {n: (x[b:b + 1] if n == "sinks" and np.ndim(x) > 1 else x) for n, x in kw.items()})
        out.append(o[0]), lse.append(s[0])
    return out, lse


@pytest.mark.parametrize("paged,page_size", [(False, 40), (True, 1), (True, 16)])
@pytest.mark.parametrize("kw", CASES, ids=IDS)
@pytest.mark.parametrize("backend", ["flash", "small", "reference"])
def test_each_sequence_attends_its_own_rows_and_appends_that_many_keys(paged, page_size, kw, backend):
    q, k, v, table, lengths, new = ragged_case(paged, page_size)
    q_lengths = np.array([4, 0, 1])
    before_k, before_v = k.copy(), v.copy()
    out, lse = attnkit.attention_kvcache(q, k, v, lengths, block_table=table, q_lengths=q_lengths, return_lse=True,
                                         backend=backend, **new, **kw)
    want, want_lse = alone(q, k, v, table, lengths, q_lengths, page_size, kw)
    for b, n in enumerate(q_lengths):
        assert max_error(out[b, :, :n], want[b]) <= 1e-12 and max_error(lse[b, :, :n], want_lse[b]) <= 1e-12
        assert (out[b, :, n:] == 0).all() and (lse[b, :, n:] == -np.inf).all()    # padding, sink or not
        got = read(k, table, b, lengths[b] + n, page_size)[:, lengths[b]:]       # the first n new keys
        assert np.array_equal(got, new["k_new"][b, :, :n])
        write(before_k, table, b, range(lengths[b], lengths[b] + n), new["k_new"][b, :, :n], page_size)
        write(before_v, table, b, range(lengths[b], lengths[b] + n), new["v_new"][b, :, :n], page_size)
    assert np.array_equal(k, before_k, equal_nan=True) and np.array_equal(v, before_v, equal_nan=True)


@pytest.mark.parametrize("kw", CASES, ids=IDS)
def test_without_new_keys_the_lengths_only_mark_padding_rows(kw):
    """No k_new: the cache is read as it is; q_lengths aligns each sequence's rows."""
    q, k, v, table, lengths, _ = ragged_case(True, 16, seed=1)
    q_lengths = np.array([0, 3, 2])
    kv_len = lengths + 3                                   # keys already there
    for b in range(3):
        write(k, table, b, range(lengths[b], kv_len[b]), RNG(b).standard_normal((2, 3, 8)), 16)
        write(v, table, b, range(lengths[b], kv_len[b]), RNG(b).standard_normal((2, 3, 5)), 16)
    before = k.copy()
    out, lse = attnkit.attention_kvcache(q, k, v, kv_len, block_table=table, q_lengths=q_lengths, return_lse=True,
                                         **kw)
    want, want_lse = alone(q, k, v, table, kv_len - q_lengths, q_lengths, 16, kw)
    for b, n in enumerate(q_lengths):
        assert max_error(out[b, :, :n], want[b]) <= 1e-12 and max_error(lse[b, :, :n], want_lse[b]) <= 1e-12
        assert (out[b, :, n:] == 0).all() and (lse[b, :, n:] == -np.inf).all()
    assert np.array_equal(k, before, equal_nan=True)


def test_float32_streaming_kernel_bits_across_threads_and_torch():
    """The compiled decoding kernel (float32, few rows) by the 2× rule against float64,
    the same bits on 1 and 2 threads and from torch CPU tensors (eager and compiled)."""
    torch = pytest.importorskip("torch")
    q, k, v, table, lengths, new = ragged_case(True, 16, seed=3, dtype="float32")
    kw = dict(causal=True, alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625], np.float32))
    q_lengths = np.array([2, 4, 0])

    def run(threads, lib="numpy"):
        kc, vc = k.copy(), v.copy()
        args = [q, kc, vc, lengths, table, new["k_new"], new["v_new"], q_lengths, kw["alibi_slopes"]]
        if lib != "numpy":
            args = [torch.from_numpy(np.asarray(a)) for a in args]
        f = attnkit.attention_kvcache
        if lib == "compiled":
            f = torch.compile(f, fullgraph=True, backend="aot_eager")
        with runtime.threads(threads):
            out = f(args[0], args[1], args[2], args[3], block_table=args[4], k_new=args[5], v_new=args[6],
                    q_lengths=args[7], causal=True, alibi_slopes=args[8], backend="flash")
        return np.asarray(out), np.asarray(args[1])

    one, kc1 = run(1)
    two, kc2 = run(2)
    assert np.array_equal(one, two) and np.array_equal(kc1, kc2, equal_nan=True)
    for lib in ("torch", "compiled"):
        got, kc3 = run(2, lib)
        assert np.array_equal(got, one) and np.array_equal(kc3, kc1, equal_nan=True), lib
    kc, vc = k.astype(np.float64), v.astype(np.float64)
    wide = attnkit.attention_kvcache(q.astype(np.float64), kc, vc, lengths, block_table=table, q_lengths=q_lengths,
                                     k_new=new["k_new"].astype(np.float64), v_new=new["v_new"].astype(np.float64),
                                     backend="reference", **kw)
    same = attnkit.attention_kvcache(q, k.copy(), v.copy(), lengths, block_table=table, q_lengths=q_lengths,
                                     **new, backend="reference", **kw)
    assert max_error(one, wide) <= 2 * max_error(same, wide) + 1e-6


BAD = [
    (dict(q_lengths=np.array([5, 0, 1])), ValueError, r"q_lengths: expected lengths in \[0, L=4\]"),
    (dict(q_lengths=np.array([-1, 0, 1])), ValueError, "q_lengths"),
    (dict(q_lengths=np.array([1.0, 0, 1])), TypeError, "q_lengths"),
    (dict(q_lengths=np.array([1, 2])), ValueError, "q_lengths"),
    (dict(q_lengths=np.array([1, 2, 3]), k_new=np.zeros((3, 2, 2, 8)), v_new=np.zeros((3, 2, 2, 5))),
     ValueError, r"k_new: with q_lengths.*L_new = L = 4"),
    (dict(q_lengths=np.array([0, 4, 4]), cache_lengths=np.array([0, 17, 37])), ValueError,
     r"cache_lengths: sequence 2 holds 37 keys \+ 4 new = 41, the append overflows"),
]


@pytest.mark.parametrize("kw,err,match", BAD)
def test_bad_lengths_are_named_and_leave_the_cache_alone(kw, err, match):
    q, k, v, _, lengths, new = ragged_case(False, 40)
    kw = {"k_new": new["k_new"], "v_new": new["v_new"], "cache_lengths": lengths, **kw}
    before = k.copy()
    with pytest.raises(err, match=f"^{match}"):
        attnkit.attention_kvcache(q, k, v, kw.pop("cache_lengths"), **kw)
    assert np.array_equal(k, before, equal_nan=True)


def test_one_int_for_every_sequence():
    q, k, v, table, lengths, new = ragged_case(True, 16, seed=2)
    a = attnkit.attention_kvcache(q, k.copy(), v.copy(), lengths, block_table=table, q_lengths=2, causal=True, **new)
    b = attnkit.attention_kvcache(q, k.copy(), v.copy(), lengths, block_table=table, q_lengths=np.array([2, 2, 2]),
                                  causal=True, **new)
    assert np.array_equal(a, b)


def test_paged_cache_runs_prefill_chunks_next_to_decoding_steps():
    """One PagedCache, two sequences in every call: one prefills in chunks of 3 while
    the other decodes a token at a time, then both decode; each step equals attention
    over the whole sequence so far (causal, bottom-right)."""
    rng = RNG(11)
    cache = attnkit.PagedCache(num_pages=32, page_size=4, kv_heads=2, head_dim=8, dtype="float64")
    seqs = [cache.add_sequence() for _ in range(2)]
    ks, vs, qs = [[], []], [[], []], [[], []]
    for step, counts in enumerate([(3, 1), (3, 1), (3, 1), (1, 1), (1, 1)]):
        q = rng.standard_normal((2, 4, 3, 8))
        kn, vn = rng.standard_normal((2, 2, 3, 8)), rng.standard_normal((2, 2, 3, 8))
        out = cache.attend(q, seqs, k_new=kn, v_new=vn, q_lengths=np.array(counts), causal=True)
        for b, n in enumerate(counts):
            ks[b].append(kn[b, :, :n]), vs[b].append(vn[b, :, :n]), qs[b].append(q[b, :, :n])
            want = attnkit.attention(q[b, :, :n], np.concatenate(ks[b], 1), np.concatenate(vs[b], 1), causal=True,
                                     backend="reference")
            assert max_error(out[b, :, :n], want) <= 1e-12 and (out[b, :, n:] == 0).all(), (step, b)
    assert [cache.length(s) for s in seqs] == [11, 5]
    q = rng.standard_normal((2, 4, 1, 8))                  # a decoding step of the second sequence only
    kn, vn = rng.standard_normal((2, 2, 1, 8)), rng.standard_normal((2, 2, 1, 8))
    out = cache.attend(q, seqs, k_new=kn, v_new=vn, q_lengths=[0, 1], causal=True)
    ks[1].append(kn[1]), vs[1].append(vn[1])
    want = attnkit.attention(q[1], np.concatenate(ks[1], 1), np.concatenate(vs[1], 1), backend="reference")
    assert max_error(out[1], want) <= 1e-12 and (out[0] == 0).all()
    assert [cache.length(s) for s in seqs] == [11, 6]
    free = len(cache._free)
    with pytest.raises(ValueError, match="^q_lengths"):   # refused: no page kept
        cache.attend(rng.standard_normal((2, 4, 3, 8)), seqs, k_new=kn, v_new=vn, q_lengths=np.array([3, 4]))
    with pytest.raises(ValueError, match="^q_lengths"):
        cache.attend(rng.standard_normal((2, 4, 3, 8)), seqs, k_new=kn, v_new=vn, q_lengths=np.array([1, 2, 3]))
    assert len(cache._free) == free and [cache.length(s) for s in seqs] == [11, 6]


MORE = [dict(dropout=0.3, seed=5, causal=True), dict(window=(2, 1), align="top_left"),
        dict(sinks=np.linspace(-1, 1, 3 * 4 * 4).reshape(3, 4, 4), causal=True)]


@pytest.mark.parametrize("kw", MORE, ids=["dropout", "top_left-window", "row-sinks"])
@pytest.mark.parametrize("backend", ["flash", "small"])
def test_dropout_top_left_and_row_sinks_as_the_reference(kw, backend):
    """The rungs against the reference (the definition, checked above) on the same
    ragged call: dropout's draws, a top-left window, per-row sinks on padding rows."""
    results = []
    for b in (backend, "reference"):
        q, k, v, table, lengths, new = ragged_case(True, 16, seed=4)
        results.append(attnkit.attention_kvcache(q, k, v, lengths, block_table=table, q_lengths=np.array([2, 4, 0]),
                                                 return_lse=True, backend=b, **new, **kw))
    (out, lse), (want, want_lse) = results
    assert max_error(out, want) <= 1e-12 and max_error(lse, want_lse) <= 1e-12
    assert (lse[0, :, 2:] == -np.inf).all() and (lse[2] == -np.inf).all()


def test_paged_cache_names_bad_lengths_before_counting_pages():
    """Lengths that are not one per sequence reserve nothing: the error names them even
    when the pool could not hold L new keys per sequence."""
    cache = attnkit.PagedCache(num_pages=2, page_size=4, kv_heads=1, head_dim=4, dtype="float64")
    seqs = [cache.add_sequence() for _ in range(2)]
    cache.attend(np.ones((2, 1, 4, 4)), seqs, k_new=np.ones((2, 1, 4, 4)), v_new=np.ones((2, 1, 4, 4)))
    with pytest.raises(ValueError, match="^q_lengths"):
        cache.attend(np.ones((2, 1, 3, 4)), seqs, k_new=np.ones((2, 1, 3, 4)), v_new=np.ones((2, 1, 3, 4)),
                     q_lengths=np.array([0, 0, 0]))
    with pytest.raises(ValueError, match="^k_new: 2 more keys for 2 sequences need 2 more pages, 0 are free"):
        cache.attend(np.ones((2, 1, 3, 4)), seqs, k_new=np.ones((2, 1, 3, 4)), v_new=np.ones((2, 1, 3, 4)),
                     q_lengths=np.array([1, 1]))
    assert [cache.length(s) for s in seqs] == [4, 4]


def test_no_new_key_to_write_reads_no_page():
    """Every sequence appends nothing (q_lengths 0) into a block table without columns:
    no table entry is looked up, the rows are all padding."""
    q, new = np.ones((2, 1, 2, 4)), np.ones((2, 1, 2, 4))
    kc, vc = np.zeros((3, 1, 4, 4)), np.zeros((3, 1, 4, 4))
    out, lse = attnkit.attention_kvcache(q, kc, vc, 0, block_table=np.zeros((2, 0), np.int64), k_new=new,
                                         v_new=new, q_lengths=0, return_lse=True)
    assert (out == 0).all() and (lse == -np.inf).all() and not kc.any()


@pytest.mark.parametrize("backend", ["flash", "reference"])
def test_one_new_token_for_some_sequences_and_none_for_others(backend):
    """L = 1: a decoding step for sequence 0 and none for sequence 1, whose cache and
    length stay as they were."""
    q, k, v, table, lengths, new = ragged_case(True, 16, L=1, seed=6)
    before_k = k.copy()
    out = attnkit.attention_kvcache(q, k, v, lengths, block_table=table, q_lengths=np.array([1, 0, 1]),
                                     backend=backend, **new)
    assert (out[1] == 0).all() and not (out[0] == 0).all()
    write(before_k, table, 0, [lengths[0]], new["k_new"][0], 16)
    write(before_k, table, 2, [lengths[2]], new["k_new"][2], 16)
    assert np.array_equal(k, before_k, equal_nan=True)          # sequence 1's slot not written

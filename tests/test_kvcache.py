"""attention_kvcache: contiguous and paged caches (page sizes 1, 16, 256, pages in any
order), lengths 0 … capacity, one query and several, with and without appends, every
mask term a cache takes — equal to attention over each sequence's keys alone; the
append writes exactly the new keys; bad input leaves the cache untouched; NumPy,
torch CPU tensors and thread counts agree bitwise."""

import numpy as np
import pytest

import attnkit
from attnkit import flash
from attnkit.testing import error_budget, max_error

RNG = np.random.default_rng


def make_cache(B, Hkv, D, Dv, capacity, page_size, paged, seed=0, dtype="float64"):
    """A cache with garbage (NaN) in every slot, plus (pages, table) when paged."""
    rng = RNG(seed)
    if not paged:
        k = np.full((B, Hkv, capacity, D), np.nan, dtype)
        v = np.full((B, Hkv, capacity, Dv), np.nan, dtype)
        return k, v, None
    per_seq = -(-capacity // page_size)
    n_pages = B * per_seq + 3                            # spare pages nobody uses
    table = rng.permutation(n_pages)[:B * per_seq].reshape(B, per_seq)
    k = np.full((n_pages, Hkv, page_size, D), np.nan, dtype)
    v = np.full((n_pages, Hkv, page_size, Dv), np.nan, dtype)
    return k, v, table


def write(cache, table, b, pos, x, page_size):
    """cache positions pos (1-D) of sequence b ← x (Hkv, len(pos), D), by hand."""
    for i, p in enumerate(pos):
        if table is None:
            cache[b, :, p] = x[:, i]
        else:
            cache[table[b, p // page_size], :, p % page_size] = x[:, i]


def read(cache, table, b, n, page_size):
    """The first n keys of sequence b as (Hkv, n, D), by hand."""
    if table is None:
        return cache[b, :, :n]
    return np.stack([cache[table[b, p // page_size], :, p % page_size] for p in range(n)], axis=1) if n else \
        cache[:0, :, :0].reshape(cache.shape[1], 0, cache.shape[-1])


def one_by_one(q, keys, values, kw):
    """Each sequence alone through the reference (bottom-right: the last query sees the
    last key); no keys: out 0, lse -inf."""
    B, H, L, _ = q.shape
    out = np.zeros((B, H, L, values[0].shape[-1]))
    lse = np.full((B, H, L), -np.inf)
    for b in range(B):
        if keys[b].shape[1] == 0:                        # no key: out 0; lse the sink's (or -inf)
            if "sinks" in kw:
                lse[b] = np.broadcast_to(np.asarray(kw["sinks"])[:, None], (H, L))
            continue
        o, l = attnkit.attention(q[b], keys[b], values[b], return_lse=True, backend="reference",
                                 **{n: (x[b] if n == "sinks" and np.ndim(x) > 1 else x) for n, x in kw.items()})
        out[b], lse[b] = o, l
    return out, lse


CASES = [dict(), dict(causal=True), dict(window=(5, 0)), dict(softcap=2.0, causal=True),
         dict(alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625]), causal=True), dict(sinks=np.array([0.3, -1.0, 0.0, 2.0]))]


@pytest.mark.parametrize("paged,page_size", [(False, 40), (True, 1), (True, 16), (True, 256)])
@pytest.mark.parametrize("L,L_new", [(1, 1), (1, 0), (3, 3), (4, 2)])
@pytest.mark.parametrize("kw", CASES, ids=["plain", "causal", "window", "softcap", "alibi", "sinks"])
@pytest.mark.parametrize("backend", ["flash", "reference"])
def test_equals_each_sequence_alone(paged, page_size, L, L_new, kw, backend):
    B, H, Hkv, D, Dv = 3, 4, 2, 8, 5
    capacity = 40 if not paged else max(page_size * 2, 40)
    k, v, table = make_cache(B, Hkv, D, Dv, capacity, page_size, paged, seed=L + L_new)
    rng = RNG(7)
    lengths = np.array([0, 17, capacity - L_new])
    if paged:                                            # entries past the pages in use may hold anything
        used = -(-(lengths + L_new) // page_size)
        for b in range(B):
            table[b, used[b]:] = np.resize([10 ** 6, -1], table.shape[1] - used[b])
    for b in range(B):                                   # the cached keys
        write(k, table, b, range(lengths[b]), rng.standard_normal((Hkv, lengths[b], D)), page_size)
        write(v, table, b, range(lengths[b]), rng.standard_normal((Hkv, lengths[b], Dv)), page_size)
    q = rng.standard_normal((B, H, L, D))
    k_new, v_new = rng.standard_normal((B, Hkv, L_new, D)), rng.standard_normal((B, Hkv, L_new, Dv))
    before_k, before_v = k.copy(), v.copy()
    new = dict(k_new=k_new, v_new=v_new) if L_new else {}
    out, lse = attnkit.attention_kvcache(q, k, v, lengths, block_table=table, return_lse=True, backend=backend,
                                         **new, **kw)
    total = lengths + L_new
    keys = [np.repeat(read(k, table, b, total[b], page_size), H // Hkv, axis=0) for b in range(B)]
    values = [np.repeat(read(v, table, b, total[b], page_size), H // Hkv, axis=0) for b in range(B)]
    want, want_lse = one_by_one(q, keys, values, kw)
    assert max_error(out, want) <= 1e-12 and max_error(lse, want_lse) <= 1e-12
    for b in range(B):                                   # the append wrote exactly the new keys, nothing else
        if L_new:
            assert np.array_equal(read(k, table, b, total[b], page_size)[:, lengths[b]:], k_new[b])
            write(before_k, table, b, range(lengths[b], total[b]), k_new[b], page_size)
            write(before_v, table, b, range(lengths[b], total[b]), v_new[b], page_size)
    assert np.array_equal(k, before_k, equal_nan=True) and np.array_equal(v, before_v, equal_nan=True)


@pytest.mark.parametrize("paged,page_size", [(True, 1), (True, 16), (True, 256), (False, 3000)],
                         ids=["pages of 1", "pages of 16", "pages of 256", "contiguous"])
def test_float32_by_the_twice_the_reference_rule_and_bits_across_threads(paged, page_size):
    """The streaming kernel (float32) in short and long chunks of keys (pages of 256 and
    more keys take CHUNK_LONG; pages of one key are copied into one run a chunk),
    lengths that end inside chunks."""
    B, H, Hkv, D = 4, 8, 2, 64
    k, v, table = make_cache(B, Hkv, D, D, 3000, page_size, paged, dtype="float32")
    rng = RNG(3)
    lengths = np.array([3000, 1, 2500, 1200])
    for b in range(B):
        for cache in (k, v):
            write(cache, table, b, range(lengths[b]), rng.standard_normal((Hkv, lengths[b], D)).astype(np.float32),
                  page_size)
    q = rng.standard_normal((B, H, 1, D)).astype(np.float32)
    results = []
    for n in (1, 2, 3):
        with flash.threads(n):
            results.append(attnkit.attention_kvcache(q, k, v, lengths, block_table=table, return_lse=True,
                                                     backend="flash"))
    for r in results[1:]:
        assert np.array_equal(r[0], results[0][0]) and np.array_equal(r[1], results[0][1])
    same = attnkit.attention_kvcache(q, k, v, lengths, block_table=table, return_lse=True, backend="reference")
    oracle = attnkit.attention_kvcache(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), lengths,
                                       block_table=table, return_lse=True, backend="reference")
    for got, s, o in zip(results[0], same, oracle):
        assert max_error(got, o) <= error_budget(o, s)


@pytest.mark.parametrize("L", [1, 3])
@pytest.mark.parametrize("paged,page_size", [(True, 16), (False, 5000)], ids=["pages of 16", "contiguous"])
def test_a_long_sequence_is_split_and_merged_exactly(paged, page_size, L, monkeypatch):
    """One sequence of 5,000 keys (B = 1, two GQA groups: too few units for the workers)
    has its keys cut into parts (split-KV) merged by lse: equal to attention over its
    keys (float64 ≤ 1e-12; causal), the same bits on one thread and two."""
    B, H, Hkv, D, S = 1, 8, 2, 16, 5000
    k, v, table = make_cache(B, Hkv, D, D, S, page_size, paged)
    rng = RNG(5)
    for cache in (k, v):
        write(cache, table, 0, range(S), rng.standard_normal((Hkv, S, D)), page_size)
    q = rng.standard_normal((B, H, L, D))
    parts, forward = [], flash._forward.forward

    def spy(call, *args):                                # each task's part count (plans are kept)
        parts.extend(n for _, _, n, _, _ in flash._forward._plan(call)[1])
        return forward(call, *args)
    monkeypatch.setattr(flash._forward, "forward", spy)
    results = []
    for n in (1, 2):
        with flash.threads(n):
            results.append(attnkit.attention_kvcache(q, k, v, np.array([S]), block_table=table, causal=True,
                                                     return_lse=True, backend="flash"))
    assert parts and min(parts) > 1
    assert np.array_equal(results[0][0], results[1][0]) and np.array_equal(results[0][1], results[1][1])
    keys, values = read(k, table, 0, S, page_size), read(v, table, 0, S, page_size)
    out, lse = attnkit.attention(q[0], keys, values, causal=True, return_lse=True, backend="reference")
    assert max_error(results[0][0][0], out) <= 1e-12 and max_error(results[0][1][0], lse) <= 1e-12

@pytest.mark.parametrize("paged,page_size", [(True, 1), (True, 16), (True, 65), (False, 300)],
                         ids=["pages of 1", "pages of 16", "pages of 65", "contiguous"])
@pytest.mark.parametrize("H,Hkv,L,D,Dv", [(8, 2, 1, 32, 24), (6, 2, 2, 17, 5), (8, 1, 3, 8, 16), (3, 3, 1, 64, 64),
                                        (10, 2, 1, 72, 70)],
                         ids=["g4", "g3x2 odd dims", "g8x3", "mha", "g5 wide"])
@pytest.mark.parametrize("kw", CASES, ids=["plain", "causal", "window", "softcap", "alibi", "sinks"])
def test_float32_streaming_kernel_takes_every_term(paged, page_size, H, Hkv, L, D, Dv, kw):
    """The compiled kernel's row blocks (four rows per key read, and the rest), its
    edges (rows that see part of a chunk, pages that straddle chunks) and every term it
    applies, against the float64 reference by DESIGN.md §6's rule; 1 and 2 threads
    give the same bits. A contiguous cache of four sequences (one empty) takes the
    units of all kv heads at once, two sequences one kv head per unit."""
    B = 2 if paged else 4
    kw = {n: (np.resize(x, H) if n in ("sinks", "alibi_slopes") else x) for n, x in kw.items()}   # one per head
    k, v, table = make_cache(B, Hkv, D, Dv, 300, page_size, paged, dtype="float32")
    rng = RNG(11)
    lengths = np.array([300, 70, 0, 151])[:B]
    for b in range(B):
        write(k, table, b, range(lengths[b]), rng.standard_normal((Hkv, lengths[b], D)).astype(np.float32), page_size)
        write(v, table, b, range(lengths[b]), rng.standard_normal((Hkv, lengths[b], Dv)).astype(np.float32), page_size)
    q = rng.standard_normal((B, H, L, D)).astype(np.float32)
    runs = []
    for n in (1, 2):
        with flash.threads(n):
            runs.append(attnkit.attention_kvcache(q, k, v, lengths, block_table=table, return_lse=True,
                                                  backend="flash", **kw))
    assert all(np.array_equal(a, b) for a, b in zip(*runs))
    same = attnkit.attention_kvcache(q, k, v, lengths, block_table=table, return_lse=True, backend="reference", **kw)
    oracle = attnkit.attention_kvcache(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), lengths,
                                       block_table=table, return_lse=True, backend="reference", **kw)
    for g, s, o in zip(runs[0], same, oracle):
        assert max_error(g, o) <= error_budget(o, s)


@pytest.mark.parametrize("layout", ["k and v strided along D", "v strided along D", "padded rows", "heads inner"])
@pytest.mark.parametrize("paged", [True, False], ids=["pages", "contiguous"])
def test_float32_caches_in_any_layout_give_the_bits_of_their_copies(paged, layout):
    """The streaming kernel reads cache rows as vectors and follows every other stride:
    a cache strided along D (every other float of a wider array: read from a copy),
    one whose rows are padded or whose heads are inner (read in place) gives the same
    bits as its C-ordered copy, and the append lands in the caller's array."""
    B, Hkv, D, cap, page_size = 2, 2, 24, 48, 16
    wide = 2 * D if "strided" in layout else D + 5 if layout == "padded rows" else D
    k2, v2, table = make_cache(B, Hkv, wide, wide, cap, page_size, paged, dtype="float32")
    if layout == "heads inner":                       # (…, slots, Hkv, D) memory, viewed as (…, Hkv, slots, D)
        k2, v2 = (np.ascontiguousarray(x.swapaxes(1, 2)).swapaxes(1, 2) for x in (k2, v2))
    cut = slice(None, None, 2) if "strided" in layout else slice(None, D)
    k, v = (k2[..., :D] if layout == "v strided along D" else k2[..., cut]), v2[..., cut]
    rng = RNG(8)
    lengths = np.array([37, 20])
    for b in range(B):
        for cache in (k, v):
            write(cache, table, b, range(lengths[b]), rng.standard_normal((Hkv, lengths[b], D)).astype(np.float32),
                  page_size)
    q = rng.standard_normal((B, 8, 1, D)).astype(np.float32)
    k_new, v_new = (rng.standard_normal((B, Hkv, 1, D)).astype(np.float32) for _ in range(2))
    kc, vc = np.ascontiguousarray(k), np.ascontiguousarray(v)
    want = attnkit.attention_kvcache(q, kc, vc, lengths, block_table=table, k_new=k_new, v_new=v_new,
                                     return_lse=True, backend="flash")
    got = attnkit.attention_kvcache(q, k, v, lengths, block_table=table, k_new=k_new, v_new=v_new, return_lse=True,
                                    backend="flash")
    assert all(np.array_equal(g, w) for g, w in zip(got, want))
    assert np.array_equal(k, kc, equal_nan=True) and np.array_equal(v, vc, equal_nan=True)


@pytest.mark.parametrize("backend", ["auto", "small", "flash"])
def test_a_broadcast_batch_of_queries_and_a_batch_inner_cache(backend):
    """q broadcast along the batch (stride 0) and caches stored (Hkv, B, S, D), viewed as
    (B, Hkv, S, D): every rung as the reference (the small rung's scores came out of
    NumPy's product in another memory order, and its in-place softmax missed them)."""
    rng = RNG(0)
    q = np.broadcast_to(rng.standard_normal((1, 4, 3, 16)), (2, 4, 3, 16))
    k, v = (rng.standard_normal((2, 2, 20, 16)).transpose(1, 0, 2, 3) for _ in range(2))
    lengths = np.array([5, 13])
    want = attnkit.attention_kvcache(q, k, v, lengths, return_lse=True, backend="reference")
    got = attnkit.attention_kvcache(q, k, v, lengths, return_lse=True, backend=backend)
    assert all(max_error(g, w) <= 1e-12 for g, w in zip(got, want))


def test_a_pool_read_in_place_unless_strided_along_d():
    """Only a pool whose rows are not of unit stride is copied for the kernel (a padded
    or heads-inner pool is read where it is)."""
    from attnkit.flash.plan import Call
    from attnkit.spec.kvcache import validate_kvcache
    k2, v2, table = make_cache(1, 2, 16, 16, 32, 16, True, dtype="float32")
    q = np.ones((1, 4, 1, 8), np.float32)
    for k, v, copied in ((k2[..., :8], v2[..., :8], (False, False)), (k2[..., ::2], v2[..., :8], (True, False)),
                         (k2[..., :8], v2[..., ::2], (False, True))):
        kv = validate_kvcache(q, k, v, np.array([20]), block_table=table)
        call = Call(kv.spec, None, None, pages=(kv.k_cache, kv.v_cache, np.asarray(table, np.int64), kv.page_size))
        assert call.stream
        assert (not np.shares_memory(call.pages[0], k), not np.shares_memory(call.pages[1], v)) == copied


@pytest.mark.parametrize("paged", [True, False], ids=["pages of 16", "contiguous"])
@pytest.mark.parametrize("n,kw,nan_keys,nan_rows", [
    (40, dict(window=(2, 0)), [34, 38], [True, False, True, True]),   # key 34: row 0 only; 38: rows 2, 3
    (40, dict(causal=True), [39], [False, False, False, True]),       # the last key: the last row only
    (400, dict(window=(300, 0)), [96], [True, False, False, False]),  # rows that start apart in one chunk
], ids=["window", "causal", "wide window"])
@pytest.mark.parametrize("where", ["values", "keys"])
def test_float32_kernel_never_reads_the_value_of_a_key_a_row_excludes(paged, n, kw, nan_keys, nan_rows, where):
    """Four query rows over n cached keys, NaN values (or keys) at keys some rows
    exclude: the rows that see one are NaN, every other row is finite."""
    page_size = 16 if paged else n
    k, v, table = make_cache(1, 1, 8, 8, n, page_size, paged, dtype="float32")
    rng = RNG(5)
    write(k, table, 0, range(n), rng.standard_normal((1, n, 8)).astype(np.float32), page_size)
    write(v, table, 0, range(n), rng.standard_normal((1, n, 8)).astype(np.float32), page_size)
    write(v if where == "values" else k, table, 0, nan_keys, np.full((1, len(nan_keys), 8), np.nan, np.float32),
          page_size)
    q = rng.standard_normal((1, 4, 4, 8)).astype(np.float32)
    out = attnkit.attention_kvcache(q, k, v, np.array([n]), block_table=table, backend="flash", **kw)
    assert np.array_equal(np.isnan(out).all(axis=-1), np.broadcast_to(nan_rows, (1, 4, 4)))
    assert np.isfinite(out[:, :, ~np.array(nan_rows)]).all()


def test_torch_cpu_tensors_match_numpy_and_append_in_place():
    torch = pytest.importorskip("torch")
    k, v, table = make_cache(2, 1, 4, 4, 32, 8, True, dtype="float32")
    rng = RNG(4)
    q = rng.standard_normal((2, 2, 1, 4)).astype(np.float32)
    kn, vn = (rng.standard_normal((2, 1, 1, 4)).astype(np.float32) for _ in range(2))
    lengths = np.array([5, 0])
    for b in range(2):
        write(k, table, b, range(lengths[b]), rng.standard_normal((1, lengths[b], 4)).astype(np.float32), 8)
        write(v, table, b, range(lengths[b]), rng.standard_normal((1, lengths[b], 4)).astype(np.float32), 8)
    tk, tv = torch.tensor(k), torch.tensor(v)
    want = attnkit.attention_kvcache(q, k, v, lengths, block_table=table, k_new=kn, v_new=vn, causal=True)
    got = attnkit.attention_kvcache(torch.tensor(q), tk, tv, torch.tensor(lengths), block_table=torch.tensor(table),
                                    k_new=torch.tensor(kn), v_new=torch.tensor(vn), causal=True)
    assert isinstance(got, torch.Tensor) and np.array_equal(got.numpy(), want)
    assert np.array_equal(tk.numpy(), k, equal_nan=True) and np.array_equal(tv.numpy(), v, equal_nan=True)


def test_one_length_for_every_sequence():
    """cache_lengths as one int (a Python int, a NumPy integer, a 0-d array or tensor:
    FlashAttention's ``cache_seqlens`` takes an int) is that length for every sequence:
    the same bits and the same appended cache as the (B,) array."""
    torch = pytest.importorskip("torch")
    rng = RNG(7)
    q = rng.standard_normal((3, 4, 2, 8)).astype(np.float32)
    kn, vn = (rng.standard_normal((3, 2, 2, 8)).astype(np.float32) for _ in range(2))
    base = rng.standard_normal((2, 3, 2, 12, 8)).astype(np.float32)
    k, v = base[0].copy(), base[1].copy()
    want = attnkit.attention_kvcache(q, k, v, np.array([5, 5, 5]), k_new=kn, v_new=vn, causal=True)
    for n in (5, np.int32(5), np.array(5, dtype=np.int16)):
        kc, vc = base[0].copy(), base[1].copy()
        got = attnkit.attention_kvcache(q, kc, vc, n, k_new=kn, v_new=vn, causal=True)
        assert np.array_equal(got, want) and np.array_equal(kc, k) and np.array_equal(vc, v), type(n)
    for n in (5, torch.tensor(5)):
        kc, vc = torch.tensor(base[0]), torch.tensor(base[1])
        got = attnkit.attention_kvcache(torch.tensor(q), kc, vc, n, k_new=torch.tensor(kn), v_new=torch.tensor(vn),
                                        causal=True)
        assert np.array_equal(got.numpy(), want) and np.array_equal(kc.numpy(), k), type(n)
    with pytest.raises(TypeError, match="^cache_lengths: expected a torch.Tensor"):   # one library per call
        attnkit.attention_kvcache(torch.tensor(q), torch.tensor(k), torch.tensor(v), np.array(5))


BAD = [
    (dict(cache_lengths=np.array([41, 0])), ValueError, "cache_lengths"),        # beyond capacity
    (dict(cache_lengths=np.array([39, 0]), k_new=np.zeros((2, 1, 2, 4)), v_new=np.zeros((2, 1, 2, 4))),
     ValueError, "cache_lengths"),                                                 # the append overflows
    (dict(k_new=np.zeros((2, 2, 1, 4)), v_new=np.zeros((2, 2, 1, 4))), ValueError, "k_new"),   # wrong heads
    (dict(k_new=np.zeros((2, 1, 1, 4))), ValueError, "v_new"),
    (dict(cache_lengths=np.array([1.0, 2.0])), TypeError, "cache_lengths"),
    (dict(cache_lengths=np.array([-1, 2])), ValueError, "cache_lengths"),
    (dict(cache_lengths=np.array([1, 2, 3])), ValueError, "cache_lengths"),
    (dict(cache_lengths=41), ValueError, "cache_lengths"),                           # one int: each sequence's
    (dict(cache_lengths=-1), ValueError, "cache_lengths"),
    (dict(cache_lengths=2**64), ValueError, "cache_lengths"),                        # past int64 (no OverflowError)
    (dict(q_lengths=2**63), ValueError, "q_lengths"),
    (dict(cache_lengths=True), TypeError, "cache_lengths"),                          # not an int
    (dict(cache_lengths=2.0), TypeError, "cache_lengths"),
    (dict(cache_lengths=np.array(2.0)), TypeError, "cache_lengths"),
    (dict(keep=np.ones((1, 40), bool)), TypeError, "keep"),
    (dict(q=np.zeros((2, 2, 4))), ValueError, "q"),
    (dict(q=np.zeros((2, 2, 0, 4))), ValueError, "q"),                              # no query rows
    (dict(q=np.zeros((0, 2, 1, 4)), cache_lengths=np.zeros(0, np.int64)), ValueError, "q"),   # no sequences
]


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("kw,err,name", BAD)
def test_bad_input_gets_a_named_error_and_leaves_the_cache_alone(kw, err, name, paged):
    """Each a named error with the cache untouched (random keys: the new ones, zeros,
    would show), contiguous or paged (pages of 8, five a sequence in a shuffled table:
    the same 40 keys of capacity)."""
    args = dict(q=np.zeros((2, 2, 1, 4)), cache_lengths=np.array([3, 0]))
    k, v = RNG(7).standard_normal((2, 2, 1, 40, 4))
    if paged:
        k, v = RNG(7).standard_normal((2, 10, 1, 8, 4))
        args["block_table"] = RNG(6).permutation(10).reshape(2, 5)
    before = k.copy(), v.copy()
    args.update(kw)
    with pytest.raises(err, match=f"^{name}"):
        attnkit.attention_kvcache(args.pop("q"), k, v, args.pop("cache_lengths"), **args)
    assert np.array_equal(k, before[0]) and np.array_equal(v, before[1])


def test_a_block_table_past_the_pages_is_refused():
    k, v = np.zeros((4, 1, 8, 4)), np.zeros((4, 1, 8, 4))
    with pytest.raises(ValueError, match="^block_table.*page 9"):
        attnkit.attention_kvcache(np.zeros((1, 1, 1, 4)), k, v, np.array([10]), block_table=np.array([[0, 9]]),
                                  k_new=np.ones((1, 1, 1, 4)), v_new=np.ones((1, 1, 1, 4)))
    assert not k.any()


def test_paged_cache_helper_generates_like_attention_over_the_whole_sequence():
    rng = RNG(5)
    cache = attnkit.PagedCache(num_pages=16, page_size=4, kv_heads=2, head_dim=8, dtype="float64")
    seqs = [cache.add_sequence() for _ in range(2)]
    ks, vs = [[], []], [[], []]
    for step in range(9):
        q = rng.standard_normal((2, 4, 1, 8))
        kn, vn = rng.standard_normal((2, 2, 1, 8)), rng.standard_normal((2, 2, 1, 8))
        out = cache.attend(q, seqs, k_new=kn, v_new=vn)
        for b in range(2):
            ks[b].append(kn[b]), vs[b].append(vn[b])
            want = attnkit.attention(q[b], np.concatenate(ks[b], 1), np.concatenate(vs[b], 1), backend="reference")
            assert max_error(out[b], want) <= 1e-12
    assert cache.length(seqs[0]) == 9
    cache.free(seqs[0])
    with pytest.raises(ValueError, match="^seq"):
        cache.length(seqs[0])
    with pytest.raises(ValueError, match="^n"):
        cache.reserve(seqs[1], 16 * 4)


# ---- found by mutation testing (scripts/mutation.py, docs/mutation.md) ------------------
BAD_MORE = [
    (dict(q=None), TypeError, "q"),
    (dict(k_cache=None), TypeError, "k_cache"),
    (dict(v_cache=None), TypeError, "v_cache"),
    (dict(cache_lengths=None), TypeError, "cache_lengths"),
    (dict(k_cache=np.zeros((2, 40, 4))), ValueError, "k_cache"),                  # 3-D
    (dict(v_cache=np.zeros((2, 1, 40, 0))), ValueError, "v_cache"),               # an empty dim
    (dict(k_cache=np.zeros((2, 0, 40, 4)), v_cache=np.zeros((2, 0, 40, 4))), ValueError, "k_cache"),
    (dict(q=np.zeros((2, 3, 1, 4)), k_cache=np.zeros((2, 2, 40, 4)), v_cache=np.zeros((2, 2, 40, 4))),
     ValueError, "k_cache"),                                                       # H=3 over Hkv=2
    (dict(block_table=np.zeros((2, 1))), TypeError, "block_table"),               # float pages
    (dict(block_table=np.zeros(2, np.int64)), ValueError, "block_table"),         # 1-D
]


@pytest.mark.parametrize("kw,err,name", BAD_MORE)
def test_more_bad_input_gets_a_named_error_and_leaves_the_cache_alone(kw, err, name):
    k, v = np.zeros((2, 1, 40, 4)), np.zeros((2, 1, 40, 4))
    args = dict(q=np.zeros((2, 2, 1, 4)), k_cache=k, v_cache=v, cache_lengths=np.array([3, 0]))
    args.update(kw)
    with pytest.raises(err, match=rf"^{name}(?!\w)"):
        attnkit.attention_kvcache(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), args.pop("cache_lengths"),
                                  **args)
    assert not k.any() and not v.any()


def test_overflow_messages_say_whether_the_append_overflows():
    k, v = np.zeros((2, 1, 40, 4)), np.zeros((2, 1, 40, 4))
    q = np.zeros((2, 2, 1, 4))
    with pytest.raises(ValueError, match=r"^cache_lengths: sequence 0 holds 41 keys \+ 0 new = 41, beyond"):
        attnkit.attention_kvcache(q, k, v, np.array([41, 0]))
    with pytest.raises(ValueError,
                       match=r"^cache_lengths: sequence 1 holds 39 keys \+ 2 new = 41, the append overflows"):
        attnkit.attention_kvcache(q, k, v, np.array([0, 39]), k_new=np.ones((2, 1, 2, 4)), v_new=np.ones((2, 1, 2, 4)))
    assert not k.any() and not v.any()


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("held", [np.int64(2**63 - 1), np.uint64(2**63), np.uint64(2**64 - 1)],
                         ids=["int64 max", "uint64 past int64", "uint64 max"])
def test_lengths_near_the_integer_limit_are_quoted_and_refused(paged, held):
    """A length near its dtype's limit plus the new keys wrapped to a negative total: a
    contiguous cache was refused under kv_lengths (an argument not given) with the
    wrapped value, a paged one with an IndexError from inside the check. The length is
    beyond the capacity, quoted as given; a page past int64 likewise."""
    k, v = np.zeros((2, 1, 8, 4)), np.zeros((2, 1, 8, 4))
    lengths = np.array([held, 3], dtype=np.asarray(held).dtype)
    new = np.ones((2, 1, 1, 4))
    table = dict(block_table=np.array([[0], [1]])) if paged else {}
    with pytest.raises(ValueError, match=rf"^cache_lengths: sequence 0 holds {int(held)} keys \+ 1 new = "
                                         rf"{int(held) + 1}, beyond its capacity of 8 keys"):
        attnkit.attention_kvcache(np.zeros((2, 1, 1, 4)), k, v, lengths, k_new=new, v_new=new, **table)
    if paged:
        with pytest.raises(ValueError, match=rf"^block_table: sequence 1 points at page {2**64 - 1} outside"):
            attnkit.attention_kvcache(np.zeros((2, 1, 1, 4)), k, v, np.array([3, 3], dtype=np.uint64), k_new=new,
                                      v_new=new, block_table=np.array([[0], [2**64 - 1]], dtype=np.uint64))
    assert not k.any() and not v.any()


@pytest.mark.parametrize("bad", [-1, 4])
def test_a_block_table_entry_outside_the_pages_is_named(bad):
    """Page -1 would silently read the last page (NumPy's negative index); page
    num_pages is one past the end. Either is refused, and the message names it."""
    k, v = np.zeros((4, 1, 8, 4)), np.zeros((4, 1, 8, 4))
    with pytest.raises(ValueError, match=rf"^block_table: sequence 0 points at page {bad} outside \[0, num_pages=4\)"):
        attnkit.attention_kvcache(np.zeros((1, 1, 1, 4)), k, v, np.array([10]), block_table=np.array([[2, bad]]))
    assert not k.any()


def test_a_block_table_is_checked_per_sequence_up_to_its_used_pages():
    """Entries past the pages a sequence uses are never read, so any value there is
    accepted; the first sequence with a bad used entry is the one named, with that
    entry."""
    k, v = np.zeros((4, 1, 8, 4)), np.zeros((4, 1, 8, 4))
    q = np.zeros((3, 1, 1, 4))
    table = np.array([[0, 99], [1, -5], [2, 3]])          # sequences 0 and 1 use one page each
    attnkit.attention_kvcache(q, k, v, np.array([8, 3, 16]), block_table=table)
    with pytest.raises(ValueError, match=r"^block_table: sequence 1 points at page -5 outside \[0, num_pages=4\)"):
        attnkit.attention_kvcache(q, k, v, np.array([8, 9, 16]), block_table=table)
    table[2, 1] = 7                                       # a later sequence's bad page is not the one named
    with pytest.raises(ValueError, match=r"^block_table: sequence 1 points at page -5"):
        attnkit.attention_kvcache(q, k, v, np.array([8, 9, 16]), block_table=table)


@pytest.mark.parametrize("backend", ["flash", "reference"])
def test_tiny_caches_one_slot_and_no_pages(backend):
    """A contiguous cache of one slot attends its one key; a block table with no
    columns holds no key (out 0, lse -inf)."""
    rng = RNG(6)
    q, k, v = rng.standard_normal((2, 2, 1, 4)), rng.standard_normal((2, 1, 1, 4)), rng.standard_normal((2, 1, 1, 3))
    out, lse = attnkit.attention_kvcache(q, k, v, np.array([1, 0]), return_lse=True, backend=backend)
    for b, n in enumerate((1, 0)):
        want, want_lse = one_by_one(q[b:b + 1], [np.repeat(k[b, :, :n], 2, axis=0)],
                                    [np.repeat(v[b, :, :n], 2, axis=0)], {})
        assert max_error(out[b:b + 1], want) <= 1e-12 and max_error(lse[b:b + 1], want_lse) <= 1e-12
    out, lse = attnkit.attention_kvcache(q, k, v, np.array([0, 0]), block_table=np.zeros((2, 0), np.int64),
                                         return_lse=True, backend=backend)
    assert out.shape == (2, 2, 1, 3) and not out.any() and np.all(lse == -np.inf)


def test_new_keys_in_lists_are_read_like_arrays():
    rng = RNG(8)
    q = rng.standard_normal((1, 2, 1, 4))
    kn, vn = rng.standard_normal((1, 1, 1, 4)), rng.standard_normal((1, 1, 1, 4))
    k1, v1, k2, v2 = (np.zeros((1, 1, 8, 4)) for _ in range(4))
    want = attnkit.attention_kvcache(q, k1, v1, np.array([0]), k_new=kn, v_new=vn)
    got = attnkit.attention_kvcache(q.tolist(), k2, v2, [0], k_new=kn.tolist(), v_new=vn.tolist())
    assert np.array_equal(got, want) and np.array_equal(k2, k1) and np.array_equal(v2, v1)


def test_torch_caches_refuse_new_keys_that_require_grad():
    """Forward only: any input that requires grad is named while grad mode is on; no
    append at all runs with grad mode on."""
    torch = pytest.importorskip("torch")
    q, cache = torch.randn(1, 2, 1, 4), torch.zeros(1, 1, 8, 4)
    assert attnkit.attention_kvcache(q, cache, cache, torch.tensor([3])).shape == (1, 2, 1, 4)
    kn, vn = torch.ones(1, 1, 1, 4, requires_grad=True), torch.ones(1, 1, 1, 4)
    with pytest.raises(TypeError, match=r"^k_new: attention_kvcache is forward only"):
        attnkit.attention_kvcache(q, cache, cache, torch.tensor([3]), k_new=kn, v_new=vn)
    assert not cache.any()
    with pytest.raises(TypeError, match=r"^k_new\b"):
        attnkit.attention_kvcache(q.numpy(), cache.numpy(), cache.numpy(), np.array([3]), k_new=kn.detach(),
                                  v_new=vn.numpy())


def test_the_validated_call_is_frozen():
    """Like the Spec, a validated call cannot be changed by the rungs it is handed to."""
    import dataclasses

    from attnkit.spec.kvcache import validate_kvcache
    kv = validate_kvcache(np.zeros((1, 1, 1, 4)), np.zeros((1, 1, 8, 4)), np.zeros((1, 1, 8, 4)), np.array([3]))
    assert kv.page_size == 8 and not kv.paged
    with pytest.raises(dataclasses.FrozenInstanceError):
        kv.page_size = 4


# ---- dropout: the same entries as attention over the gathered keys ------------------------
def dropout_case(paged, page_size, dtype="float64", seed=0):
    """(q, k, v, table, lengths, k_new, v_new, dense (K, V) with each sequence's keys
    after the append, zeros past its length): B=3, H=4 over Hkv=2, L=3, L_new=2."""
    B, H, Hkv, D, Dv, L, L_new, capacity = 3, 4, 2, 8, 5, 3, 2, 48
    k, v, table = make_cache(B, Hkv, D, Dv, capacity, page_size, paged, seed=seed, dtype=dtype)
    rng = RNG(seed + 1)
    lengths = np.array([0, 19, capacity - L_new])
    for b in range(B):
        write(k, table, b, range(lengths[b]), rng.standard_normal((Hkv, lengths[b], D)).astype(dtype), page_size)
        write(v, table, b, range(lengths[b]), rng.standard_normal((Hkv, lengths[b], Dv)).astype(dtype), page_size)
    q = rng.standard_normal((B, H, L, D)).astype(dtype)
    k_new, v_new = rng.standard_normal((B, Hkv, L_new, D)).astype(dtype), rng.standard_normal((B, Hkv, L_new, Dv)).astype(dtype)
    K, V = np.zeros((B, Hkv, capacity, D), dtype), np.zeros((B, Hkv, capacity, Dv), dtype)
    for b in range(B):
        n = lengths[b]
        K[b, :, :n], V[b, :, :n] = read(k, table, b, n, page_size), read(v, table, b, n, page_size)
        K[b, :, n:n + L_new], V[b, :, n:n + L_new] = k_new[b], v_new[b]
    return q, k, v, table, lengths, k_new, v_new, (K, V)


@pytest.mark.parametrize("paged,page_size", [(False, 48), (True, 1), (True, 16)])
@pytest.mark.parametrize("backend", ["flash", "reference"])
def test_dropout_drops_what_attention_over_the_gathered_keys_drops(paged, page_size, backend):
    """Dropout's counters are (seed, batch index, head, the query's row in q, the key's
    position in its sequence) — not the cache slot or page: the same output as
    attention with kv_lengths over each sequence's keys laid out densely."""
    q, k, v, table, lengths, k_new, v_new, (K, V) = dropout_case(paged, page_size)
    kw = dict(causal=True, alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625]), dropout=0.3, seed=2 ** 40 + 5)
    out, lse = attnkit.attention_kvcache(q, k, v, lengths, block_table=table, k_new=k_new, v_new=v_new,
                                         return_lse=True, backend=backend, **kw)
    want, want_lse = attnkit.attention(q, K, V, kv_lengths=lengths + 2, return_lse=True, backend="reference", **kw)
    plain = attnkit.attention(q, K, V, kv_lengths=lengths + 2, backend="reference",
                              **{n: x for n, x in kw.items() if n not in ("dropout", "seed")})
    assert max_error(out, want) <= 1e-12 and max_error(lse, want_lse) <= 1e-12   # lse: before dropout
    assert max_error(out, plain) > 0.1                  # dropout did drop something


def test_dropout_in_float32_and_p_zero_is_no_dropout_bitwise():
    q, k, v, table, lengths, k_new, v_new, (K, V) = dropout_case(True, 16, dtype="float32")
    got = attnkit.attention_kvcache(q, k, v, lengths, block_table=table, k_new=k_new, v_new=v_new,
                                    dropout=0.5, seed=3, backend="flash")
    want = attnkit.attention(q, K, V, kv_lengths=lengths + 2, dropout=0.5, seed=3, backend="reference")
    assert max_error(got, want) <= 1e-5 * max(1.0, np.abs(want).max())
    plain = attnkit.attention_kvcache(q, k, v, lengths, block_table=table, backend="flash")   # appended already
    zero = attnkit.attention_kvcache(q, k, v, lengths + 2, block_table=table, dropout=0.0, seed=3, backend="flash")
    again = attnkit.attention_kvcache(q, k, v, lengths + 2, block_table=table, backend="flash")
    assert np.array_equal(zero, again) and not np.array_equal(plain, again)


def test_dropout_needs_a_seed_outside_torch_and_a_probability_below_one():
    q, k, v, table, lengths, _, _, _ = dropout_case(False, 48)
    with pytest.raises(ValueError, match="^seed: dropout > 0 needs a seed"):
        attnkit.attention_kvcache(q, k, v, lengths, dropout=0.1)
    with pytest.raises(ValueError, match="^dropout"):
        attnkit.attention_kvcache(q, k, v, lengths, dropout=1.0, seed=1)


@pytest.mark.parametrize("backend", ["flash", "reference"])
def test_torch_dropout_draws_its_seed_from_torch(backend):
    """Torch tensors without a seed: torch.manual_seed makes a call reproducible, the
    next draw drops other entries, and an explicit seed equals the NumPy result."""
    torch = pytest.importorskip("torch")
    q, k, v, table, lengths, k_new, v_new, (K, V) = dropout_case(True, 16, dtype="float32")
    for b in range(len(lengths)):                        # the new keys, appended by hand
        write(k, table, b, range(lengths[b], lengths[b] + 2), k_new[b], 16)
        write(v, table, b, range(lengths[b], lengths[b] + 2), v_new[b], 16)
    t = [torch.tensor(x) for x in (q, k, v, lengths + 2, table)]

    def call(**kw):
        return attnkit.attention_kvcache(t[0], t[1], t[2], t[3], block_table=t[4], dropout=0.4, backend=backend, **kw)

    torch.manual_seed(11)
    a, b = call(), call()
    torch.manual_seed(11)
    assert torch.equal(call(), a) and not torch.equal(a, b)
    want = attnkit.attention(q, K, V, kv_lengths=lengths + 2, dropout=0.4, seed=2 ** 63 + 9, backend=backend)
    assert np.allclose(call(seed=2 ** 63 + 9).numpy(), want, atol=1e-6)


# ---- found by a port of FlashInfer's tests (2026-12-04) ----------------------------
@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_half_precision_pages_on_the_flash_rung(lib):
    """A float16 paged cache on the flash rung (which "auto" picks for real sizes)
    equals the reference; the compiled streaming kernel takes float32 only."""
    q, k_new, v_new = (RNG(s).standard_normal(sh).astype(np.float16) for s, sh in
                       ((1, (2, 4, 1, 16)), (2, (2, 2, 1, 16)), (3, (2, 2, 1, 16))))
    kp, vp, table = make_cache(2, 2, 16, 16, 40, 16, True, dtype="float16")
    kp[np.isnan(kp)], vp[np.isnan(vp)] = 0.5, -0.5
    lengths = np.array([17, 30])
    res = {}
    for backend in ("reference", "flash"):
        args = [x.copy() for x in (q, kp, vp)] + [lengths, table, k_new, v_new]
        if lib == "torch":
            torch = pytest.importorskip("torch")
            args = [torch.from_numpy(x) for x in args]
        qq, kc, vc, n, t, kn, vn = args
        out = attnkit.attention_kvcache(qq, kc, vc, n, block_table=t, k_new=kn, v_new=vn, backend=backend)
        res[backend] = np.asarray(out, np.float64)
    assert max_error(res["flash"], res["reference"]) <= 2e-3


def test_a_cache_that_cannot_be_written_is_named_and_left_alone():
    q, new = np.ones((1, 1, 1, 2)), np.full((1, 1, 1, 2), 7.0)
    k, v = np.zeros((1, 1, 4, 2)), np.zeros((1, 1, 4, 2))
    v.setflags(write=False)
    with pytest.raises(ValueError, match="^v_cache"):
        attnkit.attention_kvcache(q, k, v, np.array([0]), k_new=new, v_new=new)
    assert not k.any()
    torch = pytest.importorskip("torch")
    tk, tv = torch.zeros(1, 1, 4, 2), torch.zeros(1, 1, 1, 2).expand(1, 1, 4, 2)   # broadcast: one slot
    tn = torch.full((1, 1, 1, 2), 7.0)
    with pytest.raises(ValueError, match="^v_cache"):
        attnkit.attention_kvcache(torch.ones(1, 1, 1, 2), tk, tv, torch.tensor([0]), k_new=tn, v_new=tn)
    assert not tk.any()


def test_paged_cache_refuses_a_sequence_twice_and_grows_all_or_nothing():
    cache = attnkit.PagedCache(num_pages=3, page_size=2, kv_heads=1, head_dim=2, dtype="float64")
    a, b = cache.add_sequence(), cache.add_sequence()
    k = np.ones((2, 1, 1, 2))
    with pytest.raises(ValueError, match="^seqs"):
        cache.attend(np.ones((2, 1, 1, 2)), [a, a], k_new=k, v_new=k)
    assert cache.length(a) == 0
    for bad in (-5, 1.5, True):
        with pytest.raises(ValueError, match="^n"):
            cache.reserve(a, bad)
    four = np.ones((1, 1, 4, 2))
    cache.attend(np.ones((1, 1, 1, 2)), a, k_new=four, v_new=four)   # a: 4 keys on two of three pages
    with pytest.raises(ValueError, match="^k_new"):      # a needs a page, b needs one: one is free
        cache.attend(np.ones((2, 1, 1, 2)), [b, a], k_new=k, v_new=k)
    assert cache.block_table([b]).tolist() == [[-1]] and cache.length(b) == 0   # b took no page
    with pytest.raises(ValueError, match="^v_new"):      # refused once b has its page: no page kept
        cache.attend(np.ones((1, 1, 1, 2)), b, k_new=k[:1], v_new=np.ones((1, 2, 1, 2)))
    assert cache.block_table([b]).tolist() == [[-1]] and cache.length(b) == 0
    c = cache.add_sequence()                             # the last free page is still there
    cache.attend(np.ones((1, 1, 1, 2)), c, k_new=k[:1], v_new=k[:1])
    assert cache.length(c) == 1


def test_paged_cache_errors_name_its_own_arguments():
    """PagedCache's dtype and head_dim, and the sequences for q's rows, named as the
    user wrote them (attention_kvcache would name k_cache, which the user never passed)."""
    for bad in ("flot32", "int32"):
        with pytest.raises(TypeError, match="^dtype"):
            attnkit.PagedCache(num_pages=2, page_size=2, kv_heads=1, head_dim=2, dtype=bad)
    cache = attnkit.PagedCache(num_pages=4, page_size=2, kv_heads=1, head_dim=4)
    s = cache.add_sequence()
    new = np.ones((1, 1, 1, 4), np.float32)
    for q, err, name in ((np.ones((1, 1, 1, 4)), TypeError, "q: dtype float64 differs from the cache's float32"),
                         (np.ones((1, 1, 1, 2), np.float32), ValueError, "q: expected head_dim 4"),
                         (np.ones((2, 1, 1, 4), np.float32), ValueError, "seqs: 1 sequence")):
        with pytest.raises(err, match=f"^{name}"):
            cache.attend(q, s, k_new=new, v_new=new)
    assert cache.length(s) == 0 and cache.block_table([s]).tolist() == [[-1]]


def test_paged_cache_dtype_none_or_not_a_float_type_is_refused():
    for bad in (None, "float128", "complex64"):
        with pytest.raises(TypeError, match="^dtype"):
            attnkit.PagedCache(num_pages=2, page_size=2, kv_heads=1, head_dim=2, dtype=bad)



def test_paged_cache_attends_without_new_keys_and_reads_lists():
    """attend with no k_new (n = 0 new keys) and q given as nested lists."""
    cache = attnkit.PagedCache(num_pages=4, page_size=2, kv_heads=1, head_dim=2, dtype="float64")
    s = cache.add_sequence()
    k = np.array([[[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]]])
    first = cache.attend(np.ones((1, 1, 1, 2)), s, k_new=k, v_new=k)
    again = cache.attend([[[[1.0, 1.0]]]], s)
    assert cache.length(s) == 3 and np.array_equal(first, again)


def test_writability_is_checked_only_for_an_append_and_only_where_slots_alias():
    """A read-only cache attends without appending; a size-1 dim with stride 0 (torch's
    expand adds those) is not a broadcast; a broadcast over two heads is."""
    k = np.zeros((1, 1, 4, 2))
    k[0, 0, :2] = [[1, 0], [0, 1]]
    k.setflags(write=False)
    attnkit.attention_kvcache(np.ones((1, 1, 1, 2)), k, k, np.array([2]))
    none = np.zeros((1, 1, 0, 2))                                                      # an empty append
    attnkit.attention_kvcache(np.ones((1, 1, 1, 2)), k, k, np.array([2]), k_new=none, v_new=none)
    torch = pytest.importorskip("torch")
    kc, vc = torch.zeros(4, 2).expand(1, 1, 4, 2), torch.zeros(4, 2).expand(1, 1, 4, 2)   # strides (0, 0, 2, 1)
    kc, vc = kc.clone().as_strided((1, 1, 4, 2), (0, 0, 2, 1)), vc.clone().as_strided((1, 1, 4, 2), (0, 0, 2, 1))
    new = torch.ones(1, 1, 1, 2)
    attnkit.attention_kvcache(torch.ones(1, 1, 1, 2), kc, vc, torch.tensor([0]), k_new=new, v_new=new)
    assert kc[0, 0, 0].tolist() == [1.0, 1.0]
    two = torch.zeros(1, 1, 4, 2).expand(1, 2, 4, 2)                                    # one slot, two heads
    with pytest.raises(ValueError, match="^k_cache: a broadcast"):
        attnkit.attention_kvcache(torch.ones(1, 2, 1, 2), two, torch.zeros(1, 2, 4, 2), torch.tensor([0]),
                                  k_new=torch.ones(1, 2, 1, 2), v_new=torch.ones(1, 2, 1, 2))


def test_torch_arguments_on_another_device_or_without_data_are_named():
    """New keys on another device than q are refused before anything is written (the
    cache was written, then the call failed); a tensor whose values are read (lengths,
    block tables) on the meta device has none: a named error, not torch's copy error."""
    torch = pytest.importorskip("torch")
    q, kc, vc = torch.randn(2, 2, 1, 4), torch.zeros(2, 2, 8, 4), torch.zeros(2, 2, 8, 4)
    kn = torch.ones(2, 2, 1, 4)
    for bad in ("k_new", "v_new"):
        new = dict(k_new=kn, v_new=kn.clone())
        new[bad] = new[bad].to("meta")
        with pytest.raises(ValueError, match=rf"^{bad}: expected a tensor on q's device cpu, got meta"):
            attnkit.attention_kvcache(q, kc, vc, 3, **new)
        assert not kc.any() and not vc.any()
    for name, kw in (("cache_lengths", dict(cache_lengths=torch.tensor([3, 3], device="meta"))),
                     ("q_lengths", dict(cache_lengths=3, q_lengths=torch.tensor([1, 1], device="meta")))):
        with pytest.raises(ValueError, match=rf"^{name}: its values are read to check them, and a tensor on the meta"):
            attnkit.attention_kvcache(q, kc, vc, **kw)


def test_paged_cache_arguments_get_named_errors():
    torch = pytest.importorskip("torch")
    for kw, err, name in ((dict(value_dim=0), ValueError, "value_dim"), (dict(value_dim=2.5), ValueError, "value_dim"),
                          (dict(like=np.zeros(3)), TypeError, "like"),
                          (dict(like=torch.zeros(3, dtype=torch.int64)), TypeError, "like")):
        with pytest.raises(err, match=f"^{name}: expected"):
            attnkit.PagedCache(num_pages=4, page_size=4, kv_heads=1, head_dim=2, **kw)
    cache = attnkit.PagedCache(num_pages=4, page_size=4, kv_heads=1, head_dim=2, dtype="float64")
    s = cache.add_sequence()
    new = np.ones((1, 1, 1, 2))
    out = cache.attend(np.ones((1, 1, 1, 2)), np.int64(s), k_new=new, v_new=new)      # NumPy ids are ids
    assert out.shape == (1, 1, 1, 2) and cache.lengths(np.int64(s)).tolist() == [1]
    assert cache.block_table([np.int64(s)]).tolist() == [[0]] and cache.lengths(s).tolist() == [1]
    for bad in (0.0, None):
        with pytest.raises(TypeError, match="^seqs: expected a sequence id"):
            cache.attend(np.ones((1, 1, 1, 2)), bad)

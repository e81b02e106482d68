"""attnkit.kvcache case by case, from a mutation run of the module (docs/mutation.md):
gather on torch tensors, and PagedCache's own bookkeeping — its sizes, torch caches
(``like=``), the pages it hands out and takes back, its sequence ids, and new keys of
the wrong rank."""

import re

import numpy as np
import pytest

import attnkit
from attnkit import kvcache
from attnkit.spec.kvcache import validate_kvcache
from attnkit.testing import max_error
from test_kvcache import make_cache, read

RNG = np.random.default_rng


def test_gather_reads_torch_tensors_as_it_reads_arrays():
    """kvcache.gather on torch tensors (its own branch: the unused table entries masked
    with a torch arange, the page axis moved past the heads with ``transpose(1, 2)``)
    gives each sequence's keys in order, the same bits as on NumPy arrays. A wrong axis
    pair or a reshape torch refuses (``reshape(-2, 1)``, which NumPy reads as -1) would
    hand a rung keys of the wrong head or position, or fail."""
    torch = pytest.importorskip("torch")
    B, H, Hkv, D, Dv, P = 2, 4, 2, 3, 5, 4
    rng = RNG(11)
    k, v, table = make_cache(B, Hkv, D, Dv, 12, P, True)          # 3 pages per sequence, 9 pages
    k[...], v[...] = rng.standard_normal(k.shape), rng.standard_normal(v.shape)
    lengths = np.array([5, 9])
    table[0, 2] = 99                                     # past sequence 0's two pages: never followed
    q = rng.standard_normal((B, H, 1, D))
    want = kvcache.gather(validate_kvcache(q, k, v, lengths, block_table=table))
    got = kvcache.gather(validate_kvcache(*(torch.tensor(x) for x in (q, k, v, lengths)),
                                          block_table=torch.tensor(table)))
    for w, g, cache in zip(want, got, (k, v)):
        assert isinstance(g, torch.Tensor) and tuple(g.shape) == w.shape == (B, Hkv, 3 * P, cache.shape[-1])
        assert np.array_equal(g.numpy(), w)
        for b in range(B):
            assert np.array_equal(w[b, :, :lengths[b]], read(cache, table, b, lengths[b], P))


@pytest.mark.parametrize("name", ["num_pages", "page_size", "kv_heads", "head_dim"])
@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "3", None])
def test_paged_cache_sizes_are_positive_ints_named(name, bad):
    """Each size of a PagedCache is a positive int: 0 (a pool without pages, pages of no
    keys), a bool, a float or a string is a ValueError naming that size — not a pool
    that cannot hold a key, or an error in NumPy's words at the first append."""
    sizes = dict(num_pages=2, page_size=2, kv_heads=1, head_dim=2)
    sizes[name] = bad
    with pytest.raises(ValueError, match=rf"^{name}: expected a positive int, got {re.escape(repr(bad))}$"):
        attnkit.PagedCache(**sizes)
    assert attnkit.PagedCache(num_pages=1, page_size=1, kv_heads=1, head_dim=1).k.shape == (1, 1, 1, 1)


def test_paged_cache_on_torch_tensors_like_its_numpy_twin():
    """``like=`` a tensor: k and v are tensors of its dtype (v with value_dim), the
    block table and lengths are tensors, and a prefill per sequence then two decoding
    steps give the bits of the same cache in NumPy. Without the torch allocation the
    cache has no arrays (or NumPy ones beside torch queries)."""
    torch = pytest.importorskip("torch")
    sizes = dict(num_pages=6, page_size=3, kv_heads=2, head_dim=4, value_dim=5)
    tc = attnkit.PagedCache(**sizes, like=torch.zeros((), dtype=torch.float64))
    nc = attnkit.PagedCache(**sizes, dtype="float64")
    assert all(isinstance(x, torch.Tensor) and x.dtype == torch.float64 for x in (tc.k, tc.v))
    assert tuple(tc.k.shape) == nc.k.shape == (6, 2, 3, 4) and tuple(tc.v.shape) == nc.v.shape == (6, 2, 3, 5)
    ts, ns = [tc.add_sequence() for _ in range(2)], [nc.add_sequence() for _ in range(2)]
    rng = RNG(12)
    steps = [([0], 4), ([1], 1), ([0, 1], 1), ([0, 1], 1)]    # (which sequences, new keys)
    for which, n in steps:
        q = rng.standard_normal((len(which), 4, n, 4))
        kn, vn = rng.standard_normal((len(which), 2, n, 4)), rng.standard_normal((len(which), 2, n, 5))
        got = tc.attend(torch.tensor(q), [ts[i] for i in which], k_new=torch.tensor(kn), v_new=torch.tensor(vn),
                        causal=True)
        want = nc.attend(q, [ns[i] for i in which], k_new=kn, v_new=vn, causal=True)
        assert isinstance(got, torch.Tensor) and np.array_equal(got.numpy(), want)
    table, lengths = tc.block_table(ts), tc.lengths(ts)
    assert isinstance(table, torch.Tensor) and isinstance(lengths, torch.Tensor)
    assert table.tolist() == nc.block_table(ns).tolist() == [[0, 1], [2, -1]] and lengths.tolist() == [6, 3]
    assert np.array_equal(tc.k.numpy(), nc.k) and np.array_equal(tc.v.numpy(), nc.v)


def test_paged_cache_hands_out_each_page_once_and_takes_it_back():
    """Pages go out 0, 1, 2 … and each to one sequence; the last free page can be taken
    (need == free), one more is refused naming ``n``; a freed sequence's pages go to
    the next sequence, in order; reserving room a sequence has takes nothing."""
    cache = attnkit.PagedCache(num_pages=3, page_size=2, kv_heads=1, head_dim=2, dtype="float64")
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.reserve(a, 3)                                  # two pages
    cache.reserve(b, 2)                                  # the last page
    cache.reserve(a, 4)                                  # a has room for 4 already
    assert cache.block_table([a, b]).tolist() == [[0, 1], [2, -1]]
    with pytest.raises(ValueError, match=r"^n: 3 more keys need 1 more pages, 0 are free"):
        cache.reserve(b, 3)
    cache.free(a)
    c = cache.add_sequence()
    cache.reserve(c, 4)
    assert cache.block_table([c, b]).tolist() == [[0, 1], [2, -1]]



@pytest.mark.parametrize("torch_cache", [False, True], ids=["numpy", "torch"])
def test_an_append_past_a_sequences_pages_in_its_table_is_refused(torch_cache):
    """A loop of one's own that appends through attention_kvcache with the helper's
    table but without reserve: the entry past a sequence's pages is no page (−1), so
    the append is a ValueError naming block_table and no key in the cache changes
    (with page 0 there, sequence a's new key overwrote sequence b's first)."""
    if torch_cache:
        torch = pytest.importorskip("torch")
        cache = attnkit.PagedCache(num_pages=4, page_size=4, kv_heads=1, head_dim=2,
                                   like=torch.zeros(1, dtype=torch.float64))
        full = cache.k.new_full
    else:
        cache = attnkit.PagedCache(num_pages=4, page_size=4, kv_heads=1, head_dim=2, dtype="float64")

        def full(shape, value):
            return np.full(shape, value)
    b, a = cache.add_sequence(), cache.add_sequence()
    cache.attend(full((1, 1, 1, 2), 1.0), b, k_new=full((1, 1, 5, 2), 1.0), v_new=full((1, 1, 5, 2), 1.0))
    cache.attend(full((1, 1, 1, 2), 1.0), a, k_new=full((1, 1, 4, 2), 2.0), v_new=full((1, 1, 4, 2), 2.0))
    table = cache.block_table([b, a])                    # b: pages 0, 1; a: page 2, full
    assert table.tolist() == [[0, 1], [2, -1]]
    before = [x.clone() if torch_cache else x.copy() for x in (cache.k, cache.v)]
    new = full((2, 1, 1, 2), 9.0)
    with pytest.raises(ValueError, match=r"^block_table: sequence 1 points at page -1 outside \[0, num_pages=4\)"):
        attnkit.attention_kvcache(full((2, 1, 1, 2), 1.0), cache.k, cache.v, cache.lengths([b, a]),
                                  block_table=table, k_new=new, v_new=new)
    assert all(bool((x == y).all()) for x, y in zip((cache.k, cache.v), before))

def test_sequence_ids_count_from_zero_and_are_never_reused():
    """add_sequence hands out 0, 1, 2, … in order (a loop that keeps its own lists per
    sequence indexes them by these ids); a freed id is not handed out again, so a stale
    id never addresses a newer sequence."""
    cache = attnkit.PagedCache(num_pages=4, page_size=2, kv_heads=1, head_dim=2)
    assert [cache.add_sequence() for _ in range(3)] == [0, 1, 2]
    cache.free(1)
    assert cache.add_sequence() == 3
    with pytest.raises(ValueError, match=r"^seq: no sequence 1 in this cache"):
        cache.length(1)


@pytest.mark.parametrize("shape", [(3, 2), (1, 3, 2)], ids=["2-D", "3-D"])
def test_attend_with_new_keys_of_the_wrong_rank_is_named_and_keeps_no_page(shape):
    """PagedCache.attend counts the new keys (``k_new.shape[-2]``) before
    attention_kvcache checks k_new: a k_new without its batch (and head) dim is
    attention_kvcache's ValueError naming k_new — not an IndexError from counting
    along a dim it lacks — and the pages taken for it are given back."""
    cache = attnkit.PagedCache(num_pages=4, page_size=2, kv_heads=1, head_dim=2, dtype="float64")
    s = cache.add_sequence()
    with pytest.raises(ValueError, match=r"^k_new: expected shape \(B, Hkv, L_new, D\)"):
        cache.attend(np.ones((1, 1, 1, 2)), s, k_new=np.ones(shape), v_new=np.ones(shape))
    assert cache.length(s) == 0 and cache.block_table([s]).tolist() == [[-1]]
    cache.reserve(s, 8)                                  # all four pages are still free
    assert max_error(cache.block_table([s]), np.arange(4)[None]) == 0


def test_new_keys_without_their_batch_dim_are_named_with_l_new_unknown():
    """A 3-D k_new has no L_new to quote: the expected shape says L_new, not a number."""
    k = np.zeros((2, 1, 8, 4))
    with pytest.raises(ValueError, match=re.escape("k_new: expected shape (B, Hkv, L_new, D) = (2, 1, L_new, 4), "
                                                   "got (1, 3, 4)")):
        attnkit.attention_kvcache(np.zeros((2, 2, 1, 4)), k, k.copy(), 0, k_new=np.ones((1, 3, 4)),
                                  v_new=np.ones((1, 3, 4)))


@pytest.mark.parametrize("lib", ["numpy", "torch"])
@pytest.mark.parametrize("lengths,q_lengths,slot", [
    ([3, 3], None, "3 of page 5"),                       # a shared part-filled page: both append at 3
    ([2, 1], [1, 2], "2 of page 5"),                     # ragged: b's second new key on a's new key
    ([4, 4], None, "0 of page 1"),                       # past the shared page, a page both tables hold
], ids=["shared page", "ragged", "second page"])
def test_two_sequences_appending_into_one_slot_are_refused(lib, lengths, q_lengths, slot):
    """Sequences sharing a page (a common prefix) that append into the same slot: one
    key would overwrite the other's (the call answered with another sequence's key). A
    ValueError names block_table and the slot, on the first call of a signature and on
    a repeated one, and no key in the cache changes; appends into slots of their own
    pass, up to the last slot of a sequence's pages."""
    k, v, _ = make_cache(2, 1, 2, 2, 8, 4, True)
    k[...], v[...] = RNG(1).standard_normal(k.shape), RNG(2).standard_normal(v.shape)
    table, good = np.array([[5, 1], [5, 1]]), np.array([[5, 1], [0, 2]])
    L = 2 if q_lengths else 1
    q, new = np.ones((2, 2, L, 2)), np.full((2, 1, L, 2), 9.0)
    kw = {} if q_lengths is None else dict(q_lengths=np.array(q_lengths))
    full = 8 - np.array(q_lengths or [1, 1])                # appends that fill each sequence's last slot
    args = [q, k, v, np.array(lengths), table, good, new, full]
    copy = np.copy
    if lib == "torch":
        torch = pytest.importorskip("torch")
        args = [torch.from_numpy(x) for x in args]
        kw = {n: torch.from_numpy(x) for n, x in kw.items()}

        def copy(x):
            return x.numpy().copy()
    q, k, v, n, table, good, new, full = args
    for lengths_ok in (n, full):
        attnkit.attention_kvcache(q, k, v, lengths_ok, block_table=good, k_new=new, v_new=new, **kw)
    before = [copy(x) for x in (k, v)]
    for _ in range(2):                                   # (the full check, then the kept one)
        with pytest.raises(ValueError, match=rf"^block_table: sequences 0 and 1 append into the same slot "
                                             rf"\({slot}\)"):
            attnkit.attention_kvcache(q, k, v, n, block_table=table, k_new=new, v_new=new, **kw)
        assert all(np.array_equal(copy(x), y) for x, y in zip((k, v), before))


@pytest.mark.parametrize("lib", ["numpy", "torch"])
@pytest.mark.parametrize("table,lengths,q_lengths,message", [
    ([[5, 1], [5, 2]], [3, 4], None, "sequence 0 appends into slot 3 of page 5, which sequence 1 holds as its key 3"),
    ([[5, 5]], [5], None, "sequence 0 appends into slot 1 of page 5, which its row also lists for its key 1, "
                          "still in view"),
    ([[5, 1], [5, 2]], [4, 4], None, None),              # a whole page shared: the appends go to pages of their own
    ([[5, 1], [5, 2]], [3, 3], [1, 0], None),            # a slot of the shared page that only sequence 0 sees
    ([[5, 1, 5]], [9], dict(window=(3, 0)), None),        # a ring of pages: keys 0-3 out of the window's view
    ([[5, 1, 5]], [9], dict(window=(8, 0)), "sequence 0 appends into slot 1 of page 5, which its row also lists for "
                                            "its key 1, still in view"),
    ([[5, 1], [5, 2]], [3, 5], dict(kv_starts=np.array([0, 4])), None),   # a shared padding page under kv_starts
    ([[5, 1], [5, 2]], [3, 5], dict(kv_starts=np.array([0, 3])),
     "sequence 0 appends into slot 3 of page 5, which sequence 1 holds as its key 3"),
], ids=["another reads it", "a page listed twice", "shared, appends apart", "past a shared prefix", "ring, window",
        "ring, window too wide", "padding page, kv_starts", "kv_starts too low"])
def test_an_append_into_a_slot_another_entry_reads_is_refused(lib, table, lengths, q_lengths, message):
    """A page two sequences share (a common prefix, a forked beam): an append into a
    slot the other reads as an old key would answer it with this sequence's key, as a
    row that lists one page twice would answer itself. A ValueError names block_table,
    the slot and the reader, on the first call of a signature and on a repeated one,
    and no key changes. Appends that no other sequence sees pass, each sequence
    attending to its own keys; so do appends over keys out of every row's view (a
    ring of pages under a window, a padding page shared under kv_starts). A dict in
    place of q_lengths: the call's other keywords."""
    B = len(table)
    k, v = RNG(1).standard_normal((6, 1, 4, 2)), RNG(2).standard_normal((6, 1, 4, 2))
    q, new = RNG(3).standard_normal((B, 2, 1, 2)), np.full((B, 1, 1, 2), 9.0)
    kw = q_lengths if isinstance(q_lengths, dict) else {} if q_lengths is None else dict(q_lengths=np.array(q_lengths))
    q_lengths = None if isinstance(q_lengths, dict) else q_lengths
    before = [k.copy(), v.copy()]
    args, call_kw = [q, k, v, np.array(lengths), np.array(table), new], kw
    if lib == "torch":
        torch = pytest.importorskip("torch")
        args = [torch.from_numpy(x) for x in args]
        call_kw = {n: torch.from_numpy(x) if isinstance(x, np.ndarray) else x for n, x in kw.items()}
    tq, tk, tv, n, tt, tn = args
    if message is None:
        out = np.asarray(attnkit.attention_kvcache(tq, tk, tv, n, block_table=tt, k_new=tn, v_new=tn, **call_kw))
        for b, row in enumerate(table):
            total = lengths[b] + (1 if q_lengths is None else q_lengths[b])
            keys, values = (np.concatenate([c[p] for p in row], axis=1)[None, :, :total] for c in (k, v))
            appended = total > lengths[b]                # (a sequence with q_lengths 0: no rows, no key)
            assert not appended or keys[0, 0, total - 1].tolist() == [9.0, 9.0]
            seen = {n: x[b:b + 1] if n == "kv_starts" else x for n, x in kw.items() if n != "q_lengths"}
            want = attnkit.attention(q[b:b + 1], keys, values, **seen) if appended else np.zeros((1, 2, 1, 2))
            assert max_error(out[b:b + 1], want) < 1e-12
        assert np.array_equal(k[5], before[0][5]) == (lengths[0] == 4)   # the shared page: only 0's slot 3 written
        return
    for _ in range(2):                                   # (the full check, then the kept one)
        with pytest.raises(ValueError, match=rf"^block_table: {re.escape(message)}: "):
            attnkit.attention_kvcache(tq, tk, tv, n, block_table=tt, k_new=tn, v_new=tn, **call_kw)
        assert np.array_equal(k, before[0]) and np.array_equal(v, before[1])


def test_a_ring_of_pages_is_read_by_its_first_query_rows_view():
    """A row's view starts at the lowest key any of its rows sees: two new keys into a
    ring of one page (keys 5 and 6 over the slots of keys 1 and 2) under a window of 3
    are refused, as the first query row (position 5) still sees key 2; a window of 2
    leaves keys 1 and 2 out of both rows' view, and the call is written."""
    k, v = RNG(1).standard_normal((6, 1, 4, 2)), RNG(2).standard_normal((6, 1, 4, 2))
    q, new = RNG(3).standard_normal((1, 2, 2, 2)), np.full((1, 1, 2, 2), 9.0)
    table, before = np.array([[5, 5]]), k.copy()
    with pytest.raises(ValueError, match=r"^block_table: sequence 0 appends into slot 2 of page 5, which its row "
                                         r"also lists for its key 2, still in view"):
        attnkit.attention_kvcache(q, k, v, np.array([5]), block_table=table, k_new=new, v_new=new, window=(3, 0))
    assert np.array_equal(k, before)
    attnkit.attention_kvcache(q, k, v, np.array([5]), block_table=table, k_new=new, v_new=new, window=(2, 0))
    assert k[5, 0, 1:3].tolist() == [[9.0, 9.0]] * 2


def test_set_length_rolls_back_drafts_and_counts_keys_written_by_a_call_of_ones_own():
    """Speculative decoding: four drafts appended, two rejected (set_length), the next
    step attends over the kept keys and its own (the rejected ones never seen; the
    pages past the kept keys back in the pool). A loop of one's own: reserve, an
    append through attention_kvcache, set_length — then attend appends after that key,
    not over it. Past a sequence's room, a ValueError naming n."""
    rng = RNG(21)
    cache = attnkit.PagedCache(num_pages=6, page_size=2, kv_heads=1, head_dim=3, dtype="float64")
    s = cache.add_sequence()
    keys, values = rng.standard_normal((1, 1, 7, 3)), rng.standard_normal((1, 1, 7, 3))
    cache.attend(rng.standard_normal((1, 2, 3, 3)), s, k_new=keys[:, :, :3], v_new=values[:, :, :3])
    cache.attend(rng.standard_normal((1, 2, 4, 3)), s, k_new=keys[:, :, 3:7], v_new=values[:, :, 3:7])   # drafts
    assert cache.length(s) == 7 and cache.block_table([s]).shape == (1, 4)
    cache.set_length(s, 5)                               # drafts 5 and 6 rejected
    assert cache.length(s) == 5 and cache.block_table([s]).shape == (1, 3)
    q, k1, v1 = rng.standard_normal((1, 2, 1, 3)), rng.standard_normal((1, 1, 1, 3)), rng.standard_normal((1, 1, 1, 3))
    out = cache.attend(q, s, k_new=k1, v_new=v1)
    want = attnkit.attention(q, np.concatenate([keys[:, :, :5], k1], 2), np.concatenate([values[:, :, :5], v1], 2))
    assert max_error(out, want) < 1e-12
    cache.reserve(s, 1)                                  # a call of one's own appends key 7
    k2, v2 = rng.standard_normal((1, 1, 1, 3)), rng.standard_normal((1, 1, 1, 3))
    attnkit.attention_kvcache(q, cache.k, cache.v, cache.lengths([s]), block_table=cache.block_table([s]),
                              k_new=k2, v_new=v2)
    cache.set_length(s, np.int64(7))
    out = cache.attend(q, s, k_new=k1, v_new=v1)
    want = attnkit.attention(q, np.concatenate([keys[:, :, :5], k1, k2, k1], 2),
                             np.concatenate([values[:, :, :5], v1, v2, v1], 2))
    assert cache.length(s) == 8 and max_error(out, want) < 1e-12
    for bad in (9, -1, True, 2.0):                       # 4 pages of 2: room for 8
        with pytest.raises(ValueError, match=rf"^n: expected an int in \[0, 8\].*got {re.escape(repr(bad))}$"):
            cache.set_length(s, bad)
    cache.set_length(s, 0)
    assert cache.block_table([s]).tolist() == [[-1]] and len(cache._free) == 6


def test_paged_cache_takes_numpy_sizes_and_ids_of_any_integer_kind():
    """NumPy integers as sizes (ints in the arrays' shapes); a sequence id as a NumPy
    integer or a 0-d integer tensor, and ids in an array or tensor; a nested list, a
    bool or a float is no id. A q of the other array library is named as q's."""
    cache = attnkit.PagedCache(np.int64(4), np.int32(2), np.uint8(1), np.int16(2), dtype="float64")
    assert cache.k.shape == (4, 1, 2, 2) and cache.page_size == 2 and type(cache.page_size) is int
    s = cache.add_sequence()
    cache.attend(np.ones((1, 1, 1, 2)), np.int64(s), k_new=np.ones((1, 1, 1, 2)), v_new=np.ones((1, 1, 1, 2)))
    assert cache.length(np.int32(s)) == 1 and cache.lengths(np.array([s])).tolist() == [1]
    for bad in ([[s]], True, [False]):
        with pytest.raises(ValueError, match=r"^seq: no sequence"):
            cache.attend(np.ones((1, 1, 1, 2)), bad)
    torch = pytest.importorskip("torch")
    assert cache.length(torch.tensor(s)) == 1 and cache.block_table(torch.tensor([s])).tolist() == [[0]]
    with pytest.raises(ValueError, match=r"^seq: no sequence tensor\(True\)"):
        cache.length(torch.tensor(True))                 # (index() reads it as 1: no id)
    cache.set_length(s, torch.tensor(0))
    assert cache.length(s) == 0
    with pytest.raises(TypeError, match=r"^q: a Tensor for a cache of ndarrays"):
        cache.attend(torch.ones(1, 1, 1, 2, dtype=torch.float64), s)
    tc = attnkit.PagedCache(4, 2, 1, 2, like=torch.zeros((), dtype=torch.float64))
    with pytest.raises(TypeError, match=r"^q: a ndarray for a cache of Tensors"):
        tc.attend(np.ones((1, 1, 1, 2)), tc.add_sequence())


@pytest.mark.parametrize("call", ["attention", "attention_kvcache"])
def test_a_peers_keyword_is_answered_with_attnkits_name(call):
    """FlashAttention's, PyTorch's and FlashInfer's names for attnkit's keywords are
    named with attnkit's, and the message lists the function's own masking keywords
    (attention_kvcache's: those a cache takes)."""
    q = np.ones((1, 1, 1, 2))
    f = (lambda **kw: attnkit.attention(q, q, q, **kw)) if call == "attention" else \
        (lambda **kw: attnkit.attention_kvcache(q, q, q, 1, **kw))
    mask = "keep or bias" if call == "attention" else None      # (attention_kvcache takes neither)
    for peer, ours in (("softmax_scale", "scale"), ("cache_leftpad", "kv_starts"), ("is_causal", "causal"),
                       ("window_size", "window"), ("logits_soft_cap", "softcap"), ("attn_mask", mask),
                       ("cache_seqlens", "kv_lengths" if call == "attention" else "cache_lengths")):
        if ours is None:
            with pytest.raises(TypeError, match=rf"^{peer}: unexpected keyword argument\(s\); the masking"):
                f(**{peer: 1})
            continue
        with pytest.raises(TypeError, match=rf"^{peer}: unexpected keyword argument\(s\) \(attnkit's name: "
                                            rf"{peer} → {ours}\); the masking keywords are scale, causal"):
            f(**{peer: 1})
    with pytest.raises(TypeError, match=r"^foo: unexpected keyword argument\(s\); the masking keywords") as e:
        f(foo=1)
    assert ("kv_lengths" in str(e.value)) == (call == "attention") and "kv_starts" in str(e.value)
    with pytest.raises(ValueError, match=r"^softcap: expected a positive finite number, got 0.0 \(None: no cap"):
        f(softcap=0.0)
    with pytest.raises(ValueError, match=r"^softcap: expected a positive finite number, got array\(\[0., 1.\]\)$"):
        f(softcap=np.array([0.0, 1.0]))


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_a_float_length_is_named_as_not_an_integer(lib):
    """One length for every sequence is an int; a float is refused as one (with torch
    tensors it was "expected a torch.Tensor like q, got float")."""
    q = np.ones((1, 1, 1, 2))
    if lib == "torch":
        q = pytest.importorskip("torch").from_numpy(q)
    with pytest.raises(TypeError, match=r"^cache_lengths: expected integers, got 3.0$"):
        attnkit.attention_kvcache(q, q, q, 3.0)


def test_set_length_takes_exactly_the_room_its_pages_hold():
    """set_length(seq, n) accepts n equal to the room (pages * page_size), the bound of
    its [0, room] range: reserve two pages of 2, write 4 keys with a call of one's own,
    count all 4 (kills `count < room`)."""
    rng = np.random.default_rng(0)
    cache = attnkit.PagedCache(num_pages=4, page_size=2, kv_heads=1, head_dim=3, dtype="float64")
    s = cache.add_sequence()
    cache.reserve(s, 4)
    assert cache.block_table([s]).shape == (1, 2)
    k, v = rng.standard_normal((1, 1, 4, 3)), rng.standard_normal((1, 1, 4, 3))
    q = rng.standard_normal((1, 1, 4, 3))
    attnkit.attention_kvcache(q, cache.k, cache.v, cache.lengths([s]), block_table=cache.block_table([s]),
                              k_new=k, v_new=v)
    cache.set_length(s, 4)                               # the whole room: allowed
    assert cache.length(s) == 4 and cache.block_table([s]).shape == (1, 2)
    q1 = rng.standard_normal((1, 1, 1, 3))
    out = cache.attend(q1, s)                            # attends over the 4 keys written
    assert np.allclose(out, attnkit.attention(q1, k, v), atol=1e-12)


def test_set_length_to_the_current_length_keeps_reserved_pages():
    """set_length with the length a sequence already holds changes nothing: pages
    reserve took ahead stay with the sequence (only fewer keys return pages), so a
    call of one's own can still write into them (kills `count <= length`)."""
    cache = attnkit.PagedCache(num_pages=6, page_size=2, kv_heads=1, head_dim=1, dtype="float64")
    s = cache.add_sequence()
    x = np.ones((1, 1, 3, 1))
    cache.attend(x, s, k_new=x, v_new=x)                 # 3 keys: 2 pages
    cache.reserve(s, 4)                                  # room for 7: 4 pages
    table = cache.block_table([s]).tolist()
    assert len(table[0]) == 4
    cache.set_length(s, 3)                               # no change
    assert cache.length(s) == 3 and cache.block_table([s]).tolist() == table


def test_paged_cache_names_a_negative_q_length_as_q_lengths():
    """A negative q_lengths entry through PagedCache.attend is attention_kvcache's to
    name (ValueError starting 'q_lengths'), not the page count's 'n:' error; nothing
    is reserved or appended (kills dropping the clip to [0, n] in _appended)."""
    cache = attnkit.PagedCache(num_pages=4, page_size=2, kv_heads=1, head_dim=2, dtype="float64")
    seqs = [cache.add_sequence() for _ in range(2)]
    x = np.ones((2, 1, 2, 2))
    with pytest.raises(ValueError, match="^q_lengths"):
        cache.attend(x, seqs, k_new=x, v_new=x, q_lengths=np.array([-1, 2]))
    assert [cache.length(s) for s in seqs] == [0, 0] and (cache.block_table(seqs) == -1).all()   # no page taken


def test_set_length_returns_pages_so_regrowing_takes_them_back_in_order():
    """Pages set_length returns go back to the pool like free's and a refused attend's
    (the lowest page handed out first): dropping drafts and regrowing gives the
    sequence its old block table again (kills dropping `reversed` in set_length)."""
    cache = attnkit.PagedCache(num_pages=6, page_size=2, kv_heads=1, head_dim=1, dtype="float64")
    s = cache.add_sequence()
    x = np.ones((1, 1, 7, 1))
    cache.attend(x, s, k_new=x, v_new=x)                 # 7 keys: pages 0..3
    before = cache.block_table([s]).tolist()
    assert before == [[0, 1, 2, 3]]
    cache.set_length(s, 2)                               # keeps page 0, returns 1, 2, 3
    assert cache.block_table([s]).tolist() == [[0]]
    cache.reserve(s, 5)
    assert cache.block_table([s]).tolist() == before


@pytest.mark.parametrize("rows", [1, 3])
def test_a_block_table_with_the_wrong_number_of_rows_is_named(rows):
    """A block table needs one row per sequence of q: 1 or 3 rows for a batch of 2 is a
    ValueError naming block_table and q's batch, and the cache is left as it was
    (kills dropping the `block_table.shape[0] != B` check)."""
    q = np.ones((2, 1, 1, 2))
    kc, vc = np.zeros((4, 1, 2, 2)), np.zeros((4, 1, 2, 2))
    new = np.ones((2, 1, 1, 2))
    table = np.arange(rows * 2).reshape(rows, 2) % 4
    with pytest.raises(ValueError, match=r"^block_table: expected 2 rows \(q's batch\)"):
        attnkit.attention_kvcache(q, kc, vc, np.array([1, 1]), block_table=table, k_new=new, v_new=new)
    assert not kc.any() and not vc.any()

"""attention_kvcache's kept step on a paged cache (NumPy arrays and CPU tensors): a
float32 decoding loop's later calls read the block table in place, write the new keys
into their pages, gather each sequence's pages (into a scratch each thread keeps) and
attend, in one compiled call (attnkit.flash.numba_small.kvcache_rows_at), which a
signature's first call runs too, its append done. It gives the full path's bits and page
contents; it declines what the full path refuses or checks further (pages out of
range, a page that sequences share taking new keys), which then gets the full path's
errors with the pages untouched. (Contiguous caches: tests/test_kvcache_step.py,
tests/test_kvcache_direct.py.)"""

import numpy as np
import pytest
import torch

import attnkit
from attnkit import api, reference, small
from cases import checked  # noqa: F401 (a fixture)

B, H, HKV, D = 3, 4, 2, 8


def paged(seed, P, width, L=1, lengths=(0, 5, 11), spare=3, share=False):
    """q, k_pages, v_pages, k_new, v_new and a shuffled block table (B, width) over
    B · width + spare pages of P keys (``share``: every sequence's first page
    sequence 0's); each sequence's slots from ``lengths`` on, and the spare pages, NaN
    (slots past a sequence's keys hold anything)."""
    rng = np.random.default_rng(seed)
    N = B * width + spare
    q, kn, vn = (rng.standard_normal(s).astype(np.float32) for s in ((B, H, L, D), (B, HKV, L, D), (B, HKV, L, D)))
    kp, vp = (rng.standard_normal((N, HKV, P, D)).astype(np.float32) for _ in range(2))
    table = rng.permutation(N)[:B * width].reshape(B, width)
    if share:
        table[1:, 0] = table[0, 0]
    stale = np.ones((N, P), bool)
    for b, n in enumerate(lengths):
        for s in range(min(n, width * P)):
            stale[table[b, s // P], s % P] = False
    kp[stale.nonzero()[0], :, stale.nonzero()[1]] = np.nan
    vp[stale.nonzero()[0], :, stale.nonzero()[1]] = np.nan
    return q, kp, vp, kn, vn, table


def as_lib(lib, *xs):
    return xs if lib == "numpy" else tuple(torch.from_numpy(x.copy()) for x in xs)


def same(a, b):
    return all((np.array_equal(x, y, equal_nan=True) if isinstance(x, np.ndarray) else torch.equal(
        torch.nan_to_num(x, 7.0), torch.nan_to_num(y, 7.0))) for x, y in zip(a, b))


def full_path(*args, **kw):
    """The call without the kept step, NumPy's pages gathered by NumPy (the reference's
    gather), not by the compiled call its first calls use too (torch's first calls use
    it: tests/test_kvcache.py checks them against the reference)."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(api, "kept_step", lambda *a: (None, None))
        m.setattr(small, "rung_kvcache", lambda kv: small.rung_forward(reference.gathered(kv))[:2])
        return attnkit.attention_kvcache(*args, **kw)


OPTIONS = [{}, dict(causal=True), dict(causal=True, window=(3, 0)), dict(softcap=2.0, scale=0.3),
           dict(window=(1, 2), align="top_left"), dict(causal=True, sinks=np.linspace(-1.0, 2.0, H, dtype=np.float32))]


@pytest.mark.parametrize("lib", ["numpy", "torch"])
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: ",".join(o) or "plain")
@pytest.mark.parametrize("P, L", [(1, 1), (4, 3), (16, 1)])
def test_a_paged_decoding_loop_on_the_kept_step_gives_the_full_paths_bits(lib, opts, P, L, checked):
    """Six steps appending L keys per sequence into shuffled pages (lengths from 0, all
    different; every slot not yet written NaN): out, lse and both page arrays as the
    full path makes them, NaN nowhere in out; only the first step validated."""
    width = -(-(12 + 6 * L) // P)
    q, kp, vp, kn, vn, table = as_lib(lib, *paged(1, P, width, L))
    kp2, vp2 = kp.copy() if lib == "numpy" else kp.clone(), vp.copy() if lib == "numpy" else vp.clone()
    if lib == "torch" and "sinks" in opts:
        opts = dict(opts, sinks=torch.from_numpy(opts["sinks"]))
    lengths = np.array([0, 5, 11])
    for step in range(6):
        n = lengths if lib == "numpy" else torch.from_numpy(lengths)
        qs, kns = q + step, kn - step
        out, lse = attnkit.attention_kvcache(qs, kp, vp, n, block_table=table, k_new=kns, v_new=vn,
                                             return_lse=True, **opts)
        want = full_path(qs, kp2, vp2, n, block_table=table, k_new=kns, v_new=vn, return_lse=True, **opts)
        assert same((out, lse, kp, vp), (*want, kp2, vp2)), step
        assert not (np.isnan(out).any() if lib == "numpy" else out.isnan().any())
        lengths = lengths + L
    assert len(checked) == 1 + 6


TABLES = {"int32": lambda t: t.astype(np.int32), "strided": lambda t: np.repeat(t, 2, axis=1)[:, ::2],
          "reversed (negative strides)": lambda t: t[::-1, ::-1],
          "past the pages used: anything": lambda t: np.where(np.arange(t.shape[1]) >= 2, -5, t),
          "int16 (the full path)": lambda t: t.astype(np.int16)}


@pytest.mark.parametrize("lib", ["numpy", "torch"])
@pytest.mark.parametrize("form", list(TABLES))
def test_the_step_reads_block_tables_in_place(lib, form, checked):
    """int32 tables and strided views (negative strides too; torch's: a strided view) are
    read in place; entries past the pages a sequence uses are never read; int16 tables
    take the full path."""
    q, kp, vp, kn, vn, table = paged(2, 4, 6, lengths=(3, 3, 3))
    table = TABLES[form](table)
    q, kp, vp, kn, vn, table = as_lib(lib, q, kp, vp, kn, vn, table)
    if lib == "torch" and form == "strided":
        table = table.repeat_interleave(2, 1)[:, ::2]
    kp2, vp2 = kp.copy() if lib == "numpy" else kp.clone(), vp.copy() if lib == "numpy" else vp.clone()
    for n in (3, 4, 5, 6):
        got = attnkit.attention_kvcache(q, kp, vp, n, block_table=table, k_new=kn, v_new=vn, causal=True)
        want = full_path(q, kp2, vp2, n, block_table=table, k_new=kn, v_new=vn, causal=True)
        assert same((got, kp, vp), (want, kp2, vp2)), n
    assert len(checked) == 4 + (4 if form.startswith("int16") else 1)


@pytest.mark.parametrize("lib", ["numpy", "torch"])
@pytest.mark.parametrize("case, match", [("out of range", "outside"), ("overflow", "overflows"),
                                         ("same slot", "append into the same slot"),
                                         ("into a page another sees", "which sequence 0 holds")])
def test_what_the_full_path_refuses_it_still_refuses_on_a_kept_signature(lib, case, match):
    """After a step of the signature: a used entry past num_pages, an append past the
    table's pages, two sequences appending into one shared page's slot, or one
    appending into a page whose keys another still sees: the full path's error, the
    pages untouched."""
    lengths = np.array([4, 2, 6])
    q, kp, vp, kn, vn, table = paged(3, 4, 3, lengths=lengths + 1)
    attnkit.attention_kvcache(*as_lib(lib, q, kp, vp), *as_lib(lib, lengths), block_table=as_lib(lib, table)[0],
                              k_new=as_lib(lib, kn)[0], v_new=as_lib(lib, vn)[0])
    bad, n = table.copy(), lengths + 1
    if case == "out of range":
        bad[1, 0] = kp.shape[0]
    elif case == "overflow":
        n = np.array([4, 12, 6])
    elif case == "same slot":
        bad[2, 1], n = bad[0, 1], np.array([5, 3, 5])     # sequences 0 and 2 append into slot 1 of one page
    else:
        bad[1, 0] = bad[0, 1]                             # sequence 1's first page is sequence 0's second,
        n = np.array([7, 1, 6])                           # whose slot 1 (0's key 5) sequence 1 appends into
    q, kp, vp, kn, vn, bad, n = as_lib(lib, q, kp, vp, kn, vn, bad, n)
    before = [x.copy() if lib == "numpy" else x.clone() for x in (kp, vp)]
    with pytest.raises(ValueError, match=match):
        attnkit.attention_kvcache(q, kp, vp, n, block_table=bad, k_new=kn, v_new=vn)
    assert same((kp, vp), before)


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_an_append_over_two_pages_the_first_shared_is_still_refused(lib):
    """Three new keys from slot 3 of a page that another sequence holds and sees, on
    into a page of the writer's own: the full path's error on a kept signature (every
    page the append writes is one the step checks), the pages untouched."""
    lengths = np.array([3, 4, 3])
    q, kp, vp, kn, vn, table = paged(5, 4, 3, L=3, lengths=lengths + 3)
    attnkit.attention_kvcache(*as_lib(lib, q, kp.copy(), vp.copy(), lengths, table, kn, vn)[:4],
                              block_table=as_lib(lib, table)[0], k_new=as_lib(lib, kn)[0], v_new=as_lib(lib, vn)[0])
    bad = table.copy()
    bad[1, 0] = bad[0, 0]                                 # sequence 1 sees that page's slot 3 as its key 3
    q, kp, vp, kn, vn, bad, n = as_lib(lib, q, kp, vp, kn, vn, bad, lengths)
    before = [x.copy() if lib == "numpy" else x.clone() for x in (kp, vp)]
    with pytest.raises(ValueError, match="which sequence 1 holds as its key 3"):
        attnkit.attention_kvcache(q, kp, vp, n, block_table=bad, k_new=kn, v_new=vn)
    assert same((kp, vp), before)


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_a_shared_prefix_page_is_read_by_the_step(lib, checked):
    """Sequences sharing their first page (a common prompt), each appending into pages
    of its own: the step takes them (the shared page takes no new key), as the full
    path computes them; a version bump on the torch pages."""
    q, kp, vp, kn, vn, table = paged(4, 4, 4, lengths=(4, 4, 4), share=True)
    q, kp, vp, kn, vn, table = as_lib(lib, q, kp, vp, kn, vn, table)
    kp2, vp2 = kp.copy() if lib == "numpy" else kp.clone(), vp.copy() if lib == "numpy" else vp.clone()
    for n in range(4, 9):
        version = None if lib == "numpy" else kp._version
        got = attnkit.attention_kvcache(q, kp, vp, n, block_table=table, k_new=kn, v_new=vn, causal=True)
        want = full_path(q, kp2, vp2, n, block_table=table, k_new=kn, v_new=vn, causal=True)
        assert same((got, kp, vp), (want, kp2, vp2)), n
        assert version is None or kp._version > version
    assert len(checked) == 1 + 5


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_a_block_table_without_columns_holds_no_key_on_a_kept_signature(lib):
    """A (B, 0) table: no capacity (where the check's stand-in key axis has one key);
    a length of 1 on a signature already run is the full path's error, not a read
    past the table."""
    q, kp, vp, table = as_lib(lib, np.ones((1, 1, 1, 4), np.float32), np.zeros((3, 1, 1, 4), np.float32),
                              np.zeros((3, 1, 1, 4), np.float32), np.zeros((1, 0), np.int64))
    for _ in range(2):
        attnkit.attention_kvcache(q, kp, vp, 0, block_table=table)
    with pytest.raises(ValueError, match="beyond its capacity of 0 keys"):
        attnkit.attention_kvcache(q, kp, vp, 1, block_table=table)


def test_torch_tables_and_lengths_with_a_negative_bit_are_read_as_their_values(checked):
    """A block table or lengths that are negative views (torch._neg_view of their
    negation): the values they hold, on the first call and after (the step declines
    such a table; the full path resolves it), as the plain tensors give."""
    q, kp, vp, kn, vn, table = as_lib("torch", *paged(6, 4, 4, lengths=(6, 6, 6)))
    plain = full_path(q, kp.clone(), vp.clone(), torch.tensor([6, 6, 6]), block_table=table, k_new=kn, v_new=vn)
    neg_table, neg_lengths = torch._neg_view(-table), torch._neg_view(-torch.tensor([6, 6, 6]))
    for n, t in ((torch.tensor([6, 6, 6]), neg_table), (neg_lengths, table), (neg_lengths, neg_table)):
        for _ in range(2):
            got = attnkit.attention_kvcache(q, kp.clone(), vp.clone(), n, block_table=t, k_new=kn, v_new=vn)
            assert same((got,), (plain,))


def test_each_thread_gathers_into_its_own_scratch(checked):
    """Two threads decoding at once from caches of two sizes (large enough that their
    compiled calls, which release the GIL, overlap), and one thread switching between
    them (its scratch grows, then serves the smaller one): every call the full path's
    bits. (A scratch shared by threads, or the values' half placed over the keys',
    gives other numbers.)"""
    import threading
    rng = np.random.default_rng(12)
    runs = []
    for P, width, n in ((16, 16, 250), (8, 24, 180)):
        N = 2 * width + 1
        q, kn, vn = (rng.standard_normal(s).astype(np.float32) for s in ((2, 16, 1, 64), (2, 4, 1, 64), (2, 4, 1, 64)))
        kp, vp = (rng.standard_normal((N, 4, P, 64)).astype(np.float32) for _ in range(2))
        table = rng.permutation(N)[:2 * width].reshape(2, width)
        want = full_path(q, kp.copy(), vp.copy(), n, block_table=table, k_new=kn, v_new=vn, causal=True)
        runs.append((q, kp, vp, kn, vn, table, n, want))

    def loop(i, times, bad):
        q, kp, vp, kn, vn, table, n, want = runs[i]
        for _ in range(times):
            got = attnkit.attention_kvcache(q, kp.copy(), vp.copy(), n, block_table=table, k_new=kn, v_new=vn,
                                            causal=True)
            bad += [] if np.array_equal(got, want) else [i]
    bad = []
    for i in (0, 1, 0, 1):                               # one thread: the scratch grows, then serves both
        loop(i, 3, bad)
    threads = [threading.Thread(target=loop, args=(i, 200, bad)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad, f"{len(bad)} calls differ"
    assert len(checked) == 2 + 2

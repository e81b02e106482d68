"""KV-cache decoding on the Triton rung (``attnkit.torch.triton.rung_kvcache``: the
split-KV kernels of ``decode.py``) through ``attnkit.attention_kvcache(...,
backend="triton")`` on CPU tensors under TRITON_INTERPRET=1, against
``backend="reference"`` on the same tensors by DESIGN.md §6's rule: |triton − oracle|
≤ 2·|reference in the same precision − oracle| + 1e-5, the oracle being the reference
on float64 copies of the very values the kernels saw (for float32 that is a tight
bound: twice float32's own error).

16-key tiles and 16 keys per split at least, so a sequence's keys spread over several
splits (the combine kernel merges them) and over several tiles within a split.
"""

import pytest

import attnkit
from attnkit.testing import error_budget, max_error

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
from attnkit.spec.kvcache import validate_kvcache  # noqa: E402
from attnkit.torch import triton as triton_rung  # noqa: E402
from attnkit.torch.triton import kvcache as tkv  # noqa: E402
from attnkit.torch.triton import tuning as triton_tuning  # noqa: E402

NAN, INF = float("nan"), float("inf")
DT = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def small_tiles(D, dtype, cap, kind):
    return {"BLOCK_M": 16, "BLOCK_N": 16, "SPLIT_KEYS": 16}


@pytest.fixture(autouse=True)
def interpreter(request, monkeypatch, fast_interpreter):
    """TRITON_INTERPRET=1 (the fast interpreter: conftest.py), small tiles and splits;
    the ``test_gpu`` tests run compiled with the tuning table."""
    if request.node.name.startswith("test_gpu"):
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        monkeypatch.setattr(triton_tuning, "override", None)
        return
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if triton_rung.unavailable() is not None:
        pytest.skip(triton_rung.unavailable())
    monkeypatch.setattr(triton_tuning, "override", small_tiles)


# ---- building a case -------------------------------------------------------------------
def contiguous(B, Hkv, S_max, D, Dv, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Hkv, S_max, D, generator=g).to(DT[dtype]),
            torch.randn(B, Hkv, S_max, Dv, generator=g).to(DT[dtype]), None)


def paged(B, Hkv, max_pages, page, D, Dv, dtype, seed):
    """A paged cache with two spare pages and each sequence's pages shuffled."""
    g = torch.Generator().manual_seed(seed)
    n = B * max_pages + 2
    table = torch.randperm(n, generator=g)[:B * max_pages].reshape(B, max_pages).to(torch.int32)
    return (torch.randn(n, Hkv, page, D, generator=g).to(DT[dtype]),
            torch.randn(n, Hkv, page, Dv, generator=g).to(DT[dtype]), table)


def decode(backend, q, k_cache, v_cache, lengths, table=None, k_new=None, v_new=None, **kw):
    """(out, lse, k_cache, v_cache) of one attention_kvcache call on copies of the
    cache (the append writes in place)."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    out, lse = attnkit.attention_kvcache(q, k_cache, v_cache, lengths, block_table=table, k_new=k_new, v_new=v_new,
                                         return_lse=True, backend=backend, **kw)
    return out, lse, k_cache, v_cache


def check(q, cache, lengths, L_new=0, new_seed=1, device="cpu", **kw):
    """Triton (on ``device``) vs the reference (on the CPU) by the 2× rule on out and
    lse; the caches after the append are identical. Returns Triton's (out, lse)."""
    k_cache, v_cache, table = cache
    g = torch.Generator().manual_seed(new_seed)
    new = {}
    if L_new:
        shape = (q.shape[0], k_cache.shape[1], L_new)
        new = dict(k_new=torch.randn(shape + (k_cache.shape[-1],), generator=g).to(q.dtype),
                   v_new=torch.randn(shape + (v_cache.shape[-1],), generator=g).to(q.dtype))
    kw = {n: (x.to(torch.float32) if isinstance(x, torch.Tensor) and x.is_floating_point() else x)
          for n, x in kw.items()}

    def on(dev, *xs):
        return [x if x is None else x.to(dev) for x in xs]

    dkw = {n: on(device, x)[0] if isinstance(x, torch.Tensor) else x for n, x in kw.items()}
    dnew = {n: x.to(device) for n, x in new.items()}
    out, lse, kc, vc = decode("triton", *on(device, q, k_cache, v_cache, lengths, table), **dnew, **dkw)
    out, lse, kc, vc = on("cpu", out, lse, kc, vc)
    same, same_lse, kc2, vc2 = decode("reference", q, k_cache, v_cache, lengths, table, **new, **kw)
    for got, want in ((kc, kc2), (vc, vc2)):          # (NaN where a test put it)
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    wide = {n: x.double() for n, x in new.items()}
    oracle, oracle_lse, _, _ = decode("reference", q.double(), k_cache.double(), v_cache.double(), lengths, table,
                                      **wide, **kw)
    assert out.dtype == q.dtype and out.shape == oracle.shape and lse.dtype == torch.float32
    for name, got, o, s in (("out", out, oracle, same), ("lse", lse, oracle_lse, same_lse)):
        err, budget = max_error(got.double(), o), error_budget(o, s.double())
        assert err <= budget, f"{name}: error {err:.3g} > budget {budget:.3g}"
    return out, lse


def queries(B, H, L, D, dtype, seed=0):
    return torch.randn(B, H, L, D, generator=torch.Generator().manual_seed(seed)).to(DT[dtype])


# ---- contiguous and paged caches, every term ---------------------------------------------
TERMS = {
    "plain": {},
    "causal": dict(causal=True),
    "window": dict(window=(20, 0)),
    "top_left-window": dict(window=(3, 9), align="top_left"),
    "softcap-alibi-sinks": dict(softcap=1.5, alibi_slopes=torch.tensor([0.3, 0.1, 0.6, 0.05]),
                                sinks=torch.tensor([0.5, -1.0, 2.0, 0.0]), causal=True),
    "row-sinks": dict(sinks=torch.linspace(-2, 2, 2 * 4 * 3).reshape(2, 4, 3)),
    "dropout": dict(dropout=0.3, seed=12345, causal=True, sinks=torch.tensor([0.5, -1.0, 2.0, 0.0])),
}


@pytest.mark.parametrize("L,L_new", [(1, 1), (3, 3), (3, 0)], ids=["L1-append", "L3-append", "L3"])
@pytest.mark.parametrize("term", list(TERMS))
def test_contiguous(term, L, L_new):
    """A contiguous cache (B, Hkv, S_max, D), GQA 4:2, lengths from 0 to the capacity
    (after the append), with and without k_new / v_new; D and Dv not powers of two."""
    kw = TERMS[term]
    if term == "row-sinks" and L != 3:
        pytest.skip("per-row sinks are shaped for L = 3")
    lengths = torch.tensor([0, 70 - L_new]) if term != "plain" else torch.tensor([37, 5])
    check(queries(2, 4, L, 40, "float32"), contiguous(2, 2, 70, 40, 24, "float32", seed=2), lengths, L_new, **kw)


@pytest.mark.parametrize("page", [1, 16, 64])
def test_paged(page):
    """Paged caches with shuffled tables: page sizes below, at and above the 16-key
    tile; lengths 0, partial pages and the full capacity; L > 1 causal with an append."""
    max_pages = -(-80 // page)
    cap = max_pages * page
    cache = paged(3, 2, max_pages, page, 16, 16, "float32", seed=page)
    kw = dict(causal=True, alibi_slopes=torch.tensor([0.2, 0.4, 0.1, 0.3]), sinks=torch.tensor([0.1, 0.2, 0.3, 0.4]))
    check(queries(3, 4, 2, 16, "float32"), cache, torch.tensor([0, 17, cap - 2]), 2, **kw)


def test_paged_dropout_across_splits():
    """Dropout on a paged cache (page 16, shuffled) whose keys spread over several
    splits and tiles: the entries the reference drops (counters: the key's position in
    its sequence, not its slot), a seed above 2⁶³ (the key's high word), L > 1."""
    cache = paged(3, 2, 6, 16, 16, 16, "float32", seed=9)
    kw = dict(causal=True, dropout=0.45, seed=2 ** 63 + 2 ** 40 + 7, alibi_slopes=torch.tensor([0.2, 0.4, 0.1, 0.3]))
    out, _ = check(queries(3, 4, 2, 16, "float32"), cache, torch.tensor([3, 50, 94]), 2, **kw)
    plain, _ = check(queries(3, 4, 2, 16, "float32"), cache, torch.tensor([3, 50, 94]), 2, causal=True,
                     alibi_slopes=kw["alibi_slopes"])
    assert (out - plain).abs().max() > 0.1              # something was dropped


RAGGED = {"causal-terms": dict(causal=True, softcap=2.5, alibi_slopes=torch.tensor([0.2, 0.4, 0.1, 0.3]),
                                sinks=torch.tensor([0.1, 0.2, 0.3, 0.4])),
          "dropout-top_left": dict(dropout=0.3, seed=7, window=(2, 1), align="top_left",
                                   sinks=torch.linspace(-1, 1, 3 * 4 * 3).reshape(3, 4, 3))}


@pytest.mark.parametrize("terms", list(RAGGED))
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_ragged_queries(layout, terms):
    """q_lengths: sequence b's first q_lengths[b] query rows are real and append that
    many of the new keys; the other rows are padding (out 0, lse −inf, no sink); causal
    and ALiBi align to each sequence's own last key; one sequence has no query."""
    cache = (paged(3, 2, 6, 16, 16, 16, "float32", seed=11) if layout == "paged" else
             contiguous(3, 2, 96, 16, 16, "float32", seed=11))
    kw = dict(RAGGED[terms], q_lengths=torch.tensor([3, 0, 1]))
    out, lse = check(queries(3, 4, 3, 16, "float32"), cache, torch.tensor([5, 40, 90]), 3, **kw)
    assert (out[1] == 0).all() and (lse[1] == -INF).all()
    assert (out[2, :, 1:] == 0).all() and (lse[2, :, 1:] == -INF).all() and (lse[2, :, 0] > -INF).all()


STARTS = {"causal": dict(causal=True),
          "top_left-window-alibi": dict(window=(9, 2), align="top_left",
                                        alibi_slopes=torch.tensor([0.2, 0.4, 0.1, 0.3])),
          "dropout-top_left-causal": dict(dropout=0.3, seed=5, causal=True, align="top_left")}


@pytest.mark.parametrize("terms", list(STARTS))
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_kv_starts(layout, terms, device="cpu"):
    """kv_starts (FlashAttention's cache_leftpad): sequence b's keys are [kv_starts[b],
    cache_lengths[b] + L_new); top-left puts the first query on the start, the window
    and ALiBi count from it; starts inside, at and past 16-key tiles (so in a later
    split), and a sequence whose only keys are the new ones. The keys before each
    start hold NaN: they are never read."""
    cache = (paged(4, 2, 6, 16, 16, 16, "float32", seed=13) if layout == "paged" else
             contiguous(4, 2, 96, 16, 16, "float32", seed=13))
    k_cache, v_cache, table = cache
    starts, lengths = torch.tensor([0, 17, 64, 40]), torch.tensor([30, 60, 93, 40])
    for b, n in enumerate(starts.tolist()):
        for j in range(n):
            page, slot = (b, j) if table is None else (int(table[b, j // 16]), j % 16)
            k_cache[page, :, slot] = NAN
            v_cache[page, :, slot] = NAN
    kw = {n: x.to(device) if isinstance(x, torch.Tensor) else x for n, x in STARTS[terms].items()}
    out, lse = check(queries(4, 4, 3, 16, "float32"), cache, lengths, 3, device=device,
                     kv_starts=starts.to(device), **kw)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


@pytest.mark.parametrize("kw", [{}, dict(causal=True)], ids=["plain", "causal"])
def test_ragged_padding_rows_stay_zero_next_to_non_finite_values(kw, device="cpu"):
    """Padding rows share row blocks with real rows: a NaN or inf value in a tile every
    real row sees makes those rows' columns NaN (the reference's), never a padding row's."""
    q = queries(2, 4, 3, 16, "float32")
    for k_cache, v_cache, table in (contiguous(2, 2, 112, 16, 16, "float32", seed=9),
                                    paged(2, 2, 7, 16, 16, 16, "float32", seed=9)):
        for (b, h, j, d), x in {(0, 0, 10, 3): NAN, (1, 1, 40, 5): INF}.items():
            page, slot = (b, j) if table is None else (int(table[b, j // 16]), j % 16)
            v_cache[page, h, slot, d] = x
        args = (q, k_cache, v_cache, torch.tensor([112, 96]), table)
        on = [x if x is None else x.to(device) for x in args]
        got = [x.cpu() for x in decode("triton", *on, q_lengths=torch.tensor([1, 2], device=device), **kw)[:2]]
        want = decode("reference", *args, q_lengths=torch.tensor([1, 2]), **kw)[:2]
        for a, w in zip(got, want):
            assert torch.equal(torch.isnan(a), torch.isnan(w))
            fin = torch.isfinite(w)
            assert torch.equal(fin, torch.isfinite(a)) and max_error(a[fin], w[fin]) < 1e-5
        out = got[0]
        assert torch.isnan(out[0, :2, 0, 3]).all() and torch.isnan(out[1, 2:, :2, 5]).all()
        assert (out[0, :, 1:] == 0).all() and (out[1, :, 2:] == 0).all()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision(dtype):
    """Half types by the 2× rule: paged (page 16) GQA and contiguous MQA."""
    kw = dict(causal=True, softcap=2.0, sinks=torch.tensor([0.3, -0.2, 0.0, 1.0]))
    check(queries(2, 4, 2, 64, dtype), paged(2, 2, 6, 16, 64, 40, dtype, seed=4), torch.tensor([90, 33]), 2, **kw)
    check(queries(2, 4, 1, 64, dtype), contiguous(2, 1, 120, 64, 64, dtype, seed=5), torch.tensor([119, 64]), 1,
          window=(40, 0))


def test_splits_depend_on_the_shapes_only():
    """The split count is a function of the shapes (tuning.decode_splits), and the
    same call twice gives the same bits; a sequence's keys are spread over the splits
    from its length on the device."""
    q = queries(2, 4, 1, 16, "float32")
    k_cache, v_cache, _ = contiguous(2, 2, 100, 16, 16, "float32", seed=6)
    kv = validate_kvcache(q, k_cache, v_cache, torch.tensor([100, 3]), backend="triton")
    cfg, _, splits = tkv.plan(kv.spec, None)
    assert splits == 7 == triton_tuning.decode_splits(4, 100, 16)          # 100 keys / 16 per split
    first = decode("triton", q, k_cache, v_cache, torch.tensor([100, 3]), causal=True)
    second = decode("triton", q, k_cache, v_cache, torch.tensor([100, 3]), causal=True)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert triton_tuning.decode_splits(4096, 1 << 17, 512) == 1                # many programs: no split
    assert triton_tuning.decode_splits(1, 1 << 20, 512) == triton_tuning.MAX_SPLITS


def test_keys_past_the_length_are_never_read():
    """NaN in every slot past each sequence's length and block-table entries past its
    last page that point nowhere: the output is finite and equals the reference's."""
    k_cache, v_cache, table = paged(2, 1, 5, 16, 16, 16, "float32", seed=7)
    lengths = torch.tensor([21, 0])
    for b, n in enumerate(lengths.tolist()):
        for p in range(5):
            slots = slice(max(0, n - 16 * p), None)
            k_cache[table[b, p], :, slots] = NAN
            v_cache[table[b, p], :, slots] = NAN
    junk = table.clone()
    junk[0, 2:] = 1 << 30
    junk[1, :] = -(1 << 30)
    q = queries(2, 2, 1, 16, "float32")
    out, lse, _, _ = decode("triton", q, k_cache, v_cache, lengths, junk)
    ref, ref_lse, _, _ = decode("reference", q, k_cache, v_cache, lengths, table)
    assert torch.isfinite(out).all() and max_error(out, ref) < 1e-6 and max_error(lse, ref_lse) < 1e-6
    assert torch.all(out[1] == 0) and torch.all(lse[1] == -INF)                 # no key: out 0, lse -inf


def test_nan_rule():
    """A non-finite value at a key the window excludes (inside a tile that is read)
    never reaches the output; at a visible key it makes the row's column NaN (an inf
    too), as on the reference; a NaN key at a visible position makes the row NaN."""
    q = queries(1, 2, 2, 16, "float32")
    k_cache, v_cache, _ = contiguous(1, 1, 48, 16, 16, "float32", seed=8)
    v_cache[0, 0, 30, 3] = NAN                      # excluded: window (4, 0) from position 45/46
    v_cache[0, 0, 44, 5] = INF                      # visible to both rows
    k_cache[0, 0, 46, 0] = NAN                      # visible to the last row only
    got = decode("triton", q, k_cache, v_cache, torch.tensor([47]), window=(4, 0))[:2]
    want = decode("reference", q, k_cache, v_cache, torch.tensor([47]), window=(4, 0))[:2]
    for a, b in zip(got, want):
        assert torch.equal(torch.isnan(a), torch.isnan(b))
        fin = torch.isfinite(b)
        assert max_error(a[fin], b[fin]) < 1e-6
    out = got[0]
    assert torch.isnan(out[0, :, 0, 5]).all() and torch.isfinite(out[0, :, 0, :5]).all()
    assert torch.isnan(out[0, :, 1]).all()


EVERY_ROW_CASES = pytest.mark.parametrize("L,kw", [(1, {}), (1, dict(causal=True)), (3, {}), (3, dict(causal=True))],
                                         ids=["decode", "decode-causal", "chunk", "chunk-causal"])


@EVERY_ROW_CASES
def test_nan_rule_in_tiles_every_row_sees(L, kw, device="cpu", dtype="float32"):
    """Tiles whose every key every row sees run without the per-tile check (decode.py):
    a NaN or ±inf value there still makes exactly the reference's columns NaN, in every
    split, contiguous and paged; a causal chunk's diagonal tile keeps the check."""
    q = queries(2, 4, L, 16, dtype)
    tol = 1e-5 if dtype == "float32" else 2e-2
    for k_cache, v_cache, table in (contiguous(2, 2, 112, 16, 16, dtype, seed=9),
                                    paged(2, 2, 7, 16, 16, 16, dtype, seed=9)):
        for (b, h, j, d), x in {(0, 0, 10, 3): NAN, (0, 1, 70, 5): INF, (1, 0, 40, 7): -INF,
                                (1, 1, 95, 2): NAN, (1, 1, 110, 4): NAN}.items():
            page, slot = (b, j) if table is None else (int(table[b, j // 16]), j % 16)
            v_cache[page, h, slot, d] = x           # (1, 1, 95) is the last key of sequence 1 and
        lengths = torch.tensor([112, 96])           # the diagonal for chunk-causal's last row only;
        on = [x if x is None else x.to(device) for x in (q, k_cache, v_cache, lengths, table)]   # 110: past
        got = [x.cpu() for x in decode("triton", *on, **kw)[:2]]                                  # its length
        want = decode("reference", q, k_cache, v_cache, lengths, table, **kw)[:2]
        for a, w in zip(got, want):
            assert torch.equal(torch.isnan(a), torch.isnan(w))
            fin = torch.isfinite(w)
            assert torch.equal(fin, torch.isfinite(a)) and max_error(a[fin].float(), w[fin].float()) < tol
        out = got[0]
        assert torch.isnan(out[0, :2, :, 3]).all() and torch.isnan(out[0, 2:, :, 5]).all()
        assert torch.isnan(out[1, :2, :, 7]).all() and torch.isfinite(out[1, :, :, 4]).all()
        assert torch.isnan(out[1, 2:, -1, 2]).all()
        assert torch.isnan(out[1, 2:, :-1, 2]).all() != (L > 1 and "causal" in kw)


@pytest.mark.parametrize("backend", ["triton", "flash"])
@pytest.mark.parametrize("L,kw", [(1, {}), (3, dict(causal=True))], ids=["decode", "chunk-causal"])
def test_a_minus_inf_score_excludes_its_key(backend, L, kw, device="cpu"):
    """An infinite key entry that makes a score −inf excludes that key (docs/decisions.md,
    NaN and inf): a NaN in its value reaches no row, also inside tiles every row sees,
    which run without the per-tile check (Triton redoes such a split checked; the flash
    rung's streaming kernel skips the key); a +inf score makes its rows NaN."""
    q = queries(2, 4, L, 16, "float32")
    q[..., 0] = 1.0                                 # score sign follows k[..., 0] when it is infinite
    for k_cache, v_cache, table in (contiguous(2, 2, 112, 16, 16, "float32", seed=11),
                                    paged(2, 2, 7, 16, 16, 16, "float32", seed=11)):
        for (b, h, j, d), (kx, vx) in {(0, 0, 20, 3): (-INF, NAN), (0, 1, 50, 5): (-INF, INF),
                                       (1, 0, 33, 7): (INF, 1.0)}.items():
            page, slot = (b, j) if table is None else (int(table[b, j // 16]), j % 16)
            k_cache[page, h, slot, 0] = kx
            v_cache[page, h, slot, d] = vx
        lengths = torch.tensor([112, 96])
        on = [x if x is None else x.to(device) for x in (q, k_cache, v_cache, lengths, table)]
        got = [x.cpu() for x in decode(backend, *on, **kw)[:2]]
        want = decode("reference", q, k_cache, v_cache, lengths, table, **kw)[:2]
        for a, w in zip(got, want):
            assert torch.equal(torch.isnan(a), torch.isnan(w))
            fin = torch.isfinite(w)
            assert torch.equal(fin, torch.isfinite(a)) and max_error(a[fin], w[fin]) < 1e-5
        assert torch.isfinite(got[0][0]).all() and torch.isnan(got[0][1, :2]).all()


@pytest.mark.parametrize("L", [1, 2])
def test_nan_rule_left_window_edge(L):
    """A window's left edge inside a read tile: a NaN at a key it excludes stays out
    (the tile is checked), an inf at a key every row sees makes its column NaN."""
    q = queries(1, 2, L, 16, "float32")
    k_cache, v_cache, _ = contiguous(1, 1, 112, 16, 16, "float32", seed=10)
    v_cache[0, 0, 80, 6] = NAN                      # tile [80, 96): the last row's window starts at 81
    v_cache[0, 0, 100, 9] = INF
    got = decode("triton", q, k_cache, v_cache, torch.tensor([112]), window=(30, None))[:2]
    want = decode("reference", q, k_cache, v_cache, torch.tensor([112]), window=(30, None))[:2]
    for a, w in zip(got, want):
        assert torch.equal(torch.isnan(a), torch.isnan(w))
        fin = torch.isfinite(w)
        assert max_error(a[fin], w[fin]) < 1e-6
    assert torch.isfinite(got[0][..., -1, 6]).all() and torch.isnan(got[0][..., 9]).all()
    assert torch.isnan(got[0][..., 0, 6]).all() == (L == 2)   # row 0 of two sees key 80


def test_not_supported_reasons_are_the_rungs():
    q = torch.zeros(1, 2, 1, 16, dtype=torch.float64)
    cache = torch.zeros(1, 1, 8, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match="float64"):
        attnkit.attention_kvcache(q, cache, cache, torch.tensor([3]), backend="triton")


def test_compiles_for_hopper_without_a_gpu():
    """The decode kernels' first compile stage (Python to Triton IR), contiguous and
    paged, every term (kv_starts too), both alignments, for sm_90 (``benchmarks/gpu.py
    --compile-only`` runs the rest)."""
    from attnkit.torch.triton import aot
    for bottom_right in (True, False):
        kinds = aot.compile_decode_only((9, 0), "bfloat16", 128, bottom_right=bottom_right, frontend_only=True)
        assert set(kinds) == {"decode", "decode/paged", "decode_combine"}


# ---- GPU, compiled with the tuning table ------------------------------------------------
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@gpu
@pytest.mark.parametrize("dtype,D", [("bfloat16", 128), ("float16", 64), ("float32", 64)])
@pytest.mark.parametrize("page", [None, 16, 256], ids=["contiguous", "page16", "page256"])
@pytest.mark.parametrize("L", [1, 4])
def test_gpu_kvcache(dtype, D, page, L):
    """Decoding against 4096-key caches, GQA 32:8, every term, lengths 0 … capacity."""
    cache = contiguous(4, 8, 4096, D, D, dtype, seed=9) if page is None else \
        paged(4, 8, 4096 // page, page, D, D, dtype, seed=9)
    kw = dict(causal=True, softcap=30.0, alibi_slopes=torch.linspace(0.01, 0.1, 32),
              sinks=torch.linspace(-1, 1, 32)) if L == 4 else dict(window=(1000, 0))
    check(queries(4, 32, L, D, dtype), cache, torch.tensor([0, 1, 3000, 4096 - L]), L, device="cuda", **kw)


@gpu
@pytest.mark.parametrize("dtype,D", [("bfloat16", 128), ("float32", 64)])
@pytest.mark.parametrize("page", [None, 16], ids=["contiguous", "page16"])
def test_gpu_ragged_queries(dtype, D, page):
    """q_lengths on the GPU: 4, 1, 0 and 3 new tokens of 4 rows, each appending its
    own, every term, against 4096-key caches."""
    cache = contiguous(4, 8, 4096, D, D, dtype, seed=12) if page is None else \
        paged(4, 8, 4096 // page, page, D, D, dtype, seed=12)
    kw = dict(causal=True, softcap=30.0, alibi_slopes=torch.linspace(0.01, 0.1, 32), sinks=torch.linspace(-1, 1, 32),
              q_lengths=torch.tensor([4, 1, 0, 3]))
    out, lse = check(queries(4, 32, 4, D, dtype), cache, torch.tensor([0, 7, 3000, 4093]), 4, device="cuda", **kw)
    assert (out[2] == 0).all() and (lse[2] == -INF).all() and (out[1, :, 1:] == 0).all()


@gpu
@pytest.mark.parametrize("kw", [{}, dict(causal=True)], ids=["plain", "causal"])
def test_gpu_ragged_padding_rows_stay_zero_next_to_non_finite_values(kw):
    test_ragged_padding_rows_stay_zero_next_to_non_finite_values(kw, device="cuda")


@gpu
@EVERY_ROW_CASES
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_nan_rule_in_tiles_every_row_sees(L, kw, dtype):
    test_nan_rule_in_tiles_every_row_sees(L, kw, device="cuda", dtype=dtype)


@gpu
@pytest.mark.parametrize("L,kw", [(1, {}), (3, dict(causal=True))], ids=["decode", "chunk-causal"])
def test_gpu_a_minus_inf_score_excludes_its_key(L, kw):
    test_a_minus_inf_score_excludes_its_key("triton", L, kw, device="cuda")


@gpu
@pytest.mark.parametrize("terms", list(STARTS))
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_gpu_kv_starts(layout, terms):
    test_kv_starts(layout, terms, device="cuda")


@gpu
def test_gpu_deterministic():
    q = queries(2, 32, 1, 128, "bfloat16").cuda()
    k_cache, v_cache, table = (x.cuda() for x in paged(2, 8, 64, 64, 128, 128, "bfloat16", seed=10))
    lengths = torch.tensor([4000, 77], device="cuda")
    first = decode("triton", q, k_cache, v_cache, lengths, table)
    second = decode("triton", q, k_cache, v_cache, lengths, table)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])

"""What a rung copies of a cache: the keys in use, not the capacity (kvcache.seen and
kvcache.compact). A rung that converts a cache (float16 and bfloat16 to float32, a D
axis without unit stride) or gathers it copied the whole of it on every call: a
bfloat16 cache of 8,192 slots holding 60 keys took a decoding step 241 ms."""

import numpy as np
import pytest

import attnkit
from cases import peak_bytes

RNG = np.random.default_rng
B, H, HKV, D, CAP = 2, 4, 2, 32, 1 << 15
LENGTHS = np.array([9, 40])


def _cache(dtype, strided=False):
    rng = RNG(3)
    q = rng.standard_normal((B, H, 1, D)).astype(dtype)
    k, v = (np.full((B, HKV, CAP, 2 * D if strided else D), np.nan, dtype) for _ in range(2))
    for x in (k, v):
        x[:, :, :40] = rng.standard_normal((B, HKV, 40, x.shape[-1]))
    if strided:                                          # a D axis of stride 2: copied for BLAS
        k, v = k[..., ::2], v[..., ::2]
    return q, k, v


@pytest.mark.parametrize("backend", ["flash", "small", "reference"])
@pytest.mark.parametrize("dtype,strided", [("float16", False), ("float32", True)], ids=["float16", "strided"])
def test_a_rung_copies_a_contiguous_cache_up_to_its_longest_sequence(backend, dtype, strided):
    """32k slots of float16 (8 MiB a cache, 16 as float32) or of float32 strided along D,
    40 keys in use: the call allocates less than half of one cache's copy (the flash
    rung its tiles, 4 MiB), and gives the bits of the same call on a cache of the 40
    keys alone."""
    q, k, v = _cache(dtype, strided)
    attnkit.attention_kvcache(q, k, v, LENGTHS, backend=backend)   # (compiling: not the call's own)
    out, peak = peak_bytes(lambda: attnkit.attention_kvcache(q, k, v, LENGTHS, causal=True, backend=backend))
    whole = B * HKV * CAP * D * 4
    assert peak < whole / 2, (peak, whole)                # (the old copies: 2 × whole)
    short = [np.ascontiguousarray(x[:, :, :40]) for x in (k, v)]
    assert np.array_equal(out, attnkit.attention_kvcache(q, *short, LENGTHS, causal=True, backend=backend))


def _pages(torch, dtype):
    """A bfloat16 pool of 4,096 pages of 16 (16 MiB a pool as float32), four pages in use
    (one of them shared), table entries past them holding what nothing may follow."""
    rng = RNG(5)
    pool = [torch.from_numpy(rng.standard_normal((4096, HKV, 16, D)).astype(np.float32)).to(dtype) for _ in range(2)]
    table = torch.tensor([[3000, 7, -1, 10 ** 6], [3000, 12, 4095, 2 ** 40]])   # 9 and 40 keys: 1 and 3 pages
    q = torch.from_numpy(rng.standard_normal((B, H, 1, D)).astype(np.float32)).to(dtype)
    return q, pool[0], pool[1], table


def _oracle(torch, q, k_pool, v_pool, table, lengths, **kw):
    """float64 attention over each sequence's keys gathered by hand."""
    rows = [torch.cat([pool[table[b, p // 16], :, p % 16][:, None] for p in range(int(lengths[b]))] +
                      [torch.zeros(HKV, 40 - int(lengths[b]), D, dtype=pool.dtype)], dim=1)
            for pool in (k_pool, v_pool) for b in range(B)]
    k, v = torch.stack(rows[:B]).double(), torch.stack(rows[B:]).double()
    return attnkit.attention(q.double(), k, v, kv_lengths=torch.as_tensor(lengths), **kw)


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
def test_a_bfloat16_cache_is_upcast_up_to_the_keys_in_use(paged, monkeypatch):
    """torch's bfloat16 (no NumPy dtype) is upcast before the NumPy rungs: a contiguous
    cache up to its longest sequence, a paged pool's pages in use only (copied into a
    pool of their own, the table renumbered; entries past a sequence's pages never
    followed, a page two sequences share copied once)."""
    torch = pytest.importorskip("torch")
    from attnkit.torch import op
    sizes = []
    real = op._np

    def spy(t):
        a = real(t)
        sizes.append(0 if a is None else a.nbytes)
        return a
    monkeypatch.setattr(op, "_np", spy)
    q, k_pool, v_pool, table = _pages(torch, torch.bfloat16)
    lengths = torch.tensor(LENGTHS)
    if paged:
        k, v, kw = k_pool, v_pool, dict(block_table=table)
        want = _oracle(torch, q, k_pool, v_pool, table, LENGTHS, causal=True)
    else:
        k, v = (torch.zeros(B, HKV, CAP, D, dtype=torch.bfloat16) for _ in range(2))
        k[:, :, :40], v[:, :, :40] = (torch.randn(B, HKV, 40, D, generator=torch.Generator().manual_seed(i))
                                      .bfloat16() for i in range(2))
        kw = {}
        want = attnkit.attention(q.double(), k[:, :, :40].double(), v[:, :, :40].double(), kv_lengths=lengths,
                                 causal=True)
    for backend in ("flash", "small", "reference"):
        sizes.clear()
        with torch.no_grad():
            out = attnkit.attention_kvcache(q, k, v, lengths, causal=True, backend=backend, **kw)
        assert max(sizes) <= 4 * 16 * HKV * 16 * D * 4 if paged else max(sizes) <= B * HKV * 40 * D * 4, sizes
        assert torch.allclose(out.double(), want, atol=2e-2), backend


def test_pages_in_use_when_no_sequence_holds_a_key():
    """Lengths of 0: no page in use (the pool cut to one page), then an append of a key
    each (the pages it lands in)."""
    torch = pytest.importorskip("torch")
    q, k_pool, v_pool, table = _pages(torch, torch.bfloat16)
    table[1, 0] = 5                                      # (an append may not share a page)
    with torch.no_grad():
        out = attnkit.attention_kvcache(q, k_pool, v_pool, torch.tensor([0, 0]), block_table=table)
        assert torch.equal(out, torch.zeros_like(out))
        kn, vn = (torch.randn(B, HKV, 1, D).bfloat16() for _ in range(2))
        out = attnkit.attention_kvcache(q, k_pool, v_pool, torch.tensor([0, 0]), block_table=table, k_new=kn,
                                        v_new=vn)
    assert torch.equal(out, vn.repeat_interleave(H // HKV, dim=1))
    assert torch.equal(k_pool[3000, :, 0], kn[0, :, 0]) and torch.equal(k_pool[5, :, 0], kn[1, :, 0])


def test_a_pool_strided_along_d_is_copied_for_its_pages_in_use():
    """A float32 pool whose D axis is not of unit stride is copied for the streaming
    kernel: its pages in use only (4 of 4,096: both pools copied whole took 33 MB),
    with the bits of the same call on a pool of unit stride."""
    rng = RNG(8)
    wide = [rng.standard_normal((4096, HKV, 16, 2 * D)).astype(np.float32) for _ in range(2)]
    k, v = (x[..., ::2] for x in wide)                   # strided along D
    table = np.array([[4000, 7, -1], [4000, 12, 4095]])  # 9 and 40 keys
    q = rng.standard_normal((B, H, 1, D)).astype(np.float32)
    attnkit.attention_kvcache(q, k, v, LENGTHS, block_table=table, backend="flash")
    out, peak = peak_bytes(lambda: attnkit.attention_kvcache(q, k, v, LENGTHS, block_table=table, backend="flash"))
    assert peak < 4096 * HKV * 16 * D * 4 / 2, peak      # (the old copies: 2 × the pool; tiles: 4 MiB)
    dense = [np.ascontiguousarray(x) for x in (k, v)]
    assert np.array_equal(out, attnkit.attention_kvcache(q, *dense, LENGTHS, block_table=table, backend="flash"))

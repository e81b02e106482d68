"""attention_kvcache against FlashAttention's ``flash_attn_with_kvcache`` conventions,
by a peer written from FlashAttention's test definitions (``peers.fa_kvcache``, torch
ops, no attnkit code): its caches (B, S, Hkv, D) read through ``.transpose(1, 2)``
views, ``cache_leftpad`` as ``kv_starts``, ``cache_batch_idx`` as a block table of one
page per cache row, paged caches with shuffled tables, appended keys, causal, local
windows and ALiBi together, MHA, GQA and MQA; every CPU rung, and torch tensors."""

import numpy as np
import pytest

import attnkit
from peers import fa_kvcache

SEEDS = range(24)


def fa_case(seed):
    """A random flash_attn_with_kvcache-style call in FlashAttention's layouts, float64:
    q (B, L, H, D), caches (B or 2B, S, Hkv, D) or pages (n, P, Hkv, D), cache_seqlens
    ``lengths``, cache_leftpad ``starts``, k_new / v_new (B, L_new, Hkv, D) or None,
    ``rows`` (each sequence's cache row; None when paged), ``table`` and the options."""
    rng = np.random.default_rng(seed)
    B, H = 3, 6
    Hkv = int(rng.choice([6, 2, 1]))
    L, D = int(rng.choice([1, 3, 16])), int(rng.choice([8, 59]))
    S = int(rng.choice([40, 97]))
    layout = ["dense", "paged", "batch_idx"][seed % 3]
    L_new = int(rng.integers(1, L + 1)) if rng.random() < 0.6 else 0
    lengths = rng.integers(0 if L_new else 1, S - L_new + 1, B)
    starts = np.array([rng.integers(0, n) if n and rng.random() < 0.5 else 0 for n in lengths])
    opts = dict(causal=bool(rng.random() < 0.5))
    if rng.random() < 0.6:                               # a side past the rows' reach (right ≥ L − 1) changes
        left = None if rng.random() < 0.3 else int(rng.integers(0, S))      # nothing: right < L mostly
        opts["window"] = (left, None if left is not None and rng.random() < 0.2 else int(rng.integers(0, L + 1)))
    if rng.random() < 0.5:
        opts["alibi_slopes"] = rng.random((B, H)) * 0.3
    call = dict(q=rng.standard_normal((B, L, H, D)), lengths=lengths, starts=starts, opts=opts,
                k_new=rng.standard_normal((B, L_new, Hkv, D)) if L_new else None,
                v_new=rng.standard_normal((B, L_new, Hkv, D)) if L_new else None)
    if layout == "dense":
        call.update(k_cache=rng.standard_normal((B, S, Hkv, D)), v_cache=rng.standard_normal((B, S, Hkv, D)),
                    rows=np.arange(B), table=None)
    elif layout == "batch_idx":                          # sequence b reads cache row idx[b]
        idx = rng.permutation(2 * B)[:B]
        call.update(k_cache=rng.standard_normal((2 * B, S, Hkv, D)), v_cache=rng.standard_normal((2 * B, S, Hkv, D)),
                    rows=idx, table=idx[:, None])
    else:                                                # pages of 16 (or 1), any order
        P = int(rng.choice([16, 1]))
        n = -(-S // P)
        table = rng.permutation(B * n + 3)[:B * n].reshape(B, n)
        call.update(k_cache=rng.standard_normal((B * n + 3, P, Hkv, D)),
                    v_cache=rng.standard_normal((B * n + 3, P, Hkv, D)), rows=None, table=table, P=P)
    return call


def fa_append(c):
    """Copies of the caches with the new keys and values written as FlashAttention
    writes them: sequence b's t-th at slot lengths[b] + t of its row or pages."""
    caches = c["k_cache"].copy(), c["v_cache"].copy()
    for b in range(c["q"].shape[0]):
        for t in range(0 if c["k_new"] is None else c["k_new"].shape[1]):
            slot = c["lengths"][b] + t
            for cache, new in zip(caches, (c["k_new"], c["v_new"])):
                if c["rows"] is not None:
                    cache[c["rows"][b], slot] = new[b, t]
                else:
                    cache[c["table"][b, slot // c["P"]], slot % c["P"]] = new[b, t]
    return caches


def dense_keys(c, cache):
    """Every sequence's slots 0 … S − 1 of a (B, S, Hkv, D) or paged cache, as (B, Hkv, S, D)."""
    rows = [cache[c["rows"][b]] if c["rows"] is not None else np.concatenate([cache[p] for p in c["table"][b]])
            for b in range(c["q"].shape[0])]
    return np.stack(rows).swapaxes(1, 2)


@pytest.mark.parametrize("lib, backend", [("numpy", "reference"), ("numpy", "small"), ("numpy", "flash"),
                                          ("torch", "auto")])
@pytest.mark.parametrize("seed", SEEDS)
def test_flash_attn_with_kvcache_calls_match_flashattentions_definition(seed, lib, backend):
    c = fa_case(seed)
    want_k, want_v = fa_append(c)

    def conv(x):                                         # in the library under test
        if lib == "numpy" or x is None:
            return x
        import torch
        return torch.from_numpy(x)

    def view(x):                                         # FlashAttention's (B, S, H, D), as views
        return None if x is None else x.swapaxes(1, 2)

    k_cache, v_cache = conv(c["k_cache"]), conv(c["v_cache"])
    opts = {n: conv(x) if n == "alibi_slopes" else x for n, x in c["opts"].items()}
    out = attnkit.attention_kvcache(view(conv(c["q"])), view(k_cache), view(v_cache), conv(c["lengths"]),
                                    block_table=conv(c["table"]), k_new=view(conv(c["k_new"])),
                                    v_new=view(conv(c["v_new"])), kv_starts=conv(c["starts"]), backend=backend, **opts)
    assert np.array_equal(np.asarray(k_cache), want_k) and np.array_equal(np.asarray(v_cache), want_v)
    L_new = 0 if c["k_new"] is None else c["k_new"].shape[1]
    want = fa_kvcache(c["q"].swapaxes(1, 2), dense_keys(c, want_k), dense_keys(c, want_v), c["starts"],
                      c["lengths"] + L_new, **c["opts"])
    assert np.abs(np.asarray(out) - want).max() <= 1e-12

"""kv_starts: sequence b's keys are [kv_starts[b], kv_lengths[b]) — left padding,
FlashAttention's cache_leftpad. Every CPU rung, NumPy and torch, forward and backward,
and attention_kvcache equal attention over each sequence's own keys alone (the
alignments, the window and ALiBi counted from its first key); bad starts get named
errors; ring attention refuses it by name (the Triton kernels take it:
tests/torch/test_triton.py and test_triton_kvcache.py); transformers' left-padded
batches use it, and their decoding steps run kept like unpadded ones."""

import numpy as np
import pytest

import attnkit
from attnkit.testing import error_budget, max_error

RNG = np.random.default_rng
RUNGS = ["reference", "small", "flash"]


def case(seed, L=3, S=13):
    rng = RNG(seed)
    B, Hkv, G, D, Dv = 3, 2, 2, 8, 5
    q = rng.standard_normal((B, Hkv * G, L, D))
    k, v = rng.standard_normal((B, Hkv, S, D)), rng.standard_normal((B, Hkv, S, Dv))
    lengths = np.array([S, S - 4, 9])
    starts = np.array([0, 3, 9])                          # the last sequence has no key
    return q, k, v, starts, lengths


def alone(q, k, v, starts, lengths, b, **kw):
    """(out, lse) of sequence b over its own keys, by the reference (a sequence without
    keys: one key, excluded by kv_lengths = 0)."""
    s, n = starts[b], lengths[b]
    if s == n:
        return attnkit.attention(q[b], k[b, :, :1], v[b, :, :1], kv_lengths=np.array(0), backend="reference",
                                 return_lse=True, **kw)
    return attnkit.attention(q[b], k[b, :, s:n], v[b, :, s:n], backend="reference", return_lse=True, **kw)


TERMS = [dict(), dict(causal=True), dict(causal=True, align="top_left"), dict(window=(2, 1)),
         dict(window=(1, 0), align="top_left"), dict(alibi_slopes=np.array([0.5, 0.25, 1.0, 0.125])),
         dict(alibi_slopes=np.array([0.5, 0.25, 1.0, 0.125]), align="top_left", causal=True),
         dict(softcap=2.0, causal=True), dict(sinks=np.array([0.3, -1.0, 2.0, 0.0]))]


@pytest.mark.parametrize("lib", ["numpy", "torch"])
@pytest.mark.parametrize("rung", RUNGS)
@pytest.mark.parametrize("terms", TERMS, ids=lambda t: "+".join(t) or "plain")
def test_each_sequence_is_attention_over_its_own_keys(terms, rung, lib):
    q, k, v, starts, lengths = case(1)
    args = (q, k, v)
    extra = dict(kv_starts=starts, kv_lengths=lengths)
    if lib == "torch":
        torch = pytest.importorskip("torch")
        args = tuple(torch.from_numpy(x) for x in args)
        extra = {n: torch.from_numpy(x) for n, x in extra.items()}
        terms = {n: torch.from_numpy(x) if isinstance(x, np.ndarray) else x for n, x in terms.items()}
    out, lse = attnkit.attention(*args, backend=rung, return_lse=True, **extra, **terms)
    out, lse = np.asarray(out), np.asarray(lse)
    for b in range(3):
        plain = {n: np.asarray(x) if hasattr(x, "numpy") else x for n, x in terms.items()}
        want, want_lse = alone(q, k, v, starts, lengths, b, **plain)
        assert max_error(out[b], want) <= 1e-12 and max_error(lse[b], want_lse) <= 1e-12, b


@pytest.mark.parametrize("rung", RUNGS)
@pytest.mark.parametrize("terms", [dict(), dict(causal=True, window=(3, 0)), dict(align="top_left", causal=True)],
                         ids=["plain", "window", "top_left"])
def test_gradients_are_each_sequences_own(terms, rung):
    """dq, dk, dv of the batched call: each sequence's own, and 0 on the keys before
    its first."""
    torch = pytest.importorskip("torch")
    q, k, v, starts, lengths = case(2, L=4)
    t = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    dout = torch.from_numpy(RNG(3).standard_normal((3, 4, 4, 5)))
    out = attnkit.attention(*t, kv_starts=torch.from_numpy(starts), kv_lengths=torch.from_numpy(lengths),
                            backend=rung, **terms)
    out.backward(dout)
    for b in range(3):
        s, n = starts[b], lengths[b]
        if s == n:                                       # no key: no gradient at all
            assert not any(x.grad[b].any() for x in t)
            continue
        one = [torch.tensor(x, requires_grad=True) for x in (q[b], k[b, :, s:n], v[b, :, s:n])]
        o = attnkit.attention(*one, backend="reference", **terms)
        o.backward(dout[b])
        assert (t[0].grad[b] - one[0].grad).abs().max() <= 1e-12
        assert (t[1].grad[b, :, s:n] - one[1].grad).abs().max() <= 1e-12
        assert (t[2].grad[b, :, s:n] - one[2].grad).abs().max() <= 1e-12
        assert not t[1].grad[b, :, :s].any() and not t[2].grad[b, :, :s].any()


@pytest.mark.parametrize("rung", ["small", "flash"])
def test_float32_rungs_within_the_budget(rung):
    """The compiled float32 kernels (the small rung's streaming call, the flash tiles)
    against the float64 reference, by DESIGN.md's 2× rule."""
    q, k, v, starts, lengths = case(4, L=1, S=40)
    kw = dict(kv_starts=starts, kv_lengths=lengths, causal=True)
    oracle = attnkit.attention(q, k, v, backend="reference", **kw)
    same = attnkit.attention(*(x.astype(np.float32) for x in (q, k, v)), backend="reference", **kw)
    got = attnkit.attention(*(x.astype(np.float32) for x in (q, k, v)), backend=rung, **kw)
    assert max_error(got, oracle) <= error_budget(oracle, same)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("backend", RUNGS)
def test_kvcache_starts_like_cache_leftpad(backend, paged, dtype):
    """attention_kvcache with kv_starts (FlashAttention's cache_leftpad): after the
    append, each sequence's queries see its keys [kv_starts[b], cache_lengths[b] + L_new)."""
    rng = RNG(5)
    B, Hkv, H, D, L, S = 3, 2, 4, 8, 2, 32
    k, v = (rng.standard_normal((B, Hkv, S, D)).astype(dtype) for _ in range(2))
    q = rng.standard_normal((B, H, L, D)).astype(dtype)
    kn, vn = (rng.standard_normal((B, Hkv, L, D)).astype(dtype) for _ in range(2))
    lengths, starts = np.array([10, 30, 5]), np.array([4, 0, 6])
    K, V = k.copy(), v.copy()
    for b in range(B):
        K[b, :, lengths[b]:lengths[b] + L], V[b, :, lengths[b]:lengths[b] + L] = kn[b], vn[b]
    kc, vc, table = k, v, None
    if paged:                                            # pages of 8 in a shuffled table
        table = rng.permutation(B * 4).reshape(B, 4)
        kc, vc = np.empty((B * 4, Hkv, 8, D), dtype), np.empty((B * 4, Hkv, 8, D), dtype)
        for b in range(B):
            for p in range(4):
                kc[table[b, p]], vc[table[b, p]] = k[b, :, 8 * p:8 * p + 8], v[b, :, 8 * p:8 * p + 8]
    out = attnkit.attention_kvcache(q, kc, vc, lengths, block_table=table, k_new=kn, v_new=vn, kv_starts=starts,
                                    causal=True, backend=backend)
    for b in range(B):
        s, n = starts[b], lengths[b] + L
        oracle = attnkit.attention(q[b].astype(np.float64), K[b, :, s:n].astype(np.float64),
                                   V[b, :, s:n].astype(np.float64), causal=True, backend="reference")
        same = attnkit.attention(q[b], K[b, :, s:n], V[b, :, s:n], causal=True, backend="reference")
        assert max_error(out[b], oracle) <= (1e-12 if dtype == "float64" else error_budget(oracle, same)), b


BAD = [
    (dict(kv_starts=np.array([0.0, 1.0, 2.0])), TypeError, "kv_starts: expected integers"),
    (dict(kv_starts=np.array([0, 1])), ValueError, "kv_starts: expected a shape that broadcasts"),
    (dict(kv_starts=np.array([0, 14, 1])), ValueError, r"kv_starts: expected lengths in \[0, S=13\]"),
    (dict(kv_starts=np.array([0, -1, 1])), ValueError, r"kv_starts: expected lengths in \[0, S=13\]"),
    (dict(kv_starts=np.array([0, 10, 1]), kv_lengths=np.array([13, 9, 13])), ValueError,
     "kv_starts: sequence 1 starts at key 10, past its kv_lengths of 9"),
]


@pytest.mark.parametrize("kw,err,message", BAD)
def test_bad_starts_get_named_errors(kw, err, message):
    q, k, v, _, _ = case(6)
    with pytest.raises(err, match=f"^{message}"):
        attnkit.attention(q, k, v, **kw)


def test_starts_with_packed_sequences_are_refused():
    q, k, v = RNG(7).standard_normal((3, 2, 6, 4))
    with pytest.raises(ValueError, match="^kv_starts: not combined with cu_seqlens"):
        attnkit.attention(q, k, v, cu_seqlens_q=np.array([0, 6]), cu_seqlens_k=np.array([0, 6]),
                          kv_starts=np.array([1]))


def test_ring_attention_refuses_starts_by_name():
    torch = pytest.importorskip("torch")
    from attnkit.spec import validate
    from attnkit.spec.checks import check_ring_shard
    q, k, v, starts, _ = case(8)
    spec = validate(*(torch.from_numpy(x) for x in (q, k, v)), kv_starts=torch.from_numpy(starts))
    with pytest.raises(ValueError, match="^kv_starts: not supported by ring_attention"):
        check_ring_shard(spec, None, None, "contiguous")


def test_left_padded_generation_keeps_its_decoding_calls(monkeypatch):
    """transformers' left-padded batch (the usual batched generation) reads its padding
    as kv_starts, gives eager's tokens, and its decoding steps run the layers' kept
    calls: after the first step, no call takes attention's full path."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import attnkit.hf
    from attnkit import api
    attnkit.hf.register()
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64)
    ids = torch.randint(1, 97, (3, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, :3] = 0
    mask[2, :6] = 0
    ids[mask == 0] = 0
    outs, full = {}, []
    real = api.attention

    def spy(*args, **kwargs):
        full.append(kwargs)
        return real(*args, **kwargs)

    for impl in ("eager", "attnkit"):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=impl).to(torch.float32).eval()
        if impl == "attnkit":
            monkeypatch.setattr(api, "attention", spy)
        with torch.no_grad():
            outs[impl] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                        pad_token_id=0)
    assert torch.equal(outs["eager"], outs["attnkit"])
    assert full and all(kw.get("kv_starts") is not None and kw.get("keep") is None for kw in full)
    assert full[0]["kv_starts"].tolist() == [0, 3, 6]
    # the prefill (2 layers) and the first decoding step (2 layers); every later step is kept
    assert len(full) <= 4, len(full)


@pytest.mark.parametrize("rung", RUNGS)
def test_calls_that_differ_only_in_their_starts(rung):
    """Plans and kept calls are made per starts: the same shapes with other starts
    (the flash rung's kept units, a small call's kept bounds) give those starts' result."""
    q, k, v, _, lengths = case(9)
    for starts in ([0, 3, 9], [5, 0, 2], [0, 3, 9], [13, 9, 0]):
        starts = np.array(starts)
        for _ in range(2):                               # (the second time: what was kept)
            out = attnkit.attention(q, k, v, kv_starts=starts, kv_lengths=lengths, causal=True, backend=rung)
            for b in range(3):
                assert max_error(out[b], alone(q, k, v, starts, lengths, b, causal=True)[0]) <= 1e-12, starts


def test_a_kept_call_declines_fewer_keys_than_a_first_key():
    """The small rung's kept call (transformers' layers reuse it as the keys grow) runs
    for key lengths from the largest first key on; below, it declines (the full path
    then names the error)."""
    torch = pytest.importorskip("torch")
    from attnkit import small
    from attnkit.spec import validate
    q, k, v = (torch.randn(2, 4, 1, 8) for _ in range(3))
    k, v = torch.randn(2, 2, 20, 8), torch.randn(2, 2, 20, 8)
    spec = validate(q, k, v, kv_starts=torch.tensor([3, 12]))
    call = small.direct_at(spec)
    assert call is not None

    def run(S):
        out = torch.empty(2, 4, 1, 8)
        return call(q.data_ptr(), q.stride(), k.data_ptr(), k.stride(), v.data_ptr(), v.stride(), S,
                    out.data_ptr(), out.stride(), 0, 0), out

    ok, out = run(16)
    want = attnkit.attention(q, k[:, :, :16], v[:, :, :16], kv_starts=torch.tensor([3, 12]), backend="reference")
    assert ok and (out - want).abs().max() <= 1e-6
    assert not run(11)[0]


@pytest.mark.parametrize("rung", RUNGS)
def test_weights_are_each_sequences_own(rung):
    """attention_weights (and return_weights): each sequence's own weights on its keys,
    0 before its first key and past its length."""
    q, k, v, starts, lengths = case(10)
    w = attnkit.attention_weights(q, k, kv_starts=starts, kv_lengths=lengths, causal=True, backend=rung)
    _, w2 = attnkit.attention(q, k, v, kv_starts=starts, kv_lengths=lengths, causal=True, backend=rung,
                              return_weights=True)
    assert max_error(w, w2) <= 1e-12
    for b in range(2):                                   # (sequence 2 has no key)
        s, n = starts[b], lengths[b]
        want = attnkit.attention_weights(q[b], k[b, :, s:n], causal=True, backend="reference")
        assert max_error(w[b][..., s:n], want) <= 1e-12
        assert not w[b][..., :s].any() and not w[b][..., n:].any()
    assert not w[2].any()


def test_a_kept_call_keeps_the_starts_it_was_made_for():
    """A caller that reuses (and changes) its starts array: a later call with the first
    values runs with those values (a review found the kept call reading the array)."""
    rng = RNG(11)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((2, 2, 1, 8), (2, 2, 8, 8), (2, 2, 8, 8)))
    starts = np.array([2, 5])
    attnkit.attention(q, k, v, kv_starts=starts)
    starts[:] = [0, 0]
    got = attnkit.attention(q, k, v, kv_starts=np.array([2, 5]))
    want = attnkit.attention(*(x.astype(np.float64) for x in (q, k, v)), kv_starts=np.array([2, 5]),
                             backend="reference")
    assert max_error(got, want) <= 1e-5

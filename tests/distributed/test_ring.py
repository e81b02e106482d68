"""Ring attention (attnkit.distributed) on 2 and 4 local gloo processes against
single-process attention.

One spawn per world size runs every case inside (starting a process that imports
torch costs seconds on the 2-core CI machine); the processes return their shards
and the test process unshards them and compares with the single-process result
computed here. Runtime on 2 cores: about 25 s (P=2) and 50 s (P=4).

Checks: forward (out, lse) and backward (dq, dk, dv) for non-causal, causal
(contiguous and zigzag layouts), GQA/MQA, key padding (keep and drop, including
query rows that see no key), windows, cross-attention L ≠ S with both alignments,
softcap, 2-D inputs, float32/float16 by the DESIGN.md §6 2× rule; errors for uneven
shard lengths, odd zigzag shards, non-padding masks, and kv_lengths, ALiBi slopes or
per-head sinks of other values on one rank, raised on every rank (no hang); per-rank peak memory set by L/P (see test_ring_memory_is_set_by_shard_length).
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import attnkit  # noqa: E402
from attnkit.testing import error_budget, make_qkv, max_error  # noqa: E402

# name: (B, H, Hkv, Lc, Sc, D, Dv, dtype, layout, kwargs, mask); L = 2·P·Lc, S = 2·P·Sc.
# B None = 2-D inputs. mask: None, "keep" (random key padding), "drop_first" (drop the
# first 3 keys: with causal, the first queries see no key at all).
CASES = {
    "full": (2, 4, 4, 5, 5, 16, 12, "float64", "contiguous", {}, None),
    "full_zigzag": (2, 4, 4, 5, 5, 16, 12, "float64", "zigzag", {}, None),
    "causal": (2, 4, 4, 5, 5, 16, 16, "float64", "contiguous", dict(causal=True), None),
    "causal_zigzag": (2, 4, 4, 5, 5, 16, 16, "float64", "zigzag", dict(causal=True), None),
    "gqa_causal_zigzag": (2, 4, 2, 5, 5, 16, 8, "float64", "zigzag", dict(causal=True), None),
    "mqa_causal": (1, 4, 1, 4, 4, 8, 8, "float64", "contiguous", dict(causal=True), None),
    "padding": (2, 4, 2, 5, 5, 16, 16, "float64", "contiguous", {}, "keep"),
    "padding_causal_zigzag": (2, 4, 2, 5, 5, 16, 16, "float64", "zigzag", dict(causal=True), "keep"),
    "masked_rows_causal": (1, 2, 2, 3, 3, 8, 8, "float64", "contiguous", dict(causal=True), "drop_first"),
    "window": (1, 4, 4, 6, 6, 8, 8, "float64", "contiguous", dict(window=(3, 2)), None),
    "window_zigzag": (1, 4, 4, 6, 6, 8, 8, "float64", "zigzag", dict(window=(3, 2)), None),
    "window_causal_zigzag": (1, 4, 2, 6, 6, 8, 8, "float64", "zigzag", dict(window=(7, None), causal=True), "keep"),
    "window_right_only": (1, 2, 2, 6, 6, 8, 8, "float64", "zigzag", dict(window=(None, 1)), None),
    "cross_bottom_right": (1, 2, 2, 3, 6, 8, 8, "float64", "contiguous", dict(causal=True), None),
    "cross_top_left_zigzag": (1, 2, 2, 6, 3, 8, 8, "float64", "zigzag", dict(causal=True, align="top_left"), None),
    "cross_bottom_right_zigzag": (1, 2, 2, 6, 3, 8, 8, "float64", "zigzag", dict(causal=True), None),
    "softcap_scale": (2, 2, 2, 4, 4, 8, 8, "float64", "contiguous", dict(softcap=2.0, scale=0.7), None),
    "two_d_causal_zigzag": (None, 1, 1, 5, 5, 8, 6, "float64", "zigzag", dict(causal=True), None),
    "f32_gqa_causal_zigzag": (2, 4, 2, 8, 8, 32, 32, "float32", "zigzag", dict(causal=True), "keep"),
    "f32_full": (2, 4, 4, 8, 8, 32, 16, "float32", "contiguous", {}, None),
    "f16_causal": (1, 4, 4, 8, 8, 32, 32, "float16", "contiguous", dict(causal=True), None),
    "f16_full": (1, 4, 4, 12, 12, 16, 16, "float16", "contiguous", {}, None),
    # the terms every rung has: ALiBi from global positions, sinks folded in once (and
    # their gradient summed over ranks), dropout dropping the single-device entries,
    # key lengths in global positions
    "alibi_causal_zigzag": (2, 4, 2, 5, 5, 16, 16, "float64", "zigzag",
                            dict(causal=True, alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625])), None),
    "sinks_causal_zigzag": (2, 4, 4, 5, 5, 8, 8, "float64", "zigzag",
                            dict(causal=True, sinks=np.array([0.1, -0.5, 1.0, 0.0])), "drop_first"),
    "dropout_causal_zigzag": (2, 4, 2, 5, 5, 8, 8, "float64", "zigzag", dict(causal=True, dropout=0.3, seed=11), None),
    "kv_lengths_causal": (2, 4, 2, 5, 5, 8, 8, "float64", "contiguous",
                          dict(causal=True, align="top_left", kv_lengths=lambda L, S: np.array([S - 7, S])), None),
    # bottom-right: a sequence's diagonal sits kv_len[b] − S left of the plan's, so a
    # window's left edge must not crop the blocks by the plan's (a port of
    # ring-flash-attention's tests found keys cut off)
    "kv_lengths_window_zigzag": (2, 2, 2, 5, 5, 8, 8, "float64", "zigzag",
                                 dict(window=(3, 0), kv_lengths=lambda L, S: np.array([S - 7, S])), None),
    "kv_lengths_causal_window": (1, 2, 1, 4, 4, 8, 8, "float64", "contiguous",
                                 dict(causal=True, window=(2, None), kv_lengths=lambda L, S: np.array([S // 2 + 1])),
                                 None),
    # sinks per row (sharded like q; here one row per rank: a last dim of 1 that is not
    # a per-head logit) and one 0-d logit for every row (its gradient summed over ranks)
    "sinks_per_row_one_row": (1, 2, 2, 0.5, 2, 8, 8, "float64", "contiguous",
                              dict(sinks=lambda L, S: np.linspace(-1, 1, 2 * L).reshape(1, 2, L)), None),
    "sinks_0d_causal": (1, 2, 2, 3, 3, 8, 8, "float64", "zigzag", dict(causal=True, sinks=np.array(0.3)), None),
}


def _per_row(x, L):
    """Whether a sinks array holds one logit per query row (sharded like q)."""
    return np.ndim(x) >= 2 and np.shape(x)[-1] == L


def _kwargs(case, P):
    """A case's keyword arguments for world size P (lengths depend on the sequence)."""
    B, H, Hkv, Lc, Sc, *_, kw, _ = CASES[case]
    return {n: (x(int(2 * P * Lc), int(2 * P * Sc)) if callable(x) else x) for n, x in kw.items()}


def _inputs(case, P, seed=0):
    """Full-sequence NumPy inputs (q, k, v, dout, keep) for a case and world size."""
    B, H, Hkv, Lc, Sc, D, Dv, dtype, _, kw, mask = CASES[case]
    L, S = int(2 * P * Lc), int(2 * P * Sc)
    lead_q, lead_k = ((), ()) if B is None else ((B, H), (B, Hkv))
    q, k, v = make_qkv(lead_q + (L, D), lead_k + (S, D), Dv, dtype=dtype, seed=seed)
    rng = np.random.default_rng(seed + 1)
    dout = rng.standard_normal(lead_q + (L, Dv)).astype(dtype)
    keep = None
    if mask is not None:
        keep = np.ones(((1,) if B is None else (B, 1, 1)) + (S,), bool)
        if mask == "keep":
            keep &= rng.random(keep.shape) > 0.3
        else:
            keep[..., :3] = False
    return q, k, v, dout, keep


def _run_cases(rank, world):
    """In each process: every case through ring_attention, forward and backward;
    returns {case: dict of this rank's NumPy shards}."""
    from attnkit.distributed import ring_attention, shard

    res = {}
    for case, (*_, dtype, layout, _kw, mask) in CASES.items():
        q, k, v, dout, keep = (None if a is None else torch.from_numpy(a) for a in _inputs(case, world))
        kw = {n: torch.from_numpy(x) if isinstance(x, np.ndarray) else x for n, x in _kwargs(case, world).items()}
        if "sinks" in kw:
            if _per_row(kw["sinks"], q.shape[-2]):
                kw["sinks"] = shard(kw["sinks"], rank, world, layout=layout, dim=-1).clone()
            kw["sinks"].requires_grad_()
        q, k, v = (shard(x, rank, world, layout=layout).clone().requires_grad_() for x in (q, k, v))
        dout = shard(dout, rank, world, layout=layout)
        masks = {}
        if keep is not None:
            keep = shard(keep, rank, world, layout=layout, dim=-1)
            masks = {"keep": keep} if mask == "keep" else {"drop": ~keep}
        out, lse = ring_attention(q, k, v, layout=layout, return_lse=True, **kw, **masks)
        out.backward(dout)
        again = ring_attention(q.detach(), k.detach(), v.detach(), layout=layout, **kw, **masks)
        res[case] = dict(out=out.detach().numpy(), lse=lse.numpy(), dq=q.grad.numpy(),
                         dk=k.grad.numpy(), dv=v.grad.numpy(),
                         deterministic=bool(torch.equal(out.detach(), again)))
        if "sinks" in kw:
            res[case]["dsinks"] = kw["sinks"].grad.numpy()
    return res


def _errors(rank, world):
    """Bad inputs: every rank must raise (a hang here would time the test out)."""
    from attnkit.distributed import ring_attention

    def catch(fn):
        try:
            fn()
        except (ValueError, TypeError, NotImplementedError) as e:
            return f"{type(e).__name__}: {e}"
        return None

    t = lambda *s: torch.zeros(*s, dtype=torch.float64)
    n = 4 + (rank == world - 1)                          # the last rank's shard is longer
    return {
        "uneven_q": catch(lambda: ring_attention(t(2, n, 8), t(2, 4, 8), t(2, 4, 8))),
        "uneven_kv": catch(lambda: ring_attention(t(2, 4, 8), t(2, n, 8), t(2, n, 8))),
        "odd_zigzag": catch(lambda: ring_attention(t(2, 5, 8), t(2, 5, 8), t(2, 5, 8), layout="zigzag")),
        "one_rank_bad_dtype": catch(lambda: ring_attention(
            t(2, 4, 8).float() if rank == 0 else t(2, 4, 8), t(2, 4, 8), t(2, 4, 8))),
        "query_mask": catch(lambda: ring_attention(t(2, 4, 8), t(2, 4, 8), t(2, 4, 8),
                                                   keep=torch.ones(4, 4, dtype=torch.bool))),
        "bad_layout": catch(lambda: ring_attention(t(2, 4, 8), t(2, 4, 8), t(2, 4, 8), layout="striped")),
        "bad_flag": catch(lambda: ring_attention(t(2, 4, 8), t(2, 4, 8), t(2, 4, 8), return_lse="no")),
        # arrays of global or per-head values, other values on the last rank
        "other_kv_lengths": catch(lambda: ring_attention(
            t(2, 3, 4, 8), t(2, 3, 4, 8), t(2, 3, 4, 8), kv_lengths=torch.tensor([4 * world, 5 + (rank == world - 1)]))),
        "other_slopes": catch(lambda: ring_attention(
            t(1, 2, 4, 8), t(1, 2, 4, 8), t(1, 2, 4, 8), alibi_slopes=torch.tensor([0.5, 0.25 + (rank == world - 1)]))),
        "other_sinks": catch(lambda: ring_attention(
            t(1, 2, 4, 8), t(1, 2, 4, 8), t(1, 2, 4, 8), sinks=torch.tensor([0.0, 1.0 * (rank == world - 1)]))),
        "same_sinks_other_dtype": catch(lambda: ring_attention(            # (values compared, not bits)
            t(1, 2, 4, 8), t(1, 2, 4, 8), t(1, 2, 4, 8),
            sinks=torch.tensor([-0.0 if rank else 0.0, 1.0], dtype=torch.float32 if rank else torch.float64))),
        # an error other than TypeError/ValueError on one rank (a meta tensor reaches
        # the rung choice): the others must not wait for it
        "one_rank_meta": catch(lambda: ring_attention(
            t(2, 4, 8).to("meta") if rank == 0 else t(2, 4, 8), t(2, 4, 8).to(t(1).device if rank else "meta"),
            t(2, 4, 8).to(t(1).device if rank else "meta"))),
    }


# ---- memory ---------------------------------------------------------------------
MEM = dict(B=2, H=8, D=128, n=256)   # per-rank shard: q, k, v 4 MiB each in float64


def _rss_peak(fn):
    """Peak resident memory growth (bytes) of this process while fn() runs: Linux's
    VmHWM after resetting it through /proc/self/clear_refs, minus VmRSS before."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")

    def read(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    before = read("VmRSS")
    fn()
    return read("VmHWM") - before


def _ring_step(group, size, n, rank_in_group):
    """Forward and backward of (non-causal: every step the same shapes) ring attention with shard length n in a
    group of ``size`` ranks (inputs made inside: their bytes count too)."""
    from attnkit.distributed import ring_attention

    def run():
        g = torch.Generator().manual_seed(rank_in_group)
        q, k, v = (torch.randn(MEM["B"], MEM["H"], n, MEM["D"], dtype=torch.float64, generator=g,
                               requires_grad=True) for _ in range(3))
        out = ring_attention(q, k, v, group)
        out.backward(torch.ones_like(out))
        dist.barrier(group=group)
    return run


def _memory(rank, world):
    """Peak RSS growth per rank: the whole world (L = world·n) vs pairs of ranks
    (L = 2·n, and L = 4·n to show the measure follows the shard length)."""
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
    pair = pairs[rank // 2]
    n = MEM["n"]
    _ring_step(pair, 2, n, rank % 2)()                  # warm up: first calls, gloo buffers
    _ring_step(None, world, n, rank)()
    # the peak depends a little on how sends and receives interleave (a buffer freed
    # a moment earlier or later): take the larger of two runs
    return dict(
        pair_n=max(_rss_peak(_ring_step(pair, 2, n, rank % 2)) for _ in range(2)),
        world_n=max(_rss_peak(_ring_step(None, world, n, rank)) for _ in range(2)),
        pair_2n=_rss_peak(_ring_step(pair, 2, 2 * n, rank % 2)),
        shard_bytes=MEM["B"] * MEM["H"] * n * MEM["D"] * 8,
    )


def _worker(rank, world):
    return dict(cases=_run_cases(rank, world), errors=_errors(rank, world),
                memory=_memory(rank, world) if world == 4 else None)


# ---- the single-process oracle and the comparisons -------------------------------
def _single(case, P):
    """Single-process results: float64 reference (the oracle) and, for low precision,
    the reference in the case's own dtype (the 2× rule's yardstick)."""
    *_, dtype, layout, _kw, mask = CASES[case]
    kw = _kwargs(case, P)
    q, k, v, dout, keep = _inputs(case, P)
    masks = {} if keep is None else ({"keep": keep} if mask == "keep" else {"drop": ~keep})

    def run(dt):
        a = [x.astype(dt) for x in (q, k, v, dout)]
        out, lse = attnkit.attention(*a[:3], return_lse=True, backend="reference", **kw, **masks)
        grads = attnkit.attention_backward(a[3], *a[:3], out, lse, backend="reference", **kw, **masks)
        return dict(zip(("out", "lse", "dq", "dk", "dv", "dsinks"), (out, lse) + tuple(grads)))

    return run("float64"), (None if dtype == "float64" else run(dtype))


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_plan_covers_exactly_the_visible_pairs(layout):
    """No processes: for every (rank, key shard) pair, the blocks plan() computes
    cover every (query, key) pair that causal/window leave visible in the full
    sequence (mask from the torch tril/triu peer) exactly once, place their rows and
    keys at their true global positions, and skip shards with nothing visible."""
    from attnkit.distributed import plan, shard
    from peers import torch_index_keep

    options = [dict(), dict(causal=True), dict(window=(3, 2)), dict(window=(None, 1)),
               dict(window=(5, None), causal=True), dict(window=(0, 0)), dict(causal=True, align="top_left")]
    for world in (1, 2, 3, 4):
        for Lr, Sr in ((4, 4), (6, 2), (2, 6)):
            for kw in options:
                L, S = world * Lr, world * Sr
                full = torch_index_keep(L, S, kw.get("causal", False), kw.get("window"),
                                        kw.get("align", "bottom_right"))
                for rank in range(world):
                    rows = shard(torch.arange(L), rank, world, layout=layout, dim=0)
                    for src in range(world):
                        cols = shard(torch.arange(S), src, world, layout=layout, dim=0)
                        want = full[rows][:, cols]
                        covered = torch.zeros(Lr, Sr, dtype=torch.int32)
                        blocks = plan(rank, src, world, Lr, Sr, layout=layout, **kw)
                        for b in blocks:
                            covered[b.r0:b.r1, b.c0:b.c1] += 1
                            assert torch.equal(rows[b.r0:b.r1], torch.arange(b.gr, b.gr + b.r1 - b.r0))
                            assert torch.equal(cols[b.c0:b.c1], torch.arange(b.gc, b.gc + b.c1 - b.c0))
                        assert covered.max() <= 1 and bool((covered[want] == 1).all()), (world, kw, rank, src)
                        if not want.any():
                            assert blocks == []


def test_zigzag_balances_causal_work():
    """Causal zigzag: every rank computes the same number of visible pairs (contiguous
    does not), and shard/unshard are inverse."""
    from attnkit.distributed import plan, shard, unshard, zigzag_shard, zigzag_unshard

    def work(rank, layout, world=4, n=8):               # visible (query, key) pairs in the blocks
        return sum(int((torch.arange(b.gr, b.gr + b.r1 - b.r0)[:, None]
                        >= torch.arange(b.gc, b.gc + b.c1 - b.c0)[None, :]).sum())
                   for src in range(world) for b in plan(rank, src, world, n, n, causal=True, layout=layout))
    assert len({work(r, "zigzag") for r in range(4)}) == 1
    assert work(0, "contiguous") < work(3, "contiguous")
    x = torch.arange(2 * 3 * 24).reshape(2, 3, 24)
    for layout in ("contiguous", "zigzag"):
        assert torch.equal(unshard([shard(x, r, 4, layout=layout, dim=-1) for r in range(4)],
                                   layout=layout, dim=-1), x)
    assert torch.equal(zigzag_unshard([zigzag_shard(x, r, 3, dim=2) for r in range(3)], dim=2), x)
    with pytest.raises(ValueError, match="not divisible by 8"):
        zigzag_shard(x, 0, 4, dim=1)


def _check_cases(results, world):
    from attnkit.distributed import unshard

    failures = []
    for case in CASES:
        layout = CASES[case][8]
        got = {key: unshard([torch.from_numpy(r["cases"][case][key]) for r in results],
                            layout=layout, dim=-1 if key == "lse" else -2).numpy()
               for key in ("out", "lse", "dq", "dk", "dv")}
        oracle, same_precision = _single(case, world)
        if "dsinks" in oracle and _per_row(oracle["dsinks"], oracle["lse"].shape[-1]):   # sharded like q
            got["dsinks"] = unshard([torch.from_numpy(r["cases"][case]["dsinks"]) for r in results],
                                    layout=layout, dim=-1).numpy()
        elif "dsinks" in oracle:              # per head: every rank holds the whole (summed) gradient
            got["dsinks"] = results[0]["cases"][case]["dsinks"]
            if not all(np.array_equal(r["cases"][case]["dsinks"], got["dsinks"]) for r in results):
                failures.append(f"{case} P={world}: ranks hold different dsinks")
        for key in got:
            err = max_error(got[key], oracle[key])
            tol = 1e-10 if same_precision is None else error_budget(oracle[key], same_precision[key])
            if CASES[case][7] == "float16":  # blocks merged and summed unrounded (CPU): one rounding, as the reference's
                tol = min(tol, 1.25 * max_error(same_precision[key], oracle[key]) + 1e-6)
            if not err <= tol:
                failures.append(f"{case} P={world} {key}: error {err:.3g} > {tol:.3g}")
        if not all(r["cases"][case]["deterministic"] for r in results):
            failures.append(f"{case} P={world}: two identical calls gave different bits")
        if case == "masked_rows_causal":      # queries 0..2 see no key: out 0, lse -inf, dq 0
            o, lse, dq = got["out"][..., :3, :], got["lse"][..., :3], got["dq"][..., :3, :]
            if not (np.all(o == 0) and np.all(lse == -np.inf) and np.all(dq == 0)):
                failures.append(f"{case} P={world}: fully masked rows are not out 0, lse -inf, dq 0")
    return failures


def _check_errors(results, world):
    failures = []
    lengths = f"lengths [{', '.join(['4'] * (world - 1) + ['5'])}]"
    for rank, e in enumerate(r["errors"] for r in results):
        want = {
            "uneven_q": ["ValueError: q:", "equal shard lengths", lengths],
            "uneven_kv": ["ValueError: k:", "equal shard lengths", lengths],
            "odd_zigzag": ["ValueError: q:", "zigzag", "even", "got 5"],
            "query_mask": ["ValueError: keep:", "key-padding", "(4, 4)"],
            "bad_layout": ["ValueError: layout:", "'striped'"],
            "one_rank_bad_dtype": ["TypeError: k:", "dtype"] if rank == 0 else ["rank(s) [0]"],
            "one_rank_meta": ["Error"] if rank == 0 else ["rank(s) [0]"],
            "bad_flag": ["TypeError: return_lse: expected True or False"],
            "other_kv_lengths": ["ValueError: kv_lengths:", "same values on every rank", f"rank(s) [{world - 1}]"],
            "other_slopes": ["ValueError: alibi_slopes:", "same values", f"rank(s) [{world - 1}]"],
            "other_sinks": ["ValueError: sinks:", "same values", f"rank(s) [{world - 1}]"],
        }
        if e["same_sinks_other_dtype"] is not None:
            failures.append(f"rank {rank}: sinks of equal values were refused: {e['same_sinks_other_dtype']}")
        for name, parts in want.items():
            if e[name] is None or not all(p in e[name] for p in parts):
                failures.append(f"rank {rank} {name}: expected an error with {parts}, got {e[name]!r}")
    return failures


def _check_memory(results):
    """Per-rank peak RSS growth for one forward+backward step with shard length n is
    the same whether the sequence is 2·n long (pairs of ranks) or 4·n (all four), and
    it doubles when the shard doubles: memory follows L/P, not L. RSS is the honest
    process-wide measure (torch's CPU allocator keeps no statistics and tracemalloc
    sees only NumPy); the children run with glibc's mmap threshold at 64 KiB (set by
    the test) so freed buffers leave RSS and each peak is that step's own. A rank
    holding one extra full-sequence K or V (4 shards) would break the second bound."""
    failures = []
    for rank, m in enumerate(r["memory"] for r in results):
        note = f"rank {rank}: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in m.items())
        checks = [m["pair_n"] > 4 * m["shard_bytes"],            # the measure sees the step's buffers
                  m["world_n"] <= 1.1 * m["pair_n"],                # a full-L K alone adds 4 shards
                  m["pair_2n"] > 1.6 * m["pair_n"]]
        if not all(checks):
            failures.append(f"memory {checks}: {note}")
    return failures


@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_on_gloo(world, monkeypatch):
    """Everything for one world size from one spawn (see the module docstring)."""
    from attnkit.distributed.launch import spawn

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")   # inherited by the spawned children
    results = spawn(_worker, world, threads=1)
    failures = _check_cases(results, world) + _check_errors(results, world)
    if world == 4:
        failures += _check_memory(results)
    assert not failures, "\n".join(failures)

"""Host side of KV-cache decoding on the Triton rung (``attnkit.attention_kvcache``):
the launches of the split-KV kernels in ``decode.py``.

One launch of ``_decode_split`` over (row block, sequence · kv head, key split) —
each program attends the rows of a whole GQA group (H / Hkv heads × L query rows,
at most the table's BLOCK_M per program) against its share of the sequence's keys, so
every key and value tile is read once per kv head — then one launch of
``_decode_combine`` merging the splits by lse in split order and joining the sink
once. The split count comes from ``tuning.decode_splits`` (the shapes only: batch,
kv heads, row blocks and the cache's capacity; never the device's SM count), and the
keys of each sequence are dealt out to the splits on the device from its length, so
the same inputs give the same bits on every device and every run, with no host sync
(lengths and block table stay on the device). Partials are float32: (B·Hkv, splits,
rows, Dv) for acc and two (B·Hkv, splits, rows) arrays for m and l.

Terms: scale, softcap, ALiBi, sinks, dropout (Philox counters: the flat head, the
query's row in q and the key's position in its sequence, as every rung), causal /
window in either alignment (bottom-right per sequence: diag(i) = i + length − L),
each sequence's first key (``kv_starts``, FlashAttention's ``cache_leftpad``: keys
before it are never read; top-left puts the first query on it),
GQA / MQA, any L >= 1, float16, bfloat16, float32. The cache was appended to
(``attnkit.kvcache.append``) before this runs.
"""

from ...spec import geometry
from . import tuning as triton_tuning
from .jit import FP_FUSION, interpreting, kernels, triton
from .launch import _capability, _device_guard, _dropout_scalars, _next_pow2, _precision, _terms, op


def split_constexprs(cfg, *, group, D, Dv, dtype, rows, band, softcap, alibi, dropout, paged, bottom_right,
                     qlens, starts, interpret, precision):
    """(BLOCK_M, the compile-time parameters of _decode_split): BLOCK_M is the table's
    at most, fewer for a small group (rows = H / Hkv · L)."""
    block_m = min(cfg["BLOCK_M"], _next_pow2(rows))
    return block_m, dict(GROUP=group, HEAD_D=D, HEAD_DV=Dv, BLOCK_M=block_m, BLOCK_N=cfg["BLOCK_N"],
                         BLOCK_D=_next_pow2(D), BLOCK_DV=_next_pow2(Dv), HAS_LEFT=band[0], HAS_RIGHT=band[1],
                         HAS_SOFTCAP=softcap, HAS_ALIBI=alibi, HAS_DROPOUT=dropout, PAGED=paged,
                         BOTTOM_RIGHT=bottom_right, SPLIT=bool(cfg["SPLIT"]) and dtype != "float32",
                         HAS_QLENS=qlens, HAS_KSTART=starts, INTERPRET=interpret, PRECISION=precision)


def combine_constexprs(cfg, *, group, Dv, rows, sinks, qlens, interpret):
    """(BLOCK_M, the compile-time parameters of _decode_combine)."""
    block_m = min(cfg["BLOCK_M"], _next_pow2(rows))
    return block_m, dict(GROUP=group, HEAD_DV=Dv, BLOCK_M=block_m, BLOCK_DV=_next_pow2(Dv), HAS_SINKS=sinks,
                         HAS_QLENS=qlens, INTERPRET=interpret)


def plan(spec, cap):
    """(split config, combine config, splits) for a KVCall's spec (its key axis is the
    cache's capacity): the table's entries and the split count, from shapes only."""
    D = max(spec.D, spec.Dv)
    cfg = triton_tuning.config(D, spec.dtype, cap, "decode")
    ccfg = triton_tuning.config(spec.Dv, spec.dtype, cap, "decode_combine")
    rows = spec.group * spec.L
    block_m = min(cfg["BLOCK_M"], _next_pow2(rows))
    programs = spec.batch[0] * spec.Hkv * triton.cdiv(rows, block_m)
    splits = triton_tuning.decode_splits(programs, spec.S, int(cfg.get("SPLIT_KEYS", 1)))
    return cfg, ccfg, splits


def kvcache(kv):
    """(out, lse) of a validated, appended KVCall: out (B, H, L, Dv) in q's dtype, lse
    (B, H, L) float32 (natural log; −inf on rows that see no key, whose out is 0; the
    sink's logit there when sinks are given)."""
    import torch
    spec = kv.spec
    (B,), H, Hkv, L, D, Dv = spec.batch, spec.H, spec.Hkv, spec.L, spec.D, spec.Dv
    q, dev = spec.q, spec.q.device
    out = torch.empty((B, H, L, Dv), dtype=q.dtype, device=dev)
    lse = torch.empty((B, H, L), dtype=torch.float32, device=dev)
    if lse.numel() == 0:
        return out, lse
    slopes, sinks, qlens, lens, starts = _terms(spec)   # lens: the lengths after the append, int32 on the device
    k, v = kv.k_cache, kv.v_cache
    if kv.paged:
        table = kv.block_table if kv.block_table.dtype == torch.int32 else kv.block_table.to(torch.int32)
        table_strides, page = table.stride(), kv.page_size
    else:
        table, table_strides, page = lens, (0, 0), spec.S
    cap = _capability(dev)
    cfg, ccfg, splits = plan(spec, cap)
    left, right = geometry.band(spec.causal, spec.window)
    rows, bh = spec.group * L, B * Hkv
    block_m, consts = split_constexprs(
        cfg, group=spec.group, D=D, Dv=Dv, dtype=spec.dtype, rows=rows, band=(left is not None, right is not None),
        softcap=spec.softcap is not None, alibi=slopes is not None, dropout=spec.dropout > 0, paged=kv.paged,
        bottom_right=spec.align == "bottom_right", qlens=qlens is not None, starts=starts is not None,
        interpret=interpreting(), precision=_precision(spec))
    row_blocks = triton.cdiv(rows, block_m)
    part_o = torch.empty((bh, splits, rows, Dv), dtype=torch.float32, device=dev)
    part_ml = torch.empty((2, bh, splits, rows), dtype=torch.float32, device=dev)
    kern = kernels()
    with _device_guard(q):
        kern._decode_split[(row_blocks * bh * splits,)](
            op(q), op(k), op(v), (table, *table_strides), op(lens), op(qlens, 1, lens), op(starts, 1, lens),
            op(slopes, 2, part_o), op(part_o),
            op(part_ml[0]), part_ml[1], Hkv, L, bh, page, splits, spec.scale, spec.softcap or 1.0, left or 0,
            right or 0, *_dropout_scalars(spec), **consts,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **FP_FUSION)
        block_c, cconsts = combine_constexprs(ccfg, group=spec.group, Dv=Dv, rows=rows, sinks=sinks is not None,
                                              qlens=qlens is not None, interpret=interpreting())
        blocks_c = triton.cdiv(rows, block_c)
        kern._decode_combine[(bh * blocks_c,)](
            op(part_o), op(part_ml[0]), part_ml[1], op(sinks, 3, part_o), op(qlens, 1, lens), op(out), op(lse),
            Hkv, L, splits,
            blocks_c, **cconsts, num_warps=ccfg["num_warps"], num_stages=ccfg["num_stages"], **FP_FUSION)
    return out, lse

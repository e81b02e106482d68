"""GPU benchmark for attnkit's Triton kernels against PyTorch SDPA's fused backends.

Validates first, then times, all in one run:

1. correctness: for each (dtype, D, causal) in the grid, attnkit's kernels and each
   SDPA backend at B=1, H=4, L=S=1024 against attnkit's float64 reference, by
   DESIGN.md §6's rule (error ≤ 2× the reference's own error in that precision +
   1e-5) for out, lse, dq, dk, dv; SDPA's errors are reported for comparison only;
2. decoding (``attnkit.attention_kvcache``, the split-KV kernels): bf16, D = 128,
   H = 32 query heads on 8 kv heads, one new query per sequence, contiguous and paged
   (page 64) caches, checked first against the reference at a small size, then timed
   as KV-cache bandwidth (bytes of keys and values read / time, GB/s) next to SDPA
   over the same keys (a contiguous cache whose lengths all equal its capacity, so
   SDPA computes the same thing), kernels alone and through the public call.
3. timing: forward and forward+backward of attnkit (the kernels called directly,
   through ``attnkit.attention`` + autograd when that path exists, and with
   ``SPLIT=False`` in the backward too, FlashAttention-2 rounding throughout, for
   bf16 D=128: timed for fwd+bwd only, to show the split's cost) and of SDPA's
   flash, efficient and cuDNN backends (each when available), bf16 and fp16,
   D ∈ {64, 128}, L = S ∈ {1k, 2k, 4k, 8k, 16k} with B·L = 16k tokens and
   H·D = 2048, causal and not.

Prints TFLOP/s from one formula (attnkit.spec.flops: 4·B·H·L·S·D forward, ×0.5
causal, backward 2.5× forward, so forward+backward counts 3.5×) and attnkit's ratio
to each peer measured in the same run; writes every row to the CSV given by --out.
A time budget (--budget-s, default 280 s) skips the remaining timing configurations
when reached, so the run stays under 5 minutes; skipped ones are listed.

    python benchmarks/gpu.py --out gpu.csv            # full grid
    python benchmarks/gpu.py --quick --out quick.csv  # bf16, D=128, L ∈ {4k, 8k}
    python benchmarks/gpu.py --decode-only            # only the decoding part
    python benchmarks/gpu.py --compile-only 8.0,9.0   # no GPU needed: compile + smem
    python benchmarks/gpu.py --warm bfloat16,128,True  # compile one part into Triton's cache
    python benchmarks/gpu.py --sweep                  # try tuning candidates, print best
    python benchmarks/gpu.py --sweep-decode           # the decode kernel's candidates, best per shape
    python benchmarks/gpu.py --dtypes float32         # the grid's float32 rows only
    TRITON_INTERPRET=1 python benchmarks/gpu.py --dry-run --out /tmp/dry.csv   # CPU

Standalone: needs torch, triton and numpy; attnkit is imported from ../src.
"""

import argparse
import csv
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

TOKENS = 16 * 1024
WIDTH = 2048                 # H · D
PEERS = ("flash", "efficient", "cudnn")


# ---- inputs and implementations -----------------------------------------------------
def make_inputs(torch, B, H, L, S, D, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v, dout = (torch.randn(shape, generator=g).to(device=device, dtype=dtype)
                     for shape in ((B, H, L, D), (B, H, S, D), (B, H, S, D), (B, H, L, D)))
    return q, k, v, dout


def sdpa_backend(name):
    from torch.nn.attention import SDPBackend
    return {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": getattr(SDPBackend, "CUDNN_ATTENTION", None), "math": SDPBackend.MATH}[name]


def sdpa_runner(torch, name, causal):
    """(forward(q, k, v) -> out, fwd_bwd(q, k, v, dout) -> grads) for one SDPA backend."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel
    backend = sdpa_backend(name)
    if backend is None:
        raise RuntimeError(f"this torch has no SDPA backend {name}")

    def forward(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def fwd_bwd(q, k, v, dout):
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return torch.autograd.grad(out, (q, k, v), dout)

    return forward, fwd_bwd


# runs whose forward is attnkit's default forward (the split is a backward setting):
# timed for fwd+bwd only
SAME_FORWARD = ("attnkit-nosplit",)


def attnkit_runner(torch, causal, split=None):
    """attnkit's kernels called directly (no autograd), optionally forcing SPLIT."""
    from attnkit.spec import validate
    from attnkit.torch.triton import launch as tk
    from attnkit.torch.triton import tuning as triton_tuning

    def with_split(fn):
        def run(*args):
            saved = triton_tuning.override
            if split is not None:
                triton_tuning.override = lambda *a: {"SPLIT": split}
            try:
                return fn(*args)
            finally:
                triton_tuning.override = saved
        return run

    @with_split
    def forward(q, k, v):
        return tk.forward(validate(q, k, v, causal=causal))[0]

    @with_split
    def fwd_bwd(q, k, v, dout):
        spec = validate(q, k, v, causal=causal)
        out, lse = tk.forward(spec)
        return tk.backward(spec, dout, out, lse)[:3]

    return forward, fwd_bwd


def attnkit_autograd_runner(torch, causal):
    """attnkit.attention(..., backend="triton") with autograd: the public path
    through the torch op onto the same kernels."""
    import attnkit

    def forward(q, k, v):
        return attnkit.attention(q, k, v, causal=causal, backend="triton")

    def fwd_bwd(q, k, v, dout):
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        out = attnkit.attention(q, k, v, causal=causal, backend="triton")
        return torch.autograd.grad(out, (q, k, v), dout)

    return forward, fwd_bwd


# ---- correctness ------------------------------------------------------------------------
def check(torch, dtype_name, D, causal, device, L=1024, H=4):
    """Rows of max errors vs attnkit's float64 reference, with the 2× budget. attnkit
    rows must pass; peers are informative."""
    import numpy as np

    from attnkit import reference
    from attnkit.spec import validate
    from attnkit.testing import error_budget, max_error
    from attnkit.torch.triton import launch as tk
    dtype = getattr(torch, dtype_name)
    q, k, v, dout = make_inputs(torch, 1, H, L, L, D, dtype, device, seed=1)
    host = [x.detach().cpu() for x in (q, k, v, dout)]
    spec64 = validate(*(x.double().numpy() for x in host[:3]), causal=causal)
    spec32 = validate(*(x.float().numpy() for x in host[:3]), causal=causal)
    o64, l64, _ = reference.forward(spec64)
    o32, l32, _ = reference.forward(spec32)

    def rounded(a):  # the reference's float32 result in the benchmark dtype
        return torch.from_numpy(np.asarray(a, dtype=np.float32)).to(dtype).double().numpy()

    rows = []
    spec = validate(q, k, v, causal=causal)
    out, lse = tk.forward(spec)
    grads = tk.backward(spec, dout, out, lse)[:3]
    given = [x.detach().cpu() for x in (dout, out, lse)]
    r64 = reference.backward(spec64, *(x.double().numpy() for x in given))
    r32 = reference.backward(spec32, *(x.float().numpy() for x in given))
    ours = {"out": (out, o64, rounded(o32)), "lse": (lse, l64, l32)}
    for name, got, a, b in zip(("dq", "dk", "dv"), grads, r64, r32):
        ours[name] = (got, a, rounded(b))
    # peers: their own out; gradients against the reference run on their out/lse-free path
    peer_out = {}
    for peer in PEERS:
        try:
            fwd, fb = sdpa_runner(torch, peer, causal)
            po = fwd(q, k, v)
            pg = fb(q, k, v, dout)
            peer_out[peer] = (po, pg)
        except RuntimeError as e:
            peer_out[peer] = str(e).splitlines()[0][:80]
    ok = True
    for name, (got, a, b) in ours.items():
        err = max_error(got.detach().double().cpu().numpy(), a)
        budget = error_budget(a, b)
        ok &= err <= budget
        row = dict(kind="check", impl="attnkit", dtype=dtype_name, D=D, L=L, S=L, B=1, H=H,
                   causal=causal, what=name, max_error=err, budget=budget,
                   status="ok" if err <= budget else "FAIL")
        rows.append(row)
    # peers against the ordinary gradient (reference on their own forward is not defined),
    # so use the oracle's out and the oracle gradient of the same dout
    g64 = reference.backward(spec64, host[3].double().numpy(), o64, l64)
    for peer, res in peer_out.items():
        if isinstance(res, str):
            rows.append(dict(kind="check", impl=peer, dtype=dtype_name, D=D, L=L, S=L, B=1, H=H,
                             causal=causal, what="-", status=f"unavailable: {res}"))
            continue
        po, pg = res
        for name, got, a in (("out", po, o64),) + tuple(zip(("dq", "dk", "dv"), pg, g64)):
            rows.append(dict(kind="check", impl=peer, dtype=dtype_name, D=D, L=L, S=L, B=1, H=H,
                             causal=causal, what=name,
                             max_error=max_error(got.detach().double().cpu().numpy(), a),
                             status="info"))
    return ok, rows


# ---- timing -------------------------------------------------------------------------------
def timer(torch, device, fn, min_time=0.15, max_reps=50):
    """Median milliseconds of fn() over repetitions (CUDA events on GPU)."""
    fn()                                            # warm-up: compiles, allocates
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
    times = []
    start_all = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start_all < min_time and len(times) < max_reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def grid(args):
    """(dtype, D, L, causal) to check and time, limited to --dtypes when given."""
    keep = args.dtypes.split(",") if getattr(args, "dtypes", None) else None
    return [g for g in _grid(args) if keep is None or g[0] in keep]


def _grid(args):
    if args.dry_run:
        return [("float32", 64, 64, c) for c in (False, True)]
    if args.quick:
        return [("bfloat16", 128, L, c) for L in (4096, 8192) for c in (False, True)]
    lengths = (1024, 2048, 4096, 8192, 16384)
    # in the order of what matters most when the budget runs out: D = 128 (the targets'
    # shape) first, then D = 64, the float32 path (tf32 off) at one length, float16 D = 64
    return ([(dt, 128, L, c) for dt in ("bfloat16", "float16") for L in lengths for c in (False, True)]
            + [("bfloat16", 64, L, c) for L in lengths for c in (False, True)]
            + [("float32", D, 4096, c) for D in (64, 128) for c in (False, True)]
            + [("float16", 64, L, c) for L in lengths for c in (False, True)])


def gemm_rate(torch, device, n=8192):
    """TFLOP/s of one n×n×n bf16 matrix product (torch.matmul, cuBLAS): the ceiling the
    attention forward is compared with (its FLOPs are all matrix products)."""
    if device != "cuda":
        return None
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    ms = timer(torch, device, lambda: a @ b, min_time=0.5)
    return 2 * n ** 3 / ms / 1e9


def run_benchmark(args):
    import torch

    from attnkit.spec import flops
    from attnkit.torch.triton import launch as tk
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: use --dry-run (with TRITON_INTERPRET=1) or --compile-only")
    why = tk.not_supported_reasons(__import__("attnkit.spec", fromlist=["validate"]).validate(
        torch.zeros(1, 16, 16, device=device), torch.zeros(1, 16, 16, device=device),
        torch.zeros(1, 16, 16, device=device)))
    if why:
        sys.exit(f"attnkit's Triton kernels cannot run here: {why}")
    env = dict(gpu=torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
               torch=torch.__version__, triton=__import__("triton").__version__,
               python=platform.python_version())
    print("# " + ", ".join(f"{k} {v}" for k, v in env.items()))
    t0 = time.perf_counter()
    gemm = None if args.decode_only else gemm_rate(torch, device)
    if gemm:
        print(f"# bf16 GEMM 8192^3 (cuBLAS): {gemm:.1f} TFLOP/s")
    rows, failed, skipped = [], [], []

    # 1. correctness, once per (dtype, D, causal) of the grid
    seen = set()
    for dt, D, _, causal in [] if args.decode_only or args.skip_checks else grid(args):
        if (dt, D, causal) in seen:
            continue
        seen.add((dt, D, causal))
        ok, r = check(torch, dt, D, causal, device, L=64 if args.dry_run else 1024,
                      H=2 if args.dry_run else 4)
        rows += r
        for row in r:
            if row["impl"] == "attnkit" or row["what"] == "out":
                err = row.get("max_error")
                extra = f" (budget {row['budget']:.2e})" if "budget" in row else ""
                print(f"check {dt:8} D={D:3} causal={causal!s:5} {row['impl']:9} {row['what']:3} "
                      f"{'' if err is None else f'{err:.2e}'}{extra} {row['status']}")
        if not ok:
            failed.append((dt, D, causal))
    print(f"# checks done in {time.perf_counter() - t0:.0f} s")

    # 2. decoding against a KV cache: checked, then timed (small: before the grid's budget)
    ok, r = decode_benchmark(torch, args, device)
    rows += r
    if not ok:
        failed.append("decode")
    print(f"# decoding done at {time.perf_counter() - t0:.0f} s")

    # 3. timing
    for dt, D, L, causal in [] if args.decode_only else grid(args):
        if (dt, D, causal) in failed:                  # validate first: never time a wrong answer
            skipped.append((dt, D, L, causal))
            continue
        if time.perf_counter() - t0 > args.budget_s:
            skipped.append((dt, D, L, causal))
            continue
        H = WIDTH // D if not args.dry_run else 2
        B = max(1, TOKENS // L) if not args.dry_run else 1
        dtype = getattr(torch, dt)
        q, k, v, dout = make_inputs(torch, B, H, L, L, D, dtype, device)
        impls = {"attnkit": attnkit_runner(torch, causal)}
        if dt == "bfloat16" and D == 128 and not args.dry_run:
            impls["attnkit-nosplit"] = attnkit_runner(torch, causal, split=False)
        impls["attnkit-autograd"] = attnkit_autograd_runner(torch, causal)
        for peer in PEERS:
            impls[peer] = sdpa_runner(torch, peer, causal)
        f_fwd = flops(B, H, L, L, D, causal=causal)
        measured = {}
        for mode in ("fwd", "fwd+bwd"):
            f = f_fwd if mode == "fwd" else f_fwd + flops(B, H, L, L, D, causal=causal, backward=True)
            names = [n for n in impls if not (mode == "fwd" and n in SAME_FORWARD)]
            for name in names:
                fwd, fb = impls[name]
                inputs = (q, k, v) if mode == "fwd" else (q, k, v, dout)
                call = (lambda f=fwd if mode == "fwd" else fb, a=inputs: f(*a))
                try:
                    ms = timer(torch, device, call)
                except (RuntimeError, ValueError, TypeError, ImportError) as e:
                    measured[(mode, name)] = None
                    rows.append(dict(kind="time", impl=name, mode=mode, dtype=dt, D=D, L=L, S=L, B=B,
                                     H=H, causal=causal, status=f"unavailable: {str(e).splitlines()[0][:80]}"))
                    continue
                tf = f / ms / 1e9
                measured[(mode, name)] = tf
                rows.append(dict(kind="time", impl=name, mode=mode, dtype=dt, D=D, L=L, S=L, B=B, H=H,
                                 causal=causal, ms=ms, tflops=tf, status="ok"))
            line = f"{dt:8} D={D:3} L={L:5} B={B:2} H={H:2} causal={causal!s:5} {mode:7} TFLOP/s:"
            for name in names:
                tf = measured.get((mode, name))
                line += f" {name} {'n/a' if tf is None else f'{tf:7.1f}'}"
            ours = measured.get((mode, "attnkit"))
            if mode == "fwd" and ours and gemm:
                line += f" | {ours / gemm:.2f} of bf16 GEMM"
            for row in rows:
                if row.get("kind") == "time" and row.get("mode") == mode and row["impl"].startswith("attnkit") \
                        and (row["dtype"], row["D"], row["L"], row["causal"]) == (dt, D, L, causal):
                    for peer in PEERS:
                        p = measured.get((mode, peer))
                        if row.get("tflops") and p:
                            row[f"ratio_vs_{peer}"] = row["tflops"] / p
                    if row.get("tflops") and gemm:
                        row["ratio_vs_gemm"] = row["tflops"] / gemm
            for peer in PEERS:
                p = measured.get((mode, peer))
                if ours and p:
                    line += f" | x{ours / p:.2f} vs {peer}"
            print(line, flush=True)
        del q, k, v, dout
        if device == "cuda":
            torch.cuda.empty_cache()

    fields = ["kind", "impl", "mode", "what", "dtype", "D", "L", "S", "B", "H", "causal", "ms", "tflops",
              "ratio_vs_flash", "ratio_vs_efficient", "ratio_vs_cudnn", "ratio_vs_gemm", "max_error", "budget", "status",
              "Hkv", "page", "gbps", "ratio_vs_sdpa"]
    fields += list(env)
    with open(args.out, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields)
        w.writeheader()
        for row in rows:
            w.writerow({**env, **row})
    print(f"# wrote {len(rows)} rows to {args.out} in {time.perf_counter() - t0:.0f} s")
    if skipped:
        print(f"# budget reached, not timed: {skipped}")
    if failed:
        print(f"# CORRECTNESS FAILED for {failed}")
        sys.exit(1)


# ---- decoding ---------------------------------------------------------------------------
def decode_cache(torch, B, Hkv, S, D, dtype, device, page=None, seed=0):
    """(k_cache, v_cache, block_table or None) holding S keys per sequence: contiguous
    (B, Hkv, S, D), or paged with each sequence's pages in shuffled order."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    n = B * S // page if page else B
    shape = (n, Hkv, page or S, D)
    k, v = (torch.randn(shape, generator=g).to(device=device, dtype=dtype) for _ in range(2))
    table = torch.randperm(n, generator=g).reshape(B, S // page).to(device=device, dtype=torch.int32) if page else None
    return k, v, table


def decode_benchmark(torch, args, device):
    """Check, then time, attention_kvcache on the Triton rung (rows of kind
    decode_check / decode_time); returns (all checks passed, rows)."""
    import numpy as np
    import torch.nn.functional as F

    import attnkit
    from attnkit.spec.kvcache import validate_kvcache
    from attnkit.testing import error_budget, max_error
    from attnkit.torch import triton as rung
    dt, D, H, Hkv = ("float32", 16, 4, 2) if args.dry_run else ("bfloat16", 128, 32, 8)
    dtype = getattr(torch, dt)
    rows, ok = [], True
    for page in (None, 16 if args.dry_run else 64):        # 1. check at a small size against the reference
        B, S = 2, 64 if args.dry_run else 1024
        k, v, table = decode_cache(torch, B, Hkv, S, D, dtype, device, page, seed=1)
        q = torch.randn(B, H, 1, D, generator=torch.Generator().manual_seed(2)).to(device=device, dtype=dtype)
        lengths = torch.tensor([S, S // 3], device=device)
        got = attnkit.attention_kvcache(q, k, v, lengths, block_table=table, backend="triton").cpu()
        host = [None if x is None else x.cpu() for x in (q, k, v, lengths, table)]
        want = [attnkit.attention_kvcache(host[0].to(w), host[1].to(w), host[2].to(w), host[3], block_table=host[4],
                                          backend="reference") for w in (torch.float64, dtype)]
        err, budget = max_error(got.double().numpy(), want[0].numpy()), error_budget(want[0].numpy(),
                                                                                      want[1].double().numpy())
        ok &= err <= budget
        rows.append(dict(kind="decode_check", impl="attnkit", dtype=dt, D=D, B=B, H=H, Hkv=Hkv, L=1, S=S, page=page,
                         what="out", max_error=err, budget=budget, status="ok" if err <= budget else "FAIL"))
        print(f"decode check page={page} out {err:.2e} (budget {budget:.2e}) {rows[-1]['status']}")
    if not ok:
        return ok, rows
    cases = [(2, 64, None), (2, 64, 16)] if args.dry_run else \
        [(B, S, page) for B, S in ((1, 32768), (8, 8192), (64, 4096), (128, 1024)) for page in (None, 64)]
    for B, S, page in cases:                              # 2. time: KV bytes read / time
        k, v, table = decode_cache(torch, B, Hkv, S, D, dtype, device, page)
        q = torch.randn(B, H, 1, D, device=device).to(dtype)
        lengths = torch.full((B,), S, device=device)
        kv = validate_kvcache(q, k, v, lengths, block_table=table, backend="triton")
        impls = {"attnkit": lambda kv=kv: rung.rung_kvcache(kv),
                 "attnkit-public": lambda a=(q, k, v, lengths), t=table: attnkit.attention_kvcache(
                     *a, block_table=t, backend="triton")}
        if page is None:                                  # the same keys for SDPA: all lengths = capacity
            impls["sdpa"] = lambda a=(q, k, v): F.scaled_dot_product_attention(*a, enable_gqa=True)
        gbytes = 2 * B * Hkv * S * D * k.element_size() / 1e9
        line = f"decode {dt} D={D} H={H}/{Hkv} B={B:3} S={S:5} page={page!s:4} GB/s:"
        measured = {}
        for name, fn in impls.items():
            try:
                ms = timer(torch, device, fn)
            except (RuntimeError, TypeError) as e:
                rows.append(dict(kind="decode_time", impl=name, dtype=dt, D=D, B=B, H=H, Hkv=Hkv, L=1, S=S,
                                 page=page, status=f"unavailable: {str(e).splitlines()[0][:80]}"))
                continue
            measured[name] = gbytes / ms * 1e3
            rows.append(dict(kind="decode_time", impl=name, dtype=dt, D=D, B=B, H=H, Hkv=Hkv, L=1, S=S, page=page,
                             ms=ms, gbps=measured[name], status="ok"))
            line += f" {name} {measured[name]:8.4g}"
        if "sdpa" in measured:
            for row in rows[-len(measured):]:
                row["ratio_vs_sdpa"] = row.get("gbps", np.nan) / measured["sdpa"]
            line += f" | x{measured.get('attnkit', np.nan) / measured['sdpa']:.2f} vs sdpa"
        print(line, flush=True)
    return ok, rows


# ---- warming Triton's cache in parallel ---------------------------------------------------
def warm(spec_text, device="cuda"):
    """Compile (by running once, small) the kernels one part of the benchmark launches, so
    that the timed run finds them in Triton's on-disk cache: Triton compiles a kernel
    variant in 10–30 s and one process compiles one at a time, which on a fresh H200
    took ~50 s per (dtype, D, causal) of the checks. ``spec_text``: "dtype,D,causal"
    (attnkit's forward and backward, with and without the split) or "decode". On the
    CPU (``device="cpu"``, the interpreter) the same calls run at a tiny size."""
    import torch

    import attnkit
    n = 1024 if device == "cuda" else 32
    if spec_text == "decode":
        dt, D, H, Hkv = ("bfloat16", 128, 32, 8) if device == "cuda" else ("float32", 16, 4, 2)
        for page in (None, 64 if device == "cuda" else 16):
            k, v, table = decode_cache(torch, 2, Hkv, n, D, getattr(torch, dt), device, page)
            q = torch.randn(2, H, 1, D, device=device).to(getattr(torch, dt))
            attnkit.attention_kvcache(q, k, v, torch.full((2,), n, device=device), block_table=table,
                                      backend="triton")
    else:
        dt, D, causal = spec_text.split(",")
        D, causal = int(D), causal == "True"
        q, k, v, dout = make_inputs(torch, 2, 4, n, n, D, getattr(torch, dt), device)
        for split in (None, False) if (dt, D) == ("bfloat16", 128) else (None,):
            attnkit_runner(torch, causal, split)[1](q, k, v, dout)
        attnkit_autograd_runner(torch, causal)[1](q, k, v, dout)
    if device == "cuda":
        torch.cuda.synchronize()


def warm_list(args):
    """The --warm arguments that cover the grid (one process each)."""
    seen = []
    for dt, D, _, causal in grid(args):
        if f"{dt},{D},{causal}" not in seen:
            seen.append(f"{dt},{D},{causal}")
    return seen + ["decode"]


# ---- tools without a GPU: compile-only; with one: a small tuning sweep ---------------------
SPILL_LIMIT = 1024   # bytes spilled per thread: more is reported (a table entry to shrink, see tuning.py)
SMEM = {(8, 0): 166912, (8, 6): 101376, (8, 9): 101376, (9, 0): 232448, (10, 0): 232448,
        (12, 0): 101376}


def compile_only(caps):
    """Compile every kernel with the tuning table for each target and compare shared
    memory to the target's per-block limit (exit status 1 when over), and report
    spilled registers above SPILL_LIMIT (no GPU needed): both variants (plain and
    careful, see attnkit.torch.triton.launch) with every feature on and per-sequence
    lengths and starts, for bf16 and fp32 at D = 64, 128, 256; packed sequences at
    bf16 D = 128; the KV-cache decode kernels (contiguous and paged, every term) at
    bf16 and fp32, D = 64, 128, 256."""
    from attnkit.torch.triton import aot
    bad = 0
    for cap in caps:
        configs = [(dt, D, "starts") for dt in ("bfloat16", "float32") for D in (64, 128, 256)]
        configs.append(("bfloat16", 128, "packed"))  # float16 tiles are bfloat16's size
        configs += [(dt, D, "decode") for dt in ("bfloat16", "float32") for D in (64, 128, 256)]
        for dt, D, varlen in configs:
            t = time.perf_counter()
            usage = (aot.compile_decode_only(cap, dt, D, usage=True) if varlen == "decode"
                     else aot.compile_only(cap, dt, D, varlen=varlen, usage=True))
            limit = SMEM.get(cap)
            over = [k for k, (sh, _, _) in usage.items() if limit is not None and sh > limit]
            bad += bool(over)
            # spills cost speed, not correctness: reported, not counted as a failure
            over += [f"{k} spills {sp} B" for k, (_, _, sp) in usage.items() if sp is not None and sp > SPILL_LIMIT]
            shown = {k: f"{sh} B smem, {'?' if r is None else r} regs, {'?' if sp is None else sp} B spilled"
                     for k, (sh, r, sp) in usage.items()}
            print(f"sm_{cap[0]}{cap[1]} {dt:8} D={D:3} {varlen:7} {shown} smem limit {limit} "
                  f"{'CHECK: ' + ', '.join(over) if over else 'ok'} ({time.perf_counter() - t:.0f} s)",
                  flush=True)
    sys.exit(1 if bad else 0)


def sweep(args):
    """Time a few candidate configurations per kernel kind through triton_tuning.override
    (bf16, L=S=8k, B=2, non-causal) and print the fastest; update triton_tuning's table
    from the output."""
    import torch

    from attnkit.spec import validate
    from attnkit.torch.triton import launch as tk
    from attnkit.torch.triton import tuning as triton_tuning
    cands = {
        "forward": [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 32, 4, 4)],
        "backward_dkdv": [(32, 128, 4, 2), (32, 128, 8, 2), (64, 128, 8, 2), (32, 64, 4, 3), (16, 128, 4, 2)],
        "backward_dq": [(128, 32, 4, 2), (128, 32, 8, 2), (128, 64, 8, 2), (64, 32, 4, 3), (128, 16, 4, 2)],
    }
    t0 = time.perf_counter()
    for D in (64, 128):
        H, L, B = WIDTH // D, 8192, 2
        q, k, v, dout = make_inputs(torch, B, H, L, L, D, torch.bfloat16, "cuda")
        spec = validate(q, k, v)
        out, lse = tk.forward(spec)
        for kind, cs in cands.items():
            best = None
            for bm, bn, w, s in cs:
                if time.perf_counter() - t0 > args.budget_s:
                    break
                triton_tuning.override = (lambda D_, dt, cap, kd, c=(bm, bn, w, s), want=kind:
                                          dict(zip(("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"), c))
                                          if kd == want else None)
                fn = ((lambda s=spec: tk.forward(s)) if kind == "forward"
                      else (lambda s=spec, g=(dout, out, lse): tk.backward(s, *g)))
                try:
                    ms = timer(torch, "cuda", fn)
                except RuntimeError as e:           # e.g. out of shared memory
                    print(f"D={D} {kind} {(bm, bn, w, s)} failed: {str(e).splitlines()[0][:80]}")
                    continue
                finally:
                    triton_tuning.override = None
                print(f"D={D} {kind:13} BLOCK_M={bm:3} BLOCK_N={bn:3} warps={w} stages={s}: {ms:.3f} ms", flush=True)
                if best is None or ms < best[0]:
                    best = (ms, (bm, bn, w, s))
            print(f"best D={D} {kind}: {best}")


# the decode sweep's candidates: (BLOCK_N, num_warps, num_stages) of the split kernel
# (BLOCK_M is the group's rows, 16 at L = 1) and (DECODE_PROGRAMS, SPLIT_KEYS, MAX_SPLITS)
DECODE_KERNELS = [(64, 4, 3), (64, 4, 2), (64, 2, 3), (64, 8, 4), (32, 4, 4), (128, 4, 3), (128, 8, 3),
                  (128, 4, 2), (128, 4, 4), (256, 8, 2)]
DECODE_SPLITS = [(512, 512, 64), (1024, 256, 128), (2048, 256, 256), (256, 1024, 64)]
DECODE_SHAPES = [(8, 8192), (1, 32768), (64, 4096), (128, 1024)]


def sweep_decode(args):
    """Time the split kernel's candidates (DECODE_KERNELS × DECODE_SPLITS) on the
    decoding benchmark's shapes (bf16, D = 128, H = 32 on 8 kv heads, L = 1, full
    caches, contiguous and paged 64) next to SDPA over the same keys, each candidate's
    output compared with SDPA's first; then where the public call's host time goes.
    ``--shard i/n`` only runs the i-th of n slices of the kernels once (compiling them
    into Triton's cache, for a parallel warm-up)."""
    import torch
    import torch.nn.functional as F

    import attnkit
    from attnkit.spec.kvcache import validate_kvcache
    from attnkit.torch import triton as rung
    from attnkit.torch.triton import tuning as triton_tuning
    dev = "cpu" if args.dry_run else "cuda"
    D, H, Hkv, dtype = (16, 4, 2, torch.float32) if args.dry_run else (128, 32, 8, torch.bfloat16)
    shapes = [(2, 64), (1, 128)] if args.dry_run else DECODE_SHAPES
    page_size = 16 if args.dry_run else 64
    size = dtype.itemsize
    kernels = DECODE_KERNELS[:2] if args.dry_run else DECODE_KERNELS
    if args.shard:
        i, n = (int(x) for x in args.shard.split("/"))
        kernels = kernels[i::n]
    t0 = time.perf_counter()
    data = {}
    for B, S in shapes:
        for page in (None, page_size):
            k, v, table = decode_cache(torch, B, Hkv, S, D, dtype, dev, page)
            q = torch.randn(B, H, 1, D, device=dev).to(dtype)
            lengths = torch.full((B,), S, device=dev)
            data[B, S, page] = (q, k, v, lengths, table)
    sdpa, want = {}, {}
    for (B, S, page), (q, k, v, _, table) in data.items():
        if page:                                    # the paged cache's keys in sequence order
            k, v = (c[table.long()].permute(0, 2, 1, 3, 4).reshape(B, Hkv, S, D) for c in (k, v))
        fn = (lambda a=(q, k, v): F.scaled_dot_product_attention(*a, enable_gqa=True))
        want[B, S, page] = fn()
        if page is None and not args.shard:
            sdpa[B, S] = 2 * B * Hkv * S * D * size / 1e9 / timer(torch, dev, fn) * 1e3
    best = {}
    defaults = (triton_tuning.DECODE_PROGRAMS, triton_tuning.MAX_SPLITS)
    for bn, w, st in kernels:
        for programs, split_keys, max_splits in DECODE_SPLITS:
            triton_tuning.override = (lambda D_, dt, cap, kd, c=(bn, w, st, split_keys):
                                      dict(zip(("BLOCK_N", "num_warps", "num_stages", "SPLIT_KEYS"), c))
                                      if kd == "decode" else None)
            triton_tuning.DECODE_PROGRAMS, triton_tuning.MAX_SPLITS = programs, max_splits
            line = f"BLOCK_N={bn:3} warps={w} stages={st} programs={programs:4} split_keys={split_keys:4} " \
                   f"max_splits={max_splits:3} GB/s:"
            try:
                for (B, S, page), (q, k, v, lengths, table) in data.items():
                    kv = validate_kvcache(q, k, v, lengths, block_table=table, backend="triton")
                    fn = (lambda kv=kv: rung.rung_kvcache(kv))
                    err = (fn()[0].float() - want[B, S, page].float()).abs().max().item()
                    if args.shard:
                        continue
                    gbps = 2 * B * Hkv * S * D * size / 1e9 / timer(torch, dev, fn, min_time=0.05) * 1e3
                    line += f" {B}x{S}{'p' if page else 'c'} {gbps:6.0f}{'' if err < 3e-2 else f' (ERROR {err:.1e})'}"
                    if err < 3e-2 and gbps > best.get((B, S, page), (0,))[0]:
                        best[B, S, page] = (gbps, (bn, w, st, programs, split_keys, max_splits))
            except RuntimeError as e:                # e.g. out of shared memory
                line += f" failed: {str(e).splitlines()[0][:80]}"
            finally:
                triton_tuning.override = None
                triton_tuning.DECODE_PROGRAMS, triton_tuning.MAX_SPLITS = defaults
            print(line if not args.shard else f"compiled {line.split(' GB/s')[0]} "
                  f"at {time.perf_counter() - t0:.0f} s", flush=True)
    if args.shard:
        return
    print("SDPA GB/s: " + " ".join(f"{B}x{S} {g:.0f}" for (B, S), g in sdpa.items()))
    for key, (gbps, cfg) in best.items():
        print(f"best {key}: {gbps:.0f} GB/s (x{gbps / sdpa[key[:2]]:.2f} vs sdpa) with "
              f"(BLOCK_N, warps, stages, programs, split_keys, max_splits) = {cfg}")
    # where the public call's time goes on the host (ms, each step synchronised)
    for (B, S, page), (q, k, v, lengths, table) in data.items():
        if B != shapes[0][0]:
            continue
        call = (q, k, v, lengths)
        kv = validate_kvcache(*call, block_table=table, backend="triton")
        steps = {"validate_kvcache": lambda a=call, t=table: validate_kvcache(*a, block_table=t, backend="triton"),
                 "rung (kernels)": lambda kv=kv: rung.rung_kvcache(kv),
                 "public call": lambda a=call, t=table: attnkit.attention_kvcache(*a, block_table=t,
                                                                                  backend="triton")}
        shown = []
        for name, fn in steps.items():
            sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
            fn()
            sync()
            times = []
            for _ in range(20):
                t = time.perf_counter()
                fn()
                sync()
                times.append((time.perf_counter() - t) * 1e3)
            shown.append(f"{name} {statistics.median(times):.3f}")
        print(f"host+device ms, B={B} S={S} page={page}: " + ", ".join(shown), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="gpu_benchmark.csv", help="CSV path")
    ap.add_argument("--quick", action="store_true", help="bf16, D=128, L in {4k, 8k} only")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU through Triton's interpreter at tiny sizes (sets TRITON_INTERPRET=1)")
    ap.add_argument("--budget-s", type=float, default=280.0, help="stop starting new timings after this")
    ap.add_argument("--compile-only", metavar="CAPS", help="e.g. 8.0,9.0: compile for these targets, no GPU")
    ap.add_argument("--sweep", action="store_true", help="time tuning candidates (GPU)")
    ap.add_argument("--skip-checks", action="store_true",
                    help="time without the correctness checks (only after a run whose checks passed)")
    ap.add_argument("--warm", metavar="WHAT", help='compile one part\'s kernels into Triton\'s cache: '
                    '"dtype,D,causal" or "decode"; "list" prints the parts that cover the grid')
    ap.add_argument("--decode-only", action="store_true", help="only the KV-cache decoding check and timing")
    ap.add_argument("--dtypes", help="comma-separated: check and time only these dtypes of the grid")
    ap.add_argument("--sweep-decode", action="store_true", help="time the decode kernel's candidates (GPU)")
    ap.add_argument("--shard", metavar="I/N", help="with --sweep-decode: only compile the I-th of N slices")
    args = ap.parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.warm == "list":
        print("\n".join(warm_list(args)))
    elif args.warm:
        warm(args.warm, "cpu" if args.dry_run else "cuda")
    elif args.compile_only:
        compile_only([tuple(int(x) for x in c.split(".")) for c in args.compile_only.split(",")])
    elif args.sweep:
        sweep(args)
    elif args.sweep_decode:
        sweep_decode(args)
    else:
        run_benchmark(args)


if __name__ == "__main__":
    main()

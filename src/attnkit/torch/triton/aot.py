"""Compiling the kernels for a CUDA target without a GPU (Triton's bundled ptxas):
:func:`compile_only` (the attention kernels, forward and backward) and
:func:`compile_decode_only` (the KV-cache decode kernels) build each kernel with the
tuning table's configuration and report its shared memory, which catches compile
errors and table entries over a target's shared memory on machines without a GPU
(``benchmarks/gpu.py --compile-only`` sweeps targets). ``frontend_only`` runs only the
first stage (Python to Triton IR), where a kernel's Python-level errors show, in a
second or so per kernel.
"""

from . import tuning as triton_tuning
from .jit import FP_FUSION, kernels, triton
from .launch import _constexprs, _preprocess_launch

_TRITON_TYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}

# each kernel operand ``*_op`` = (pointer, strides): the pointer's name (its type below)
# and how many strides follow it
_OPERANDS = dict(q_op=("Q", 4), k_op=("K", 4), v_op=("V", 4), out_op=("Out", 4), do_op=("DO", 4),
                 dq_op=("DQ", 4), dk_op=("DK", 4), dv_op=("DV", 4), ds_op=("DS", 4), lse_op=("Lse", 3),
                 delta_op=("Delta", 3), keep_op=("Keep", 4), drop_op=("Drop", 4), bias_op=("Bias", 4),
                 slopes_op=("Slopes", 2), sinks_op=("Sinks", 3), qlen_op=("QLen", 1), klen_op=("KLen", 1),
                 kstart_op=("KStart", 1),
                 table_op=("Table", 2), lens_op=("Lens", 1), part_o_op=("PartO", 4), part_m_op=("PartM", 3))


def _signature(kern, consts, dtype, bias_dtype):
    """(Triton's signature of ``kern``, the constants of its operands) for contiguous
    operands: each operand's last stride is 1, which Triton makes a compile-time
    constant at launch, so it is a constant here too (keyed by its path: (argument,
    element))."""
    t, b = _TRITON_TYPES[dtype], _TRITON_TYPES[bias_dtype]
    ptrs = {n: f"*{t}" for n in ("Q", "K", "V", "Out", "DO", "DK", "DV", "DQ")}
    ptrs.update({n: "*fp32" for n in ("Lse", "Delta", "Slopes", "Sinks", "Finite", "PartO", "PartM", "PartL")})
    ptrs.update({n: "*i32" for n in ("QLen", "KLen", "KStart", "CuQ", "CuK", "Table", "Lens")})
    ptrs.update(Keep="*u8", Drop="*u8", Bias=f"*{b}", DS=f"*{b}")
    floats = ("sm_scale", "softcap", "drop_scale")
    sig, unit = {}, {}
    for i, a in enumerate(kern.arg_names):
        if a in _OPERANDS:
            name, n = _OPERANDS[a]
            sig[a] = (ptrs[name],) + ("i32",) * (n - 1) + ("constexpr",)
            unit[(i, n)] = 1
        else:
            sig[a] = "constexpr" if a in consts else ptrs.get(a, "fp32" if a in floats else "i32")
    return sig, unit


def _frontend(src, target, options):
    """Triton's first compile stage alone (Python AST -> Triton IR), where the kernels'
    Python-level errors show; a second or so per kernel instead of a full compile's ten
    or more. Uses the stage hooks of triton.compile (the same in Triton 3.6 and 3.9)."""
    from triton._C.libtriton import ir
    from triton.compiler.compiler import make_backend
    backend = make_backend(target)
    opts = backend.parse_options(dict(options))
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    return src.make_ir(target, opts, backend.get_codegen_implementation(opts), backend.get_module_map(), context)


def compile_only(capability, dtype, D, Dv=None, *, group=2, causal=True, window=False, masks=True,
                 softcap=True, terms=True, varlen="lengths", bias_dtype="float32", careful=(False, True),
                 bottom_right=True, frontend_only=False, usage=False) -> dict:
    """Compile the kernels for a CUDA target without a GPU (Triton's bundled ptxas)
    with the tuning table's configuration and every feature asked for (``terms``:
    ALiBi, sinks and dropout; ``varlen``: None, "lengths" (q_lengths and kv_lengths),
    "starts" (those and kv_starts) or "packed"; ``bottom_right`` the alignment); the
    three attention kernels in the variants ``careful`` names (plain: kind "forward",
    ...; careful: "forward/careful", ...).
    Returns {kind: shared memory bytes}: catches compile errors and shared-memory
    overruns of table entries on machines without a GPU (``benchmarks/gpu.py
    --compile-only`` sweeps targets). ``frontend_only``: only the first stage (Python
    to Triton IR), {kind: None}. ``usage``: {kind: (shared memory bytes, registers,
    spilled bytes stored)} by :func:`ptxas_usage` (registers and spills ``None`` where
    that ptxas cannot run)."""
    Dv = D if Dv is None else Dv
    cap = tuple(capability)
    k = kernels(False)
    launches = {"forward": k._attn_fwd, "backward_preprocess": k._bwd_preprocess,
                "backward_dkdv": k._attn_bwd_dkdv, "backward_dq": k._attn_bwd_dq}
    kernels_ = []
    for kind, kern in launches.items():
        for variant in [False] if kind == "backward_preprocess" else careful:
            if kind == "backward_preprocess":
                cfg, consts = _preprocess_launch(Dv, dtype, cap)
            else:
                cfg = triton_tuning.config(max(D, Dv), dtype, cap, kind)
                consts = _constexprs(cfg, kind, group=group, D=D, Dv=Dv, dtype=dtype, band=(window, causal or window),
                                     keep=masks, drop=masks, bias=masks, softcap=softcap, alibi=terms, sinks=terms,
                                     dropout=terms, lengths=(varlen in ("lengths", "starts"),) * 2,
                                     starts=varlen == "starts", packed=varlen == "packed",
                                     bottom_right=bottom_right, interpret=False, precision="ieee")
                consts["CAREFUL"] = variant
                if kind == "backward_dq":
                    consts["WRITE_DS"] = masks
            kernels_.append((kind + ("/careful" if variant else ""), kern, cfg, consts))
    return _compile(kernels_, cap, dtype, bias_dtype, frontend_only, usage)


def compile_decode_only(capability, dtype, D, Dv=None, *, group=4, rows=None, causal=True, window=True,
                        softcap=True, terms=True, bottom_right=True, frontend_only=False, usage=False) -> dict:
    """The KV-cache decode kernels (``decode.py``) for a CUDA target, as
    :func:`compile_only`: the split kernel for a contiguous ("decode") and a paged
    ("decode/paged") cache with the band and softcap asked for (``terms``: ALiBi,
    dropout, q_lengths and kv_starts), and the combine kernel ("decode_combine", with
    sinks when ``terms``); ``rows`` (a GQA group's heads × L, default the table's
    BLOCK_M) sizes the row block."""
    from .kvcache import combine_constexprs, split_constexprs
    Dv = D if Dv is None else Dv
    cap = tuple(capability)
    k = kernels(False)
    cfg = triton_tuning.config(max(D, Dv), dtype, cap, "decode")
    ccfg = triton_tuning.config(Dv, dtype, cap, "decode_combine")
    rows = cfg["BLOCK_M"] if rows is None else rows
    kernels_ = []
    for paged in (False, True):
        _, consts = split_constexprs(cfg, group=group, D=D, Dv=Dv, dtype=dtype, rows=rows,
                                     band=(window, causal or window), softcap=softcap, alibi=terms,
                                     dropout=terms, paged=paged, bottom_right=bottom_right, qlens=terms,
                                     starts=terms, interpret=False, precision="ieee")
        kernels_.append(("decode/paged" if paged else "decode", k._decode_split, cfg, consts))
    _, consts = combine_constexprs(ccfg, group=group, Dv=Dv, rows=rows, sinks=terms, qlens=terms, interpret=False)
    kernels_.append(("decode_combine", k._decode_combine, ccfg, consts))
    return _compile(kernels_, cap, dtype, "float32", frontend_only, usage)


def ptxas_usage(ptx: str, arch: int):
    """(registers, spilled bytes stored) per thread of a kernel's PTX, by ``ptxas -v``
    with the ptxas Triton compiles with for ``arch`` (e.g. 90); (None, None) where it
    cannot run. Spills are local-memory traffic in the inner loop: a table entry that
    spills kilobytes runs many times slower (the float32 backward's old tiles did)."""
    import os
    import re
    import subprocess
    import tempfile

    try:
        from triton.backends.nvidia.compiler import get_ptxas
    except ImportError:                                   # a Triton without the NVIDIA backend
        return None, None
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "kernel.ptx")
        with open(src, "w") as fh:
            fh.write(ptx)
        gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"   # Triton's target names (sm_90a, sm_100a)
        try:
            r = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name={gpu}", src, "-o",
                                os.path.join(d, "kernel.cubin")], capture_output=True, text=True, timeout=600)
        except (OSError, RuntimeError, subprocess.SubprocessError):
            return None, None
    regs = re.search(r"Used (\d+) registers", r.stderr)
    spill = re.search(r"(\d+) bytes spill stores", r.stderr)
    if r.returncode or regs is None:
        return None, None
    return int(regs.group(1)), int(spill.group(1)) if spill else 0


def _compile(kernels_, cap, dtype, bias_dtype, frontend_only, usage=False) -> dict:
    """{name: shared memory bytes (None: frontend only)} of (name, kernel, config,
    constexprs) compiled for CUDA capability ``cap``; with ``usage``, {name: (shared,
    registers, spilled bytes stored)}."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    target = GPUTarget("cuda", cap[0] * 10 + cap[1], 32)
    shared: dict = {}
    for name, kern, cfg, consts in kernels_:
        sig, unit = _signature(kern, consts, dtype, bias_dtype)
        src = ASTSource(kern, sig, constexprs={**consts, **unit})
        options = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **FP_FUSION)
        if frontend_only:
            _frontend(src, target, options)
            shared[name] = None
        else:
            compiled = triton.compile(src, target=target, options=options)
            shared[name] = compiled.metadata.shared
            if usage:
                shared[name] = (shared[name],) + ptxas_usage(compiled.asm["ptx"], target.arch)
    return shared

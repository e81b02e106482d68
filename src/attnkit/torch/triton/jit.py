"""Wrapping the kernels with ``triton.jit``, lazily, once per interpreter setting.

Triton reads ``TRITON_INTERPRET`` when ``@triton.jit`` wraps a function, so the kernel
modules (``device``, ``forward``, ``backward``, ``decode``) keep their kernels and device functions
as plain Python functions and :func:`kernels` wraps them on first use, once per
setting. Triton's own ``@jit`` helpers in ``triton.language.standard`` (``tl.zeros``,
``tl.cdiv``, ``tl.max``, ...) are wrapped at ``import triton`` and fail inside an
interpreted kernel when triton was imported before the variable was set, so the
kernels use only core builtins (``tl.full``, integer arithmetic, ``tl.reduce`` with a
combine step). Net effect: setting the variable any time before the first call works,
whatever imported triton earlier (the tests set it per test with monkeypatch).

Constants that kernels read as globals are ``tl.constexpr`` (:func:`const`): Triton
reads no other globals inside a kernel.
"""

import os
import threading
import types

try:
    import triton
    import triton.language as tl
    constexpr = tl.constexpr
    IMPORT_ERROR = None
except (ImportError, OSError, RuntimeError) as e:   # missing or broken install
    triton = tl = None
    constexpr = "constexpr"                         # annotation stand-in; kernels are never wrapped
    IMPORT_ERROR = f"{type(e).__name__}: {e}"

# Fused multiply-add contraction on, as Triton has always defaulted to; said explicitly
# because Triton 3.9 warns that its default will change in 3.10.
FP_FUSION = {"enable_fp_fusion": True}

KERNEL_NAMES = ("_attn_fwd", "_bwd_preprocess", "_attn_bwd_dkdv", "_attn_bwd_dq", "_decode_split", "_decode_combine")
# scalar kernel arguments that are never specialised on their value: Triton turns an int
# argument equal to 1 into a compile-time constant, which would recompile per value and
# change the type of seeds and lengths inside the kernels
NO_SPECIALIZE = ("H", "HKV", "L", "S", "N0", "SEQ0", "OFFSET", "ROW0", "COL0", "LEFT", "RIGHT", "seed_lo",
                 "seed_hi", "drop_threshold", "BH", "PAGE", "NUM_SPLITS", "ROW_BLOCKS")
# the row max / row sum combine steps: Triton's own (what tl.max / tl.sum use) when
# present; the interpreter runs those as one NumPy reduction, any other combine
# function element by element
_STANDARD_COMBINE = {"_max_combine": "_elementwise_max", "_sum_combine": "_sum_combine"}
_KERNELS: dict = {}                                 # interpreter mode -> namespace of jitted functions
_LOCK = threading.Lock()


def const(x):
    """A global constant the kernels can read (a ``tl.constexpr``; the value itself
    when Triton is missing)."""
    return x if tl is None else tl.constexpr(x)


def interpreting() -> bool:
    """True when Triton would interpret (TRITON_INTERPRET=1), read the way triton.jit
    reads it right now."""
    knobs = getattr(triton, "knobs", None)          # Triton >= 3.4
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


class _InterpretedHelper:
    """A device function called from an interpreted kernel, minus the per-call
    re-patching of triton.language that Triton's interpreter does on every call (the
    calling kernel has patched it already); about a third of the interpreter's time
    in these kernels. Falls back to the plain call when the interpreter lacks
    ``rewrite`` (it is internal API)."""

    def __init__(self, fn):
        self.fn = fn
        self.call = fn.rewrite() if hasattr(fn, "rewrite") else fn

    def __call__(self, *args, **kwargs):
        return self.call(*args, **kwargs)


def _modules():
    from . import backward, decode, device, forward
    return (device, forward, backward, decode)


def kernels(mode=None):
    """The jitted kernels and device functions for interpreter mode ``mode`` (default:
    the current TRITON_INTERPRET setting), built once per mode, as a namespace.

    Every function a kernel module lists in its ``JIT`` tuple is copied into one
    private namespace whose globals hold the wrapped copies of all of them (and the
    modules' constants), so a kernel calls helpers of its own mode and the modules'
    own functions stay plain Python."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    mode = interpreting() if mode is None else mode
    wrap = InterpretedFunction if mode else JITFunction   # what triton.jit picks for each mode
    with _LOCK:
        if mode not in _KERNELS:
            mods = _modules()
            ns = {}
            for m in mods:
                ns.update({k: v for k, v in vars(m).items() if not k.startswith("__")})
            names = [n for m in mods for n in m.JIT]
            for name in names:
                f = ns[name]
                g = types.FunctionType(f.__code__, ns, f.__name__, f.__defaults__, f.__closure__)
                g.__qualname__, g.__module__, g.__doc__ = f.__qualname__, f.__module__, f.__doc__
                g.__annotations__ = dict(f.__annotations__)
                if name in KERNEL_NAMES:
                    args = f.__code__.co_varnames[:f.__code__.co_argcount]
                    ns[name] = wrap(g, do_not_specialize=[a for a in NO_SPECIALIZE if a in args])
                else:
                    ns[name] = wrap(g)
                if name in _STANDARD_COMBINE:
                    ns[name] = getattr(tl.standard, _STANDARD_COMBINE[name], ns[name])
                elif mode and name not in KERNEL_NAMES:
                    ns[name] = _InterpretedHelper(ns[name])
            _KERNELS[mode] = types.SimpleNamespace(**{n: ns[n] for n in names})
        return _KERNELS[mode]

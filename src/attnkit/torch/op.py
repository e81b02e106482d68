"""The torch bridge: one autograd op for torch tensors around the compute rung that
``backends.select`` chose (flash or reference on the CPU, Triton on CUDA).

``torch.ops.attnkit.attention_fwd`` is a ``torch.library`` custom op with an autograd
formula and a fake (meta) implementation, so ``torch.compile(fullgraph=True)`` traces
it as one node. Its arguments are q, k, v, every masking keyword of
:data:`attnkit.spec.OPTIONS` in the table's order (arrays as tensors, the window as
two ints, the dropout seed as a 0-d int64 tensor) and the rung's name; it returns
``(out, lse, out32)`` and saves only its inputs, out (out32 where there is one) and
lse for the backward — never an L × S matrix. ``out32`` is out in float32 for
half-precision inputs on a NumPy rung (what the backward reads instead of out:
rowsum(dout ∘ out) without out's rounding), else empty; callers of the op see out and
lse only. :func:`to_op_args` and :func:`from_op_args` are the only code that knows
that order; the schema string is generated from the same table.

CPU tensors reach the NumPy rungs on zero-copy views (``t.detach().numpy()`` shares
memory); bfloat16 has no NumPy dtype and is upcast to float32 (a copy), the results
cast back. Gradients: q, k, v, ``bias`` and ``sinks`` (each to its own shape), and lse
is differentiable too (d lse / d scores = weights), so ``attnkit.merge`` of torch
blocks is differentiable end to end. Weights from ``return_weights=True`` or
``attention_weights`` are recomputed from lse and carry **no** gradient.

Dropout without a seed draws one from torch's default generator, so
``torch.manual_seed`` makes a training step reproducible.

``attention_kvcache`` is eager (it reads the cache's lengths to check them); while
torch.compile traces, it is one custom op (:mod:`.kvcache_op`).

>>> import torch, attnkit
>>> q = torch.tensor([[1.0, 0.0]], requires_grad=True)
>>> k = torch.eye(2); v = torch.tensor([[10.0, 0.0], [0.0, 10.0]])
>>> out = attnkit.attention(q, k, v)
>>> out.detach().numpy().round(2)
array([[6.7, 3.3]], dtype=float32)
>>> out.sum().backward(); q.grad.shape
torch.Size([1, 2])
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from .. import philox
from ..backends import RUNGS, Grads, load
from ..kvcache import compact, seen
from ..spec import OPTIONS, Spec, dtype_name
from ..spec import acc_dtype as spec_acc_dtype
from ..spec.checks import check_sequence_values
from ..spec.core import empty_out, heads_inner, strides_heads_inner
from ..spec.validate import host_ints

# ---- the flat argument order: the one place that knows it --------------------------------
_ARRAY_OPTIONS = tuple(o.name for o in OPTIONS if o.schema == "Tensor?")
_SCHEMA_ARGS = ", ".join(["Tensor q", "Tensor k", "Tensor v"]
                         + [f"{o.schema} {o.name}" if o.name != "window" else o.schema for o in OPTIONS]
                         + ["int[] origin", "int[]? extent", "str rung"])
_UINT64 = 1 << 64


def seed_tensor(spec: Spec) -> torch.Tensor | None:
    """The dropout seed as a 0-d int64 CPU tensor: the user's (wrapped into int64), else
    drawn from torch's default generator; None without dropout."""
    if spec.dropout == 0:
        return None
    if spec.seed is not None:
        return torch.tensor(philox.int64(int(spec.seed)), dtype=torch.int64)
    return torch.randint(0, 1 << 62, (), dtype=torch.int64)


def _pack(options: tuple[Any, ...], value: Callable[[Any], Any]) -> list[Any]:
    """Options as flat op arguments in table order: the window as two ints (None, None
    when unset), every other option as ``value(option)`` gives it."""
    args: list[Any] = []
    for o in options:
        w = value(o)
        if o.name == "window":
            args += list(w) if w is not None else [None, None]
        else:
            args.append(w)
    return args


def _unpack(options: tuple[Any, ...], args: tuple[Any, ...], i: int, seed: Callable[[Any], int]
            ) -> tuple[dict[str, Any], int]:
    """:func:`_pack`'s inverse from position i: (options by name, the next position);
    a seed that is given becomes ``seed(x)``."""
    opts: dict[str, Any] = {}
    for o in options:
        if o.name == "window":
            left, right = args[i], args[i + 1]
            opts["window"] = None if left is None and right is None else (left, right)
            i += 2
            continue
        x = args[i]
        opts[o.name] = seed(x) if o.name == "seed" and x is not None else x
        i += 1
    return opts, i


def to_op_args(spec: Spec, rung: str) -> tuple[Any, ...]:
    """The custom ops' flat arguments for a torch Spec: q, k, v, the options in table
    order, the block geometry (origin, extent: ring attention) and the rung's name."""
    args = [spec.q, spec.k, spec.v] + _pack(OPTIONS, lambda o: seed_tensor(spec) if o.name == "seed"
                                            else getattr(spec, o.name))
    return tuple(args) + (list(spec.origin), None if spec.extent is None else list(spec.extent), rung)


def from_op_args(args: tuple[Any, ...]) -> tuple[Spec, str]:
    """(Spec, rung name) back from :func:`to_op_args`'s tuple (already validated: the
    sizes are read off the tensors). On the CPU the sequences' values are checked
    here: a call traced by torch.compile was validated without them, and the NumPy
    rungs index memory by them (out-of-range lengths crashed the process)."""
    q, k, v = args[:3]
    opts, i = _unpack(OPTIONS, args, 3, lambda x: int(x.item()) % _UINT64)
    origin, extent = tuple(args[i]), (None if args[i + 1] is None else tuple(args[i + 1]))
    spec = Spec.from_arrays(q, k, v, origin=origin, extent=extent, **opts)
    if spec.varlen and q.device.type == "cpu":
        check_sequence_values(spec)
    return spec, args[i + 2]


def _rung(name: str) -> Any:
    mod, why = load(RUNGS[name][0])
    if mod is None:
        raise RuntimeError(f"attnkit rung {name!r} is not available: {why}")
    return mod


# positions of the options in the flat arguments (after q, k, v; the window takes two)
_OPT_INDEX: dict[str, int] = {}
_i = 3
for _o in OPTIONS:
    _OPT_INDEX[_o.name] = _i
    _i += 2 if _o.name == "window" else 1
del _i, _o

# ---- NumPy views of CPU tensors ---------------------------------------------------------
def _np(t: Any) -> Any:
    """A NumPy view of a CPU tensor sharing its memory; bfloat16 (no NumPy dtype) is
    upcast to float32, which copies."""
    if t is None:
        return None
    try:
        return t.numpy()                                 # the common case, in one call
    except (RuntimeError, TypeError):                    # grad, bfloat16, conjugate or negative bit
        pass
    if t.requires_grad:
        t = t.detach()
    if t.dtype == torch.bfloat16:
        t = t.float()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    return t.numpy()


def _torch(a: Any, dtype: torch.dtype) -> torch.Tensor:
    """A NumPy result as a contiguous tensor of ``dtype`` (no copy when it already is)."""
    t = torch.from_numpy(a if a.flags.c_contiguous else np.ascontiguousarray(a))
    return t if t.dtype == dtype else t.to(dtype)


def _out(out: Any, q: torch.Tensor, like_q: bool) -> torch.Tensor:
    """The forward's out (a tensor, or a NumPy result) in q's dtype, contiguous; or,
    ``like_q``, with its heads inner where q's are (attnkit.spec.core.heads_inner; no
    copy when the rung wrote it so). Only calls outside the custom op take q's layout:
    under torch.compile the op may receive q in another layout than its fake saw."""
    t = torch.from_numpy(out) if isinstance(out, np.ndarray) else out
    if t.dtype != q.dtype:
        t = t.to(q.dtype)
    if not (like_q and heads_inner(q)):
        return t if t.is_contiguous() else t.contiguous()
    if heads_inner(t) and t.transpose(-3, -2).is_contiguous():     # the rung wrote it so
        return t
    return t.transpose(-3, -2).contiguous().transpose(-3, -2)


_VIEWED = tuple(n for n in ("q", "k", "v") + _ARRAY_OPTIONS if n != "seed")


def numpy_spec(spec: Spec, **changes: Any) -> Spec:
    """The same call on NumPy views (for the NumPy rungs), with ``changes``."""
    fields = spec.__dict__
    for name in _VIEWED:
        x = fields[name]
        if x is not None:
            changes[name] = _np(x)
    if spec.dtype == "bfloat16":
        changes["dtype"] = "float32"
    return spec.replace(**changes)


def acc_dtype(x: torch.Tensor) -> torch.dtype:
    """The accumulation (and lse) dtype for inputs like x (:func:`attnkit.spec.acc_dtype`)."""
    return getattr(torch, spec_acc_dtype(dtype_name(x)))


def _batch(*xs: torch.Tensor) -> tuple[int, ...]:
    return tuple(torch.broadcast_shapes(*(x.shape[:-3] for x in xs)))


# ---- the custom ops -----------------------------------------------------------------------
def _takes_tensors(mod: Any) -> bool:
    """Whether compute rung ``mod`` works on torch tensors (Triton) rather than on
    NumPy views (``arrays = "torch"``)."""
    return getattr(mod, "arrays", "numpy") == "torch"


def _forward(mod: Any, spec: Spec, keep_acc: bool = False, like_q: bool = False) -> tuple[torch.Tensor, ...]:
    """(out, lse) of compute rung ``mod`` as tensors (a seed already drawn); with
    ``keep_acc`` (a NumPy rung) also out in float32, before its rounding to q's dtype;
    ``like_q``: out in q's layout (see :func:`_out`)."""
    if _takes_tensors(mod):
        out, lse, _ = mod.rung_forward(spec)
        return _out(out, spec.q, like_q), lse.contiguous()
    if not keep_acc and getattr(mod, "streams_alone", None) is not None and mod.streams_alone(spec):
        # the small rung's decoding call on views of q, k, v, into tensors: no NumPy Spec
        o32, lse = mod.streamer(spec)(_np(spec.q), _np(spec.k), _np(spec.v))
        return _out(o32, spec.q, like_q), torch.from_numpy(lse)
    out, lse, _ = mod.rung_forward(numpy_spec(spec, out_like_q=like_q, **({"dtype": "float32"} if keep_acc else {})))
    res = (_out(out, spec.q, like_q), _torch(lse, acc_dtype(spec.q)))
    return res + (_torch(out, torch.float32),) if keep_acc else res


def _keeps_acc(q: torch.Tensor, name: str) -> bool:
    """Whether the forward op also returns out in float32 for the backward: half
    precision on a NumPy rung (which has it). rowsum(dout ∘ out) from the rounded out
    carries its rounding into dq, dk and dbias (a bias broadcast over keys, whose
    gradient is exactly 0, got 7e-3 in bfloat16); the Triton rung keeps
    FlashAttention's rounded out."""
    return q.dtype in (torch.float16, torch.bfloat16) and not _takes_tensors(_rung(name))


def _fwd(*args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    spec, name = from_op_args(args)
    out, lse, *acc = _forward(_rung(name), spec, _keeps_acc(spec.q, name))
    return out, lse, acc[0] if acc else spec.q.new_empty(0, dtype=torch.float32)


def _eager(spec: Spec) -> bool:
    """Whether a forward may run the NumPy rung directly instead of through the custom
    op: plain CPU tensors, nothing to differentiate, and nothing watching the call
    (torch.compile, jit tracing, a torch function or dispatch mode, functorch
    transforms). The op's dispatch costs about as much as a whole small call (a
    decoding step); the results are the same tensors, bit for bit."""
    if torch.compiler.is_compiling():
        return False
    fields = spec.__dict__
    return _plain([fields[name] for name in _VIEWED]) and spec.q.device.type == "cpu"


# what the per-call tests call, bound once (a decoding step runs them in every layer)
_C, _Tensor, _fwad, _CPU = torch._C, torch.Tensor, torch.autograd.forward_ad, torch.device("cpu")
_Parameter, _F32 = torch.nn.Parameter, torch.float32
_interpreters = torch._C._functorch.peek_interpreter_stack


def _plain(xs: Sequence[Any]) -> bool:
    """:func:`_eager`'s test (torch.compile aside) of the tensors (None: not given; plain
    tensors or Parameters — a model's sinks) and of what watches the call: jit tracing,
    torch function or dispatch modes, a functorch transform (whose wrapped tensors live
    only while it runs)."""
    if _C._is_tracing() or _C._len_torch_function_stack() or _C._len_torch_dispatch_stack() \
            or _interpreters() is not None:
        return False
    grad = _C.is_grad_enabled()
    for x in xs:
        if x is not None and ((type(x) is not _Tensor and type(x) is not _Parameter) or (grad and x.requires_grad)):
            return False
    return True


def _direct_reads(q: Any, k: Any, v: Any) -> bool:
    """Whether a kept direct call may read q, k, v's memory as they are: no autocast,
    no forward-mode AD (_plain sees a functorch transform, the level a dual one), what
    :func:`_plain` asks, and no negative bit (a view whose memory holds −x)."""
    return not (_C._is_any_autocast_enabled() or _fwad._current_level >= 0 or not _plain((q, k, v))
                or q.is_neg() or k.is_neg() or v.is_neg())


def _sinks_at(x: Any, shape: Any) -> int | None:
    """The address at which a kept call reads sinks ``x`` (0: none given where none are
    kept, ``shape`` None), or None where it cannot read them as they are: a float32 CPU
    tensor (a model's Parameter too) of ``shape``, C-ordered, no negative bit, no
    gradient to track."""
    if x is None or shape is None:
        return 0 if x is None and shape is None else None
    if not (type(x) is _Tensor or type(x) is _Parameter) or x.dtype is not _F32 or x.shape != shape or not x.is_cpu \
            or not x.is_contiguous() or x.is_neg() or (x.requires_grad and _C.is_grad_enabled()):
        return None
    return x.data_ptr()


def _forward_ad_possible() -> bool:
    """Whether forward-mode AD may watch a call (a functorch transform or a dual level)."""
    return _interpreters() is not None or _fwad._current_level >= 0


def check_no_forward_ad(spec: Spec) -> None:
    """NotImplementedError when forward-mode AD watches the call (``torch.func.jvp``,
    or ``torch.autograd.forward_ad`` dual tensors among the inputs): the op has no
    forward-mode derivative, and its tangent would otherwise be lost without a word."""
    if torch.compiler.is_compiling() or not _forward_ad_possible():
        return
    jvp = False
    if _interpreters() is not None:
        from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
        jvp = any(i.key() == torch._C._functorch.TransformType.Jvp for i in retrieve_all_functorch_interpreters())
    if not jvp and torch.autograd.forward_ad._current_level >= 0:
        jvp = any(isinstance(x, torch.Tensor) and torch.autograd.forward_ad.unpack_dual(x).tangent is not None
                  for x in (getattr(spec, n) for n in _VIEWED))
    if jvp:
        raise NotImplementedError("attnkit attention has no forward-mode derivative (torch.func.jvp, "
                                  "torch.autograd.forward_ad): use reverse mode (backward, torch.autograd.grad)")


def _fwd_fake(*args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = args[:3]
    batch = _batch(q, k, v)
    H, L = q.shape[-3], q.shape[-2]
    out = batch + (H, L, v.shape[-1])
    return (q.new_empty(out), q.new_empty(batch + (H, L), dtype=acc_dtype(q)),
            q.new_empty(out if _keeps_acc(q, args[-1]) else 0, dtype=torch.float32))


attention_fwd = torch.library.custom_op("attnkit::attention_fwd", _fwd, mutates_args=(),
                                        schema=f"({_SCHEMA_ARGS}) -> (Tensor, Tensor, Tensor)")
attention_fwd.register_fake(_fwd_fake)


def _bwd(dout: torch.Tensor, dlse: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor,
         need_dbias: bool, *args: Any) -> tuple[torch.Tensor, ...]:
    spec, name = from_op_args(args)
    mod = _rung(name)
    if _takes_tensors(mod):
        g = mod.rung_backward(spec, dout, out, lse, dlse, need_dbias)
    else:
        g = mod.rung_backward(numpy_spec(spec), _np(dout), _np(out), _np(lse), _np(dlse), need_dbias)
        g = Grads(*(None if x is None else _torch(x, like.dtype)
                    for x, like in zip(g, (spec.q, spec.k, spec.v, spec.bias, spec.sinks))))
    dbias = g.dbias if g.dbias is not None and need_dbias else spec.q.new_empty(0)
    dsinks = g.dsinks if g.dsinks is not None else spec.q.new_empty(0)
    return tuple(x.contiguous() for x in (g.dq, g.dk, g.dv, dbias, dsinks))


def _bwd_fake(dout: torch.Tensor, dlse: Any, out: Any, lse: Any, need_dbias: bool, *args: Any
              ) -> tuple[torch.Tensor, ...]:
    q, k, v = args[:3]
    bias, sinks = args[_OPT_INDEX["bias"]], args[_OPT_INDEX["sinks"]]

    def like(x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    return (like(q), like(k), like(v), like(bias) if bias is not None and need_dbias else q.new_empty(0),
            like(sinks) if sinks is not None else q.new_empty(0))


attention_bwd = torch.library.custom_op(
    "attnkit::attention_bwd", _bwd, mutates_args=(),
    schema=f"(Tensor dout, Tensor? dlse, Tensor out, Tensor lse, bool need_dbias, {_SCHEMA_ARGS}) "
           "-> (Tensor, Tensor, Tensor, Tensor, Tensor)")
attention_bwd.register_fake(_bwd_fake)

_GRAD_INPUTS = {0: 0, 1: 1, 2: 2, _OPT_INDEX["bias"]: 3, _OPT_INDEX["sinks"]: 4}


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    ctx.tensor_pos = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor)]
    ctx.scalars = {i: x for i, x in enumerate(inputs) if not isinstance(x, torch.Tensor)}
    ctx.n = len(inputs)
    out, lse, acc = output
    ctx.mark_non_differentiable(acc)
    # the backward reads out only for rowsum(dout ∘ out): the float32 one where there is one
    ctx.save_for_backward(*(inputs[i] for i in ctx.tensor_pos), acc if acc.numel() else out, lse)


def _backward(ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None, _: Any = None) -> tuple[Any, ...]:
    saved = ctx.saved_tensors
    args: list[Any] = [None] * ctx.n
    for i, x in ctx.scalars.items():
        args[i] = x
    for i, x in zip(ctx.tensor_pos, saved):
        args[i] = x
    out, lse = saved[-2:]
    if dout is None:
        dout = torch.zeros_like(out)
    need_dbias = args[_OPT_INDEX["bias"]] is not None and ctx.needs_input_grad[_OPT_INDEX["bias"]]
    grads = torch.ops.attnkit.attention_bwd(dout, dlse, out, lse, need_dbias, *args)
    res: list[Any] = [None] * ctx.n
    for pos, g in _GRAD_INPUTS.items():
        if args[pos] is not None and ctx.needs_input_grad[pos] and g < len(grads):
            res[pos] = grads[g] if grads[g].numel() or args[pos].numel() == 0 else None
    return tuple(res)


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def _weights(lse: torch.Tensor | None, rows: torch.Tensor | None, *args: Any) -> torch.Tensor:
    spec, name = from_op_args(args)
    mod = _rung(name)
    if _takes_tensors(mod):
        return mod.rung_weights(spec, lse, None if rows is None else rows.cpu().numpy())
    w = mod.rung_weights(numpy_spec(spec), _np(lse), None if rows is None else rows.cpu().numpy())
    return _torch(w, spec.q.dtype)


def _weights_fake(lse: Any, rows: torch.Tensor | None, *args: Any) -> torch.Tensor:
    q, k = args[:2]
    n = q.shape[-2] if rows is None else rows.shape[0]
    return q.new_empty(_batch(q, k) + (q.shape[-3], n, k.shape[-2]))


attention_weights = torch.library.custom_op(
    "attnkit::attention_weights", _weights, mutates_args=(),
    schema=f"(Tensor? lse, Tensor? rows, {_SCHEMA_ARGS.replace('Tensor v', 'Tensor? v')}) -> Tensor")
attention_weights.register_fake(_weights_fake)


# ---- the rung the dispatcher hands out for torch tensors --------------------------------
class TorchRung:
    """The torch op bound to one compute rung (see backends.select)."""

    def __init__(self, mod: Any) -> None:
        self.mod = mod
        self.name = f"torch ({mod.name})"

    def not_supported_reasons(self, spec: Spec) -> list[str]:
        return list(self.mod.not_supported_reasons(spec))

    def rung_forward(self, spec: Spec, need_weights: bool = False) -> tuple[Any, Any, Any]:
        check_no_forward_ad(spec)
        if not _takes_tensors(self.mod) and _eager(spec):
            drawn = seed_tensor(spec) if spec.seed is None else None     # the op's arguments' draw
            if drawn is not None:
                spec = spec.replace(seed=int(drawn.item()) % _UINT64)
            out, lse = _forward(self.mod, spec, like_q=True)
            w = self.rung_weights(spec, lse, None) if need_weights else None
            return out, lse, w
        args = to_op_args(spec, self.mod.name)
        out, lse, _ = torch.ops.attnkit.attention_fwd(*args)
        w = self._weights(args, lse.detach(), None) if need_weights else None
        return out, lse, w

    def direct(self, spec: Spec) -> Callable[[Any, Any, Any, bool], tuple[torch.Tensor, Any] | None] | None:
        """For calls that repeat spec's signature (:func:`attnkit.api.attention` keeps
        it): ``call(q, k, v, need_lse, sinks=None) -> (out, lse or None)`` (sinks where
        spec has them, read in place: :func:`_sinks_at`), the compute rung's direct
        call on the tensors' memory (``mod.direct_at``: the small rung's streaming call),
        as :meth:`rung_forward` runs it; its out of the layout :func:`_out` gives — or
        None for a call whose forward would not run eagerly (:func:`_eager`: gradients,
        tracing, modes; forward-mode AD; autocast; a negative bit), which then takes
        the full path."""
        make = getattr(self.mod, "direct_at", None)
        inner = None if make is None or not _eager(spec) else make(spec)
        if inner is None:
            return None
        out_shape, lse_shape = spec.out_shape, spec.lse_shape
        sink_shape = None if spec.sinks is None else spec.shapes["sinks"]     # as the caller gives them
        apart = spec.H > 1 and spec.L > 1                # (heads inner needs both)
        new = functools.partial(torch.empty, dtype=torch.float32, device=_CPU)    # (not the defaults)

        def call(q: Any, k: Any, v: Any, need_lse: bool, sinks: Any = None) -> tuple[torch.Tensor, Any] | None:
            # (torch.compile: api keeps no call for a traced one; dtype, device and layout
            # are the signature's)
            if not _direct_reads(q, k, v):               # (first: a functorch transform's
                return None                              # sinks have no memory to read)
            at = 0 if sinks is None and sink_shape is None else _sinks_at(sinks, sink_shape)
            if at is None:
                return None
            qs = q.stride()                            # (read once: the layout and the kernel)
            out = empty_out(out_shape, True, new) if apart and strides_heads_inner(qs) else new(out_shape)
            lse = new(lse_shape) if need_lse else None
            done = inner(q.data_ptr(), qs, k.data_ptr(), k.stride(), v.data_ptr(), v.stride(), k.shape[-2],
                         out.data_ptr(), out.stride(), 0 if lse is None else lse.data_ptr(), at)
            return (out, lse) if done else None
        return call

    def rung_backward(self, spec: Spec, dout: Any, out: Any, lse: Any, dlse: Any = None,
                      need_dbias: bool = True) -> Grads:
        with torch.no_grad():
            g = torch.ops.attnkit.attention_bwd(dout, dlse, out, lse, need_dbias and spec.bias is not None,
                                                *to_op_args(spec, self.mod.name))
        dq, dk, dv, dbias, dsinks = g
        return Grads(dq.reshape(spec.shapes["q"]), dk.reshape(spec.shapes["k"]), dv.reshape(spec.shapes["v"]),
                     dbias.reshape(spec.shapes["bias"]) if spec.bias is not None else None,
                     dsinks.reshape(spec.shapes["sinks"]) if spec.sinks is not None else None)

    def rung_kvcache(self, kv: Any) -> tuple[Any, Any]:
        """attention_kvcache for torch tensors (forward only, no autograd): NumPy views of CPU tensors
        for the NumPy rungs, the tensors for Triton; dropout without a seed draws one from torch's."""
        check_no_forward_ad(kv.spec)
        drawn = seed_tensor(kv.spec) if kv.spec.dropout > 0 and kv.spec.seed is None else None
        if drawn is not None:
            kv = replace(kv, spec=kv.spec.replace(seed=int(drawn)))
        if _takes_tensors(self.mod):
            return self.mod.rung_kvcache(kv)
        kept = self._kept_kvcache(kv)
        if kept is not None:
            return kept
        if kv.k_cache.dtype == torch.bfloat16:           # _np's upcast: the keys, or pages, in use only
            kv = compact(kv) if kv.paged else seen(kv)
        with torch.no_grad():
            names = ("k_cache", "v_cache", "cache_lengths", "lengths", "block_table", "k_new", "v_new")
            npkv = replace(kv, spec=numpy_spec(kv.spec), **{n: _np(getattr(kv, n)) for n in names})
            out, lse = self.mod.rung_kvcache(npkv)
        return _torch(out, kv.spec.q.dtype), _torch(lse, acc_dtype(kv.spec.q))

    def _kept_kvcache(self, kv: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(out, lse) of a cache's call, its append done, by :meth:`kvcache_call` on the
        tensors' memory (a paged cache's checked block table as int64), as
        :meth:`rung_kvcache` computes them; or None: the full path (no memo, a rung or
        call without one, tensors the direct call cannot read: what :meth:`direct`
        declines): a signature's first call, and the calls its kept step
        (:meth:`kvcache_step`) declines."""
        call = self.kvcache_call(kv)
        q, k, v, sinks = kv.spec.q, kv.k_cache, kv.v_cache, kv.spec.sinks
        if call is None or not q.is_cpu or not _direct_reads(q, k, v):
            return None
        at = _sinks_at(sinks, None if sinks is None else sinks.shape)    # (the kept shape: validate's)
        if at is None:
            return None
        out = torch.empty(kv.spec.out_shape, dtype=torch.float32, device=_CPU)
        lse = torch.empty(kv.spec.lse_shape, dtype=torch.float32, device=_CPU)
        lengths = np.ascontiguousarray(kv.lengths.numpy(), dtype=np.int64)     # after the append: none to make
        pages: tuple[Any, ...] = ()
        if kv.paged:                                     # (its used entries checked: in range)
            table = np.ascontiguousarray(host_ints("block_table", kv.block_table), dtype=np.int64)
            pages = (table.ctypes.data, 8, (table.shape[1], 1))
        done = call(q.data_ptr(), q.stride(), k.data_ptr(), k.stride(), v.data_ptr(), v.stride(),
                    lengths.ctypes.data, out.data_ptr(), out.stride(), lse.data_ptr(), at, 8, 1, 0, 0, _NO_ROWS,
                    0, _NO_ROWS, *pages)
        return (out, lse) if done else None

    def kvcache_call(self, kv: Any) -> Any:
        """The compute rung's kept call on a cache's memory for calls of kv's signature
        (``mod.kvcache_at``, made once in ``kv.memo``), or None."""
        make = getattr(self.mod, "kvcache_at", None)
        if make is None or kv.memo is None:
            return None
        key = ("kvcache_at", self.mod.name)
        call = kv.memo.get(key, _MISSING)
        if call is _MISSING:
            pages = (int(kv.k_cache.shape[0]), kv.page_size, int(kv.block_table.shape[1])) if kv.paged else None
            call = kv.memo[key] = make(kv.spec, pages)
        return call

    def kvcache_step(self, kv: Any) -> Callable[..., Any] | None:
        """attention_kvcache's kept step for calls of kv's signature (:func:`.kvcache_op.step`)."""
        from .kvcache_op import step
        return step(self, kv)

    def rung_weights(self, spec: Spec, lse: Any = None, rows: Any = None) -> Any:
        return self._weights(to_op_args(spec, self.mod.name), None if lse is None else lse.detach(), rows)

    @staticmethod
    def _weights(args: tuple[Any, ...], lse: Any, rows: Any) -> Any:
        if rows is not None:
            rows = torch.as_tensor(rows, dtype=torch.int64)
        detached = tuple(x.detach() if isinstance(x, torch.Tensor) else x for x in args)
        return torch.ops.attnkit.attention_weights(lse, rows, *detached)


_BOUND: dict[str, TorchRung] = {}
_MISSING = object()
_NO_ROWS = (0, 0, 0, 0)          # the strides of new keys not given


def bound(mod: Any) -> TorchRung:
    """The torch op bound to compute rung module ``mod`` (one object per rung)."""
    r = _BOUND.get(mod.name)
    if r is None:
        r = _BOUND[mod.name] = TorchRung(mod)
    return r


def unavailable() -> None:
    """None: CPU tensors always have the NumPy rungs (CUDA ones need Triton)."""
    return None

"""The "torch" rung: one autograd op for torch tensors, every mask kind, CPU and CUDA.

``torch.ops.attnkit.attention_fwd`` is a ``torch.library`` custom op with an autograd
formula and a fake (meta) implementation, so ``torch.compile(fullgraph=True)`` traces
it as one node. Its inputs are the tensors (q, k, v and the optional keep, drop and
bias) plus scalars (scale, causal, the two window sides, align, softcap and kernel);
it returns ``(out, lse)`` and saves only q, k, v, the masks, out and lse for backward
— never an L × S matrix. Backward is a second custom op,
``torch.ops.attnkit.attention_bwd``, which recomputes the weights from lse.

Where it runs:

- CPU tensors go down the NumPy ladder (``backends.select(numpy_spec, "auto")``: the
  flash rung when it is built, else the reference) on zero-copy views
  (``t.detach().numpy()`` shares memory). bfloat16 has no NumPy dtype: bfloat16
  tensors are upcast to float32 (a copy) and the results cast back.
- CUDA tensors (and any tensor with ``kernel="triton"``) go to
  ``attnkit.torch.triton_kernels``; when that cannot run a call, ``attnkit.attention``
  raises the ValueError of ``backends.select`` listing every rung's reasons.

Gradients: q, k, v, and ``bias`` (reduced to bias's own broadcast shape) when bias
requires grad. lse is differentiable too (d lse / d scores = weights), so
``attnkit.merge`` of torch blocks is differentiable end to end. ``weights`` returned by
``return_weights=True`` or ``attention_weights`` are recomputed from lse by
``rung_weights`` and carry **no** gradient (they are detached); train through out.

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

import numpy as np
import torch

from .. import backends
from ..spec import validate


# ---- where a call runs ------------------------------------------------------------
def triton_module():
    """``(attnkit.torch.triton_kernels, None)``, or ``(None, reason)`` when it cannot be
    imported (no triton)."""
    try:
        from . import triton_kernels
    except ImportError as e:
        return None, f"attnkit.torch.triton_kernels not available: {e}"
    return triton_kernels, None


def triton_reasons(spec) -> list[str]:
    """Why the Triton kernels cannot run spec (empty list = they can)."""
    mod, why = triton_module()
    return [why] if mod is None else list(mod.not_supported_reasons(spec))


def _uses_triton(q, kernel: str) -> bool:
    return kernel == "triton" or q.device.type == "cuda"


def reasons_for(spec, kernel: str) -> list[str]:
    """not_supported_reasons of the op run with ``kernel`` ("auto" or "triton")."""
    if not spec.torch:
        return ["takes torch tensors (NumPy arrays use the flash or reference rung)"]
    if _uses_triton(spec.q, kernel):
        return triton_reasons(spec)
    if spec.q.device.type != "cpu":
        return [f"device {spec.q.device} is not supported (CPU runs the NumPy ladder, CUDA the Triton kernels)"]
    return []


# ---- NumPy bridge (CPU) ---------------------------------------------------------------
def _np(t):
    """A NumPy view of a CPU tensor sharing its memory; bfloat16 (no NumPy dtype) is
    upcast to float32, which copies."""
    if t is None:
        return None
    t = t.detach()
    if t.dtype == torch.bfloat16:
        t = t.float()
    return t.resolve_conj().resolve_neg().numpy()


def _torch(a, dtype):
    """A NumPy result as a contiguous tensor of ``dtype`` (no copy when it already is)."""
    return torch.from_numpy(np.ascontiguousarray(a)).to(dtype)


def _window(left, right):
    return None if left is None and right is None else (left, right)


def _numpy_spec(q, k, v, keep, drop, bias, scale, causal, wl, wr, align, softcap):
    return validate(_np(q), _np(k), _np(v), scale=scale, causal=causal, window=_window(wl, wr),
                    align=align, keep=_np(keep), drop=_np(drop), bias=_np(bias), softcap=softcap)


def _torch_spec(q, k, v, keep, drop, bias, scale, causal, wl, wr, align, softcap):
    return validate(q, k, v, scale=scale, causal=causal, window=_window(wl, wr), align=align,
                    keep=keep, drop=drop, bias=bias, softcap=softcap)


def _lse_dtype(q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _batch(*xs):
    return tuple(torch.broadcast_shapes(*(x.shape[:-3] for x in xs)))


# ---- the custom ops -------------------------------------------------------------------
@torch.library.custom_op("attnkit::attention_fwd", mutates_args=())
def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  keep: torch.Tensor | None, drop: torch.Tensor | None, bias: torch.Tensor | None,
                  scale: float, causal: bool, window_left: int | None, window_right: int | None,
                  align: str, softcap: float | None, kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) for q (..., H, L, D), k (..., Hkv, S, D), v (..., Hkv, S, Dv)."""
    args = (q, k, v, keep, drop, bias, scale, causal, window_left, window_right, align, softcap)
    if _uses_triton(q, kernel):
        out, lse = triton_module()[0].forward(_torch_spec(*args))
        return out.contiguous(), lse.contiguous()
    spec = _numpy_spec(*args)
    out, lse, _ = backends.select(spec, "auto").rung_forward(spec, False)
    return _torch(out, q.dtype), _torch(lse, _lse_dtype(q))


@attention_fwd.register_fake
def _(q, k, v, keep, drop, bias, scale, causal, window_left, window_right, align, softcap, kernel):
    batch = _batch(q, k, v)
    H, L = q.shape[-3], q.shape[-2]
    out = q.new_empty(batch + (H, L, v.shape[-1]))
    return out, q.new_empty(batch + (H, L), dtype=_lse_dtype(q))


@torch.library.custom_op("attnkit::attention_bwd", mutates_args=())
def attention_bwd(dout: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                  keep: torch.Tensor | None, drop: torch.Tensor | None, bias: torch.Tensor | None,
                  scale: float, causal: bool, window_left: int | None, window_right: int | None,
                  align: str, softcap: float | None, kernel: str, need_dbias: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dbias) from the given out and lse; dbias is empty without bias or
    when ``need_dbias`` is False (the Triton kernels then skip it). A gradient ``dlse``
    for lse goes to the rung, which folds it into the softmax Jacobian term
    (d lse / d scores = weights)."""
    args = (q, k, v, keep, drop, bias, scale, causal, window_left, window_right, align, softcap)
    if _uses_triton(q, kernel):
        dq, dk, dv, dbias = triton_module()[0].backward(_torch_spec(*args), dout, out, lse, dlse,
                                                          need_dbias=need_dbias)
    else:
        spec = _numpy_spec(*args)
        grads = backends.select(spec, "auto").rung_backward(spec, _np(dout), _np(out), _np(lse),
                                                            None if dlse is None else _np(dlse))
        dq, dk, dv, dbias = (None if g is None else _torch(g, x.dtype)
                             for g, x in zip(grads, (q, k, v, bias)))
    dbias = q.new_empty(0) if dbias is None or not need_dbias else dbias
    return dq.contiguous(), dk.contiguous(), dv.contiguous(), dbias.contiguous()


@attention_bwd.register_fake
def _(dout, dlse, q, k, v, out, lse, keep, drop, bias, scale, causal, window_left, window_right,
      align, softcap, kernel, need_dbias):
    def like(x):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    return like(q), like(k), like(v), q.new_empty(0) if bias is None or not need_dbias else like(bias)


_SCALARS = ("scale", "causal", "window_left", "window_right", "align", "softcap", "kernel")


def _setup_context(ctx, inputs, output):
    q, k, v, keep, drop, bias = inputs[:6]
    ctx.scalars = inputs[6:]
    ctx.has_bias = bias is not None
    ctx.save_for_backward(q, k, v, keep, drop, bias, *output)


def _backward(ctx, dout, dlse):
    q, k, v, keep, drop, bias, out, lse = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    need_dbias = ctx.has_bias and ctx.needs_input_grad[5]
    dq, dk, dv, dbias = torch.ops.attnkit.attention_bwd(dout, dlse, q, k, v, out, lse, keep, drop, bias,
                                                        *ctx.scalars, need_dbias)
    return (dq, dk, dv, None, None, dbias if need_dbias else None) + (None,) * len(_SCALARS)


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("attnkit::attention_weights", mutates_args=())
def attention_weights_op(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor | None, rows: torch.Tensor | None,
                         keep: torch.Tensor | None, drop: torch.Tensor | None, bias: torch.Tensor | None,
                         scale: float, causal: bool, window_left: int | None, window_right: int | None,
                         align: str, softcap: float | None) -> torch.Tensor:
    """Weights (..., H, len(rows), S) in q's dtype, from lse when given. Runs on the
    NumPy ladder (the Triton kernels have no weights kernel): CUDA tensors make a
    round trip through the CPU, O(rows · S) memory."""
    args = (q, k, None, keep, drop, bias, scale, causal, window_left, window_right, align, softcap)
    cpu = [None if x is None else x.detach().cpu() for x in args[:6]]
    spec = _numpy_spec(*cpu, *args[6:])
    lse_np = None if lse is None else _np(lse.cpu())
    rows_np = None if rows is None else rows.cpu().numpy()
    w = backends.select(spec, "auto").rung_weights(spec, lse_np, rows_np)
    return _torch(w, q.dtype).to(q.device)


@attention_weights_op.register_fake
def _(q, k, lse, rows, keep, drop, bias, scale, causal, window_left, window_right, align, softcap):
    n = q.shape[-2] if rows is None else rows.shape[0]
    return q.new_empty(_batch(q, k) + (q.shape[-3], n, k.shape[-2]))


# ---- the rung interface (backends.py), shared with triton_rung.py -------------------
def _inputs(spec):
    wl, wr = spec.window if spec.window is not None else (None, None)
    return (spec.keep, spec.drop, spec.bias, spec.scale, spec.causal, wl, wr, spec.align, spec.softcap)


def forward(spec, need_weights: bool = False, kernel: str = "auto"):
    """(out, lse, weights | None) through the autograd op; weights carry no gradient."""
    out, lse = torch.ops.attnkit.attention_fwd(spec.q, spec.k, spec.v, *_inputs(spec), kernel)
    return out, lse, (weights(spec, lse, None) if need_weights else None)


def backward(spec, dout, out, lse, kernel: str = "auto"):
    """(dq, dk, dv, dbias | None) in the shapes the user passed."""
    with torch.no_grad():
        dq, dk, dv, dbias = torch.ops.attnkit.attention_bwd(dout, None, spec.q, spec.k, spec.v, out, lse,
                                                            *_inputs(spec), kernel, spec.bias is not None)
    return (dq.reshape(spec.shapes["q"]), dk.reshape(spec.shapes["k"]), dv.reshape(spec.shapes["v"]),
            dbias if spec.bias is not None else None)


def weights(spec, lse=None, rows=None):
    """Exact weights for query rows ``rows`` (all if None), detached from autograd."""
    if rows is not None:
        rows = torch.as_tensor(np.asarray(rows) if not isinstance(rows, torch.Tensor) else rows,
                               dtype=torch.int64)
    keep, drop, bias, *scalars = _inputs(spec)
    lse = None if lse is None else lse.detach()
    return torch.ops.attnkit.attention_weights(spec.q.detach(), spec.k.detach(), lse, rows, keep, drop,
                                               None if bias is None else bias.detach(), *scalars)


def not_supported_reasons(spec) -> list[str]:
    return reasons_for(spec, "auto")


def rung_forward(spec, need_weights: bool = False):
    return forward(spec, need_weights, "auto")


def rung_backward(spec, dout, out, lse):
    return backward(spec, dout, out, lse, "auto")


def rung_weights(spec, lse=None, rows=None):
    return weights(spec, lse, rows)


def unavailable():
    """None: CPU tensors always have the NumPy ladder (CUDA ones need Triton, see the
    triton rung)."""
    return None

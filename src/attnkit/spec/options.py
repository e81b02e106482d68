"""The masking keywords: the one table every public function, the Spec and the torch
op derive from (DESIGN.md §2–3).

``OPTIONS`` lists each keyword once — its default, what it means, the custom op's
schema type and whether ``attention_kvcache`` takes it. :class:`Masking` is the same
list as a ``TypedDict`` for type checkers (``**masking: Unpack[Masking]``); a test
checks that the two agree. :func:`with_options` gives a public function the explicit
keyword signature (for ``help()`` and ``inspect.signature``) and its "Masking
keywords" docstring section from the table.

>>> [o.name for o in OPTIONS][:4]
['scale', 'causal', 'window', 'align']
>>> defaults()["causal"], defaults()["align"]
(False, 'bottom_right')
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypedDict, TypeVar


@dataclass(frozen=True)
class Option:
    """One masking keyword. ``schema``: its type in the torch op's schema ("Tensor?"
    for arrays; window is two ints), ``kvcache``: whether attention_kvcache takes it."""

    name: str
    default: Any
    schema: str
    doc: str
    kvcache: bool = True


OPTIONS: tuple[Option, ...] = (
    Option("scale", None, "float?", "score scale; None means 1/√D"),
    Option("causal", False, "bool", "exclude key j when j > diag(i)"),
    Option("window", None, "int? window_left, int? window_right",
           "(left, right): keep key j only if diag(i) − left ≤ j ≤ diag(i) + right; "
           "None on a side is unbounded (FlashAttention's window_size)"),
    Option("align", "bottom_right", "str",
           "where diag(i) lies when L ≠ S: 'bottom_right' (i + S − L, per sequence: the "
           "last query sees the last key) or 'top_left' (i, PyTorch's is_causal)"),
    Option("keep", None, "Tensor?", "boolean, True = this query may attend this key",
           kvcache=False),
    Option("drop", None, "Tensor?", "boolean, True = masked out (nn.MultiheadAttention's polarity)",
           kvcache=False),
    Option("bias", None, "Tensor?", "additive float scores, −inf allowed, broadcastable to "
           "(..., H, L, S)", kvcache=False),
    Option("softcap", None, "float?", "scores become softcap · tanh(scores / softcap)"),
    Option("alibi_slopes", None, "Tensor?",
           "float, broadcastable to (..., H): adds −slope · |diag(i) − j| (computed per tile)"),
    Option("sinks", None, "Tensor?",
           "float: one extra logit per row with a zero value, (H,) per head or broadcastable "
           "to (..., H, L); joins the softmax denominator only"),
    Option("q_lengths", None, "Tensor?",
           "ints broadcastable to the batch dims: rows i ≥ q_lengths[b] are padding "
           "(out 0, lse −inf)"),
    Option("kv_lengths", None, "Tensor?",
           "ints broadcastable to the batch dims: keys j ≥ kv_lengths[b] are excluded",
           kvcache=False),
    Option("kv_starts", None, "Tensor?",
           "ints broadcastable to the batch dims: sequence b's first key is kv_starts[b] "
           "(left padding; FlashAttention's cache_leftpad): keys j < kv_starts[b] are "
           "excluded, and top_left alignment puts the first query on that key"),
    Option("cu_seqlens_q", None, "Tensor?",
           "packed sequences: B + 1 non-decreasing query offsets from 0 (FlashAttention's "
           "meaning); q is (H, Tq, D)", kvcache=False),
    Option("cu_seqlens_k", None, "Tensor?",
           "packed sequences: B + 1 key offsets; k, v are (Hkv, Tk, D[v])", kvcache=False),
    Option("dropout", 0.0, "float",
           "probability p of dropping each weight (kept ones are scaled by 1/(1 − p))"),
    Option("seed", None, "Tensor?",
           "dropout seed (an int ≥ 0): the drop decision is a pure function of "
           "(seed, batch, head, i, j); required when dropout > 0 except for torch "
           "tensors, which draw it from torch's generator"),
)

NAMES: tuple[str, ...] = tuple(o.name for o in OPTIONS)
BY_NAME: dict[str, Option] = {o.name: o for o in OPTIONS}

# what peers call attnkit's arguments (FlashAttention, PyTorch's SDPA, FlashInfer): an
# unexpected keyword among them is answered with those of attnkit's the function takes
PEER_NAMES = {"softmax_scale": ("scale",), "sm_scale": ("scale",), "is_causal": ("causal",),
              "window_size": ("window",), "window_left": ("window",), "dropout_p": ("dropout",),
              "attn_mask": ("keep", "bias"), "logits_soft_cap": ("softcap",), "cache_leftpad": ("kv_starts",),
              "cache_seqlens": ("cache_lengths", "kv_lengths"), "return_softmax_lse": ("return_lse",),
              "return_attn_probs": ("return_lse", "return_weights")}


def unexpected(names: set[str] | list[str], taken: tuple[str, ...], params: tuple[str, ...] = ()) -> str:
    """The message for unexpected keyword arguments ``names``: those a peer uses with
    attnkit's names for them among the masking keywords the function takes (``taken``,
    which the message lists) and its other arguments (``params``).

    >>> print(unexpected({"sm_scale"}, ("scale",)))
    sm_scale: unexpected keyword argument(s) (attnkit's name: sm_scale → scale); the masking keywords are scale
    """
    hints = [f"{n} → {' or '.join(ours)}" for n in sorted(names)
             if (ours := [x for x in PEER_NAMES.get(n, ()) if x in taken or x in params])]
    said = f" (attnkit's name: {', '.join(hints)})" if hints else ""
    return (f"{', '.join(sorted(names))}: unexpected keyword argument(s){said}; the masking keywords are "
            f"{', '.join(taken)}")


class Masking(TypedDict, total=False):
    """The masking keywords for type checkers (the same list as :data:`OPTIONS`)."""

    scale: float | None
    causal: bool
    window: tuple[int | None, int | None] | None
    align: Literal["bottom_right", "top_left"]
    keep: Any
    drop: Any
    bias: Any
    softcap: float | None
    alibi_slopes: Any
    sinks: Any
    q_lengths: Any
    kv_lengths: Any
    kv_starts: Any
    cu_seqlens_q: Any
    cu_seqlens_k: Any
    dropout: float
    seed: int | None


def defaults() -> dict[str, Any]:
    """{name: default} for every masking keyword."""
    return {o.name: o.default for o in OPTIONS}


def docs_section(kvcache: bool = False) -> str:
    """The "Masking keywords" docstring section (numpydoc style) from the table."""
    lines = ["Masking keywords", "----------------"]
    for o in OPTIONS:
        if kvcache and not o.kvcache:
            continue
        lines.append(f"{o.name} : default {o.default!r}")
        lines.append(f"    {o.doc}.")
    return "\n".join(lines)


F = TypeVar("F", bound=Callable[..., Any])


def with_options(kvcache: bool = False) -> Callable[[F], F]:
    """Decorate a public function whose signature ends in ``**masking``: its
    ``__signature__`` lists every masking keyword with its default (so ``help()`` and
    ``inspect.signature`` show them) and its docstring gains the keyword section
    (where the docstring says ``{masking}``)."""

    def deco(fn: F) -> F:
        sig = inspect.signature(fn)
        params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        types = Masking.__annotations__
        opts = [inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, default=o.default, annotation=types[o.name])
                for o in OPTIONS if o.kvcache or not kvcache]
        fn.__signature__ = sig.replace(parameters=params + opts)  # type: ignore[attr-defined]
        if fn.__doc__ and "{masking}" in fn.__doc__:
            indent = " " * 4
            section = "\n".join(indent + line if line else line for line in docs_section(kvcache).splitlines())
            fn.__doc__ = fn.__doc__.replace("{masking}", section.lstrip())
        return fn

    return deco

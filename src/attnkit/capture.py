"""A transformers model's attention calls, recorded: each layer's q, k, v and the
attnkit keywords that reproduce the call, to explain on real numbers
(``attnkit.explain(c.q, c.k, c.v, **c.options)``) or to compare with. Available as
``attnkit.hf.capture``."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

_NAMES = itertools.count()


@dataclass
class Call:
    """One attention call of a model: ``name`` (the layer's module, e.g.
    ``"model.layers.0.self_attn"``), ``q (B, H, L, D)``, ``k``, ``v (B, Hkv, S, D)``
    (detached copies, as the layer passed them: after rotary embeddings, with the
    cache's keys), ``options`` (the keywords with which :func:`attnkit.attention` and
    :func:`attnkit.explain` compute this call, as attnkit's transformers integration
    reads it: causality, scale, softcap, masks, sinks; None, with the reason in
    ``why``, for a call attnkit cannot compute), and ``out (B, L, H, Dv)``, what the
    model's own attention function returned (its layout)."""
    name: str
    q: Any
    k: Any
    v: Any
    options: dict[str, Any] | None = field(default_factory=dict)
    out: Any = None
    why: str | None = None


@contextlib.contextmanager
def capture(model: Any) -> Iterator[list[Call]]:
    """Record a transformers model's attention calls while the block runs: a list of
    :class:`Call`, one per layer and forward, in the order the layers ran. The model
    keeps computing with its own attention implementation (``"sdpa"``, ``"attnkit"``
    or any registered one; not ``"eager"``, which is not a registered function) and is
    switched back to it afterwards.

    Examples
    --------
    >>> import torch, transformers, attnkit, attnkit.hf
    >>> cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1,
    ...                                num_attention_heads=2, intermediate_size=32)
    >>> model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    >>> with attnkit.hf.capture(model) as calls, torch.no_grad():
    ...     _ = model(input_ids=torch.tensor([[1, 2, 3]]))
    >>> c = calls[0]
    >>> c.name, tuple(c.q.shape), c.options["causal"]
    ('model.layers.0.self_attn', (1, 2, 3, 8), True)
    >>> trace = attnkit.explain(c.q, c.k, c.v, **c.options)     # the four steps, every head
    """
    from transformers import AttentionInterface, AttentionMaskInterface

    from . import hf
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if not hasattr(model, "set_attn_implementation") or impl is None:
        raise TypeError(f"model: expected a transformers model, got {type(model).__name__}")
    functions, masks = AttentionInterface(), AttentionMaskInterface()
    if impl not in functions or impl not in masks:
        raise ValueError(f"model: its attention implementation {impl!r} is not a registered attention function; "
                         "load it with attn_implementation='sdpa' or 'attnkit' to capture its calls")
    attend, mask = functions[impl], masks[impl]
    names = {id(m): n for n, m in model.named_modules()}
    calls: list[Call] = []

    def recording(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, scaling: Any = None,
                  dropout: float = 0.0, **kwargs: Any) -> Any:
        out = attend(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        is_causal = kwargs.get("is_causal")
        causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
        try:
            k, v, opts, why = *hf._options(query, key, value, attention_mask, scaling, dropout, causal, kwargs), None
        except ValueError as e:                          # a keyword attnkit cannot honour: recorded
            k, v, opts, why = key, value, None, str(e)

        def copy(x: Any) -> Any:
            return x.detach().clone() if hasattr(x, "detach") else x
        calls.append(Call(names.get(id(module), type(module).__name__), copy(query), copy(k), copy(v),
                          None if opts is None else {n: copy(x) for n, x in opts.items() if x is not None},
                          copy(out[0]), why))
        return out

    name = f"attnkit_capture_{next(_NAMES)}"
    AttentionInterface.register(name, recording)
    AttentionMaskInterface.register(name, mask)
    model.set_attn_implementation(name)
    try:
        yield calls
    finally:
        model.set_attn_implementation(impl)
        for registry in (AttentionInterface, AttentionMaskInterface):
            registry._global_mapping.pop(name, None)

"""A transformers model's attention calls, recorded: each layer's q, k, v and the
attnkit keywords that reproduce the call, to explain on real numbers
(``attnkit.explain(c.q, c.k, c.v, **c.options)``) or to compare with. Available as
``attnkit.hf.capture``."""

from __future__ import annotations

import contextlib
from collections.abc import Container, Iterator
from dataclasses import dataclass, field
from typing import Any


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
def capture(model: Any, names: Container[str] | None = None, max_calls: int | None = None) -> Iterator[list[Call]]:
    """Record a transformers model's attention calls while the block runs: a list of
    :class:`Call`, one per layer and forward, in the order the layers ran. The model
    computes exactly as before: for the block, each attention function its
    (sub-)models name (``"sdpa"``, ``"attnkit"``, any registered one) is wrapped in
    place, under its own name, recording the calls of this model's layers only. Calls
    of layers on ``"eager"`` (a function their module holds, not a registered one) are
    not seen; a model with no registered function is refused.

    Each record copies the layer's q, k, v (the cache's keys: a long generate holds
    every step's): ``names`` (module names, e.g. ``{"model.layers.0.self_attn"}``)
    records those layers only, ``max_calls`` the first calls only.

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
    from transformers import AttentionInterface, PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"model: expected a transformers model, got {type(model).__name__}")
    functions = AttentionInterface()
    impls = {m.config._attn_implementation for m in model.modules() if isinstance(m, PreTrainedModel)}
    wrapped = sorted(i for i in impls if isinstance(i, str) and i in functions)
    if not wrapped:
        raise ValueError(f"model: its attention implementation {sorted(map(str, impls))} is not a registered "
                         "attention function; load it with attn_implementation='sdpa' or 'attnkit' to capture "
                         "its calls")
    layers = {id(m): n for n, m in model.named_modules() if names is None or n in names}
    calls: list[Call] = []

    def recorder(attend: Any) -> Any:
        def recording(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, scaling: Any = None,
                      dropout: float = 0.0, **kwargs: Any) -> Any:
            out = attend(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
            if id(module) in layers and (max_calls is None or len(calls) < max_calls):
                calls.append(_record(layers[id(module)], module, query, key, value, attention_mask, scaling,
                                     dropout, kwargs, out[0]))
            return out
        return recording

    originals = {i: functions[i] for i in wrapped}
    try:
        for i, attend in originals.items():                   # (the same names: transformers branches on them)
            AttentionInterface.register(i, recorder(attend))
        yield calls
    finally:
        for i, attend in originals.items():
            AttentionInterface.register(i, attend)


def _record(name: str, module: Any, query: Any, key: Any, value: Any, attention_mask: Any, scaling: Any,
            dropout: float, kwargs: dict[str, Any], out: Any) -> Call:
    """A :class:`Call` of the arguments an attention function got and its output."""
    from . import hf  # (hf imports this module)
    try:
        k, v, opts = hf._options(query, key, value, attention_mask, scaling, dropout, hf.layer_causal(module, kwargs),
                                 kwargs, hf.indexer_block_size(module))
        why = None
    except ValueError as e:                                  # a keyword attnkit cannot honour: recorded
        k, v, opts, why = key, value, None, str(e)

    def copy(x: Any) -> Any:
        return x.detach().clone() if hasattr(x, "detach") else x
    return Call(name, copy(query), copy(k), copy(v),
                None if opts is None else {n: copy(x) for n, x in opts.items() if x is not None}, copy(out), why)

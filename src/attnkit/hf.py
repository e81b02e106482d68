"""Hugging Face ``transformers`` on attnkit: ``attn_implementation="attnkit"``.

:func:`register` adds attnkit to transformers' ``AttentionInterface`` (the attention
function) and ``AttentionMaskInterface`` (the mask builder: transformers' boolean SDPA
mask, True = attend, passed to attnkit as ``keep=``; without a registered mask builder
transformers would build no padding mask at all for a new name). Then any model whose
attention goes through the interface (BERT, Llama, Mistral, Qwen, Gemma, ...) runs on
attnkit::

    import attnkit.hf, transformers
    attnkit.hf.register()
    model = transformers.AutoModel.from_config(config, attn_implementation="attnkit")

``transformers`` is an optional dependency (``pip install attnkit[hf]``); importing
this module does not import it.

How the model's arguments map (the same decisions as transformers' SDPA path):

- ``attention_mask``: boolean → ``keep``; float (additive, e.g. a user's 4-D mask) →
  ``bias``; None → causal when the layer is causal (``is_causal`` keyword, else
  ``module.is_causal``) and more than one query, with top-left alignment, which is what
  transformers leaves to ``is_causal`` (it only skips the mask when L == S, L == 1,
  or for an empty-cache prefill).
- GQA: key and value keep their Hkv heads (no ``repeat_kv`` copy).
- ``softcap`` (Gemma 2) and ``position_bias`` (added to the scores) are supported.
- ``dropout`` must be 0 (``model.eval()``, or attention dropout 0 in the config):
  attnkit computes exact attention.
- With ``output_attentions=True`` the exact weights are returned, detached (no
  gradient); otherwise None, like SDPA.
- Fully masked query rows (e.g. left padding under a causal mask) give 0 where
  eager gives an average of V; real tokens are unaffected.

>>> import attnkit.hf
>>> attnkit.hf.register()
>>> from transformers import AttentionInterface
>>> "attnkit" in AttentionInterface._global_mapping
True
"""

from __future__ import annotations

from . import api

NAME = "attnkit"


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function signature: query (B, H, L, D), key
    (B, Hkv, S, D), value (B, Hkv, S, Dv) → (out (B, L, H, Dv), weights or None)."""
    if dropout:
        raise ValueError(f"dropout: attnkit computes exact attention without weight dropout, got {dropout}; "
                         "use model.eval() or set the attention dropout to 0")
    if kwargs.get("s_aux") is not None:
        raise ValueError("s_aux (attention sinks) is not supported by attnkit")
    masks = {"keep": None, "bias": kwargs.get("position_bias")}
    causal = False
    if attention_mask is None:
        is_causal = kwargs.get("is_causal")
        is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        causal = bool(is_causal) and query.shape[-2] > 1
    elif attention_mask.dtype.is_floating_point:
        masks["bias"] = attention_mask if masks["bias"] is None else masks["bias"] + attention_mask
    else:
        masks["keep"] = attention_mask
    want = bool(kwargs.get("output_attentions"))
    res = api.attention(query, key, value, scale=scaling, causal=causal, align="top_left",
                        softcap=kwargs.get("softcap"), return_weights=want, **masks)
    out, weights = res if want else (res, None)
    return out.transpose(1, 2).contiguous(), weights


def register(name: str = NAME) -> None:
    """Make ``attn_implementation=name`` ("attnkit") work in transformers. Idempotent."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)

"""Hugging Face ``transformers`` on attnkit: ``attn_implementation="attnkit"``.

:func:`register` adds attnkit to transformers' ``AttentionInterface`` (the attention
function) and ``AttentionMaskInterface`` (the mask builder). Then any model whose
attention goes through the interface (Llama, Qwen, Mistral, Gemma, gpt-oss, BERT,
T5, BART, ViT, Whisper, GPT-2, ...) runs on attnkit::

    import attnkit.hf, transformers
    attnkit.hf.register()
    model = transformers.AutoModel.from_config(config, attn_implementation="attnkit")

``transformers`` and ``torch`` are optional dependencies (``pip install
'attnkit[hf]'``); importing this module imports neither.

How the model's arguments map:

- Masks. For a plain causal or bidirectional layer the mask builder hands over only
  the 2-D padding mask (like FlashAttention's), never an L × S mask: no padding →
  no mask (causal aligned bottom-right: the last query sees the last key, which is
  right for prefill, chunked prefill and decoding with a cache); right padding with
  L == S → ``kv_lengths`` (tiles past each sequence's end are skipped); other
  padding → a (B, 1, 1, S) key-padding ``keep``. A static cache's empty slots are
  cut off (keys, and T5's position bias, up to the tokens so far; a causal layer's
  mask over more slots is cut to them, one over fewer padded). Every other mask
  (sliding windows, image-token or prefix patterns) is transformers' own boolean SDPA
  mask (True = attend) passed as ``keep`` — but one query row's (a decoding step's),
  which says only which keys it sees, is read as the 2-D padding mask (or none:
  :func:`_one_row`) —; a float mask is ``bias``. The window of a
  layer is the one in its mask (a ``sliding_window`` keyword alone, as OLMoE passes
  it with a plain causal mask, changes nothing — as for sdpa and eager).
- Models (and towers of composite models) that support neither transformers'
  attention backends nor SDPA (XGLM, Bloom and MPT compute attention themselves;
  NLLB-MoE's decoder layers do not keep ``is_causal``) get transformers' eager mask,
  hence eager's results.
- Packed sequences (padding-free training): ``cu_seq_lens_q/k`` keywords (with the
  layer's ``sliding_window``, as FlashAttention reads them: w − 1 keys back, and w − 1
  ahead in a layer that is not causal), or ``position_ids`` that
  restart within one row where transformers built the matching packed mask (no
  cache: it packs only then) run as packed sequences (``cu_seqlens_q/k``).
- GQA: key and value keep their Hkv heads (no ``repeat_kv`` copy).
- ``indices`` (a sparse-attention indexer's top-k keys per query: DeepSeek-V3.2,
  GLM-MoE-DSA) are folded into the layer's mask, as those models fold them for sdpa;
  ``block_indices`` (MiniMax-M3: top-k key blocks of the layer's ``indexer.block_size``
  per query and index head) join the mask's terms as a keep.
- ``softcap`` (Gemma 2), ``position_bias`` (T5: added to the scores), ``s_aux``
  (gpt-oss: one sink logit per head) and ``sinks`` (per-token sink logits,
  (B, H, L, 1)) are supported; ``dropout`` (training) uses attnkit's dropout with a
  seed from torch's generator (``torch.manual_seed`` makes a step reproducible).
- Attention weights: returned (exact, detached) when transformers records them
  (``output_attentions=True``); otherwise None, like SDPA. On a static cache they span
  the whole cache (0 on its empty slots), as eager's. A model whose layers neither
  pass ``output_attentions`` down nor record through transformers' output collector
  (Falcon) gets None, as from SDPA: nothing tells the attention function to make them.
- Any other keyword that can change the result raises ``ValueError`` naming it; the
  harmless ones are listed in :data:`HARMLESS`.
- Fully masked query rows (e.g. left padding under a causal mask) give 0 where
  eager gives an average of V; real tokens are unaffected.

>>> import attnkit.hf
>>> attnkit.hf.register()
>>> from transformers import AttentionInterface
>>> "attnkit" in AttentionInterface._global_mapping
True
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

from . import api
from .hfmasks import _chosen_blocks, _is_block_causal, _packed_offsets, _with_selected_keys
from .spec.validate import tensor_key

NAME = "attnkit"
# keywords transformers passes that cannot change the attention result
HARMLESS = frozenset({
    "output_attentions", "output_hidden_states", "output_router_logits", "use_cache", "cache_position",
    "past_key_values", "past_key_value", "layer_idx", "num_items_in_batch", "return_dict", "deterministic",
    "max_length_q", "max_length_k", "position_embeddings", "token_type_ids", "seq_idx",
})
HANDLED = frozenset({"is_causal", "softcap", "s_aux", "sinks", "position_bias", "sliding_window",
                     "cu_seq_lens_q", "cu_seq_lens_k", "position_ids", "head_mask", "layer_head_mask", "indices",
                     "block_indices"})
_KNOWN = HARMLESS | HANDLED
# keywords that, without a mask, leave the call as causality and scale make it (a
# sliding_window alone changes nothing: see the module's doc; position_ids only with a
# packed mask); with s_aux, the calls a layer keeps (gpt-oss's sinks: read every call)
_COMMON = HARMLESS | {"is_causal", "position_ids", "sliding_window"}
_KEPT_KEYWORDS = _COMMON | {"s_aux"}


def _torch_required() -> Any:
    try:
        import torch
    except ImportError:
        raise ImportError("attnkit.hf needs torch and transformers: pip install 'attnkit[hf]'") from None
    return torch


_COLLECTOR: list[Any] = []                   # transformers' output collector (a ContextVar), once found


def _recording_attentions() -> bool:
    """True when transformers is collecting attention weights (output_attentions=True:
    any collected key ending in "attentions"), also for models that do not pass that
    keyword down."""
    if not _COLLECTOR:
        try:
            from transformers.utils.output_capturing import _active_collector as found
        except ImportError:                  # other transformers versions: the keyword only
            found = None                     # type: ignore[assignment]
        _COLLECTOR.append(found)
    if _COLLECTOR[0] is None:
        return False
    collected = _COLLECTOR[0].get()
    return bool(collected) and any(k.endswith("attentions") for k in collected)   # cross_, mask_decoder_, ...


def _compiling() -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and torch.compiler.is_compiling()


# the last 2-D mask read by _padded: (weak reference, version, L == S, keywords, token)
_LAST_PADDING: list[Any] = [None]


def _padding(mask: Any, square: bool) -> dict[str, Any]:
    """What a 2-D padding mask (1 = token) says, as keywords: nothing (no padding: every
    decoding step of an unpadded batch), ``kv_lengths`` (right padding, L == S: ones,
    then zeros), ``kv_starts`` (left padding: zeros, then ones — batched generation's
    prompts; each sequence's first key; in CPU memory: on a GPU validation would copy
    the starts to the host in every layer, a sync the ``keep`` mask does not need —
    untimed, docs/decisions.md) or a (B, 1, 1, S) key-padding ``keep``. Read once per
    mask: every layer of a forward gets the same tensor (an in-place change bumps its
    version; tensors made under ``torch.inference_mode`` have no version counter and
    are read every time)."""
    return dict(_padded(mask, square)[0])


def _padded(mask: Any, square: bool) -> tuple[dict[str, Any], tuple[Any, ...] | None]:
    """(:func:`_padding`'s keywords, what they add to a layer's key: the key length and
    the lengths' bytes (no bytes where there is no padding), or the first keys' bytes
    alone — left padding: a decoding step's call, one key longer every step, is the
    same call; None for a ``keep`` mask or one not in CPU memory), read once per mask
    as :func:`_padding` says."""
    version = None if mask.is_inference() else mask._version
    last = _LAST_PADDING[0]
    if version is not None and last is not None and last[0]() is mask and last[1] == version and last[2] == square:
        return last[3], last[4]
    res: dict[str, Any] = {}
    if not bool(mask.all()):
        pad = mask.bool()
        steps = pad.int().diff(dim=-1)
        if square and bool((steps <= 0).all()):
            res = dict(kv_lengths=pad.sum(-1), align="top_left")
        elif mask.device.type == "cpu" and bool((steps >= 0).all()):   # (a GPU: keep, no host
            res = dict(kv_starts=(~pad).sum(-1))                         # read per layer)
        else:
            res = dict(keep=pad[:, None, None, :])
    token: tuple[Any, ...] | None = None
    if mask.device.type == "cpu" and "keep" not in res:
        token = ("starts", res["kv_starts"].numpy().tobytes()) if "kv_starts" in res else \
            ("padding", mask.shape[-1], res["kv_lengths"].numpy().tobytes() if res else b"")
    if version is not None:
        _LAST_PADDING[0] = (weakref.ref(mask), version, square, res, token)
    return res, token


# the last one-row mask read by _one_row: (weak reference, version, what it says)
_LAST_ROW: list[Any] = [None]


def _one_row(mask: Any) -> Any:
    """A decoding step's boolean mask (B, 1, 1, S) — transformers builds a sliding
    layer's even when its window holds every key of the sliding cache — as what it
    says: the keys its one row sees, a 2-D padding mask, or None for all (the call is
    then kept as an unmasked one). Read once per mask and version (a step's sliding
    layers share it); a float mask is returned as it is. Here, not in the mask builder:
    some models read the 4-D mask (DeepSeek-V3.2's indexer, Doge, Falcon's ALiBi)."""
    if mask.dtype is not _torch_required().bool:
        return mask
    version = None if mask.is_inference() else mask._version
    last = _LAST_ROW[0]
    if version is not None and last is not None and last[0]() is mask and last[1] == version:
        return last[2]
    keys = mask[:, 0, 0, :]
    res = None if bool(keys.all()) else keys
    if version is not None:
        _LAST_ROW[0] = (weakref.ref(mask), version, res)
    return res


_TRUSTED: dict[type, bool] = {}


def _trusts_layers(config: Any) -> bool:
    """Whether a model's attention layers may get :func:`attention_mask`'s short forms
    (None or the 2-D padding mask): models that support transformers' attention
    backends or SDPA, whose layers call the attention function with a true
    ``is_causal`` (SDPA itself relies on it). Others (hand-written attention such as
    XGLM, Bloom and MPT, or layers whose ``is_causal`` is not kept, such as NLLB-MoE's
    decoder) get the eager mask. The model classes are those of the config's family
    module whose ``config_class`` is the config's class (text and vision towers
    included); a config from outside transformers (remote code) is trusted."""
    kind = type(config)
    trusted = _TRUSTED.get(kind)
    if trusted is None:
        trusted = _TRUSTED[kind] = all(bool(getattr(c, "_supports_attention_backend", False)
                                            or getattr(c, "_supports_sdpa", False)) for c in _model_classes(kind))
    return trusted


def _model_classes(config_class: type) -> list[Any]:
    """transformers' model classes for a config class: those of its family's modeling
    module (``configuration_x`` → ``modeling_x``, already imported: a model of it
    exists; looked up in ``sys.modules``, which torch.compile can trace) whose
    ``config_class`` is it, else all of that module's (BLIP's text config, whose
    classes live in another module, takes its family's); none for configs outside
    ``transformers.models`` or without such a module (their model classes are another
    family's, e.g. Exaone's are Llama's)."""
    from transformers import PreTrainedModel
    name = config_class.__module__
    if not name.startswith("transformers.models.") or ".configuration_" not in name:
        return []
    module = sys.modules.get(name.replace(".configuration_", ".modeling_"))
    if module is None:
        return []
    models = [c for c in vars(module).values() if isinstance(c, type) and issubclass(c, PreTrainedModel)
              and c.__module__ == module.__name__]
    return [c for c in models if getattr(c, "config_class", None) is config_class] or models


# configs read by _layers_not_causal: id → (weak references to the config and its text
# config (None: itself), the attributes get_text_config reads, the flag, the answer)
_NOT_CAUSAL: dict[int, tuple[Any, Any, tuple[Any, ...], Any, bool]] = {}
_TEXT_NAMES = ("text_encoder", "decoder", "generator", "text_config")   # where get_text_config looks
_FLAG = "use_bidirectional_attention"
_MISSING = object()


def _own(obj: Any) -> dict[str, Any]:
    """obj's own attribute dict, read past transformers' config ``__getattribute__``
    ({} for an object without one)."""
    try:
        return object.__getattribute__(obj, "__dict__")
    except AttributeError:
        return {}


def _layers_not_causal(config: Any) -> bool:
    """Whether a config makes its attention layers non-causal (``is_causal`` False:
    Gemma's, Gemma 2's and pi0.5's ``use_bidirectional_attention`` True, or "all")
    while a model of it may still build a causal mask (PaliGemma without
    ``token_type_ids``): eager then attends causally, and the short masks, which leave
    causality to the layer, would not. Kept per config object while what it rests on
    is the same objects — the attributes ``get_text_config`` reads, and the text
    config's flag —, read from the objects' own dicts (through transformers'
    ``__getattribute__`` the answer cost ~17 µs a forward)."""
    if config is None:
        return False
    compiling = _compiling()
    hit = None if compiling else _NOT_CAUSAL.get(id(config))
    if hit is not None and hit[0]() is config:
        _, text_ref, subs, flag, res = hit
        text = config if text_ref is None else text_ref()
        own = _own(config)
        if text is not None and _own(text).get(_FLAG, _MISSING) is flag \
                and all(own.get(n, _MISSING) is s for n, s in zip(_TEXT_NAMES, subs)):
            return res
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    flag = getattr(text, _FLAG, None)
    res = flag is True or flag == "all"
    if not compiling:
        try:
            refs = weakref.ref(config), None if text is config else weakref.ref(text)
        except TypeError:                     # an object without weak references: read each time
            return res
        if len(_NOT_CAUSAL) >= _LAYERS_MAX:
            _NOT_CAUSAL.clear()
        own = _own(config)
        _NOT_CAUSAL[id(config)] = (*refs, tuple(own.get(n, _MISSING) for n in _TEXT_NAMES),
                                   _own(text).get(_FLAG, _MISSING), res)
    return res


def _no_mask(causal: bool, L: int) -> dict[str, Any]:
    """A layer's causality with no L × S mask: causal aligned bottom-right (the last
    query sees the last key: prefill, chunked prefill and decoding with a cache); one
    query row sees every key."""
    return dict(causal=causal and L > 1, align="bottom_right")


def _options(query: Any, key: Any, value: Any, attention_mask: Any, scaling: float | None, dropout: float,
             causal: bool, kwargs: dict[str, Any], block_size: Any = None) -> tuple[Any, Any, dict[str, Any]]:
    """(key, value, attnkit's keywords) for a call with a mask or keywords other than
    :data:`_COMMON` (:func:`attention_forward`'s parameters; ``block_size``: the
    layer's indexer's, for ``block_indices``)."""
    torch = _torch_required()
    unknown = [] if kwargs.keys() <= _KNOWN else sorted(n for n, x in kwargs.items()
                                                         if n not in _KNOWN and x is not None)
    if unknown:
        raise ValueError(f"{', '.join(unknown)}: attnkit's transformers integration does not know "
                         "this keyword and cannot honour it (it may change the result)")
    for name in ("head_mask", "layer_head_mask"):
        if kwargs.get(name) is not None:
            raise ValueError(f"{name}: head masks are not supported by attnkit")
    L, S = query.shape[-2], key.shape[-2]
    if kwargs.get("indices") is not None:
        attention_mask = _with_selected_keys(torch, attention_mask, kwargs["indices"], S)
    opts: dict[str, Any] = dict(scale=scaling, softcap=kwargs.get("softcap"), dropout=float(dropout or 0.0))
    if kwargs.get("position_bias") is not None:
        opts["bias"] = kwargs["position_bias"]
    if kwargs.get("s_aux") is not None:
        opts["sinks"] = kwargs["s_aux"]
    if kwargs.get("sinks") is not None:
        s = kwargs["sinks"]
        opts["sinks"] = s[..., 0] if s.dim() == 4 and s.shape[-1] == 1 else s

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    sliding = kwargs.get("sliding_window")
    # FlashAttention's reading of a layer's window: w − 1 keys back (and, in a layer that
    # is not causal, w − 1 ahead: transformers' bidirectional sliding mask |i − j| < w)
    window = None if sliding is None else (int(sliding) - 1, 0 if causal else int(sliding) - 1)
    mask = attention_mask
    if cu_q is None and L == S and query.shape[0] == 1 and mask is not None and mask.dim() == 4 \
            and mask.dtype == torch.bool and not _compiling():   # packed only where transformers' mask is
        cu = _packed_offsets(torch, kwargs.get("position_ids"))
        for w in ((window, None) if window else (None,)) if cu is not None else ():
            if _is_block_causal(torch, mask, cu, causal, w):
                cu_q, cu_k, window = cu, cu, w
                break
    if cu_q is not None:                                  # FlashAttention's keywords: its window too
        opts.update(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k if cu_k is not None else cu_q,
                    causal=causal, align="bottom_right", window=window)
    elif attention_mask is None:
        opts.update(_no_mask(causal, L))
    elif attention_mask.dim() == 2:                       # the padding mask of a plain layer
        T = attention_mask.shape[-1]
        if T < S:                                         # a static cache: slots past T are empty
            key, value, S = key[..., :T, :], value[..., :T, :], T      # (weights padded back below)
            if opts.get("bias") is not None and opts["bias"].shape[-1] > T:
                opts["bias"] = opts["bias"][..., :T]      # T5's position bias spans the cache too
        opts.update(_no_mask(causal, L))
        # compiled, no check (a graph cannot branch on values): the keys' padding as keep
        if _compiling():
            opts["keep"] = attention_mask.bool()[:, None, None, :]
        else:
            opts.update(_padding(attention_mask, L == S))
    elif attention_mask.dtype.is_floating_point:
        opts["bias"] = attention_mask if opts.get("bias") is None else opts["bias"] + attention_mask
    else:
        opts["keep"] = attention_mask
    if kwargs.get("block_indices") is not None:          # the keys a block-sparse indexer chose
        chosen = _chosen_blocks(torch, kwargs["block_indices"], query.shape[-3], key.shape[-2], block_size)
        opts["keep"] = chosen if opts.get("keep") is None else opts["keep"] & chosen
    return key, value, opts


# A layer's call that repeats (every decoding step) runs the call attention kept for
# its signature (api.kept_call) without attention's own steps: a layer's last
# LAYER_SIGNATURES signatures (a prefill's and its steps') are kept by id(layer) with
# their calls, each as the hook's scalars (a tuple: scale, dropout, causality; for a
# padding mask its key length and lengths too) and a test of the tensors (_same_tensors),
# compared rather than hashed (a layer freed and its id reused finds only calls of the
# signatures it asks for)
_LAYERS: dict[int, tuple[tuple[tuple[Any, ...], Any, Any], ...]] = {}
_LAYERS_MAX = 1024
LAYER_SIGNATURES = 2


def _same_tensors(query: Any, key: Any, value: Any) -> Any:
    """For CPU torch tensors (strided; what kept calls run on): a test that another
    call's query, key and value have these ones' :func:`attnkit.spec.validate.tensor_key`
    — the same types, dtypes and shapes but the key length, in CPU memory, strided —
    without making the key (its shapes and device objects cost a decoding step's
    layer 10–15 µs inside a model, whose ops leave the interpreter's caches cold);
    None for other tensors. Outside torch.compile, as the key (the caller checks)."""
    torch = sys.modules.get("torch")
    xs = (query, key, value)
    if torch is None or tensor_key(*xs) is None or not all(x.is_cpu and x.layout is torch.strided for x in xs):
        return None
    T, strided = torch.Tensor, torch.strided
    (qd, qs), (kd, kb, kD), (vd, vb, vD) = (query.dtype, query.shape), \
        (key.dtype, key.shape[:-2], key.shape[-1]), (value.dtype, value.shape[:-2], value.shape[-1])

    def same(q: Any, k: Any, v: Any) -> bool:
        return (type(q) is T and type(k) is T and type(v) is T and q.dtype is qd and k.dtype is kd
                and v.dtype is vd and q.shape == qs and k.shape[:-2] == kb and k.shape[-1] == kD
                and v.shape[:-2] == vb and v.shape[-1] == vD and q.is_cpu and k.is_cpu and v.is_cpu
                and q.layout is strided and k.layout is strided and v.layout is strided)
    return same


def _keep_layer(module: Any, layer: tuple[Any, ...], query: Any, key: Any, value: Any, kept: Any) -> None:
    """Keep ``kept`` (api.kept_call's, or None: nothing) for the layer's scalars
    ``layer`` and its tensors' signature."""
    same = None if kept is None else _same_tensors(query, key, value)
    others = tuple(e for e in _LAYERS.get(id(module), ()) if not (e[0] == layer and e[1](query, key, value)))
    kept_now = ((layer, same, kept),) if same is not None else ()
    if len(_LAYERS) >= _LAYERS_MAX:
        _LAYERS.clear()
    _LAYERS[id(module)] = (kept_now + others)[:LAYER_SIGNATURES]


def _rerun(module: Any, layer: tuple[Any, ...], query: Any, key: Any, value: Any, sinks: Any) -> Any:
    """out (B, L, H, Dv) of the call the layer kept for scalars ``layer`` and tensors
    of its signature (sinks: s_aux, or None), or None (none kept, or it declines: the
    full path)."""
    for scalars, same, kept in _LAYERS.get(id(module), ()):
        if scalars == layer and same(query, key, value):
            direct = api.run_kept(kept, query, key, value, False, sinks)
            return None if direct is None else direct[0].transpose(1, 2).contiguous()
    return None


def attention_forward(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
                      scaling: float | None = None, dropout: float = 0.0, **kwargs: Any) -> tuple[Any, Any]:
    """attnkit as a transformers attention function (registered by :func:`register`).

    Parameters
    ----------
    module : torch.nn.Module
        The attention layer (its ``is_causal`` is read when no ``is_causal`` is passed).
    query : torch.Tensor (B, H, L, D)
        Queries.
    key, value : torch.Tensor (B, Hkv, S, D[v])
        Keys and values (GQA heads kept, no repeat).
    attention_mask : torch.Tensor or None
        What the registered mask builder made: None, the 2-D padding mask, a boolean
        (True = attend) or a float (added) 4-D mask.
    scaling : float, optional
        The score scale (None: 1/√D).
    dropout : float
        Attention dropout while training (a seed from torch's generator).
    **kwargs
        transformers' other keywords: handled (is_causal, softcap, s_aux, sinks,
        position_bias, sliding_window, cu_seq_lens_q/k, position_ids, indices), harmless
        (:data:`HARMLESS`), or refused (``ValueError`` naming them).

    Returns
    -------
    (out (B, L, H, Dv), weights (B, H, L, S) or None): weights only when transformers
    records attentions.
    """
    L = query.shape[-2]
    if L == 1 and attention_mask is not None and attention_mask.dim() == 4 and kwargs.keys() <= _KEPT_KEYWORDS \
            and attention_mask.shape[:3] == (query.shape[0], 1, 1) and not _compiling():
        attention_mask = _one_row(attention_mask)
    causal = layer_causal(module, kwargs)
    S_all = key.shape[-2]
    want = bool(kwargs.get("output_attentions")) or _recording_attentions()
    layer = None
    # the layer's scalars (types too: a kept call skips attention's checks of them)
    sinks = kwargs.get("s_aux")
    scalars = (type(scaling), scaling, float(dropout or 0.0), causal, sinks is None)
    if attention_mask is None and kwargs.keys() <= _KEPT_KEYWORDS:   # most calls (every decoding step)
        if not want and not _compiling():
            layer = scalars
            out = _rerun(module, layer, query, key, value, sinks)
            if out is not None:
                return out, None
        opts: dict[str, Any] = dict(scale=scaling, dropout=scalars[2], **_no_mask(causal, L))
        if sinks is not None:
            opts["sinks"] = sinks
    else:
        if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.shape[-1] == S_all \
                and not want and kwargs.get("sliding_window") is None and not _compiling() \
                and all(n in _KEPT_KEYWORDS or x is None for n, x in kwargs.items()):
            # a padding mask that _options turns into kv_lengths, kv_starts (or nothing):
            # kept as the calls without a mask, what _padded says in the layer's key
            token = _padded(attention_mask, L == S_all)[1]
            if token is not None:
                layer = (*scalars, *token)
                out = _rerun(module, layer, query, key, value, sinks)
                if out is not None:
                    return out, None
        key, value, opts = _options(query, key, value, attention_mask, scaling, dropout, causal, kwargs,
                                    indexer_block_size(module))
    res = api.attention(query, key, value, return_weights=want, **opts)
    if layer is not None:
        _keep_layer(module, layer, query, key, value, api.kept_call(query, key, value, "auto", opts)[1])
    out, weights = res if want else (res, None)
    if weights is not None and weights.shape[-1] < S_all:  # a static cache's empty slots: weight 0,
        weights = _torch_required().nn.functional.pad(weights, (0, S_all - weights.shape[-1]))   # as eager's
    return out.transpose(1, 2).contiguous(), weights


def indexer_block_size(module: Any) -> Any:
    """The key-block size of a layer's sparse-attention indexer (MiniMax-M3's), or None."""
    return getattr(getattr(module, "indexer", None), "block_size", None)


def layer_causal(module: Any, kwargs: dict[str, Any]) -> bool:
    """Whether a layer's call is causal: its ``is_causal`` keyword, else the layer's."""
    is_causal = kwargs.get("is_causal")
    return bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)


def _masking_utils() -> Any:
    # from sys.modules (an import statement costs a forward ~1 µs): the mask builder is
    # called by masking_utils' own functions, so the module there is whole
    mu = sys.modules.get("transformers.masking_utils")
    if mu is None:
        from transformers import masking_utils as mu
    return mu


def attention_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                   mask_function: Any = None, attention_mask: Any = None, allow_is_causal_skip: bool = True,
                   allow_is_bidirectional_skip: bool = False, local_size: int | None = None,
                   **kwargs: Any) -> Any:
    """attnkit's mask builder for transformers (registered by :func:`register`): plain
    causal or bidirectional layers get the 2-D padding mask (None without padding; a
    causal layer on a static cache a mask of ones over the tokens so far), everything
    else transformers' own boolean SDPA mask (True = attend), and models whose layers
    cannot take the short forms (:func:`_trusts_layers`) the eager mask.

    Parameters
    ----------
    batch_size, q_length, kv_length : int
        The mask's batch, query and key lengths.
    q_offset, kv_offset : int
        Positions of the first query and key (a cache).
    mask_function : callable
        transformers' mask pattern (causal, bidirectional, or a combination).
    attention_mask : torch.Tensor, optional
        The user's 2-D padding mask (1 = token).
    allow_is_causal_skip, allow_is_bidirectional_skip : bool
        transformers' flags that the pattern is the plain causal / bidirectional one.
    local_size : int, optional
        A sliding window's size (then transformers' mask is used).
    **kwargs
        Passed to ``transformers.masking_utils.sdpa_mask`` (or ``eager_mask``).
    """
    mu = _masking_utils()
    plain = ((mask_function is mu.causal_mask_function and allow_is_causal_skip and local_size is None)
             or (mask_function is mu.bidirectional_mask_function and allow_is_bidirectional_skip))
    if not _trusts_layers(kwargs.get("config")):
        return mu.eager_mask(batch_size, q_length, kv_length, q_offset=q_offset, kv_offset=kv_offset,
                             mask_function=mask_function, attention_mask=attention_mask, local_size=local_size,
                             allow_is_bidirectional_skip=False, **kwargs)
    causal = mask_function is mu.causal_mask_function
    if causal and _layers_not_causal(kwargs.get("config")):
        plain = False                                    # transformers' mask: its causality
    # causal: the keys are the tokens so far, T (a static cache's other slots are empty).
    # A static cache's offset is a tensor: under torch.compile reading it would break the
    # graph, so sdpa_mask below builds the mask there
    if plain and kv_offset == 0 and (attention_mask is None or attention_mask.dim() == 2) \
            and (attention_mask is None or attention_mask.shape[-1] <= kv_length) \
            and (not causal or isinstance(q_offset, int) or not _compiling()):
        T = int(q_offset) + q_length if causal else kv_length
        if attention_mask is not None:
            # a causal layer's mask over more slots than the tokens so far (a static
            # cache's whole length): its slots past T are causality's to hide, so it is
            # cut to T (the hook aligns the diagonal to the mask's end); one over fewer
            # slots is padded with zeros, as transformers reads it
            n = attention_mask.shape[-1]
            if n > T:
                attention_mask = attention_mask[:, :T]
            elif n < T and causal:
                attention_mask = _torch_required().nn.functional.pad(attention_mask, (0, T - n))
            if attention_mask.shape[-1] == kv_length and not _compiling() and bool(attention_mask.all()):
                return None
            return attention_mask.bool()
        if not causal:
            return None
        if T >= kv_length:
            return None
        import torch
        return torch.ones(batch_size, T, dtype=torch.bool, device=kwargs.get("device", "cpu"))
    return mu.sdpa_mask(batch_size, q_length, kv_length, q_offset=q_offset, kv_offset=kv_offset,
                        mask_function=mask_function, attention_mask=attention_mask,
                        allow_is_causal_skip=False, allow_is_bidirectional_skip=False, local_size=local_size,
                        **kwargs)


def register(name: str = NAME) -> None:
    """Make ``attn_implementation=name`` work in transformers (the attention function
    and its mask builder). Idempotent.

    Parameters
    ----------
    name : str
        The implementation's name (default "attnkit").
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name: expected a non-empty str (the attn_implementation to register), got {name!r}")
    _torch_required()
    try:
        from transformers import AttentionInterface, AttentionMaskInterface
    except ImportError:
        raise ImportError("attnkit.hf needs transformers: pip install 'attnkit[hf]'") from None
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, attention_mask)


from .capture import Call, capture  # noqa: E402,F401  (attnkit.hf.capture: a model's calls, recorded)

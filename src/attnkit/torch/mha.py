"""``MultiheadAttention``: the seed's projection matrices W^Q, W^K, W^V as a module.

A drop-in for ``torch.nn.MultiheadAttention`` in the common case, with attnkit's
exact attention inside (linear memory, fully masked rows give 0 instead of NaN) and
grouped-query attention (``num_kv_heads``)::

    q = x W^Qᵀ + b^Q   (B, L, E) -> (B, H, L, E/H)
    k = y W^Kᵀ + b^K   (B, S, kdim) -> (B, Hkv, S, E/H)
    v = z W^Vᵀ + b^V   (B, S, vdim) -> (B, Hkv, S, E/H)
    out = attention(q, k, v) -> (B, L, E) -> out_proj

Parameters carry ``torch.nn.MultiheadAttention``'s names (``in_proj_weight``,
``in_proj_bias``, ``q_proj_weight``/``k_proj_weight``/``v_proj_weight`` when kdim or
vdim differ from embed_dim, ``out_proj.weight``, ``out_proj.bias``), so its
``state_dict`` loads as is; :meth:`MultiheadAttention.from_torch` does that in one
call. With ``num_kv_heads < num_heads`` the packed ``in_proj_weight`` has
``E + 2 · num_kv_heads · E/H`` rows (q rows, then k, then v).

Masks keep torch's polarity: a boolean ``attn_mask`` or ``key_padding_mask`` is True
where attention is *not* allowed (passed to attnkit as ``drop=`` / ``keep=``), a float
one is added to the scores (``bias=``). ``is_causal=True`` applies a causal mask with
torch's top-left alignment (query i sees keys 0..i), on its own or together with
``attn_mask``.

Differences from torch: ``batch_first`` defaults to True; the returned weights are
exact but carry no gradient (they are recomputed from the forward's lse, so the output
path is the same with or without them — pass ``need_weights=False`` to skip the
extra L × S work; with dropout they are the weights before dropout); ``add_bias_kv``
and ``add_zero_attn`` are not supported; a fully masked query row gives 0, not NaN.
Inside ``torch.nn.TransformerEncoderLayer`` / ``TransformerEncoder`` attention stays
attnkit's in inference too: the module holds a forward pre-hook that does nothing, which
keeps those layers off torch's fused inference path (it would run torch's kernel on these
weights); the nested tensors ``TransformerEncoder`` makes of a padded batch there are
taken (all three nested, ``need_weights=False``, no other mask) and given back nested.
Attention-weight dropout (``dropout=p`` while training) is attnkit's: its seed comes
from torch's generator, so ``torch.manual_seed`` makes a step reproducible.

>>> import torch
>>> from attnkit.torch import MultiheadAttention
>>> torch.manual_seed(0) and None
>>> mha = MultiheadAttention(16, 4, num_kv_heads=2)
>>> x = torch.randn(2, 5, 16)
>>> out, w = mha(x, x, x, is_causal=True)
>>> out.shape, w.shape
(torch.Size([2, 5, 16]), torch.Size([2, 5, 5]))
>>> ref = torch.nn.MultiheadAttention(16, 4, batch_first=True)
>>> ours = MultiheadAttention.from_torch(ref)
>>> bool(torch.allclose(ours(x, x, x)[0], ref(x, x, x)[0], atol=1e-6))
True
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from .. import api
from ..spec.checks import check_mha_config, check_mha_inputs


class MultiheadAttention(nn.Module):
    """Multi-head (and grouped-query) attention on attnkit; see the module docstring.

    Parameters
    ----------
    embed_dim : int
        E, the model width (E % num_heads == 0).
    num_heads : int
        H, query heads.
    dropout : float
        Dropout of the attention weights while training (0 ≤ p < 1).
    bias : bool
        Biases in the projections.
    add_bias_kv, add_zero_attn : bool
        Must be False (not supported).
    kdim, vdim : int, optional
        Key / value feature sizes (default E).
    batch_first : bool
        (B, L, E) inputs (default True; False: (L, B, E)).
    device, dtype : optional
        Where and in which dtype to make the parameters.
    num_kv_heads : int, optional
        Hkv, key-value heads (default H; H % Hkv == 0: grouped-query attention).
    """

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False, kdim: int | None = None,
                 vdim: int | None = None, batch_first: bool = True, device: Any = None, dtype: Any = None, *,
                 num_kv_heads: int | None = None) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        check_mha_config(embed_dim, num_heads, num_kv_heads, dropout, kdim, vdim, dtype)
        if add_bias_kv or add_zero_attn:
            raise ValueError("add_bias_kv and add_zero_attn are not supported by attnkit.torch.MultiheadAttention")
        kw = {"device": device, "dtype": dtype}
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.kdim = embed_dim if kdim is None else kdim
        self.vdim = embed_dim if vdim is None else vdim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.dropout, self.batch_first = dropout, batch_first
        self.bias_k = self.bias_v = None
        self.add_zero_attn = False
        ekv = num_kv_heads * self.head_dim
        if self._qkv_same_embed_dim:
            self.in_proj_weight = nn.Parameter(torch.empty(embed_dim + 2 * ekv, embed_dim, **kw))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.q_proj_weight = nn.Parameter(torch.empty(embed_dim, embed_dim, **kw))
            self.k_proj_weight = nn.Parameter(torch.empty(ekv, self.kdim, **kw))
            self.v_proj_weight = nn.Parameter(torch.empty(ekv, self.vdim, **kw))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(embed_dim + 2 * ekv, **kw))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **kw)
        self._reset_parameters()
        # torch.nn.TransformerEncoderLayer's inference fast path would run torch's fused
        # kernel on this module's weights (not attnkit, and wrong for GQA's packing); it
        # declines where a module holds forward hooks: this one does nothing
        self.register_forward_pre_hook(_no_fused_encoder_path)

    def _reset_parameters(self):
        """torch.nn.MultiheadAttention's initialisation."""
        for w in (self.in_proj_weight, self.q_proj_weight, self.k_proj_weight, self.v_proj_weight):
            if w is not None:
                nn.init.xavier_uniform_(w)
        if self.in_proj_bias is not None:
            nn.init.zeros_(self.in_proj_bias)
            nn.init.zeros_(self.out_proj.bias)

    @classmethod
    def from_torch(cls, mha: nn.MultiheadAttention) -> MultiheadAttention:
        """A copy of a ``torch.nn.MultiheadAttention`` running on attnkit.

        Parameters
        ----------
        mha : torch.nn.MultiheadAttention
            The module to copy (weights, batch_first, dtype and device).
        """
        if mha.bias_k is not None or mha.add_zero_attn:
            raise ValueError("from_torch: add_bias_kv and add_zero_attn are not supported")
        w = mha.out_proj.weight
        new = cls(mha.embed_dim, mha.num_heads, dropout=mha.dropout, bias=mha.in_proj_bias is not None,
                  kdim=mha.kdim, vdim=mha.vdim, batch_first=mha.batch_first, device=w.device, dtype=w.dtype)
        new.load_state_dict(mha.state_dict())
        return new

    def _weights(self):
        """(W^Q, W^K, W^V) and their biases (None without bias)."""
        E, ekv = self.embed_dim, self.num_kv_heads * self.head_dim
        if self._qkv_same_embed_dim:
            ws = self.in_proj_weight.split([E, ekv, ekv])
        else:
            ws = (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)
        bs = (None,) * 3 if self.in_proj_bias is None else self.in_proj_bias.split([E, ekv, ekv])
        return ws, bs

    def forward(self, query: torch.Tensor, key: torch.Tensor | None = None, value: torch.Tensor | None = None,
                key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
                attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Multi-head attention of ``query`` over ``key`` / ``value``.

        Parameters
        ----------
        query : torch.Tensor (B, L, E)
            Queries ((L, B, E) with batch_first=False; unbatched (L, E) works too).
        key : torch.Tensor (B, S, kdim), optional
            Keys (default: query).
        value : torch.Tensor (B, S, vdim), optional
            Values (default: key).
        key_padding_mask : torch.Tensor (B, S), optional
            bool True = ignore this key, or float = added to its scores.
        need_weights : bool
            Also return the attention weights (exact, no gradient).
        attn_mask : torch.Tensor (L, S) or (B·H, L, S), optional
            bool True = not allowed, or float = added.
        average_attn_weights : bool
            Average the weights over heads.
        is_causal : bool
            A causal mask, top-left aligned like torch's.

        Returns
        -------
        (out (B, L, E), weights (B, L, S) averaged over heads, (B, H, L, S) with
        average_attn_weights=False, or None with need_weights=False).
        """
        key = query if key is None else key
        value = key if value is None else value
        for name, x in (("query", query), ("key", key), ("value", value)):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        if query.is_nested or key.is_nested or value.is_nested:
            return self._nested(query, key, value, key_padding_mask, need_weights, attn_mask, is_causal)
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = query[None], key[None], value[None]
            key_padding_mask = None if key_padding_mask is None else key_padding_mask[None]
        elif not self.batch_first:
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        out, w = self._attend(query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights,
                              is_causal)
        if unbatched:
            return out[0], None if w is None else w[0]
        if not self.batch_first:
            out = out.transpose(0, 1)
        return out, w

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_padding_mask: Any,
                need_weights: bool, attn_mask: Any, average_attn_weights: bool,
                is_causal: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`forward` on batch-first (B, L, E) inputs."""
        check_mha_inputs(query, key, value, (self.embed_dim, self.kdim, self.vdim), self.num_heads,
                         key_padding_mask, attn_mask,
                         self.in_proj_weight if self._qkv_same_embed_dim else self.q_proj_weight)
        B, L, _ = query.shape
        S = key.shape[1]
        (wq, wk, wv), (bq, bk, bv) = self._weights()
        q = F.linear(query, wq, bq).view(B, L, self.num_heads, self.head_dim).transpose(1, 2)
        k = F.linear(key, wk, bk).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = F.linear(value, wv, bv).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)

        masks: dict[str, Any] = {"keep": None, "drop": None, "bias": None}
        if attn_mask is not None:
            m = attn_mask if attn_mask.dim() == 2 else attn_mask.view(-1, self.num_heads, L, S)
            masks["drop" if m.dtype == torch.bool else "bias"] = m
        if key_padding_mask is not None:
            m = key_padding_mask[:, None, None, :]                   # (B, 1, 1, S)
            if m.dtype == torch.bool:
                masks["keep"] = ~m                                   # drop may hold attn_mask
            else:
                masks["bias"] = m if masks["bias"] is None else masks["bias"] + m
        p = self.dropout if self.training else 0.0
        res = api.attention(q, k, v, causal=bool(is_causal), align="top_left", dropout=p,
                            return_weights=bool(need_weights), **masks)
        out, w = res if need_weights else (res, None)
        out = self.out_proj(out.transpose(1, 2).reshape(B, L, self.embed_dim))
        if w is not None and average_attn_weights:
            w = w.mean(dim=1)
        return out, w

    def _nested(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_padding_mask: Any,
                need_weights: bool, attn_mask: Any, is_causal: bool) -> tuple[torch.Tensor, None]:
        """Nested (B, L_b, E) inputs — what ``torch.nn.TransformerEncoder`` makes of a padded
        batch in inference: the sequences padded, their lengths as the key padding, the
        output nested again (batch first whatever ``batch_first`` says, as nested tensors
        are)."""
        if not (query.is_nested and key.is_nested and value.is_nested) or key_padding_mask is not None \
                or attn_mask is not None or need_weights:
            raise ValueError("query, key, value: nested tensors (as torch.nn.TransformerEncoder makes of a padded "
                             "batch) are taken all three nested, without key_padding_mask or attn_mask (their "
                             "lengths are the padding) and with need_weights=False")
        lengths = [torch.tensor([t.shape[0] for t in x.unbind()]) for x in (query, key)]
        q, k, v = (x.to_padded_tensor(0.0) for x in (query, key, value))
        ignore = torch.arange(k.shape[1]) >= lengths[1][:, None]              # (B, S): past each key sequence
        out, _ = self._attend(q, k, v, ignore.to(q.device), False, None, False, is_causal)
        real = (torch.arange(q.shape[1]) < lengths[0][:, None]).to(q.device)  # (B, L): each query sequence
        return torch._nested_tensor_from_mask(out, real, mask_check=False), None


def _no_fused_encoder_path(module: nn.Module, args: Any) -> None:
    """A forward pre-hook that changes nothing (see MultiheadAttention.__init__)."""
    return None

"""What transformers' masks and keywords say about a layer's keys, in attnkit's terms
(:mod:`attnkit.hf`'s readers): sequences packed into one row, and the keys or key
blocks a sparse-attention indexer chose."""

from __future__ import annotations

from typing import Any


def _packed_offsets(torch: Any, position_ids: Any) -> Any:
    """cu_seqlens from one row of position_ids that restarts (a new sequence wherever
    a position does not follow the previous one by 1), or None."""
    if position_ids is None or position_ids.dim() != 2 or position_ids.shape[0] != 1 or position_ids.shape[1] < 2:
        return None
    p = position_ids[0]
    starts = torch.nonzero(p[1:] - p[:-1] != 1).reshape(-1) + 1
    if starts.numel() == 0:
        return None
    zero = torch.zeros(1, dtype=starts.dtype, device=starts.device)
    end = torch.full((1,), p.numel(), dtype=starts.dtype, device=starts.device)
    return torch.cat([zero, starts, end])


def _is_block_causal(torch: Any, mask: Any, cu: Any, causal: bool, window: tuple[int, int] | None) -> bool:
    """Whether a (1, 1|H, T, T) boolean mask is exactly packed sequences cu (causal
    inside each when ``causal``, keys at most ``window[0]`` back and ``window[1]``
    ahead when given)."""
    T = int(cu[-1])
    seq = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=mask.device), torch.diff(cu))
    want = seq[:, None] == seq[None, :]
    if causal:
        want &= torch.ones(T, T, dtype=torch.bool, device=mask.device).tril()
    if window is not None:
        want &= torch.ones(T, T, dtype=torch.bool, device=mask.device).triu(-window[0]).tril(window[1])
    return bool((mask == want).all())


def _with_selected_keys(torch: Any, mask: Any, indices: Any, S: int) -> Any:
    """A sparse-attention indexer's choice (DeepSeek-V3.2, GLM-MoE-DSA: ``indices``
    (B, L, topk), the keys each query may see) folded into the layer's 4-D mask, as
    those models fold it themselves for eager and sdpa."""
    if mask is None or mask.dim() != 4:
        raise ValueError(f"indices: a sparse-attention indexer's keys need the layer's 4-D mask, got "
                         f"{None if mask is None else tuple(mask.shape)}")
    picked = torch.zeros(indices.shape[:-1] + (S,), dtype=torch.bool, device=indices.device)
    picked = picked.scatter(-1, indices.long(), True).unsqueeze(1)          # (B, 1, L, S)
    if mask.dtype == torch.bool:
        return mask & picked
    return mask.masked_fill(~picked, torch.finfo(mask.dtype).min)


def _chosen_blocks(torch: Any, block_indices: Any, H: int, S: int, block_size: Any) -> Any:
    """A block-sparse indexer's choice (MiniMax-M3's ``block_indices`` (B, Hi, L, topk):
    key blocks of ``block_size`` per query, −1 none, each index head serving H / Hi
    query heads) as a (B, H, L, S) boolean keep, as the model builds it for eager."""
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_indices: the layer's indexer.block_size must be a positive int, got {block_size!r}")
    n = -(-S // block_size)
    safe = block_indices.long().masked_fill(block_indices < 0, n)    # (−1: a column dropped below)
    chosen = torch.zeros(block_indices.shape[:-1] + (n + 1,), dtype=torch.bool, device=block_indices.device)
    chosen = chosen.scatter(-1, safe, True)[..., :n].repeat_interleave(block_size, dim=-1)[..., :S]
    return chosen.repeat_interleave(H // block_indices.shape[1], dim=1)

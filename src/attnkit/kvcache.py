"""KV caches for decoding: the append, the gather, and a small paged-cache helper.

:func:`attnkit.attention_kvcache` validates a call (``attnkit.spec.kvcache``), writes
``k_new``/``v_new`` into the cache with :func:`append` and hands the call to a rung:
the flash rung reads contiguous caches in place and paged caches page by page (keys
past a sequence's length are never read, so unused slots may hold anything), the
reference gathers each sequence's keys with :func:`gather` (the definition).

:class:`PagedCache` is a minimal page allocator for people who build their own
generation loop — allocate, append, attend, free; no server, no scheduling.

>>> import numpy as np
>>> cache = PagedCache(num_pages=8, page_size=4, kv_heads=1, head_dim=2, dtype="float64")
>>> seq = cache.add_sequence()
>>> q = np.ones((1, 1, 1, 2)); k = v = np.ones((1, 1, 1, 2))
>>> out = cache.attend(q, seq, k_new=k, v_new=v)          # append one key, then attend
>>> out.shape, cache.length(seq)
((1, 1, 1, 2), 1)
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from .spec.core import as_int
from .spec.kvcache import KVCall, check_paged_attend, check_paged_config, new_key_places, sequence_ids, used_entries
from .spec.validate import host_ints


def _xp_arange(like: Any, n: int) -> Any:
    if isinstance(like, np.ndarray):
        return np.arange(n)
    import torch
    return torch.arange(n, device=like.device)


def _positions(kv: KVCall) -> tuple[Any, Any, Any]:
    """:func:`~attnkit.spec.kvcache.new_key_places` of kv's append. For NumPy arrays and
    CPU tensors they are NumPy arrays made on int64 copies of the lengths and the table
    (each torch op costs a small model's decoding step microseconds: the append took 87
    µs, 8 of them the write); on other devices int64 tensors."""
    host = not isinstance(kv.k_new, np.ndarray) and kv.k_new.device.type == "cpu"

    def index(name: str, x: Any) -> Any:                 # as int64: any integer dtype validation takes
        if x is None:                                    # (torch reads a uint8 index as a mask)
            return None
        if host or isinstance(x, np.ndarray):
            return np.asarray(host_ints(name, x) if host else x, dtype=np.int64)
        return x.long()
    lengths, table, new_lengths = (index(n, getattr(kv, n)) for n in ("cache_lengths", "block_table", "new_lengths"))
    return new_key_places(lengths, kv.k_new.shape[-2], new_lengths, table, kv.page_size,
                          lambda n: _xp_arange(lengths, n))


def _numpy_views(xs: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """NumPy views of CPU tensors (a write through them reaches the tensors' memory: a
    small model's append, views and writes, takes about 10 µs where torch's index writes
    took 40), or None: tensor subclasses, a dtype NumPy lacks (bfloat16), a negative or
    conjugate bit."""
    import torch
    if any(type(x) is not torch.Tensor for x in xs):
        return None
    try:
        return tuple(x.numpy() for x in xs)              # the common case, in one call each
    except (RuntimeError, TypeError):                    # grad, bfloat16, a negative or conjugate bit
        pass
    if any(x.dtype == torch.bfloat16 or x.is_neg() or x.is_conj() for x in xs):
        return None
    return tuple(x.detach().numpy() for x in xs)


def append(kv: KVCall) -> None:
    """Write k_new / v_new into the cache in place at positions cache_lengths[b] … (all
    L_new of them, or the first new_lengths[b]), validated beforehand, writability
    too: the cache is untouched when a call is rejected. CPU tensors are written
    through NumPy views, their version counters bumped as torch's own write bumps them
    (autograd then refuses a graph that saved the cache before)."""
    if kv.k_new is None or kv.k_new.shape[-2] == 0 or (kv.new_lengths is not None and not bool(
            (kv.new_lengths > 0).any())):
        return
    rows, slots, taken = _positions(kv)
    arrays = (kv.k_cache, kv.v_cache, kv.k_new, kv.v_new)
    views = None
    if not isinstance(kv.k_new, np.ndarray) and isinstance(rows, np.ndarray):     # CPU tensors
        import torch
        views = _numpy_views(arrays)
        if views is None:                                # (bfloat16 and the like: torch's writes)
            rows, slots, taken = (None if x is None else torch.from_numpy(x) for x in (rows, slots, taken))
    k_cache, v_cache, k_new, v_new = views or arrays
    for cache, new in ((k_cache, k_new), (v_cache, v_new)):
        rows_new = new.transpose(1, 2) if not isinstance(new, np.ndarray) else new.transpose(0, 2, 1, 3)
        if taken is None:
            cache[rows, :, slots] = rows_new
        else:
            cache[rows[taken], :, slots[taken]] = rows_new[taken]
    if views is not None:
        for cache in arrays[:2]:                         # (one at a time: torch 2.4 takes no list)
            torch.autograd.graph.increment_version(cache)


def seen(kv: KVCall) -> KVCall:
    """kv cut to the keys its sequences see, for a rung that copies the cache: a
    contiguous cache to the longest sequence's length (views, the Spec's stand-in key
    axis with them), a block table to the pages that length spans — where that halves
    them at least (a cut costs a call ~10 µs); else kv itself, as for a traced call (no
    lengths on the host). A cache a rung converts (float16 and bfloat16 to float32, a D
    axis without unit stride) or gathers is then copied up to the keys in use, not to
    its capacity: a bfloat16 cache of 8,192 slots holding 60 keys took a decoding step
    241 ms, 0.8 in float32 (docs/decisions.md)."""
    if kv.lengths is None:
        return kv
    n = max(int(host_ints("lengths", kv.lengths).max(initial=0)), 1)
    P = kv.page_size
    if kv.paged:
        pages = -(-n // P)
        if 2 * pages > kv.block_table.shape[1]:
            return kv
        return replace(kv, block_table=kv.block_table[:, :pages], spec=_keys_cut(kv.spec, pages * P))
    if 2 * n > kv.k_cache.shape[-2]:
        return kv
    return replace(kv, k_cache=kv.k_cache[:, :, :n], v_cache=kv.v_cache[:, :, :n], page_size=n,
                   spec=_keys_cut(kv.spec, n))


def _keys_cut(spec: Any, n: int) -> Any:
    """spec with its stand-in key axis cut to n keys (every sequence's lengths fit)."""
    return spec.replace(k=spec.k[..., :n, :], v=spec.v[..., :n, :], S=n)


def compact(kv: KVCall) -> KVCall:
    """kv with the pages its sequences use copied into a pool of their own (in
    ascending order) and the block table renumbered (entries past a sequence's
    pages: page 0): for a rung that would copy the whole pool (the torch op's bfloat16
    upcast, the flash rung's copy of a pool strided along D), the pages in use only."""
    table = host_ints("block_table", kv.block_table).astype(np.int64)
    lengths = host_ints("lengths", kv.lengths).astype(np.int64)
    used = used_entries(lengths, table.shape[1], kv.page_size, np.arange)
    pages, index = np.unique(table[used], return_inverse=True)
    renumbered = np.zeros_like(table)
    renumbered[used] = index
    if pages.size == 0:                                  # no sequence holds a key: any one page
        pages = np.zeros(1, dtype=np.int64)
    if isinstance(kv.k_cache, np.ndarray):
        return replace(kv, k_cache=kv.k_cache[pages], v_cache=kv.v_cache[pages], block_table=renumbered)
    import torch
    rows = torch.from_numpy(pages).to(kv.k_cache.device)
    return replace(kv, k_cache=kv.k_cache[rows], v_cache=kv.v_cache[rows],
                   block_table=torch.from_numpy(renumbered).to(kv.block_table.device))


def gather(kv: KVCall) -> tuple[Any, Any]:
    """Each sequence's keys and values as contiguous (B, Hkv, S_cap, D[v]) arrays
    (a view for a contiguous cache; positions past a sequence's length hold whatever
    the cache holds — they are excluded — and block-table entries past the pages a
    sequence uses are never followed)."""
    if not kv.paged:
        return kv.k_cache, kv.v_cache
    bt = kv.block_table                                  # (B, max_pages)
    # entries past the pages a sequence uses may hold anything: read page 0 there
    bt = bt * used_entries(kv.lengths, bt.shape[1], kv.page_size, lambda n: _xp_arange(bt, n))
    out = []
    for cache in (kv.k_cache, kv.v_cache):
        g = cache[bt]                                    # (B, max_pages, Hkv, P, D)
        B, n, H, P, D = g.shape
        g = g.transpose(1, 2) if not isinstance(g, np.ndarray) else g.transpose(0, 2, 1, 3, 4)
        out.append(g.reshape(B, H, n * P, D))
    return out[0], out[1]


class PagedCache:
    """A paged KV cache for one layer: ``num_pages`` pages of ``page_size`` keys, handed
    to sequences as they grow and returned when they are freed.

    ``k``/``v`` are the cache arrays ``(num_pages, kv_heads, page_size, head_dim)``
    (NumPy; pass ``like=`` a torch tensor to allocate tensors on its device). A
    sequence is an int id; :meth:`block_table` gives the rows attention_kvcache takes.

    Parameters
    ----------
    num_pages : int
        Pages in the pool.
    page_size : int
        Keys per page.
    kv_heads : int
        Key-value heads (Hkv).
    head_dim : int
        Query-key head dim (D).
    value_dim : int, optional
        Value head dim (default: head_dim).
    dtype : str or NumPy dtype
        The cache's dtype (NumPy caches).
    like : torch.Tensor, optional
        Allocate torch tensors with this tensor's dtype and device instead.
    """

    def __init__(self, num_pages: int, page_size: int, kv_heads: int, head_dim: int,
                 value_dim: int | None = None, dtype: Any = "float32", like: Any = None) -> None:
        num_pages, page_size, kv_heads, head_dim, value_dim = check_paged_config(
            num_pages, page_size, kv_heads, head_dim, value_dim, dtype, like)
        shape_k = (num_pages, kv_heads, page_size, head_dim)
        shape_v = (num_pages, kv_heads, page_size, value_dim)
        if like is None:
            self.k = np.zeros(shape_k, dtype=dtype)
            self.v = np.zeros(shape_v, dtype=dtype)
        else:
            self.k = like.new_zeros(shape_k)
            self.v = like.new_zeros(shape_v)
        self.page_size = page_size
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out page 0 first
        self._pages: dict[int, list[int]] = {}
        self._lengths: dict[int, int] = {}
        self._next = 0

    def add_sequence(self) -> int:
        """A new, empty sequence's id."""
        sid, self._next = self._next, self._next + 1
        self._pages[sid], self._lengths[sid] = [], 0
        return sid

    def length(self, seq: int) -> int:
        """Keys sequence ``seq`` holds."""
        return self._lengths[self._check(seq)]

    def free(self, seq: int) -> None:
        """Return a sequence's pages to the pool."""
        seq = self._check(seq)
        self._free.extend(reversed(self._pages.pop(seq)))
        del self._lengths[seq]

    def reserve(self, seq: int, n: int) -> None:
        """Make room for ``n`` more keys in sequence ``seq`` (takes pages as needed;
        ValueError naming ``n`` when the pool has too few)."""
        seq = self._check(seq)
        need = self._need(seq, n)
        if need > len(self._free):
            raise ValueError(f"n: {n} more keys need {need} more pages, {len(self._free)} are free")
        self._take(seq, need)

    def _take(self, seq: int, m: int) -> None:
        """Hand sequence ``seq`` (checked) ``m`` pages from the pool (enough are free)."""
        self._pages[seq] += [self._free.pop() for _ in range(m)]

    def set_length(self, seq: int, n: int) -> None:
        """Set sequence ``seq``'s length to ``n`` keys. Fewer drops its last keys
        (speculative decoding: the drafts the model rejected) and returns the pages past
        the keys kept to the pool; more counts keys written by a call of one's own
        (:meth:`reserve`, then attention_kvcache with :meth:`block_table`, :meth:`lengths`
        and k_new), up to the room its pages hold.

        >>> import numpy as np
        >>> cache = PagedCache(num_pages=4, page_size=2, kv_heads=1, head_dim=1, dtype="float64")
        >>> seq = cache.add_sequence()
        >>> _ = cache.attend(np.ones((1, 1, 3, 1)), seq, k_new=np.ones((1, 1, 3, 1)), v_new=np.ones((1, 1, 3, 1)))
        >>> cache.set_length(seq, 1); cache.length(seq), cache.block_table([seq]).shape
        (1, (1, 1))
        """
        seq, count = self._check(seq), as_int(n)
        room = len(self._pages[seq]) * self.page_size
        if type(count) is not int or not 0 <= count <= room:
            raise ValueError(f"n: expected an int in [0, {room}] (the keys sequence {seq}'s pages hold; reserve "
                             f"makes room), got {n!r}")
        if count < self._lengths[seq]:
            keep = -(-count // self.page_size)
            self._free.extend(reversed(self._pages[seq][keep:]))
            del self._pages[seq][keep:]
        self._lengths[seq] = count

    def _need(self, seq: int, n: int) -> int:
        """Pages sequence ``seq`` (checked) lacks for ``n`` more keys."""
        count = as_int(n)
        if type(count) is not int or count < 0:
            raise ValueError(f"n: expected a non-negative int, got {n!r}")
        return max(-(-(self._lengths[seq] + count) // self.page_size) - len(self._pages[seq]), 0)

    def block_table(self, seqs: list[int]) -> Any:
        """The page table of sequences ``seqs``: (len(seqs), max_pages) int32, in the
        cache's array library. Entries past a sequence's pages are −1, no page: an
        append through attention_kvcache past a sequence's pages (without :meth:`attend`
        or :meth:`reserve` taking them first) is refused with a ValueError, instead of
        landing in a page another sequence may hold; after an append of one's own,
        :meth:`set_length` counts the keys it wrote."""
        return self._table([self._check(s) for s in sequence_ids(seqs)])

    def _table(self, seqs: list[int]) -> Any:
        """:meth:`block_table` of sequences ``seqs`` (checked)."""
        width = max((len(self._pages[s]) for s in seqs), default=0)
        t = np.full((len(seqs), max(width, 1)), -1, dtype=np.int32)
        for i, s in enumerate(seqs):
            t[i, :len(self._pages[s])] = self._pages[s]
        if isinstance(self.k, np.ndarray):
            return t
        import torch
        return torch.as_tensor(t, device=self.k.device)

    def lengths(self, seqs: list[int]) -> Any:
        """Keys held by each of the sequences ``seqs`` ((len(seqs),) int64)."""
        return self._lengths_of([self._check(s) for s in sequence_ids(seqs)])

    def _lengths_of(self, seqs: list[int]) -> Any:
        """:meth:`lengths` of sequences ``seqs`` (checked)."""
        n = np.array([self._lengths[s] for s in seqs], dtype=np.int64)
        if isinstance(self.k, np.ndarray):
            return n
        import torch
        return torch.as_tensor(n, device=self.k.device)

    def attend(self, q: Any, seqs: int | list[int], k_new: Any = None, v_new: Any = None,
               **kwargs: Any) -> Any:
        """Append k_new / v_new to the sequences, then attention_kvcache of q against
        them; advances the lengths.

        Parameters
        ----------
        q : array (B, H, L, D)
            Queries, one row of B per sequence of ``seqs``.
        seqs : int or list of int
            The sequences (B of them).
        k_new, v_new : arrays (B, Hkv, L_new, D[v]), optional
            Keys and values to append first.
        **kwargs
            Passed to :func:`attnkit.attention_kvcache` (causal, window, softcap,
            alibi_slopes, sinks, q_lengths, dropout, seed, scale, return_lse, backend).
            With ``q_lengths`` each sequence appends the first q_lengths[b] new keys
            (a batch of prefill chunks and single decoding steps).
        """
        from .api import attention_kvcache
        seqs = [self._check(s) for s in sequence_ids(seqs)]
        check_paged_attend(q, seqs, self.k)
        n = 0 if k_new is None else int(k_new.shape[-2])
        grow = self._appended(kwargs.get("q_lengths"), n, len(seqs))
        need = [self._need(s, g) for s, g in zip(seqs, grow)]   # all or nothing: no sequence grows alone
        if sum(need) > len(self._free):
            raise ValueError(f"k_new: {sum(grow)} more keys for {len(seqs)} sequences need {sum(need)} more "
                             f"pages, {len(self._free)} are free")
        held = {s: len(self._pages[s]) for s in seqs}
        for s, m in zip(seqs, need):
            self._take(s, m)
        try:
            res = attention_kvcache(q, self.k, self.v, self._lengths_of(seqs), block_table=self._table(seqs),
                                    k_new=k_new, v_new=v_new, **kwargs)
        except BaseException:                            # a refused call keeps no page it took
            for s, n_held in held.items():
                self._free.extend(reversed(self._pages[s][n_held:]))
                del self._pages[s][n_held:]
            raise
        for s, g in zip(seqs, grow):
            self._lengths[s] += g
        return res

    @staticmethod
    def _appended(q_lengths: Any, n: int, B: int) -> list[int]:
        """Keys each of B sequences appends: n, or with q_lengths its own count (clipped
        to [0, n] here: attention_kvcache names a bad value, after which the pages are
        given back)."""
        if q_lengths is None or n == 0:
            return [n] * B
        try:
            counts = np.broadcast_to(host_ints("q_lengths", q_lengths), (B,))
            return [min(max(int(c), 0), n) for c in counts]
        except (TypeError, ValueError):                  # not B lengths: attention_kvcache says so
            return [0] * B

    def _check(self, seq: Any) -> int:
        """seq as the id of a sequence of this cache (an int; ValueError naming it)."""
        sid = as_int(seq)
        if type(sid) is not int or sid not in self._pages:
            raise ValueError(f"seq: no sequence {seq!r} in this cache")
        return sid

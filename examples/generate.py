"""Greedy generation from a tiny random decoder with a paged KV cache, NumPy only.

Each layer keeps its keys and values in an ``attnkit.PagedCache`` (pages of 4 keys,
handed out as sequences grow); every decoding step appends the new token's keys and
values and attends with ``attnkit.attention_kvcache`` (one call: append + attend).
At the end the whole sequences are recomputed in one causal pass with
``attnkit.attention`` and the logits of every step are compared.

    python examples/generate.py
"""

from __future__ import annotations

import numpy as np

import attnkit

VOCAB, E, H, HKV, LAYERS = 50, 32, 4, 2, 2
D = E // H


def init(seed=0):
    rng = np.random.default_rng(seed)
    w = {"embed": rng.standard_normal((VOCAB, E)) * 0.5, "out": rng.standard_normal((E, VOCAB)) * 0.2}
    for i in range(LAYERS):
        w[f"q{i}"] = rng.standard_normal((E, H * D)) / np.sqrt(E)
        w[f"k{i}"] = rng.standard_normal((E, HKV * D)) / np.sqrt(E)
        w[f"v{i}"] = rng.standard_normal((E, HKV * D)) / np.sqrt(E)
        w[f"o{i}"] = rng.standard_normal((H * D, E)) / np.sqrt(E)
    return w


def heads(x, n):
    """(B, T, n·D) -> (B, n, T, D)."""
    B, T, _ = x.shape
    return x.reshape(B, T, n, D).transpose(0, 2, 1, 3)


def forward(w, tokens, positions, attend):
    """Logits (B, T, VOCAB) of tokens (B, T); attend(layer, q, k, v) does attention."""
    x = w["embed"][tokens] + np.sin(positions[..., None] / (1.0 + np.arange(E)))   # a position signal
    for i in range(LAYERS):
        q, k, v = (heads(x @ w[f"{n}{i}"], H if n == "q" else HKV) for n in "qkv")
        a = attend(i, q, k, v)                                            # (B, H, T, D)
        x = x + a.transpose(0, 2, 1, 3).reshape(x.shape[0], -1, H * D) @ w[f"o{i}"]
        x = x + np.tanh(x)
    return x @ w["out"]


def generate(w, prompts, steps):
    """Greedy decoding of a batch of prompts (lists of token ids, any lengths)."""
    caches = [attnkit.PagedCache(num_pages=64, page_size=4, kv_heads=HKV, head_dim=D, dtype="float64")
              for _ in range(LAYERS)]
    seqs = [[c.add_sequence() for _ in prompts] for c in caches]
    out = [list(p) for p in prompts]
    step_logits = []
    for b, p in enumerate(prompts):                  # prefill, one sequence at a time (any length)
        def attend(i, q, k, v, b=b):
            return caches[i].attend(q, seqs[i][b], k_new=k, v_new=v, causal=True)
        logits = forward(w, np.array([p]), np.arange(len(p))[None], attend)
        step_logits.append([logits[0, -1]])
        out[b].append(int(logits[0, -1].argmax()))
    for _ in range(steps - 1):                       # decode: the whole batch, one token each
        tokens = np.array([[o[-1]] for o in out])
        positions = np.array([[len(o) - 1] for o in out])

        def attend(i, q, k, v):
            return caches[i].attend(q, seqs[i], k_new=k, v_new=v, causal=True)
        logits = forward(w, tokens, positions, attend)
        for b in range(len(out)):
            step_logits[b].append(logits[b, -1])
            out[b].append(int(logits[b, -1].argmax()))
    return out, step_logits


def full_pass(w, sequence):
    """Logits of a whole sequence in one causal pass (no cache)."""
    tokens = np.array([sequence])
    return forward(w, tokens, np.arange(len(sequence))[None],
                   lambda i, q, k, v: attnkit.attention(q, k, v, causal=True))[0]


def main():
    w = init()
    prompts = [[3, 14, 15, 9, 2], [6, 5], [35, 8, 9, 7, 9, 3, 2, 3, 8]]
    out, step_logits = generate(w, prompts, steps=12)
    worst = 0.0
    for p, seq, logits in zip(prompts, out, step_logits):
        full = full_pass(w, seq[:-1])                # the logits that predicted each new token
        for t, got in enumerate(logits):
            worst = max(worst, float(np.abs(full[len(p) - 1 + t] - got).max()))
        print("prompt", p, "->", seq[len(p):])
    print(f"largest difference from one full causal pass: {worst:.2e}")
    assert worst < 1e-10
    return worst


if __name__ == "__main__":
    main()

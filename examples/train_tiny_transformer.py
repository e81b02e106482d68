"""Train a tiny transformer built on attnkit.torch.MultiheadAttention to reverse
sequences, on the CPU, in well under a minute.

Each example is a random sequence of digits; the target is the same sequence
reversed. A two-layer encoder (token + position embeddings, self-attention, MLP) has
to learn that output position i copies input position n-1-i — which it can only do
by attention, so the gradients reach W^Q, W^K and W^V end to end.

    python examples/train_tiny_transformer.py            # full run (under 10 s on 2 cores)
    python examples/train_tiny_transformer.py --quick    # a short run for the tests

Prints the loss as it falls and the final accuracy on fresh sequences.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from attnkit.torch import MultiheadAttention


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]   # weights not needed: fast path
        return x + self.mlp(self.ln2(x))


class Reverser(nn.Module):
    def __init__(self, vocab, length, d=64, heads=2, layers=2):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(0.02 * torch.randn(length, d))
        self.blocks = nn.Sequential(*(Block(d, heads) for _ in range(layers)))
        self.head = nn.Linear(d, vocab)

    def forward(self, x):                                  # x (B, n) -> logits (B, n, vocab)
        return self.head(self.blocks(self.tok(x) + self.pos))


def batch(n_batch, length, vocab, gen):
    x = torch.randint(0, vocab, (n_batch, length), generator=gen)
    return x, x.flip(1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    p.add_argument("--quick", action="store_true", help="a short run (60 steps) for the test suite")
    p.add_argument("--length", type=int, default=8)
    p.add_argument("--vocab", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    steps = 60 if args.quick else args.steps

    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    model = Reverser(args.vocab, args.length)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    loss_fn = nn.CrossEntropyLoss()
    t0, losses = time.perf_counter(), []
    for step in range(1, steps + 1):
        x, y = batch(32, args.length, args.vocab, gen)
        loss = loss_fn(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step == 1 or step % max(1, steps // 10) == 0:
            print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)

    model.eval()
    with torch.no_grad():
        x, y = batch(1000, args.length, args.vocab, gen)
        acc = (model(x).argmax(-1) == y).float().mean().item()
    print(f"final accuracy {acc:.3f} ({time.perf_counter() - t0:.1f} s of training and evaluation)")
    return losses, acc


if __name__ == "__main__":
    main()

"""Decoding benchmark: attention of one new token against a KV cache, next to this
machine's memory bandwidth and PyTorch's SDPA, in one run.

Decoding reads every cached key and value once, so its speed is bounded by memory
bandwidth: the script measures that (a large streaming read, threaded like the flash
rung) in every case's rounds, interleaved with the calls it is compared to, and times,
float32 on the CPU, GQA H = 32 / Hkv = 8, D = 128, L = 1:

- ``attnkit``  — ``attnkit.attention_kvcache`` on a contiguous cache (B, Hkv, S, D)
- ``paged``    — the same on a paged cache (page_size 16, pages shuffled)
- ``torch``    — ``F.scaled_dot_product_attention(enable_gqa=True)`` on the contiguous K/V

Each is checked against the float64 reference first (DESIGN.md §6's rule). Reported:
seconds (best of --repeats, interleaved in a shuffled order, each timed call right
after an untimed one: ``settle`` in :func:`attnkit.bench.interleaved`), KV bytes read per second
(2·B·Hkv·S·D·4 / time), the share of the bandwidth measured in the same rounds, and
the ratios. Then a
transformers tiny Llama greedy generation (prompt 32, 20 new tokens) with
attn_implementation="attnkit" against "sdpa" on one model switched between them (best of
--generate-rounds), and "sdpa" timed again as a control (the ratio two identical
providers get in the same run: the noise); then the same with left-padded prompts; then a
tiny gpt-oss (learned sinks, sliding-window layers) against "eager", its CPU peer.
Before it, a small model's decoding step in a loop of one's own (attention_kvcache
against torch's index writes and SDPA), and half-precision caches far larger than
their keys against float32 ones.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/decode.py
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import attnkit
from attnkit import flash
from attnkit.bench import hf_calls, interleaved
from attnkit.testing import error_budget, max_error

H, HKV, D = 32, 8, 128
CASES = [(1, 32768), (8, 4096)]
READ_BYTES = 1 << 30                                     # the streaming read: 1 GiB
TARGETS = {"bandwidth share": 0.6, "vs torch": 2.0, "paged vs contiguous": 0.9, "generate vs sdpa": 1.0}


def reader():
    """A threaded streaming read of READ_BYTES (float32 sums of its parts on the flash
    rung's workers, the way its tasks read a cache), timed next to each case's calls so
    that the share compares times of the same rounds."""
    x = np.ones(READ_BYTES // 4, dtype=np.float32)
    parts = np.array_split(x, 2 * flash.get_threads())
    sums = [0.0] * len(parts)

    def read():
        def task(i):
            sums[i] = float(np.add.reduce(parts[i]))
        flash.runtime.run(list(range(len(parts))), task)
    return read


def make(B, S, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, 1, D), dtype=np.float32)
    k = rng.standard_normal((B, HKV, S, D), dtype=np.float32)
    v = rng.standard_normal((B, HKV, S, D), dtype=np.float32)
    page = 16
    n = S // page
    table = rng.permutation(B * n).reshape(B, n)
    kp = np.empty((B * n, HKV, page, D), dtype=np.float32)
    vp = np.empty_like(kp)
    kp[table.reshape(-1)] = k.reshape(B, HKV, n, page, D).transpose(0, 2, 1, 3, 4).reshape(B * n, HKV, page, D)
    vp[table.reshape(-1)] = v.reshape(B, HKV, n, page, D).transpose(0, 2, 1, 3, 4).reshape(B * n, HKV, page, D)
    lengths = np.full(B, S)
    return q, k, v, kp, vp, table, lengths


def check(q, k, v, kp, vp, table, lengths, torch_out):
    """Errors against the float64 reference, as a share of DESIGN.md §6's budget."""
    oracle = attnkit.attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), backend="reference")
    same = attnkit.attention(q, k, v, backend="reference")
    budget = error_budget(oracle, same)
    res = {"attnkit": max_error(attnkit.attention_kvcache(q, k, v, lengths), oracle) / budget,
           "paged": max_error(attnkit.attention_kvcache(q, kp, vp, lengths, block_table=table), oracle) / budget}
    if torch_out is not None:
        res["torch"] = max_error(torch_out(), oracle) / budget
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--no-generate", action="store_true")
    p.add_argument("--generate-rounds", type=int, default=15)
    args = p.parse_args(argv)
    torch = None
    if not args.no_torch:
        import torch
        torch.set_num_threads(flash.get_threads())
    read = reader()
    print("# attnkit decoding benchmark\n")
    print(f"- {flash.get_threads()} flash workers; H={H}, Hkv={HKV}, D={D}, float32, L=1; \"read\": a 1 GiB "
          "threaded streaming read (the memory bandwidth), timed in the same rounds\n")
    print("| B | S | provider | ms | GB/s | share of bandwidth | attnkit ÷ provider |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    failures = []
    for B, S in CASES:
        res = case(B, S, torch, read, args.repeats)
        if res is None:
            return 1
        failures += res
    if torch is not None:
        small_step(args.repeats)
        half_caches(args.repeats)
    if torch is not None and not args.no_generate:
        failures += generate(args.generate_rounds)
        sinks_generate(args.generate_rounds)
    print("\nmisses:", ", ".join(failures) if failures else "none")
    return 0


def case(B, S, torch, read, repeats):
    """One decoding shape: check, time (with the streaming read, ``reader()``), print;
    the names of the missed targets (None when attnkit failed its check)."""
    q, k, v, kp, vp, table, lengths = make(B, S)
    runs = {"attnkit": lambda: attnkit.attention_kvcache(q, k, v, lengths),
            "paged": lambda: attnkit.attention_kvcache(q, kp, vp, lengths, block_table=table), "read": read}
    torch_out = None
    if torch is not None:
        import torch.nn.functional as F
        tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
        runs["torch"] = lambda: F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)

        def torch_out():
            return runs["torch"]().numpy()
    errs = check(q, k, v, kp, vp, table, lengths, torch_out)
    bad = [n for n in ("attnkit", "paged") if not errs[n] <= 1]
    if bad:
        print(f"{bad} failed the check against the reference ({errs}); not timed")
        return None
    times = {n: min(t) for n, t in interleaved(runs, repeats, gap_s=0.3, settle=True).items()}
    kv_bytes = 2 * B * HKV * S * D * 4
    bw = READ_BYTES / times["read"] / 1e9
    for n, t in times.items():
        ratio = "" if n in ("attnkit", "read") else f"{t / times['attnkit']:.2f}×"
        gbs = (READ_BYTES if n == "read" else kv_bytes) / t / 1e9
        print(f"| {B} | {S} | {n} | {t * 1e3:.1f} | {gbs:.1f} | {gbs / bw:.0%} | {ratio} |")
    got = {"bandwidth share": kv_bytes / times["attnkit"] / 1e9 / bw,
           "paged vs contiguous": times["attnkit"] / times["paged"]}
    if "torch" in times:
        got["vs torch"] = times["torch"] / times["attnkit"]
    missed = []
    for name, value in got.items():
        ok = value >= TARGETS[name]
        print(f"  - B={B} S={S} {name}: {value:.2f} (target ≥ {TARGETS[name]}) "
              f"{'meets' if ok else 'MISSES'} the target")
        missed += [] if ok else [f"B={B} S={S} {name}"]
    return missed


def small_step(repeats: int) -> None:
    """A small model's decoding step in a loop of one's own: torch tensors, B = 4, H = 8
    over Hkv = 2, D = 32, a contiguous cache of 64 slots holding 40, 17, 62 and 0 keys;
    one new key appended per sequence, then attended. attnkit.attention_kvcache against
    the same step in torch: the append by index, SDPA with the lengths as a key mask
    (both made from the lengths, as each step's lengths differ); and attnkit on the
    same keys in a paged cache (pages of 16, shuffled). Per-call overhead, not
    bandwidth: reported, no target."""
    import torch
    import torch.nn.functional as F
    B, Hs, Hk, Ds, S = 4, 8, 2, 32, 64
    rng = np.random.default_rng(1)
    q, kn, vn = (torch.from_numpy(rng.standard_normal(shape, dtype=np.float32))
                 for shape in ((B, Hs, 1, Ds), (B, Hk, 1, Ds), (B, Hk, 1, Ds)))
    kc, vc = (torch.from_numpy(rng.standard_normal((B, Hk, S, Ds), dtype=np.float32)) for _ in range(2))
    lengths = torch.tensor([40, 17, 62, 0])
    P, n = 16, S // 16
    table = torch.from_numpy(rng.permutation(B * n).reshape(B, n))
    kp, vp = (torch.empty(B * n, Hk, P, Ds) for _ in range(2))
    for pages, c in ((kp, kc), (vp, vc)):
        pages[table.reshape(-1)] = c.reshape(B, Hk, n, P, Ds).transpose(1, 2).reshape(B * n, Hk, P, Ds)

    def torch_step():
        rows, slots = torch.arange(B)[:, None], lengths[:, None]
        kc[rows, :, slots] = kn.transpose(1, 2)
        vc[rows, :, slots] = vn.transpose(1, 2)
        keep = (torch.arange(S) <= lengths[:, None])[:, None, None, :]
        return F.scaled_dot_product_attention(q, kc, vc, attn_mask=keep, enable_gqa=True)

    def attnkit_step():
        return attnkit.attention_kvcache(q, kc, vc, lengths, k_new=kn, v_new=vn)

    def paged_step():
        return attnkit.attention_kvcache(q, kp, vp, lengths, block_table=table, k_new=kn, v_new=vn)

    calls = 200                                          # per timed run: the best run ÷ calls
    runs = {n: (lambda f=f: [f() for _ in range(calls)]) for n, f in (("attnkit", attnkit_step),
                                                                      ("paged", paged_step), ("torch", torch_step))}
    with torch.no_grad():
        err = max(float((f() - torch_step()).abs().max()) for f in (attnkit_step, paged_step))
        times = {n: min(t) / calls for n, t in interleaved(runs, repeats, gap_s=0.1).items()}
    print(f"\n- a small model's step, append + attend (B={B}, H={Hs}/{Hk}, D={Ds}, {S} slots, torch tensors): "
          f"attnkit {times['attnkit'] * 1e6:.0f} µs, torch (index + SDPA with a length mask) "
          f"{times['torch'] * 1e6:.0f} µs: {times['torch'] / times['attnkit']:.2f}×; attnkit on pages of {P} "
          f"(shuffled) {times['paged'] * 1e6:.0f} µs: {times['torch'] / times['paged']:.2f}× (no target; "
          f"largest difference {err:.1e})")


def half_caches(repeats: int) -> None:
    """Caches of a capacity far past their keys in float16 and bfloat16, which the
    NumPy rungs convert to float32 (B = 4, H = 32 over Hkv = 8, D = 128, 60, 50, 40 and
    30 keys, torch CPU tensors): a contiguous cache of 8,192 slots and a pool of 4,096
    pages of 16 (four pages in use per sequence), against the same calls in float32.
    What is converted is the keys in use, not the capacity (docs/decisions.md). No
    target."""
    import torch
    B, Hq, Hk, Dh, S, pages = 4, 32, 8, 128, 8192, 4096
    gen = torch.Generator().manual_seed(3)
    lengths, table = torch.tensor([60, 50, 40, 30]), torch.randperm(pages, generator=gen)[:16].reshape(4, 4)
    runs = {}
    for dt in ("float32", "float16", "bfloat16"):
        d = getattr(torch, dt)
        q = torch.randn(B, Hq, 1, Dh, generator=gen).to(d)
        kc, vc = (torch.randn(B, Hk, S, Dh, generator=gen).to(d) for _ in range(2))
        kp, vp = (torch.randn(pages, Hk, 16, Dh, generator=gen).to(d) for _ in range(2))
        runs[dt, "contiguous"] = lambda q=q, kc=kc, vc=vc: attnkit.attention_kvcache(q, kc, vc, lengths)
        runs[dt, "paged"] = lambda q=q, kp=kp, vp=vp: attnkit.attention_kvcache(q, kp, vp, lengths, block_table=table)
    with torch.no_grad():
        times = {n: min(t) for n, t in interleaved(runs, repeats, gap_s=0.005, settle=True).items()}
    print(f"\n- half-precision caches of {S} slots / a pool of {pages} pages, 30–60 keys in use (B={B}, H={Hq}/{Hk}, "
          f"D={Dh}, torch CPU tensors; no target): " + "; ".join(
              f"{kind} float16 {times['float16', kind] * 1e3:.2f} ms, bfloat16 {times['bfloat16', kind] * 1e3:.2f} ms,"
              f" float32 {times['float32', kind] * 1e3:.2f} ms" for kind in ("contiguous", "paged")))


def generate(rounds: int) -> list[str]:
    """Tiny Llama, greedy: prompt 32, 20 new tokens, attnkit vs sdpa (same tokens).

    One model, switched between implementations (``set_attn_implementation``, untimed)
    before each run: the same weights in the same memory for every provider (where a
    model's tensors lie moved a generate by a percent or two: docs/decisions.md).
    "control" is "sdpa" again, timed as a third provider: how far two identical
    providers' ratio strays in this run. Each timed generate directly follows an
    untimed one (``settle``): after the idle gap the host's second core took 4–8 ms to
    come back, for torch's ops as for attnkit's (docs/decisions.md)."""
    import torch
    import transformers

    import attnkit.hf
    attnkit.hf.register()
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                                   num_key_value_heads=2, intermediate_size=512, max_position_embeddings=128)
    ids = torch.randint(1, 512, (4, 32), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    impls = {"sdpa": "sdpa", "attnkit": "attnkit", "control": "sdpa"}
    tokens = {}

    def switch(name):
        model.set_attn_implementation(impls[name])

    mask = torch.ones(4, 32, dtype=torch.long)        # left-padded prompts of 32, 20, 27 and 12 tokens
    for b, n in enumerate((32, 20, 27, 12)):
        mask[b, :32 - n] = 0
    padded = ids * mask

    def run(name, pad=False):
        with torch.no_grad():
            tokens[name, pad] = model.generate(input_ids=padded if pad else ids, attention_mask=mask if pad else None,
                                               max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0)

    switch("attnkit")
    calls = hf_calls(lambda: run("attnkit"))             # the switch works: attnkit's function runs
    switch("sdpa")
    run("sdpa")
    assert calls == 4 * 20, f"attnkit's attention ran {calls} times in a generate, not 80"

    times = interleaved({n: (lambda n=n: run(n)) for n in impls}, rounds, gap_s=0.3, settle=True,
                        prepare={n: (lambda n=n: switch(n)) for n in impls})
    best = {n: min(t) for n, t in times.items()}
    same = torch.equal(tokens["sdpa", False], tokens["attnkit", False])
    ratio = best["sdpa"] / best["attnkit"]
    print(f"\n- transformers tiny Llama greedy generate (B=4, prompt 32, 20 new tokens, best of {rounds}): "
          f"attnkit {best['attnkit'] * 1e3:.0f} ms, sdpa {best['sdpa'] * 1e3:.0f} ms: {ratio:.2f}× "
          f"(target ≥ {TARGETS['generate vs sdpa']}), same tokens: {same}; control (sdpa against sdpa): "
          f"{best['sdpa'] / best['control']:.2f}×")
    two = ("sdpa", "attnkit")                             # left-padded prompts (batched generation's)
    padded_times = interleaved({n: (lambda n=n: run(n, True)) for n in two}, rounds, gap_s=0.3, settle=True,
                               prepare={n: (lambda n=n: switch(n)) for n in two})
    pb = {n: min(t) for n, t in padded_times.items()}
    print(f"- the same, prompts left-padded (32, 20, 27 and 12 tokens; no target): attnkit {pb['attnkit'] * 1e3:.0f}"
          f" ms, sdpa {pb['sdpa'] * 1e3:.0f} ms: {pb['sdpa'] / pb['attnkit']:.2f}×, same tokens: "
          f"{torch.equal(tokens['sdpa', True], tokens['attnkit', True])}")
    return [] if ratio >= TARGETS["generate vs sdpa"] and same else ["generate vs sdpa"]


def sinks_generate(rounds: int) -> None:
    """A tiny gpt-oss, greedy (B=4, prompt 32, 20 new tokens): learned sinks (``s_aux``)
    in every layer, sliding-window layers (window 16, on transformers' sliding cache)
    between full ones. Its peer is "eager": transformers' gpt-oss has no sdpa. The
    same model switched between the two, as :func:`generate`. No target."""
    import torch
    import transformers

    import attnkit.hf
    attnkit.hf.register()
    cfg = transformers.GptOssConfig(vocab_size=512, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                                    num_key_value_heads=2, head_dim=32, intermediate_size=256, num_local_experts=4,
                                    num_experts_per_tok=2, max_position_embeddings=256, sliding_window=16,
                                    layer_types=["sliding_attention", "full_attention"] * 2)
    ids = torch.randint(1, 512, (4, 32), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    tokens = {}

    def run(name):
        with torch.no_grad():
            tokens[name] = model.generate(input_ids=ids, max_new_tokens=20, min_new_tokens=20, do_sample=False,
                                          pad_token_id=0)
    model.set_attn_implementation("attnkit")
    calls = hf_calls(lambda: run("attnkit"))
    assert calls == 4 * 20, f"attnkit's attention ran {calls} times in a generate, not 80"
    two = ("eager", "attnkit")
    times = interleaved({n: (lambda n=n: run(n)) for n in two}, rounds, gap_s=0.3, settle=True,
                        prepare={n: (lambda n=n: model.set_attn_implementation(n)) for n in two})
    best = {n: min(t) for n, t in times.items()}
    print(f"- tiny gpt-oss greedy generate, sinks and sliding layers (B=4, prompt 32, 20 new tokens, best of "
          f"{rounds}; no target): attnkit {best['attnkit'] * 1e3:.0f} ms, eager {best['eager'] * 1e3:.0f} ms: "
          f"{best['eager'] / best['attnkit']:.2f}×, same tokens: {torch.equal(tokens['eager'], tokens['attnkit'])}")


if __name__ == "__main__":
    sys.exit(main())

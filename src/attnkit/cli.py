"""The `attnkit` command (also `python -m attnkit`): explain | info | bench.

    attnkit explain                          the worked example, step by step
    attnkit explain --q "1,0" --k "1,0;0,1" --v "10,0;0,10" --labels apple,cheese
    attnkit explain --random 4 6 8 --seed 1 --causal --plot weights.png
    attnkit explain --report out/            a self-contained HTML page
    attnkit explain --mistakes [--plot entropy.png]
    attnkit explain --packed 2,3 --causal    two sequences side by side (random inputs)
    attnkit explain --sinks 0.5 --alibi 0.5 --dropout 0.3 --dropout-seed 1
    attnkit explain --q @q.npy --k @k.npy --v @v.npy --head 5   inputs from files, one head
    attnkit info                             versions, the BLAS, which backends run here
    attnkit bench --shape 1 8 4096 64 --causal --backward   speed here, next to torch SDPA

Matrices are written as text, rows separated by ";" and values by "," (or spaces):
"1,0;0,1" is the 2 × 2 identity; @FILE reads one from a file (.npy, .npz, .pt, .csv,
.tsv, .txt). Masks use 1/0 (or t/f, x/.): for --drop 1 = masked out, for --keep 1 =
may attend. Bad input gives a one-line error naming the flag and
exit status 1 (2 for usage errors); bare `attnkit` lists the commands and exits 0.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import sys

import numpy as np

from .matrices import TEXT_FILES, parse_matrix, read_matrix


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _one_head(x, name, head, batch, H, B, grouped=False, shape=None):
    """x (…, heads, rows, cols) narrowed to --batch and --head: batch element ``batch``
    of an array (B, heads, rows, cols) (a batch of one: its element; another batch
    than q's B, where q has one, refused), then query head ``head`` of q's H (an axis of one head:
    shared; ``grouped``, k and v: the head of the query head's GQA group, h // (H /
    heads)). Without --head every head stays. ``shape``: the file's shape for the
    errors, where x is a view with axes added."""
    shape = tuple(x.shape) if shape is None else shape
    if x.ndim == 4 and B is not None and x.shape[0] not in (1, B):
        raise ValueError(f"{name}: shape {shape} holds a batch of {x.shape[0]}, q's is {B}")
    if x.ndim == 4 and (x.shape[0] == 1 or batch is not None):
        b = 0 if x.shape[0] == 1 else batch
        if b >= x.shape[0]:
            raise ValueError(f"--batch: expected a batch index below {x.shape[0]} ({name} {shape}), got {b}")
        x = x[b]
    if head is None or x.ndim < 3:
        return x
    if x.ndim > 3:
        raise ValueError(f"{name}: shape {shape} holds a batch of {x.shape[0]}; "
                         + ("pick one with --batch N" if B else "q has none to pick it from with --batch")
                         if x.ndim == 4 else f"{name}: --head picks from arrays (B, H, rows, cols) or "
                         f"(H, rows, cols), got shape {shape}")
    n = x.shape[0]
    if n in (1, H):
        return x[0 if n == 1 else head]
    if grouped and H % n == 0:
        return x[head // (H // n)]
    raise ValueError(f"{name}: shape {shape} has {n} heads; expected 1 or q's {H}"
                     + (" or a divisor of it (GQA)" if grouped else ""))


def _head(args, q):
    """(head, batch, H, B) for :func:`_one_head`: --head and --batch checked against q
    (…, H, L, D) (read before it is narrowed); B its batch (None: no batch axis)."""
    H = q.shape[-3] if q.ndim >= 3 else 1
    head = None if args.head is None else _int(args.head, "--head")
    batch = None if args.batch is None else _int(args.batch, "--batch")
    if head is not None and q.ndim < 3:
        raise ValueError(f"--head: q has no head axis (shape {q.shape}); --head picks from q (…, H, L, D)")
    if head is not None and head >= H:
        raise ValueError(f"--head: expected a head below q's {H} (shape {q.shape}), got {head}")
    if batch is not None and q.ndim != 4:
        raise ValueError(f"--batch: picks from q of shape (B, H, L, D), got shape {q.shape}")
    return head, batch, H, (q.shape[0] if q.ndim == 4 else None)


def _int(text, name, lo=0, none_ok=False, hi=None):
    if none_ok and text.lower() in ("none", "-", "inf"):
        return None
    try:
        x = int(text)
    except ValueError:
        raise ValueError(f"{name}: expected an integer{' or none' if none_ok else ''}, got {text!r}") from None
    if x < lo:
        raise ValueError(f"{name}: expected an integer >= {lo}, got {x}")
    if hi is not None and x >= hi:
        raise ValueError(f"{name}: expected an integer below {hi}, got {x}")
    return x


def _float(text, name, positive=False):
    """A finite float from the command line (positive when asked); errors name the flag."""
    try:
        x = float(text)
    except ValueError:
        raise ValueError(f"{name}: expected a number, got {text!r}") from None
    if not np.isfinite(x) or (positive and not x > 0):
        raise ValueError(f"{name}: expected a {'positive ' if positive else ''}finite number, got {text!r}")
    return x


def _lengths(text, name):
    """Sequence lengths like "2,3" (each >= 1)."""
    parts = [c for c in re.split(r"[,\s]+", text.strip()) if c]
    if not parts:
        raise ValueError(f"{name}: expected lengths like 2,3, got {text!r}")
    return [_int(c, name, lo=1) for c in parts]


def _count(n, noun):
    """ "1 query", "2 queries", "3 keys"."""
    if n == 1:
        return f"1 {noun}"
    return f"{n} {noun[:-1]}ies" if noun.endswith("y") and noun[-2] not in "aeiou" else f"{n} {noun}s"


def _packed(args):
    """(query lengths, key lengths) from --packed, or None."""
    if args.packed is None:
        return None
    if len(args.packed) > 2:
        raise ValueError("--packed: expected one list of lengths (queries and keys alike) or "
                         f"two (queries, then keys), got {len(args.packed)}")
    lq = _lengths(args.packed[0], "--packed")
    lk = _lengths(args.packed[-1], "--packed")
    if len(lq) != len(lk):
        raise ValueError(f"--packed: {_count(len(lq), 'query length')} but {_count(len(lk), 'key length')}")
    return lq, lk


def _inputs(args):
    """(q, k, v, labels, query_labels, kind, heads, note) from the command line; kind
    is "example" (the built-in worked example), "random" or "given"; heads:
    :func:`_head`'s (for masks read from files); note: what was read from files, or None."""
    from .explain import EXAMPLE, check_size
    given = [x is not None for x in (args.q, args.k, args.v)]
    heads, note = (None, None, 1, None), None
    if args.random is not None and any(given):
        raise ValueError("--random: give either --random L S D or --q/--k/--v, not both")
    seed = _int(args.seed, "--seed", lo=0)
    packed = _packed(args)
    if args.random is not None or (packed and not any(given)):
        if args.random is not None:
            L, S, D = (_int(x, "--random", lo=1) for x in args.random)
        else:                                      # --packed alone: random inputs of its lengths
            L, S, D = sum(packed[0]), sum(packed[1]), 2
        check_size((L, D), (S, D), (S, D), arg="--random" if args.random is not None else "--packed")
        rng = np.random.default_rng(seed)
        q, k, v = (rng.standard_normal(shape) for shape in ((L, D), (S, D), (S, D)))
        kind = "random"
    elif any(given):
        q, k, v = (None if t is None else read_matrix(t, n)
                   for t, n in ((args.q, "--q"), (args.k, "--k"), (args.v, "--v")))
        missing = [n for n, g in zip(("--q", "--k", "--v"), given) if not g]
        if missing:
            raise ValueError(f"{', '.join(missing)}: required with --q/--k/--v (or use --random L S D)")
        heads = _head(args, q)
        shapes = [f"{n[2:]} {x.shape} from {t[1:]}" for x, n, t in ((q, "--q", args.q), (k, "--k", args.k),
                                                                    (v, "--v", args.v)) if t.startswith("@")]
        head, batch, H, _ = heads
        picks = ([f"batch element {batch}"] if batch is not None else []) + \
            ([f"query head {head}"] if head is not None else [])
        if head is not None and k.ndim >= 3 and 1 < k.shape[-3] < H and H % k.shape[-3] == 0:
            picks[-1] += f" (its group's key and value head {head // (H // k.shape[-3])})"
        q, k, v = (_one_head(x, n, *heads, grouped=n != "--q") for x, n in ((q, "--q"), (k, "--k"), (v, "--v")))
        if shapes:
            note = "Read " + ", ".join(shapes) + (": " + ", ".join(picks) if picks else "") + "."
        if q.ndim >= 3:                              # heads left: within explain's limit?
            try:
                check_size(q.shape, k.shape, v.shape)
            except ValueError as e:
                raise ValueError(f"{e}; --head N shows one head" + (", --batch N one batch element"
                                                                     if q.ndim > 3 else "")) from None
        kind = "given"
    else:
        q, k, v = (np.array(EXAMPLE[n]) for n in ("q", "k", "v"))
        kind = "example"
    if kind != "given" and (args.head is not None or args.batch is not None):
        raise ValueError(f"--{'head' if args.head is not None else 'batch'}: picks from inputs read from files "
                         "(--q @q.npy …) with a head axis")
    example = kind == "example"
    labels = args.labels.split(",") if args.labels else (EXAMPLE["labels"] if example else None)
    qlabels = args.query_labels.split(",") if args.query_labels else (
        EXAMPLE["query_labels"] if example else None)
    return q, k, v, labels, qlabels, kind, heads, note


def _options(args, L, S, heads=(None, None, 1, None)) -> dict:
    """The masking keywords from the flags (only those given); L, S: the inputs' sizes;
    heads: (--head, --batch, q's heads, q's batch) for masks read from files."""
    opts = {"causal": args.causal, "align": args.align}
    head, batch, H, B = heads
    if args.scale is not None:
        opts["scale"] = _float(args.scale, "--scale")
    if args.softcap is not None:
        opts["softcap"] = _float(args.softcap, "--softcap", positive=True)
    if args.window is not None:
        opts["window"] = tuple(_int(x, "--window", none_ok=True) for x in args.window)
    for name, kind in (("keep", bool), ("drop", bool), ("bias", float)):
        if getattr(args, name) is not None:
            opts[name] = _one_head(read_matrix(getattr(args, name), f"--{name}", kind), f"--{name}", *heads)
    if args.alibi is not None and args.alibi.startswith("@"):     # (H,) or (…, H): one slope per head
        x = read_matrix(args.alibi, "--alibi", vector=True)
        if args.alibi.lower().endswith(TEXT_FILES) and 1 in x.shape:   # a table's row or column
            x = x.reshape(-1)
        if x.ndim > 2:
            raise ValueError(f"--alibi: expected slopes (H,) or (B, H) in {args.alibi[1:]}, got shape {x.shape}")
        opts["alibi_slopes"] = np.atleast_1d(_one_head(x[..., None, None], "--alibi", head, batch, H, B,
                                                       shape=x.shape)[..., 0, 0])
    elif args.alibi is not None:
        opts["alibi_slopes"] = np.array([_float(args.alibi, "--alibi")])
    if args.sinks is not None and args.sinks.startswith("@"):     # (H,) per head, or (…, H, L)
        x = read_matrix(args.sinks, "--sinks", vector=True)
        if x.ndim > 3 or x.ndim > 1 and x.shape[-1] not in (1, L):
            raise ValueError(f"--sinks: expected logits (H,) one per head, or (H, L) or (B, H, L) one per "
                             f"query row (L = {L}) in {args.sinks[1:]}, got shape {x.shape}")
        if x.ndim == 1:                                           # one head's logit for all its rows
            opts["sinks"] = _one_head(x[:, None, None], "--sinks", head, batch, H, B, shape=x.shape)[..., 0, 0]
        elif x.ndim > 1:                                          # (…, H, L) as a mask's rows
            x = _one_head(x[..., None], "--sinks", head, batch, H, B, shape=x.shape)[..., 0]
            opts["sinks"] = x.reshape(1, -1) if x.ndim == 1 else x   # (L,) of one head: per query
        else:
            opts["sinks"] = x                                     # one logit for every row
    elif args.sinks is not None:
        x = parse_matrix(args.sinks, "--sinks")
        if x.size == 1:
            opts["sinks"] = x.reshape(())           # one logit for every query (and every head)
        elif x.shape[0] == 1 and x.size == L:
            opts["sinks"] = x                       # (1, L): one logit per query
        else:
            got = f"{x.size}" if x.shape[0] == 1 else f"{x.shape[0]} rows of {x.shape[1]}"
            raise ValueError(f"--sinks: expected 1 value (one sink logit for every query) or one row of "
                             f"L = {L} (one per query, separated by commas), got {got}")
    packed = _packed(args)
    if packed is not None:
        for lens, n, who in ((packed[0], L, "query"), (packed[1], S, "key")):
            if sum(lens) != n:
                raise ValueError(f"--packed: the lengths {','.join(map(str, lens))} add up to "
                                 f"{sum(lens)}, but there {'is' if n == 1 else 'are'} {_count(n, who)}")
        opts["cu_seqlens_q"], opts["cu_seqlens_k"] = (np.concatenate([[0], np.cumsum(x)]).astype(np.int64)
                                                      for x in packed)
    if args.dropout is not None:
        p = _float(args.dropout, "--dropout")
        if not 0 <= p < 1:
            raise ValueError(f"--dropout: expected a probability 0 <= p < 1, got {args.dropout!r}")
        opts["dropout"] = p
        opts["seed"] = 0 if args.dropout_seed is None else _int(args.dropout_seed, "--dropout-seed", lo=0,
                                                                        hi=2 ** 64)
    elif args.dropout_seed is not None:
        raise ValueError("--dropout-seed: only used with --dropout P")
    return opts


def _progress(i, n, d_k):
    """A progress bar on stderr when it is a terminal (nothing in pipes and logs)."""
    if not sys.stderr.isatty():
        return
    bar = "#" * (20 * i // n)
    sys.stderr.write(f"\r  d_k sweep [{bar:<20}] {i}/{n}  d_k = {d_k:<5}")
    if i == n:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _say(args, text):
    print(text, file=sys.stderr if args.json else sys.stdout)


def _cmd_explain(args) -> int:
    ex = importlib.import_module("attnkit.explain")  # the module (attnkit.explain, the name, is the function)
    from . import plot  # light: matplotlib is imported on use
    for name in ("plot", "report"):
        if getattr(args, name) == "":
            raise ValueError(f"--{name}: expected a {'file' if name == 'plot' else 'folder'} name, got an empty one")
    if args.plot or args.report:
        plot.require()
        if args.plot:
            plot.check_path(args.plot)
        if args.report:
            plot.check_folder(args.report)
    if args.mistakes:
        given = [f"--{n.replace('_', '-')}" for n in _INPUT_OPTIONS if getattr(args, n) not in (None, False)]
        if given:
            raise ValueError(f"--mistakes: uses its own random inputs; drop {', '.join(given)}")
        m = ex.mistakes(progress=_progress)
        print(json.dumps(m) if args.json else ex.mistakes_text(m))
        if args.plot:
            _say(args, f"wrote {plot.save(plot.entropy_figure(m['entropy']), args.plot)}")
        trace = story = None                         # the report shows the worked example
        heading = "The worked example"
    else:
        q, k, v, labels, qlabels, kind, heads, note = _inputs(args)
        opts = _options(args, q.shape[-2], k.shape[-2], heads)
        trace = ex.explain(q, k, v, labels=labels, query_labels=qlabels, **opts)
        plain = kind == "example" and not (args.labels or args.query_labels) and opts == {
            "causal": False, "align": "bottom_right"}
        story = ex.worked_example() if plain else trace.render()
        if kind == "random":
            note = (f"Random inputs: q, k, v drawn from a normal distribution with --seed "
                    f"{_int(args.seed, '--seed')}, the seed of the random numbers: the same seed "
                    "gives the same inputs.")
        if note:
            from .explain.formatting import wrap
            story = "\n".join(wrap([note], ex.WIDTH) + ["", story])
        heading = "The worked example" if kind == "example" else "Your inputs, step by step"
        if args.json:
            data = trace.to_dict()
            data["inputs"] = {"q": q.tolist(), "k": k.tolist(), "v": v.tolist()}
            print(json.dumps(data, allow_nan=False))
        else:
            print(story)
        if args.plot:
            _say(args, f"wrote {plot.save(plot.trace_figure(trace), args.plot)}")
        m = ex.mistakes(progress=_progress) if args.report else None
    if args.report:
        if trace is None:
            trace, story = ex.example_trace(), ex.worked_example()
        page = plot.report_html(trace, "attnkit explain: attention, step by step", story,
                                m, ex.mistakes_text(m), story_title=heading)
        _say(args, f"wrote {plot.write_report(args.report, page)}")
    return 0


# explain's options that choose inputs or masks (not allowed with --mistakes)
_INPUT_OPTIONS = ("q", "k", "v", "random", "head", "batch", "labels", "query_labels", "causal", "window", "keep",
                  "drop", "bias", "scale", "softcap", "alibi", "sinks", "packed", "dropout",
                  "dropout_seed")
# the packages `attnkit info` reports: (distribution, name as written)
_VERSIONS = (("numpy", "NumPy"), ("numba", "numba"), ("threadpoolctl", "threadpoolctl"),
             ("torch", "torch"), ("triton", "Triton"), ("matplotlib", "matplotlib"))


def _version(dist) -> str:
    from importlib import metadata
    try:
        version = metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"
    try:                                           # installed is not importable (a broken
        importlib.import_module(dist)              # install, a missing library)
    except Exception as e:  # noqa: BLE001 - whatever stops the import is what to report
        return f"{version}, but it cannot be imported ({type(e).__name__}: {' '.join(str(e).split())[:100]})"
    return version


def _blas() -> list[str]:
    """One line per BLAS / OpenMP library loaded in this process, with its threads."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return ["  threadpoolctl is not installed, so the BLAS cannot be listed "
                "(pip install 'attnkit[fast]')"]
    lines = []
    for lib in threadpool_info():
        n = lib.get("num_threads")
        extra = ", ".join(str(lib[x]) for x in ("architecture", "threading_layer") if lib.get(x))
        name = " ".join(str(x) for x in (lib.get("internal_api", "?"), lib.get("version")) if x)
        lines.append(f"  {lib.get('user_api', '?'):<7} {name}: {n} thread{'s' if n != 1 else ''}"
                     + (f" ({extra})" if extra else ""))
        lines.append(f"          {lib.get('filepath', '')}")
    return lines or ["  none found"]


def _cmd_info(args) -> int:
    import platform
    import textwrap

    from . import __version__
    from .backends import info
    print("attnkit backends on this machine:")
    for name, status, desc in info():
        print(f"  {name:<10} {desc}")
        print(textwrap.fill(status, 78, initial_indent=" " * 13, subsequent_indent=" " * 13))
    print(textwrap.fill("(A rung is one backend of attnkit's ladder: each is tested against the one "
                        "below it, down to the reference, the definition.)", 78,
                        initial_indent="  ", subsequent_indent="  "))
    print("")
    print(f"attnkit {__version__}, Python {platform.python_version()}")
    for dist, label in _VERSIONS:
        print(f"  {label:<14} {_version(dist)}")
    print("BLAS and OpenMP libraries loaded (threadpoolctl.threadpool_info()):")
    for line in _blas():
        print(line)
    return 0


def _cmd_bench(args) -> int:
    from . import bench
    B, H, L, D = args.shape
    r = bench.run(B, H, L, args.kv_len, D, dtype=args.dtype, device=args.device, causal=args.causal,
                  backward=args.backward, repeats=args.repeats, backend=args.backend,
                  peers=not args.no_peers)
    print(json.dumps(r, indent=1) if args.json else bench.report(r))
    return 0 if r["checks"]["attnkit"]["ok"] else 1


def _bench_parser(sub):
    p = sub.add_parser(
        "bench", help="attention's speed here, next to PyTorch's SDPA (checked first)",
        description="Check attnkit (and PyTorch's scaled_dot_product_attention, when torch is "
                    "installed) against the float64 reference on a small problem, then time both "
                    "in one run: best of --repeats, in a new order each round. Causal uses "
                    "align=top_left, PyTorch's is_causal.")
    p.add_argument("--shape", nargs=4, type=int, default=[1, 8, 4096, 64], metavar=("B", "H", "L", "D"),
                   help="batch, heads, query length, head dim (default 1 8 4096 64)")
    p.add_argument("--kv-len", type=int, metavar="S", help="key/value length (default L)")
    p.add_argument("--dtype", choices=("float32", "float64", "float16", "bfloat16"), default="float32")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda runs torch tensors (attnkit's Triton kernels)")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--backward", action="store_true", help="also time forward+backward")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds (default 5)")
    p.add_argument("--backend", default="auto", help="attnkit's backend (default auto)")
    p.add_argument("--no-peers", action="store_true", help="time attnkit alone")
    p.add_argument("--json", action="store_true", help="the result as JSON")
    p.set_defaults(fn=_cmd_bench)


def _explain_parser(sub):
    p = sub.add_parser(
        "explain", help="the four steps of attention on a worked example or your numbers",
        description="Attention step by step on real numbers, computed by attnkit's reference "
                    "code (its definition). With no arguments: the worked example (a query "
                    "wanting 'sweet'; keys apple and cheese).",
        epilog='Matrices: rows by ";", values by "," -- e.g. --q "1,0" --k "1,0;0,1" -- or @FILE: '
               "--q @q.npy --k @k.npy --v @v.npy (files may hold (B, H, L, D) arrays; --head, --batch). "
               "Masks: 1/0 per (query, key). Figures need matplotlib: pip install 'attnkit[plot]'.")
    src = p.add_argument_group("inputs (default: the worked example)")
    src.add_argument("--q", metavar="MATRIX", help='queries, L rows of D values: "1,0;0,1", or @FILE '
                     "(.npy, .npz, .pt, .csv, .tsv, .txt; @FILE.npz:NAME for one of its arrays)")
    src.add_argument("--k", metavar="MATRIX", help="keys, S rows of D values")
    src.add_argument("--v", metavar="MATRIX", help="values, S rows of Dv values")
    src.add_argument("--random", nargs=3, metavar=("L", "S", "D"),
                     help="random normal q, k, v (L · S at most 1,000,000)")
    src.add_argument("--seed", default="0", metavar="N",
                     help="the random seed for --random: the same seed gives the same numbers (default 0)")
    src.add_argument("--head", metavar="N", help="with inputs from files of shape (…, H, L, D): query head N "
                     "(and the kv head its group shares); default every head")
    src.add_argument("--batch", metavar="N", help="with inputs from files of shape (B, H, L, D): batch element N")
    src.add_argument("--labels", metavar="A,B,...", help="names of the S keys (e.g. apple,cheese)")
    src.add_argument("--query-labels", metavar="A,B,...", help="names of the L queries")
    m = p.add_argument_group("masks and options (as in attnkit.attention)")
    m.add_argument("--causal", action="store_true", help="key j excluded when j > diag(i)")
    m.add_argument("--window", nargs=2, metavar=("LEFT", "RIGHT"),
                   help="keep keys diag(i)-LEFT..diag(i)+RIGHT; 'none' = unbounded side")
    m.add_argument("--align", choices=("bottom_right", "top_left"), default="bottom_right",
                   help="diagonal for causal/window when L != S (default bottom_right)")
    m.add_argument("--keep", metavar="MASK", help='L x S, 1 = may attend: "1,0;1,1"')
    m.add_argument("--drop", metavar="MASK", help="L x S, 1 = masked out")
    m.add_argument("--bias", metavar="MATRIX", help="L x S additive bias (-inf allowed)")
    m.add_argument("--scale", metavar="X", help="score scale (default 1/sqrt(D))")
    m.add_argument("--softcap", metavar="X", help="softcap · tanh(scores / softcap)")
    m.add_argument("--alibi", metavar="SLOPE", help="ALiBi: add -SLOPE · |diag(i) - j| to the scores "
                   "(@FILE: one slope per head, (H,) or (B, H))")
    m.add_argument("--sinks", metavar="VALUES",
                   help="a sink logit: 1 value for every query or L values, one per query "
                        "(the weights then sum to less than 1; @FILE: (H,) one per head, or (…, H, L))")
    m.add_argument("--packed", nargs="+", metavar="LENGTHS",
                   help='packed sequences side by side, e.g. "2,3" (cu_seqlens); a second list '
                        "gives the key lengths; alone: random inputs of those lengths")
    m.add_argument("--dropout", metavar="P", help="drop each weight with probability P "
                   "(the kept ones ÷ (1 - P))")
    m.add_argument("--dropout-seed", metavar="N",
                   help="the random seed that decides which weights drop (default 0)")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true",
                   help='machine-readable: every step (-inf as null, NaN as "nan")')
    o.add_argument("--plot", metavar="FILE", help="heatmaps of scores, weights and outputs "
                   "(.png/.svg/.pdf); with --mistakes, entropy against d_k")
    o.add_argument("--report", metavar="DIR", help="write DIR/index.html, a self-contained page")
    o.add_argument("--mistakes", action="store_true",
                   help="common mistakes with numbers: no √d_k scaling, Q/K/V roles, blend "
                        "not copy, order blindness")
    p.set_defaults(fn=_cmd_explain)


def parser() -> argparse.ArgumentParser:
    """The `attnkit` command line."""
    from . import __version__
    p = _Parser(prog="attnkit", description="Exact scaled dot-product attention.",
                epilog="Run `attnkit COMMAND --help` for a command's options. "
                       "`python -m attnkit` is the same command.")
    p.add_argument("--version", action="version", version=f"attnkit {__version__}")
    sub = p.add_subparsers(dest="cmd", title="commands", metavar="COMMAND", parser_class=_Parser)
    _explain_parser(sub)
    sub.add_parser("info", help="versions, the BLAS, and which backends run here (and why "
                                "the others do not)").set_defaults(fn=_cmd_info)
    _bench_parser(sub)
    return p


# explain's options that take one matrix or list: a value starting with "-" ("-1,0",
# "-inf,0") would read as an option, so it is joined to its option ("--q=-1,0")
_VALUE_OPTIONS = ("--q", "--k", "--v", "--keep", "--drop", "--bias", "--sinks", "--scale", "--softcap",
                  "--alibi", "--dropout")


def _join_negative_values(argv: list[str]) -> list[str]:
    out: list[str] = []
    for tok in argv:
        if out and out[-1] in _VALUE_OPTIONS and tok.startswith("-") and not tok.startswith("--") \
                and tok not in ("-h",):
            out[-1] = f"{out[-1]}={tok}"
        else:
            out.append(tok)
    return out


# the library's argument names that the command line spells otherwise
_FLAG_NAMES = {"alibi_slopes": "--alibi"}


def _as_flag(command: argparse.ArgumentParser, msg: str) -> str:
    """A message that starts with a library argument's name ("keep: expected ...")
    with the option the user typed instead ("--keep: expected ...")."""
    name, colon, rest = msg.partition(":")
    flags = {a.dest: a.option_strings[-1] for a in command._actions if a.option_strings}
    flag = _FLAG_NAMES.get(name) or flags.get(name)
    return f"{flag}:{rest}" if colon and flag and flag.startswith("--") else msg


def main(argv=None) -> int:
    for stream in (sys.stdout, sys.stderr):        # a console or file without UTF-8 (cp1252):
        if hasattr(stream, "reconfigure") and "utf" not in (stream.encoding or "").lower():   # ·, √ and ᵀ
            stream.reconfigure(errors="replace")                                                # become "?"
    p = parser()
    args, extra = p.parse_known_args(_join_negative_values(list(sys.argv[1:] if argv is None else argv)))
    commands = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices
    if extra:                                      # the command's parser says so (its --help)
        (commands[args.cmd] if args.cmd else p).error(f"unrecognized arguments: {' '.join(extra)}")
    if args.cmd is None:                           # bare `attnkit`: the commands, and success
        p.print_help()
        return 0
    from .plot import PlotUnavailable
    try:
        return args.fn(args)
    except BrokenPipeError:                        # `attnkit explain | head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (ValueError, TypeError, OSError, PlotUnavailable) as e:
        msg = _as_flag(commands[args.cmd], " ".join(str(e).split()))   # one line, whatever the message
        print(f"attnkit {args.cmd}: error: {msg}", file=sys.stderr)
        return 1
    except MemoryError:
        print(f"attnkit {args.cmd}: error: not enough memory for this problem; try smaller sizes",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:                      # Ctrl-C: one line, the shell's code for it
        print(f"attnkit {args.cmd}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

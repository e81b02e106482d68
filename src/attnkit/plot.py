"""Figures and the HTML report for ``attnkit explain``.

matplotlib is an optional extra (``pip install 'attnkit[plot]'``). It is imported
only when a figure is drawn, and figures are drawn on their own Agg canvas (no
pyplot, no global backend change), so importing attnkit never needs it.

>>> from attnkit.explain import explain
>>> import numpy as np, os, tempfile
>>> t = explain([[1.0, 0.0]], np.eye(2), [[10.0, 0.0], [0.0, 10.0]], labels=["apple", "cheese"])
>>> path = os.path.join(tempfile.mkdtemp(), "apple.png")
>>> save(trace_figure(t), path) == path and os.path.getsize(path) > 1000
True
"""

from __future__ import annotations

import base64
import html
import io
import os

import numpy as np

FORMATS = (".png", ".svg", ".pdf")
INSTALL = "pip install 'attnkit[plot]'"
MAX_ANNOTATED = 12          # write values in the cells when L and S are at most this


class PlotUnavailable(ImportError):
    """matplotlib is not installed; the message says how to install it."""


def require():
    """Raise PlotUnavailable (saying how to install it) when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotUnavailable(f"plotting needs matplotlib: {INSTALL}") from None


def _figure(width, height):
    """A matplotlib Figure on its own Agg canvas."""
    require()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def check_path(path) -> str:
    """The path if a figure can be written there: a known suffix and an existing,
    writable folder. Raises ValueError / OSError naming the problem (before any work).

    >>> check_path("weights.txt")
    Traceback (most recent call last):
    ...
    ValueError: --plot: expected a file ending in .png, .svg or .pdf, got 'weights.txt'
    """
    path = os.fspath(path)
    if os.path.splitext(path)[1].lower() not in FORMATS:
        raise ValueError(f"--plot: expected a file ending in .png, .svg or .pdf, got {path!r}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise OSError(f"cannot write {path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise OSError(f"cannot write {path}: permission denied")
    return path


def save(fig, path) -> str:
    """Write ``fig`` to ``path`` (format from the suffix); returns the path."""
    path = check_path(path)
    try:
        fig.savefig(path, dpi=110)
    except OSError as e:
        raise OSError(f"cannot write {path}: {e.strerror or e}") from None
    return path


def png_base64(fig) -> str:
    """The figure as a base64 PNG, for a data: URL."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return base64.b64encode(buf.getvalue()).decode("ascii")


NAN_COLOUR = "#e8a0a0"       # cells that are NaN: a non-finite value reached that row
EXCLUDED_COLOUR = "#a6a6a6"  # excluded keys (darker than coolwarm's middle, #dddddd)


def _heatmap(ax, a, rows, cols, title, cmap, fmt="{:.2f}", masked=None, vmin=None, vmax=None):
    """``a`` as an image with labelled axes: excluded cells (``masked``) grey with ×,
    NaN cells red with "NaN", ±inf cells grey with "inf"; values written in the
    cells when L and S are small."""
    a = np.asarray(a, dtype=float)
    ex = np.zeros(a.shape, bool) if masked is None else np.asarray(masked, bool)
    shown = np.ma.array(a, mask=ex | ~np.isfinite(a))
    im = ax.imshow(shown, cmap=_cmap(cmap), aspect="auto", vmin=vmin, vmax=vmax, interpolation="nearest")
    nan = np.isnan(a) & ~ex
    if nan.any():
        from matplotlib.colors import ListedColormap
        ax.imshow(np.ma.array(np.zeros(a.shape), mask=~nan), cmap=ListedColormap([NAN_COLOUR]),
                  aspect="auto", interpolation="nearest")
    L, S = a.shape
    small = L <= MAX_ANNOTATED and S <= MAX_ANNOTATED + 1
    if S <= 2 * MAX_ANNOTATED:
        ax.set_xticks(range(S), [str(c) for c in cols], rotation=45 if S > 6 else 0)
    if L <= 2 * MAX_ANNOTATED:
        ax.set_yticks(range(L), [str(r) for r in rows])
    if small:
        for i in range(L):
            for j in range(S):
                x = a[i, j]
                if ex[i, j]:
                    ax.text(j, i, "×", ha="center", va="center", color="#333333", fontsize=12)
                elif not np.isfinite(x):
                    word = "NaN" if np.isnan(x) else ("inf" if x > 0 else "-inf")
                    ax.text(j, i, word, ha="center", va="center", color="#222222", fontsize=9)
                else:
                    r, g, bl, _ = im.cmap(im.norm(x))
                    dark = 0.299 * r + 0.587 * g + 0.114 * bl < 0.5      # luminance of the cell
                    ax.text(j, i, fmt.format(x), ha="center", va="center", fontsize=9,
                            color="white" if dark else "black")
    ax.set_title(title, fontsize=10)
    ax.figure.colorbar(im, ax=ax, shrink=0.8)
    return im


def _cmap(name):
    from matplotlib import colormaps
    return colormaps[name].with_extremes(bad=EXCLUDED_COLOUR)


def _sequence_lines(ax, seqs):
    """Packed inputs: a line between sequences, so the diagonal blocks stand out."""
    for q0, _, k0, _ in seqs[1:]:
        ax.axhline(q0 - 0.5, color="black", lw=1.2)
        ax.axvline(k0 - 0.5, color="black", lw=1.2)


def panels(trace, block=None) -> list[dict]:
    """The panels of :func:`trace_figure`, left to right, as dicts (name, data,
    columns, title, cmap, masked, vmin, vmax): the ALiBi penalty (with alibi_slopes),
    the scores the softmax saw, the weights (a last column "sink" with sinks), the
    weights after dropout (with dropout) and the outputs."""
    b = trace.blocks()[0] if block is None else block
    s = trace.spec
    ex = None if trace.excluded is None else trace.pick(trace.excluded, b)
    keys, L, S = trace.labels, s.L, s.S
    small = L <= MAX_ANNOTATED and S <= MAX_ANNOTATED
    note = "" if ex is None else (" (× = excluded)" if small else " (grey = excluded)")
    out = []
    if s.alibi_slopes is not None:
        out.append(dict(name="alibi", data=trace.pick(trace.alibi_penalty, b), columns=keys,
                        title="ALiBi penalty −slope·|diag(i) − j|", cmap="Purples_r", masked=ex,
                        vmin=None, vmax=0.0))
    out.append(dict(name="scores", data=trace.pick(trace.final_scores, b), columns=keys,
                    title="scores · scale" + "".join(t for t, on in ((" → softcap", s.softcap is not None),
                                                                     (" + bias", s.bias is not None),
                                                                     (" + ALiBi", s.alibi_slopes is not None))
                                                     if on) + note,
                    cmap="coolwarm", masked=ex, vmin=None, vmax=None))
    w = trace.pick(trace.weights, b)
    if s.sinks is not None:
        sink = trace.pick(trace.sink_weights, b)
        out.append(dict(name="weights", data=np.concatenate([w, sink[:, None]], axis=1),
                        columns=keys + ["sink"], title="weights (softmax over keys + sink)",
                        cmap="Blues", masked=None if ex is None else np.concatenate(
                            [ex, np.zeros((L, 1), bool)], axis=1), vmin=0.0, vmax=1.0))
    else:
        out.append(dict(name="weights", data=w, columns=keys, title="weights = softmax over keys",
                        cmap="Blues", masked=ex, vmin=0.0, vmax=1.0))
    if s.dropout > 0:
        d = trace.pick(trace["dropped"], b)
        top = float(np.nanmax(d)) if np.isfinite(d).any() else 1.0
        out.append(dict(name="dropped", data=d, columns=keys,
                        title=f"after dropout p = {s.dropout:g} (seed {s.seed})", cmap="Blues",
                        masked=ex, vmin=0.0, vmax=max(1.0, top)))
    o = trace.pick(trace.out, b)
    out.append(dict(name="out", data=o, columns=[f"d{j}" for j in range(s.Dv)],
                    title="output = " + ("dropped" if s.dropout > 0 else "weights") + " · v",
                    cmap="viridis", masked=None, vmin=None, vmax=None))
    return out


def title(trace, block=None) -> str:
    """The figure's title: the formula, the block, and the masks used."""
    from .explain.text import formula
    b = trace.blocks()[0] if block is None else block
    name = trace.block_name(b)
    masks = ", ".join(trace.masks) if trace.masks else "none"
    return (formula(trace.spec) + (f"   [{name}]" if name else "")
            + f"\nmasks: {masks}")


def trace_figure(trace, block=None):
    """The panels of :func:`panels` for one (batch, head) block of a
    :class:`attnkit.explain.Trace` — excluded keys grey with ×, NaN cells red, packed
    sequences separated by lines — with labelled axes, the values in the cells for
    small sizes, and a title naming the masks used."""
    b = trace.blocks()[0] if block is None else block
    ps = panels(trace, b)
    L, S, Dv = trace.spec.L, trace.spec.S, trace.spec.Dv
    keyed = [p for p in ps if p["name"] != "out"]
    w = min(22.0, 4.2 * len(keyed) + 1.2 * max(2.5, Dv) + 0.35 * max(0, S - 6) * len(keyed))
    h = min(10.0, 2.6 + 0.45 * L)
    fig = _figure(w, h)
    axes = fig.subplots(1, len(ps), width_ratios=[max(len(p["columns"]), 2) for p in ps])
    seqs = trace.sequences()
    for ax, p in zip(axes, ps):
        _heatmap(ax, p["data"], trace.query_labels, p["columns"], p["title"], p["cmap"],
                 masked=p["masked"], vmin=p["vmin"], vmax=p["vmax"])
        ax.set_xlabel("output dims" if p["name"] == "out" else "keys")
        if seqs and p["name"] != "out":
            _sequence_lines(ax, seqs)
        if p["name"] == "weights" and trace.spec.sinks is not None:
            ax.axvline(S - 0.5, color="black", lw=2)
    axes[0].set_ylabel("queries")
    fig.suptitle(title(trace, b), fontsize=11)
    return fig


def entropy_figure(sweep):
    """Entropy of the weights against d_k, with and without the 1/√d_k scale, from
    :func:`attnkit.explain.entropy_sweep`."""
    fig = _figure(7.5, 4.2)
    ax = fig.subplots()
    d = sweep["d_k"]
    ax.plot(d, sweep["scaled"], "o-", label="scaled by 1/√d_k (right)")
    ax.plot(d, sweep["unscaled"], "s-", color="C3", label="no scaling (mistake)")
    ax.axhline(sweep["uniform"], ls="--", color="grey", lw=1,
               label=f"uniform over {sweep['S']} keys (ln {sweep['S']})")
    ax.set_xscale("log", base=2)
    ax.set_xticks(d, [str(x) for x in d])
    ax.set_xlabel("d_k (head dim)")
    ax.set_ylabel("entropy of the weights (nats)")
    ax.set_ylim(bottom=0)
    ax.set_title("Without √d_k scaling the softmax saturates as d_k grows")
    ax.legend(fontsize=9)
    ax.grid(alpha=0.3)
    return fig


def _table(trace, name, b):
    x = trace.pick(trace[name], b)
    s = trace.spec
    if name == "lse":
        x, cols = x[:, None], ["lse"]
    elif name == "out":
        cols = [f"d{j}" for j in range(s.Dv)]
    elif name == "weights" and s.sinks is not None:
        x, cols = np.concatenate([x, trace.pick(trace.sink_weights, b)[:, None]], axis=1), trace.labels + ["sink"]
    else:
        cols = trace.labels
    if x.shape[0] > 16 or x.shape[1] > 16:
        return f"<p><i>{x.shape[0]} × {x.shape[1]} values: see the figure</i></p>"

    def cell(v):
        if x.dtype == bool:
            return "×" if v else "·"
        if np.isnan(v):
            return "NaN"
        return ("−∞" if v < 0 else "∞") if np.isinf(v) else f"{v:.3f}"

    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in cols)
    body = "".join(
        f"<tr><th>{html.escape(str(trace.query_labels[i]))}</th>"
        + "".join(f"<td>{cell(v)}</td>" for v in row) + "</tr>" for i, row in enumerate(x))
    return f"<table><tr><th></th>{head}</tr>{body}</table>"


CSS = """body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;
color:#222;line-height:1.45}pre{background:#f6f6f6;padding:1rem;overflow-x:auto}
table{border-collapse:collapse;margin:.5rem 0 1rem}td,th{border:1px solid #ccc;padding:.2rem .6rem;
text-align:right;font-variant-numeric:tabular-nums}img{max-width:100%}h2{margin-top:2rem}"""


def report_html(trace, title, story, mistakes=None, mistakes_text=None,
                story_title="The worked example") -> str:
    """A self-contained HTML page: ``story`` (the worked example, or the text of the
    user's own inputs: say which in ``story_title``), each step as a table, the
    figure, and (when given) the mistakes with their figure. Figures are embedded as
    data:image/png;base64 URLs."""
    from .explain import step_title
    b = trace.blocks()[0]
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{CSS}</style></head><body>",
             f"<h1>{html.escape(title)}</h1>",
             "<p>Attention(Q, K, V) = softmax(Q K<sup>T</sup> / √d<sub>k</sub>) V, computed by "
             "attnkit's reference code; every number below was recorded as it ran.</p>",
             f"<h2>{html.escape(story_title)}</h2>", f"<pre>{html.escape(story)}</pre>",
             "<h2>Every step</h2>"]
    if trace.block_name(b):
        parts.append(f"<p>Shown for {html.escape(trace.block_name(b))}.</p>")
    for name in trace:
        parts.append(f"<h3>{html.escape(step_title(trace, name).strip())}</h3>")
        parts.append(_table(trace, name, b))
    parts += ["<h2>The picture</h2>",
              f"<img alt='scores, weights and outputs' src='data:image/png;base64,{png_base64(trace_figure(trace))}'>"]
    if mistakes is not None:
        parts += ["<h2>Common mistakes</h2>", f"<pre>{html.escape(mistakes_text)}</pre>",
                  f"<img alt='entropy of the weights against d_k' "
                  f"src='data:image/png;base64,{png_base64(entropy_figure(mistakes['entropy']))}'>"]
    parts.append("</body></html>")
    return "\n".join(parts)


def check_folder(folder) -> str:
    """Create ``folder`` (and parents) for the report; OSError naming the problem when
    that fails or it is not writable, so --report fails before any work."""
    folder = os.fspath(folder)
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise OSError(f"cannot write {os.path.join(folder, 'index.html')}: {e.strerror or e}") from None
    if not os.access(folder, os.W_OK):
        raise OSError(f"cannot write {os.path.join(folder, 'index.html')}: permission denied")
    return folder


def write_report(folder, page: str) -> str:
    """Write ``page`` to ``folder``/index.html (the folder is created); returns the path."""
    path = os.path.join(check_folder(folder), "index.html")
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(page)
    except OSError as e:
        raise OSError(f"cannot write {path}: {e.strerror or e}") from None
    return path

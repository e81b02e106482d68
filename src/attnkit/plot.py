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


def _heatmap(ax, a, rows, cols, title, cmap, fmt="{:.2f}", masked=None, vmin=None, vmax=None):
    a = np.asarray(a, dtype=float)
    shown = np.ma.masked_invalid(a) if masked is None else np.ma.array(a, mask=masked | ~np.isfinite(a))
    cm = _cmap(cmap)
    im = ax.imshow(shown, cmap=cm, aspect="auto", vmin=vmin, vmax=vmax, interpolation="nearest")
    L, S = a.shape
    small = L <= MAX_ANNOTATED and S <= MAX_ANNOTATED
    if S <= 2 * MAX_ANNOTATED:
        ax.set_xticks(range(S), [str(c) for c in cols], rotation=45 if S > 6 else 0)
    if L <= 2 * MAX_ANNOTATED:
        ax.set_yticks(range(L), [str(r) for r in rows])
    if small:
        for i in range(L):
            for j in range(S):
                excluded = (masked is not None and masked[i, j]) or not np.isfinite(a[i, j])
                if excluded:
                    ax.text(j, i, "×", ha="center", va="center", color="#555555", fontsize=12)
                    continue
                r, g, bl, _ = im.cmap(im.norm(a[i, j]))
                dark = 0.299 * r + 0.587 * g + 0.114 * bl < 0.5      # luminance of the cell
                ax.text(j, i, fmt.format(a[i, j]), ha="center", va="center", fontsize=9,
                        color="white" if dark else "black")
    ax.set_title(title, fontsize=10)
    ax.figure.colorbar(im, ax=ax, shrink=0.8)
    return im


def _cmap(name):
    from matplotlib import colormaps
    return colormaps[name].with_extremes(bad="#d9d9d9")      # excluded cells: grey


def trace_figure(trace, block=None):
    """Three panels for one (batch, head) block of a :class:`attnkit.explain.Trace`:
    the scores the softmax sees (excluded keys grey with ×), the weights (rows sum
    to 1) and the output vectors, with labelled axes and the values in the cells
    for small sizes."""
    b = trace.blocks()[0] if block is None else block
    pick = (lambda x: x[b]) if b else (lambda x: x)
    scores, weights, out = pick(trace.final_scores), pick(trace.weights), pick(trace.out)
    ex = None if trace.excluded is None else pick(trace.excluded)
    L, S = weights.shape
    Dv = out.shape[-1]
    w = min(16.0, 4.2 * 2 + 1.2 * max(2.5, Dv) + 0.35 * max(0, S - 6) * 2)
    h = min(10.0, 2.4 + 0.45 * L)
    fig = _figure(w, h)
    axes = fig.subplots(1, 3, width_ratios=[max(S, 2), max(S, 2), max(Dv, 2)])
    q, keys = trace.query_labels, trace.labels
    small = L <= MAX_ANNOTATED and S <= MAX_ANNOTATED
    note = "" if ex is None else (" (× = excluded)" if small else " (grey = excluded)")
    _heatmap(axes[0], scores, q, keys, "scores · scale" + note,
             "coolwarm", masked=ex)
    _heatmap(axes[1], weights, q, keys, "weights = softmax over keys", "Blues", vmin=0.0, vmax=1.0,
             masked=ex)
    _heatmap(axes[2], out, q, [f"d{j}" for j in range(Dv)], "output = weights · v", "viridis")
    for ax in axes[:2]:
        ax.set_xlabel("keys")
    axes[2].set_xlabel("output dims")
    axes[0].set_ylabel("queries")
    name = trace.block_name(b)
    fig.suptitle("Attention(Q, K, V) = softmax(Q Kᵀ / √d_k) V" + (f"   [{name}]" if name else ""),
                 fontsize=11)
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
    x = trace[name][b] if b else trace[name]
    s = trace.spec
    if name == "lse":
        x, cols = x[:, None], ["lse"]
    elif name == "out":
        cols = [f"d{j}" for j in range(s.Dv)]
    else:
        cols = trace.labels
    if x.shape[0] > 16 or x.shape[1] > 16:
        return f"<p><i>{x.shape[0]} × {x.shape[1]} values: see the figure</i></p>"

    def cell(v):
        if x.dtype == bool:
            return "×" if v else "·"
        return "−∞" if np.isneginf(v) else f"{v:.3f}"

    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in cols)
    body = "".join(
        f"<tr><th>{html.escape(str(trace.query_labels[i]))}</th>"
        + "".join(f"<td>{cell(v)}</td>" for v in row) + "</tr>" for i, row in enumerate(x))
    return f"<table><tr><th></th>{head}</tr>{body}</table>"


CSS = """body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;
color:#222;line-height:1.45}pre{background:#f6f6f6;padding:1rem;overflow-x:auto}
table{border-collapse:collapse;margin:.5rem 0 1rem}td,th{border:1px solid #ccc;padding:.2rem .6rem;
text-align:right;font-variant-numeric:tabular-nums}img{max-width:100%}h2{margin-top:2rem}"""


def report_html(trace, title, story, mistakes=None, mistakes_text=None) -> str:
    """A self-contained HTML page: the worked example as text (``story``), each
    step as a table, the figure, and (when given) the mistakes with their figure.
    Figures are embedded as data:image/png;base64 URLs."""
    from .explain import STEP_TITLES
    b = trace.blocks()[0]
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{CSS}</style></head><body>",
             f"<h1>{html.escape(title)}</h1>",
             "<p>Attention(Q, K, V) = softmax(Q K<sup>T</sup> / √d<sub>k</sub>) V, computed by "
             "attnkit's reference code; every number below was recorded as it ran.</p>",
             "<h2>The worked example</h2>", f"<pre>{html.escape(story)}</pre>",
             "<h2>Every step</h2>"]
    if trace.block_name(b):
        parts.append(f"<p>Shown for {html.escape(trace.block_name(b))}.</p>")
    for name in trace:
        parts.append(f"<h3>{html.escape(STEP_TITLES[name].split('  ', 1)[-1].strip())}</h3>")
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

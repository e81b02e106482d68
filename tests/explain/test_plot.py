"""attnkit.plot for explain's new terms, checked by pixels: packed sequences as grey
off-diagonal blocks with lines between them, NaN cells red, the sink's column, the
ALiBi penalty panel, the dropout panel, and a title naming the masks."""

from __future__ import annotations

import numpy as np
import pytest

from attnkit.explain import explain
from attnkit.testing import make_qkv

pytest.importorskip("matplotlib")
from matplotlib import colormaps
from matplotlib.colors import to_rgb

from attnkit import plot

PACKED = dict(cu_seqlens_q=np.array([0, 2, 5]), cu_seqlens_k=np.array([0, 2, 5]))


def _draw(fig):
    """The figure's pixels, RGB in [0, 1], row 0 at the top."""
    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].astype(float) / 255


def _panel(fig, title):
    return next(ax for ax in fig.axes if ax.get_title().startswith(title))


def _rgb(img, ax, i, j, off=0.3):
    """The colour of cell (i, j) of an imshow panel, near its corner (clear of the
    number written at its centre)."""
    x, y = ax.transData.transform((j - off, i - off))
    return img[int(round(img.shape[0] - y)), int(round(x))]


def _close(a, b, tol=0.03):
    return np.abs(np.asarray(a) - np.asarray(b)).max() <= tol


def test_packed_blocks_are_grey_off_the_diagonal_with_a_line_between():
    q, k, v = make_qkv((5, 2), (5, 2))
    t = explain(q, k, v, **PACKED)
    fig = plot.trace_figure(t)
    img = _draw(fig)
    grey = to_rgb(plot.EXCLUDED_COLOUR)
    for title in ("scores", "weights"):
        ax = _panel(fig, title)
        for i in range(5):
            for j in range(5):
                same = (i < 2) == (j < 2)
                assert _close(_rgb(img, ax, i, j), grey) != same, (title, i, j)
        x, y = ax.transData.transform((1.5, 3.0))                  # the line between k1 and k2
        r, c = int(round(img.shape[0] - y)), int(round(x))
        assert img[r - 1:r + 2, c - 2:c + 3].mean(axis=-1).min() < 0.25
    assert "masks: packed (2 sequences)" in fig._suptitle.get_text()


def test_nan_cells_are_red_and_finite_rows_are_not():
    q, k, v = make_qkv((3, 2), (3, 2))
    q[1, 0] = np.nan
    fig = plot.trace_figure(explain(q, k, v))
    img = _draw(fig)
    red = to_rgb(plot.NAN_COLOUR)
    for title in ("weights", "output"):
        ax = _panel(fig, title)
        assert all(_close(_rgb(img, ax, 1, j), red) for j in range(2))
        assert not any(_close(_rgb(img, ax, i, j), red) for i in (0, 2) for j in range(2))
    texts = [x.get_text() for x in _panel(fig, "weights").texts]
    assert texts.count("NaN") == 3 and "×" not in texts               # NaN is not "excluded"


def test_sink_column_shows_the_sink_weight():
    q, k, v = make_qkv((3, 2), (4, 2))
    t = explain(q, k, v, sinks=np.array([[0.0, 1.5, -1.0]]))
    fig = plot.trace_figure(t)
    img = _draw(fig)
    ax = _panel(fig, "weights")
    assert [x.get_text() for x in ax.get_xticklabels()] == ["k0", "k1", "k2", "k3", "sink"]
    blues = colormaps["Blues"]
    for i in range(3):
        assert _close(_rgb(img, ax, i, 4), blues(t.sink_weights[i])[:3])
        assert _close(_rgb(img, ax, i, 0), blues(t.weights[i, 0])[:3])


def test_alibi_penalty_panel_darkens_away_from_the_diagonal():
    q, k, v = make_qkv((4, 2), (4, 2))
    fig = plot.trace_figure(explain(q, k, v, alibi_slopes=np.array([0.5])))
    img = _draw(fig)
    ax = fig.axes[0]
    assert ax.get_title().startswith("ALiBi penalty")
    diag = [_rgb(img, ax, i, i).mean() for i in range(4)]
    far = [_rgb(img, ax, 0, 3).mean(), _rgb(img, ax, 3, 0).mean()]
    near = [_rgb(img, ax, 0, 1).mean(), _rgb(img, ax, 2, 1).mean()]
    assert min(diag) > 0.95 and max(far) < min(near) < min(diag)
    assert "masks: ALiBi (slope 0.5)" in fig._suptitle.get_text()


def test_dropout_panel_empties_the_dropped_cells():
    q, k, v = make_qkv((4, 2), (4, 2))
    t = explain(q, k, v, dropout=0.5, seed=1)
    fig = plot.trace_figure(t)
    img = _draw(fig)
    w, d = _panel(fig, "weights"), _panel(fig, "after dropout p = 0.5")
    dropped = np.argwhere((t["dropped"] == 0) & (t.weights > 0.2))
    kept = np.argwhere(t["dropped"] > 0.4)
    assert len(dropped) and len(kept)
    white = colormaps["Blues"](0.0)[:3]
    for i, j in dropped:
        assert _close(_rgb(img, d, i, j), white) and not _close(_rgb(img, w, i, j), white)
    for i, j in kept:
        assert not _close(_rgb(img, d, i, j), white)
    assert _panel(fig, "output = dropped · v")


def test_title_names_the_masks_or_none():
    q, k, v = make_qkv((3, 2), (3, 2))
    assert plot.title(explain(q, k, v)).endswith("masks: none")
    t = explain(q, k, v, causal=True, drop=np.eye(3, dtype=bool), sinks=np.array([0.0]))
    assert plot.title(t).endswith("masks: causal (bottom_right), drop, sinks")
    assert plot.trace_figure(t)._suptitle.get_text() == plot.title(t)


def test_report_table_marks_nan_and_the_sink():
    q, k, v = make_qkv((2, 2), (2, 2))
    q[0, 0] = np.nan
    page = plot.report_html(explain(q, k, v, sinks=np.array([0.0])), "t", "story",
                            story_title="Your inputs, step by step")
    assert "<h2>Your inputs, step by step</h2>" in page and "The worked example" not in page
    assert "<td>NaN</td>" in page and "<th>sink</th>" in page and "Step 3a" not in page

"""The MkDocs hook of attnkit's site (mkdocs.yml ``hooks:``) and the helpers its pages'
``markdown-exec`` blocks call while the site is built.

MkDocs imports this file before the build (as a module named after its path); it
registers itself as ``attnkit_docs`` so that a page's code block can
``import attnkit_docs``. No result shown on the site is written here or in the
pages: the blocks compute them with attnkit (``attnkit.explain``, ``attnkit.plot``)
and these helpers only lay them out — as Markdown tables, text pictures of masks, and
figures embedded in the page as PNG images (``data:`` URLs) — or copy sections of
README.md, where the benchmark tables live, into a page.
"""

from __future__ import annotations

import html
import re
import sys
from pathlib import Path
from typing import Any

sys.modules.setdefault("attnkit_docs", sys.modules[__name__])

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


# ---- MkDocs events ---------------------------------------------------------------------
def on_config(config: Any, **kwargs: Any) -> Any:
    """Fail the build early, with the install line, when attnkit or matplotlib is
    missing (the pages compute their numbers and figures with them)."""
    from mkdocs.exceptions import PluginError
    try:
        import attnkit.plot
        attnkit.plot.require()
    except ImportError as e:
        raise PluginError(f"the docs compute their examples with attnkit and matplotlib: {e}; "
                          "pip install -e '.[docs]'") from None
    return config


# ---- helpers for the pages ------------------------------------------------------------
def figure(fig: Any, alt: str, caption: str | None = None, width: int | None = None) -> str:
    """``fig`` (a matplotlib Figure, e.g. from ``attnkit.plot.trace_figure``) as an HTML
    ``<figure>`` holding a PNG image, embedded as a data: URL by ``attnkit.plot``."""
    from attnkit import plot
    size = f" width='{width}'" if width else ""
    cap = f"<figcaption>{html.escape(caption)}</figcaption>" if caption else ""
    return (f"<figure class='attnkit-figure'><img alt='{html.escape(alt, quote=True)}'{size} "
            f"src='data:image/png;base64,{plot.png_base64(fig)}'>{cap}</figure>")


def table(header: list[str], rows: list[list[Any]], align: str | None = None) -> str:
    """A Markdown table (``|`` in a cell escaped); ``align`` one letter per column
    (l, r, c)."""
    align = align or "l" * len(header)
    rule = {"l": ":--", "r": "--:", "c": ":-:"}
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(rule[a] for a in align) + " |"]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def picture(excluded: Any, rows: list[str] | None = None, cols: list[str] | None = None) -> str:
    """A mask as text: ``■`` where a query may attend a key, ``·`` where the key is
    excluded; rows are queries, columns keys."""
    import numpy as np
    ex = np.asarray(excluded, bool)
    L, S = ex.shape
    rows = rows or [f"q{i}" for i in range(L)]
    cols = cols or [f"k{j}" for j in range(S)]
    w = max(len(r) for r in rows)
    head = " " * (w + 1) + " ".join(f"{c:>2}" for c in cols)
    body = [f"{r:<{w}} " + " ".join(f"{'·' if x else '■':>2}" for x in row) for r, row in zip(rows, ex)]
    return "\n".join([head] + body)


def code(text: str, lang: str = "text") -> str:
    """``text`` as a fenced code block."""
    fence = "````" if "```" in text else "```"
    return f"{fence}{lang}\n{text.rstrip()}\n{fence}"


def readme_section(heading: str, start: str | None = None, stop: str | None = None,
                   level: int = 2) -> str:
    """The part of README.md under the heading ``heading`` (``level`` #'s), up to the
    next heading of that level or higher. ``start``: begin at the first line that
    starts with this text; ``stop``: end before the first line after it that starts
    with this text. Raises ValueError (failing the build) when a heading or line is
    not found, so a README edit cannot silently empty a page."""
    lines = README.read_text(encoding="utf-8").splitlines()
    mark = "#" * level + " "
    try:
        i = next(n for n, line in enumerate(lines) if line.strip() == mark + heading)
    except StopIteration:
        raise ValueError(f"README.md has no heading {mark + heading!r}") from None
    end = next((n for n in range(i + 1, len(lines))
                if re.match(rf"#{{1,{level}}} ", lines[n])), len(lines))
    part = lines[i + 1:end]
    if start is not None:
        try:
            part = part[next(n for n, line in enumerate(part) if line.startswith(start)):]
        except StopIteration:
            raise ValueError(f"README.md section {heading!r} has no line starting {start!r}") from None
    if stop is not None:
        try:
            part = part[:next(n for n, line in enumerate(part) if n and line.startswith(stop))]
        except StopIteration:
            raise ValueError(f"README.md section {heading!r} has no line starting {stop!r}") from None
    while part and not part[0].strip():
        part = part[1:]
    while part and not part[-1].strip():
        part = part[:-1]
    return "\n".join(part)                 # indentation kept: README's code blocks are indented

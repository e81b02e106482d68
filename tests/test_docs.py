"""The documentation site (mkdocs.yml, docs/): it builds with ``mkdocs build --strict``,
its worked example shows the numbers attnkit computes — computed while the site is
built, never typed into the sources — and a browser (headless Chromium) renders the
page with those numbers and its figure.

The site is built once per test session (once per pytest-xdist run) into a temporary
folder, never into site/. Needs the docs extra (``pip install -e '.[docs]'``) and, for
the browser test, Debian's ``chromium``; each test skips, saying what to install, when
they are missing.
"""

from __future__ import annotations

import contextlib
import functools
import html
import http.server
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS_MODULES = ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python", "markdown_exec",
                "pymdownx", "matplotlib")
PAGE = "worked-example/index.html"
FIGURE_ALT = "scores, weights and output of the worked example"
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync")
# the public API the reference must document, by the id mkdocstrings gives each object
# (attnkit.merge and attnkit.explain are documented by their defining paths: the
# attribute names are also those of submodules)
API = {"function": ["attnkit.attention", "attnkit.attention_weights", "attnkit.attention_backward",
                    "attnkit.attention_kvcache", "attnkit.api.merge", "attnkit.scaled_dot_product_attention",
                    "attnkit.explain.trace.explain", "attnkit.flash.set_threads", "attnkit.flash.get_threads",
                    "attnkit.flash.threads", "attnkit.flash.block_sizes", "attnkit.hf.register",
                    "attnkit.distributed.ring_attention", "attnkit.distributed.shard",
                    "attnkit.distributed.unshard", "attnkit.distributed.zigzag_shard",
                    "attnkit.distributed.zigzag_unshard", "attnkit.distributed.plan", "attnkit.testing.make_qkv",
                    "attnkit.testing.max_error", "attnkit.testing.error_budget"],
       "class": ["attnkit.PagedCache", "attnkit.explain.Trace", "attnkit.torch.MultiheadAttention"]}


def _missing_docs_modules() -> list[str]:
    missing = []
    for name in DOCS_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            missing.append(name)
    return missing


def _build(out: Path) -> Path:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stdout}\n{run.stderr}"
    (out / ".built").write_text("ok")
    return out


@pytest.fixture(scope="session")
def site(tmp_path_factory) -> Path:
    """The built site: built once per session, shared by the xdist workers of one run."""
    missing = _missing_docs_modules()
    if missing:
        pytest.skip(f"the docs extra is not installed ({', '.join(missing)} missing): "
                    "pip install -e '.[docs]' (bash scripts/docs does)")
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent                      # shared by every worker of this run
    out = base / "attnkit-docs-site"
    import fcntl
    with open(base / "attnkit-docs-site.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not (out / ".built").exists():
                _build(out)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return out


def _text(page_html: str) -> str:
    """The visible text of an HTML page, roughly: tags dropped, entities decoded."""
    page_html = re.sub(r"<(script|style)\b.*?</\1>", " ", page_html, flags=re.S)
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", page_html)))


def expected_numbers() -> dict[str, dict[str, str]]:
    """The worked example's numbers per step, computed by attnkit and written as the
    page writes them: attnkit.explain's formatter for scores and sums, three decimals
    for the weights, two for the output."""
    from attnkit.explain import example_trace
    from attnkit.explain.formatting import num, paren, vec
    t = example_trace()
    q, k, v = t.inputs()
    scores, scaled, w, out = t["scores"][0], t["scaled"][0], t.weights[0], t.out[0]
    e = np.exp(scaled)
    (who,), keys = t.query_labels, t.labels
    dots = {f"score of {key}": f"{who}·{key} = " + " + ".join(f"{paren(x)}·{paren(y)}" for x, y in zip(q[0], k[j]))
            + f" = {num(scores[j])}" for j, key in enumerate(keys)}
    return {
        "Step 1": dots,
        "Step 2": {"√d_k": num(math.sqrt(t.spec.D)), "scaled score of apple": num(scaled[0])},
        "Step 3": {"e^score of apple": num(e[0]), "total": num(e.sum()),
                   "weight of apple": f"{w[0]:.3f}", "weight of cheese": f"{w[1]:.3f}",
                   "lse": num(t.lse[0])},
        "Step 4": {"output": vec(out, 2),
                   "weighted sum": " + ".join(f"{w[j]:.3f}·{vec(v[j])}" for j in range(len(keys)))},
    }


def sections(page_html: str) -> dict[str, str]:
    """{heading text: text up to the next heading} of the page's article."""
    article = re.search(r'<article class="md-content__inner md-typeset">(.*?)</article>', page_html, re.S)
    assert article, "no article in the page"
    parts = re.split(r"(<h[1-6][^>]*>.*?</h[1-6]>)", article.group(1), flags=re.S)
    out = {}
    for head, body in zip(parts[1::2], parts[2::2]):
        out[_text(head).replace("¶", "").strip()] = _text(body)
    return out


def docs_sources() -> list[Path]:
    """Everything the site is built from that could hold a typed-in number: the pages,
    the hooks and assets under docs/, mkdocs.yml and scripts/docs."""
    files = [p for p in (ROOT / "docs").rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    return sorted(files) + [ROOT / "mkdocs.yml", ROOT / "scripts" / "docs"]


def test_worked_example_numbers_are_computed_not_typed(site):
    from attnkit.explain import worked_example
    page = (site / PAGE).read_text(encoding="utf-8")
    steps = sections(page)
    numbers = expected_numbers()
    for step, expected in numbers.items():
        (title,) = [h for h in steps if h.startswith(step + ":")]
        for what, s in expected.items():
            assert s in steps[title], f"{title!r} lacks the {what}, {s!r}, as attnkit computes it"
    # what `attnkit explain` prints, verbatim
    assert " ".join(worked_example().split()) in " ".join(steps["What attnkit explain prints"].split())
    # the figure, a PNG drawn by attnkit.plot at build time
    m = re.search(r"<img alt='" + re.escape(FIGURE_ALT) + r"'[^>]*src='data:image/png;base64,([^']+)'", page)
    assert m, "the worked example page has no figure"
    import base64
    png = base64.b64decode(m.group(1))
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    # ... and no source holds the numbers that are not trivial: they are computed when
    # the site is built
    typed = {what: s for expected in list(numbers.values())[1:] for what, s in expected.items()}
    for path in docs_sources():
        try:
            src = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for what, s in typed.items():
            assert s not in src, f"{path.relative_to(ROOT)} types in the {what} {s!r}: compute it at build time"


def test_api_reference_documents_the_public_api(site):
    pages = "".join((site / "reference" / name / "index.html").read_text(encoding="utf-8")
                    for name in ("attnkit", "flash", "torch", "hf", "distributed", "testing"))
    missing = [name for kind, names in API.items() for name in names if not _documented(pages, kind, name)]
    assert not missing, f"the API reference lacks {missing}"
    # the masking keywords, from attnkit.spec.options, are listed for attention
    from attnkit.spec.options import NAMES
    ref = (site / "reference" / "attnkit" / "index.html").read_text(encoding="utf-8")
    section = ref[ref.index('id="attnkit.attention"'):ref.index('id="attnkit.attention_weights"')]
    absent = [n for n in NAMES if f"<code>{n}</code>" not in section]
    assert not absent, f"attnkit.attention's reference lacks the masking keywords {absent}"
    # the benchmark page carries README's tables, copied at build time
    bench = _text((site / "benchmarks" / "index.html").read_text(encoding="utf-8"))
    rows = _readme_table_rows("CPU benchmark") + _readme_table_rows("Beyond one device")
    assert len(rows) >= 10
    for cells in rows:
        assert " ".join(cells) in bench, f"the benchmark page lacks README's row {cells}"


def _documented(pages: str, kind: str, name: str) -> bool:
    """Whether the reference pages document ``name`` as a ``kind`` (function or class):
    a heading with its id, then the kind's name tag (or, under a custom heading, the
    function's signature)."""
    m = re.search(f'id="{re.escape(name)}" class="doc doc-heading">(.*?)</h[1-6]>(.{{0,800}})', pages, re.S)
    if not m:
        return False
    head, after = m.groups()
    short = name.rsplit(".", 1)[1]
    return f"doc-{kind}-name" in head or (kind == "function" and f'<span class="nf">{short}</span>' in after)


def _readme_table_rows(heading: str) -> list[list[str]]:
    """The non-empty cells (as rendered: no backticks) of each table row in README.md's
    section ``## heading``."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    start = lines.index(f"## {heading}") + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    rows = []
    for line in lines[start:end]:
        if line.startswith("|") and not set(line) <= set("|-: "):
            rows.append([c.strip().replace("`", "") for c in line.strip().strip("|").split("|") if c.strip()])
    return rows


# ---- the page in a browser --------------------------------------------------------------
PROBE = """<!doctype html><html><head><meta charset="utf-8"></head><body>
<pre id="result">pending</pre>
<iframe id="page" src="/%s" width="1280" height="2400"></iframe>
<script>
const frame = document.getElementById("page");
frame.addEventListener("load", () => {
  const doc = frame.contentDocument, win = frame.contentWindow;
  const imgs = [...doc.querySelectorAll("img")].map(i => {
    const r = i.getBoundingClientRect();
    return {alt: i.alt, complete: i.complete, naturalWidth: i.naturalWidth,
            naturalHeight: i.naturalHeight, width: r.width, height: r.height};
  });
  const resources = win.performance.getEntriesByType("resource").map(e => e.name);
  document.getElementById("result").textContent =
      JSON.stringify({title: doc.title, text: doc.body.innerText, imgs, resources});
});
</script></body></html>
"""


@pytest.fixture(scope="session")
def chromium() -> str:
    """Debian's chromium (apt-get install -y chromium), or skip."""
    path = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)
    if path is None:
        pytest.skip("chromium is not installed: apt-get install -y chromium (Debian)")
    return path


@contextlib.contextmanager
def serve(folder: Path, extra: dict[str, str]):
    """An HTTP server on 127.0.0.1 (a free port) serving ``folder``, plus ``extra``
    pages from memory; yields its base URL."""
    class Handler(http.server.SimpleHTTPRequestHandler):
        def do_GET(self):
            if self.path in extra:
                body = extra[self.path].encode("utf-8")
                self.send_response(200)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            super().do_GET()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                             functools.partial(Handler, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_worked_example_renders_in_chromium(chromium, site, tmp_path):
    page_url = PAGE.removesuffix("index.html")
    with serve(site, {"/__probe__.html": PROBE % page_url}) as base:
        run = subprocess.run(
            [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}",
             "--virtual-time-budget=20000", "--dump-dom", f"{base}/__probe__.html"],
            capture_output=True, text=True, timeout=180)
    m = re.search(r'<pre id="result">(.*?)</pre>', run.stdout, flags=re.S)
    assert m, f"chromium gave no DOM (exit {run.returncode}):\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}"
    assert m.group(1) != "pending", "the page did not finish loading in chromium"
    shown = json.loads(html.unescape(m.group(1)))
    assert shown["title"].startswith("The formula, step by step")
    text = " ".join(shown["text"].split())
    for expected in expected_numbers().values():
        for what, s in expected.items():
            assert s in text, f"chromium does not show the {what} {s!r}"
    figures = [i for i in shown["imgs"] if i["alt"] == FIGURE_ALT]
    assert figures, f"no figure in the rendered page: {shown['imgs']}"
    fig = figures[0]
    assert fig["complete"] and fig["naturalWidth"] > 200 and fig["naturalHeight"] > 100, fig
    assert fig["width"] > 100 and fig["height"] > 50, f"the figure is not displayed: {fig}"
    outside = [r for r in shown["resources"] if not r.startswith(base) and not r.startswith("data:")]
    assert not outside, f"the page loads resources from other hosts: {outside}"

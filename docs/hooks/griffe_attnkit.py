"""A griffe extension for attnkit's docstrings, loaded by mkdocstrings (mkdocs.yml).

1. The public functions decorated with ``attnkit.spec.options.with_options`` are
   documented as ``help()`` shows them. ``with_options`` builds their signatures and
   their "Masking keywords" docstring section at import time from the one table of
   masking keywords (``attnkit.spec.options.OPTIONS``); griffe reads the source, where
   the signature ends in ``**masking`` and the docstring holds the ``{masking}``
   placeholder. For those functions this extension imports the function and takes
   its docstring (``inspect.getdoc``) and its keyword parameters
   (``inspect.signature``). The masking section is read as numpydoc's "Other
   Parameters" section, each ``name : default X`` line cut to ``name`` (the type and
   the default come from the signature).
2. Formatting only, for every docstring: doctest lines (``>>>``) outside an
   "Examples" section are fenced as ``pycon`` code, so Markdown does not read their
   brackets as links; Sphinx roles (``:func:`x```) become inline code.

Nothing is written here by hand: every word and default comes from attnkit itself.
"""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any, ForwardRef

import griffe

PLACEHOLDER = "{masking}"
SECTION = "Masking keywords"
ENTRY = re.compile(r"^(\w+) : default .*$")
ROLE = re.compile(r":(?:func|class|meth|mod|data|attr|obj|exc):`~?([^`]+)`")
EXAMPLES = {"examples", "example"}


def _is_rule(line: str) -> bool:
    return bool(line) and set(line.strip()) == {"-"}


def _annotation(a: Any) -> str | None:
    if a is inspect.Parameter.empty:
        return None
    if isinstance(a, ForwardRef):
        return a.__forward_arg__
    return a if isinstance(a, str) else inspect.formatannotation(a)


def masking_docstring(obj: Any) -> str:
    """``obj``'s docstring as help() shows it, its masking section made numpydoc's
    "Other Parameters" section."""
    lines = inspect.getdoc(obj).splitlines()
    out, in_section = [], False
    for i, line in enumerate(lines):
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if line == SECTION and _is_rule(nxt):
            in_section = True
            out.append("Other Parameters")
            continue
        if in_section and line and not line.startswith(" ") and not _is_rule(line):
            m = ENTRY.match(line)
            if m:
                line = m.group(1)
            elif _is_rule(nxt):
                in_section = False
            else:
                raise ValueError(f"{obj.__qualname__}: unexpected line in {SECTION!r}: {line!r}")
        out.append(line)
    return "\n".join(out)


def tidy(text: str) -> str:
    """Fence doctest blocks outside "Examples" sections; Sphinx roles to inline code."""
    lines = text.splitlines()
    out: list[str] = []
    in_examples = in_fence = in_doctest = False
    indent = 0
    for i, line in enumerate(lines):
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        stripped = line.strip()
        if in_doctest and not stripped:
            out.append(" " * indent + "```")
            in_doctest = False
        if not in_doctest and not in_fence and stripped and _is_rule(nxt):
            in_examples = stripped.lower() in EXAMPLES
        if stripped.startswith("```") and not in_doctest:
            in_fence = not in_fence
        elif stripped.startswith(">>>") and not (in_fence or in_doctest or in_examples):
            indent = len(line) - len(line.lstrip())
            if out and out[-1].strip():
                out.append("")
            out.append(" " * indent + "```pycon")
            in_doctest = True
        if not in_doctest and not in_fence:
            line = ROLE.sub(r"`\1`", line)
        out.append(line)
    if in_doctest:
        out.append(" " * indent + "```")
    return "\n".join(out)


class AttnkitDocstrings(griffe.Extension):
    """See the module docstring."""

    def on_object(self, *, obj: Any, loader: Any = None, **kwargs: Any) -> None:
        if obj.is_function:
            self._masking(obj)
        if obj.docstring is not None:
            obj.docstring.value = tidy(obj.docstring.value)

    def on_package(self, *, pkg: Any, loader: Any = None, **kwargs: Any) -> None:
        if pkg.docstring is not None:
            pkg.docstring.value = tidy(pkg.docstring.value)

    def _masking(self, func: griffe.Function) -> None:
        decorated = any("with_options" in str(d.value) for d in func.decorators)
        if not decorated or func.docstring is None or PLACEHOLDER not in func.docstring.value:
            return
        module = importlib.import_module(func.module.path)
        obj: Any = module
        for part in func.path[len(func.module.path) + 1:].split("."):
            obj = getattr(obj, part)
        if PLACEHOLDER in (obj.__doc__ or ""):
            raise ValueError(f"{func.path}: the runtime docstring still holds {PLACEHOLDER}")
        func.docstring.value = masking_docstring(obj)
        sig = inspect.signature(obj)
        for p in func.parameters:
            if p.kind is griffe.ParameterKind.var_keyword and p.name not in sig.parameters:
                del func.parameters[p.name]
                break
        for p in sig.parameters.values():
            if p.name in func.parameters:
                continue
            func.parameters.add(griffe.Parameter(
                p.name, annotation=_annotation(p.annotation), kind=griffe.ParameterKind.keyword_only,
                default=None if p.default is inspect.Parameter.empty else repr(p.default)))

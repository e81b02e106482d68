"""The masking keywords are one table: the TypedDict for type checkers, every public
function's signature and docstring, validate and the torch op's schema agree with it;
and the public API is fully annotated."""

import inspect
import typing

import numpy as np
import pytest

import attnkit
from attnkit import flash
from attnkit.spec import options
from attnkit.spec.options import NAMES, OPTIONS, Masking

PUBLIC = [attnkit.attention, attnkit.attention_weights, attnkit.attention_backward, attnkit.merge,
          attnkit.scaled_dot_product_attention, attnkit.explain, flash.set_threads, flash.get_threads,
          flash.threads, flash.block_sizes]


def test_the_typed_dict_lists_the_table():
    assert list(Masking.__annotations__) == list(NAMES)
    assert set(typing.get_type_hints(Masking)) == set(NAMES)
    assert len(set(NAMES)) == len(NAMES)


@pytest.mark.parametrize("fn", [attnkit.attention, attnkit.attention_weights, attnkit.attention_backward,
                                attnkit.explain])
def test_public_signatures_and_docs_list_every_keyword(fn):
    params = inspect.signature(fn).parameters
    for o in OPTIONS:
        assert o.name in params and params[o.name].default == o.default
        assert params[o.name].kind is inspect.Parameter.KEYWORD_ONLY
    if "{masking}" not in (fn.__doc__ or "") and fn is not attnkit.explain:
        for o in OPTIONS:
            assert o.name in fn.__doc__


def test_the_op_schema_has_every_keyword():
    pytest.importorskip("torch")
    from attnkit.torch import op
    for o in OPTIONS:
        assert (o.name in op._SCHEMA_ARGS) or o.name == "window"
    assert "window_left" in op._SCHEMA_ARGS and "window_right" in op._SCHEMA_ARGS


@pytest.mark.parametrize("fn", PUBLIC, ids=lambda f: f.__name__)
def test_public_functions_are_fully_annotated(fn):
    sig = inspect.signature(fn)
    for name, p in sig.parameters.items():
        if p.kind in (p.VAR_POSITIONAL,) or name in ("self", "cls"):
            continue
        assert p.annotation is not inspect.Parameter.empty, f"{fn.__name__}({name}) has no annotation"
    assert sig.return_annotation is not inspect.Signature.empty, f"{fn.__name__} has no return annotation"


def test_docs_section_from_the_table():
    text = options.docs_section()
    assert all(f"{o.name} :" in text for o in OPTIONS)
    assert "cu_seqlens_q" not in options.docs_section(kvcache=True)


# ---- found by mutation testing (scripts/mutation.py, docs/mutation.md) ------------------
# What attention_kvcache takes is part of its contract, written out here rather than
# read from the table (a wrong flag in the table would then pass unseen).
KVCACHE_TAKES = ["scale", "causal", "window", "align", "softcap", "alibi_slopes", "sinks", "q_lengths", "kv_starts",
                 "dropout", "seed"]
KVCACHE_REFUSES = dict(keep=np.ones((1, 8), bool), drop=np.zeros((1, 8), bool), bias=np.zeros((1, 8)),
                       kv_lengths=np.array([3]), cu_seqlens_q=np.array([0, 1]), cu_seqlens_k=np.array([0, 3]))


def test_kvcache_signature_has_exactly_the_cache_keywords():
    params = inspect.signature(attnkit.attention_kvcache).parameters
    assert all(n in params for n in KVCACHE_TAKES)
    assert not any(n in params for n in KVCACHE_REFUSES)
    assert set(KVCACHE_TAKES) | set(KVCACHE_REFUSES) == set(NAMES)


@pytest.mark.parametrize("name", list(KVCACHE_REFUSES))
def test_kvcache_refuses_the_other_keywords_by_name(name):
    q, cache = np.zeros((1, 1, 1, 4)), np.zeros((1, 1, 8, 4))
    with pytest.raises(TypeError, match=rf"^{name}: not taken by attention_kvcache"):
        attnkit.attention_kvcache(q, cache, cache, np.array([3]), **{name: KVCACHE_REFUSES[name]})


def test_with_options_on_a_function_without_docstring():
    """python -OO strips docstrings: the decorator still gives the keyword signature."""
    def fn(q, **masking):
        return masking

    fn.__doc__ = None
    deco = options.with_options()(fn)
    assert deco.__doc__ is None
    assert list(inspect.signature(deco).parameters) == ["q"] + list(NAMES)

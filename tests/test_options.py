"""The options table (cuonline/_options.py) is the one definition of the options: the public
signatures, their documentation, the backward's gradient targets and the Gradients fields all
agree with it, and every option reaches the engines from each public function."""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest

import cuonline
from cuonline import _options
from cuonline._validate import validate_attention, validate_attention_backward

# the keywords each public function takes besides the table's options
EXTRA = {cuonline.attention: ("return_lse",), cuonline.attention_backward: (),
         cuonline.attention_vjp: ()}


@pytest.mark.parametrize("function", list(EXTRA), ids=lambda f: f.__name__)
def test_public_signatures_are_the_table(function):
    keywords = {n: p for n, p in inspect.signature(function).parameters.items()
                if p.kind is p.KEYWORD_ONLY}
    expected = [n for n in keywords if n not in EXTRA[function]]
    assert expected == list(_options.names()), "keyword names or order differ from the table"
    defaults = {f.name: f.default for f in dataclasses.fields(_options.Options)}
    for name in expected:
        assert keywords[name].default == defaults[name], name


def test_attention_stats_takes_every_score_option_of_the_table():
    """attention_stats takes the table's score options (every option but the engine's), then
    its own keywords, then the engine options it uses; its docstring names them all."""
    parameters = inspect.signature(cuonline.attention_stats).parameters
    keywords = [n for n, p in parameters.items() if p.kind is p.KEYWORD_ONLY]
    score = [n for n in _options.names() if _options.option_kind(n) != "engine"]
    own = ["entropy", "received", "query_weights", "top_k", "rows"]
    assert keywords == score + own + ["backend", "workers"]
    defaults = {f.name: f.default for f in dataclasses.fields(_options.Options)}
    for name in score + ["backend", "workers"]:
        assert parameters[name].default == defaults[name], name
    assert ", ".join(score) in cuonline.attention_stats.__doc__
    assert "SCORE_OPTIONS" not in cuonline.attention_stats.__doc__


def test_every_score_option_reaches_the_statistics(rng):
    """Each option that changes the scores changes the statistics: none is dropped on the way
    from attention_stats to the engine."""
    lq, lk = 12, 16
    q, k = rng.standard_normal((2, lq, 5)), rng.standard_normal((2, lk, 5))
    for name, (options, without) in _cases(rng, lq, lk).items():
        st = cuonline.attention_stats(q, k, **options)
        base = cuonline.attention_stats(q, k, **without)
        assert not np.allclose(st.lse, base.lse), f"{name} did not reach attention_stats"


def test_help_names_every_option_from_the_table():
    """attention_backward and attention_vjp document the options in one entry, written from
    the table (tests/test_docs.py checks that help() renders every docstring)."""
    for function in (cuonline.attention_backward, cuonline.attention_vjp):
        assert ", ".join(_options.names()) in function.__doc__
        assert "OPTIONS" not in function.__doc__


def test_gradient_fields_follow_the_table():
    differentiable = _options.differentiable_options()
    fields = [f.name for f in dataclasses.fields(cuonline.Gradients)]
    assert fields == ["dq", "dk", "dv", *differentiable.values()]
    assert set(differentiable) <= set(_options.array_options())


def test_unknown_or_doubled_options_are_type_errors():
    q = np.zeros((4, 8))
    with pytest.raises(TypeError, match="unknown option 'casual'"):
        validate_attention(q, q, q, casual=True)
    with pytest.raises(TypeError, match="not both"):
        validate_attention(q, q, q, _options.Options(), causal=True)
    with pytest.raises(TypeError, match="unknown option 'return_lse'"):
        validate_attention_backward(q, q, q, q, q, q[:, 0], return_lse=True)


def _cases(rng, lq, lk):
    """Option -> (keywords with the option, keywords without it): the option alone or with
    what gives it meaning (the offsets move a causal diagonal, the block bias needs a bias)."""
    bias, coarse = rng.standard_normal((lq, lk)), rng.standard_normal((-(-lq // 4), -(-lk // 4)))
    rel_q, rel_k = rng.standard_normal((lq, 3)), rng.standard_normal((9, 3))
    return {
        "scale": ({"scale": 0.3}, {}), "causal": ({"causal": True}, {}),
        "window": ({"window": (3, 2)}, {}), "bias": ({"bias": bias}, {}),
        "mask": ({"mask": rng.random((lq, lk)) > 0.3}, {}),
        "kv_lengths": ({"kv_lengths": np.array(lk - 3)}, {}),
        "alibi_slopes": ({"alibi_slopes": np.array(0.25)}, {}),
        "softcap": ({"softcap": 2.0}, {}),
        "softcap_bias": ({"softcap": 2.0, "bias": bias, "softcap_bias": True},
                         {"softcap": 2.0, "bias": bias}),
        "q_offset": ({"causal": True, "q_offset": 0}, {"causal": True}),
        "k_offset": ({"causal": True, "k_offset": 3}, {"causal": True}),
        "bias_block": ({"bias": coarse, "bias_block": 4}, {}),
        "rel_bias": ({"rel_bias": rng.standard_normal(2 * (lq + lk) + 1)}, {}),
        "rel_q": ({"rel_q": rel_q, "rel_k": rel_k}, {"rel_q": 2 * rel_q, "rel_k": rel_k}),
        "rel_k": ({"rel_q": rel_q, "rel_k": rel_k}, {"rel_q": rel_q, "rel_k": 2 * rel_k}),
        # two packed sequences against one; the key boundaries alone moved
        "cu_seqlens_q": ({"cu_seqlens_q": [0, 5, lq], "cu_seqlens_k": [0, 7, lk]}, {}),
        "cu_seqlens_k": ({"cu_seqlens_q": [0, 5, lq], "cu_seqlens_k": [0, 7, lk]},
                         {"cu_seqlens_q": [0, 5, lq], "cu_seqlens_k": [0, 9, lk]}),
    }


def test_every_option_reaches_the_engines_from_every_public_function(rng):
    """For each option of the table that changes the scores, attention, attention_vjp and
    attention_backward all see it: a forgotten forwarding would give the result without it."""
    lq, lk = 12, 16
    q, k = rng.standard_normal((2, lq, 5)), rng.standard_normal((2, lk, 5))
    v, dout = rng.standard_normal((2, lk, 4)), rng.standard_normal((2, lq, 4))
    cases = _cases(rng, lq, lk)
    engine_options = {n for n in _options.names() if _options.option_kind(n) == "engine"}
    assert set(cases) == set(_options.names()) - engine_options, "add the new option here"
    for name, (options, without) in cases.items():
        out, lse = cuonline.attention(q, k, v, return_lse=True, **options)
        base, base_lse = cuonline.attention(q, k, v, return_lse=True, **without)
        assert not np.allclose(out, base), f"{name} did not change attention"
        out_vjp, vjp = cuonline.attention_vjp(q, k, v, **options)
        np.testing.assert_array_equal(out_vjp, out, err_msg=name)
        g = cuonline.attention_backward(dout, q, k, v, out, lse, **options)
        g_vjp = vjp(dout)
        for field in ("dq", "dk", "dv"):
            np.testing.assert_array_equal(getattr(g_vjp, field), getattr(g, field),
                                          err_msg=f"{name}: {field}")
        g_base = cuonline.attention_backward(dout, q, k, v, base, base_lse, **without)
        assert not np.allclose(g.dq, g_base.dq), f"{name} did not reach the backward"

import pytest

from certify.catalog.rules import RuleError, evaluate, rule_names


def test_rules_evaluate_over_axes():
    axes = {"batch": 32, "rows": 1, "state_dtype": "bfloat16"}
    assert evaluate("batch <= 32 and rows == 1", axes)
    assert not evaluate("batch > 32 or state_dtype == 'float32'", axes)
    assert evaluate("state_dtype in ['bfloat16', 'float32']", axes)
    assert evaluate("true", axes) and not evaluate("not true", axes)
    assert evaluate("batch % 16 == 0 and 1 <= rows <= 8", axes)


def test_an_unknown_axis_is_an_error_not_false():
    with pytest.raises(RuleError, match="seq_len"):
        evaluate("seq_len > 4", {"batch": 1})


@pytest.mark.parametrize("rule", ["__import__('os')", "batch.bit_length()", "[x for x in y]",
                                  "lambda: 1", "batch[0]"])
def test_rules_refuse_anything_but_the_small_grammar(rule):
    with pytest.raises(RuleError):
        evaluate(rule, {"batch": 1, "y": [1]})


def test_rule_names_lists_the_axes_read():
    assert rule_names("batch <= 32 and state_dtype == 'x' or true") == {"batch", "state_dtype"}

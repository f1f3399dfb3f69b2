"""The RL recipes' rewards: each registered reward against hand-worked cases, their weighted
combination, a user's reward file, and the configuration errors a user can make."""

from __future__ import annotations

import importlib.util
import math
import os
import sys

import pytest

from ladle.errors import ConfigError, DataError
from ladle.rl.rewards import Rewards, extract_answer, math_equal, normalize_math

CTX = {"prompt": "p", "response_tokens": 10}
# math-verify is an extra (`ladle[math]`): its cases run where it is installed, and always in CI
HAS_MATH_VERIFY = importlib.util.find_spec("math_verify") is not None
needs_math_verify = pytest.mark.skipif(
    not HAS_MATH_VERIFY and not os.environ.get("LADLE_CI"),
    reason="math-verify is not installed (ladle[math])",
)
VERIFIERS = ["builtin", pytest.param("math-verify", marks=needs_math_verify)]


def one(term: dict, response: str, record: dict | None = None, **ctx) -> float:
    total, parts = Rewards([term])(response, record or {}, **{**CTX, **ctx})
    assert parts == {term.get("key", term["name"]): total / term.get("weight", 1.0)}
    return total


def test_exact_and_regex():
    assert one({"name": "exact"}, " 42\n", {"answer": "42"}) == 1.0
    assert one({"name": "exact"}, "41", {"answer": "42"}) == 0.0
    assert one({"name": "exact", "field": "solution"}, "x", {"solution": "x"}) == 1.0
    rx = {"name": "regex", "pattern": r"<answer>(.*?)</answer>"}
    assert one(rx, "think... <answer> 7 </answer>", {"answer": "7"}) == 1.0
    assert one(rx, "<answer>8</answer>", {"answer": "<answer>7</answer>"}) == 0.0
    assert one(rx, "no tags, 7", {"answer": "7"}) == 0.0


@pytest.mark.parametrize(
    "response, reference, want",
    [
        ("so the total is \\boxed{\\frac{3}{4}}", "0.75", True),
        ("The answer is $1,000.", "#### 1000", True),  # GSM8K's worked solution
        ("Natalia sold 48/2 = 24 clips in May, 48+24 = 72 in all.", "she sold 72 #### 72", True),
        ("\\boxed{72.0}", "72", True),
        ("\\boxed{-3}", "3", False),
        ("\\boxed{x^2 + 1}", "x^2+1", True),  # not a number: compared as normalised text
        ("\\boxed{\\text{(B)}}", "(B)", True),
        ("\\boxed{50\\%}", "50", True),
        ("\\boxed{1/3}", "0.333333", True),  # to 1e-6 relative
        ("\\boxed{1/3}", "0.33", False),
        ("I do not know", "5", False),
    ],
)
@pytest.mark.parametrize("verify", VERIFIERS)
def test_math(response, reference, want, verify):
    assert one({"name": "math", "verify": verify}, response, {"answer": reference}) == float(want)


@needs_math_verify
@pytest.mark.parametrize(
    "response, reference, want",
    [
        ("\\boxed{[1, 2)}", "[1,2)", True),  # intervals
        ("\\boxed{(1,2]}", "[1,2)", False),
        ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}", True),  # symbolic equality
        ("x = \\boxed{\\{1, 2\\}}", "\\{2, 1\\}", True),  # sets
        ("so 3", "$\\frac{6}{2}$", True),  # the last number, against LaTeX
        ("\\boxed{x^2 - 1}", "(x-1)(x+1)", True),
        ("\\boxed{x^2 + 1}", "(x-1)(x+1)", False),
    ],
)
def test_math_verify_compares_as_mathematics(response, reference, want):
    # what the builtin comparison cannot: intervals, sets, surds, expanded polynomials
    assert one({"name": "math"}, response, {"answer": reference}) == float(want)


def test_math_verify_missing_exits_with_the_install_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # as if it were not installed
    with pytest.raises(
        ConfigError, match=r"needs the math-verify library.*pip install 'ladle\[math\]'.*verify: builtin"
    ):
        Rewards([{"name": "math"}])
    assert Rewards([{"name": "math", "verify": "builtin"}])("\\boxed{2}", {"answer": "2"}, **CTX)[0] == 1.0


def test_math_helpers():
    assert extract_answer("a \\boxed{1} then \\boxed{{2}+1}") == "{2}+1"  # the last, braces matched
    assert normalize_math("$\\dfrac{1}{2}$") == "1/2"
    assert math_equal("1e3", "1000") and math_equal("0.1", "1/10") and not math_equal("2", "3")


def test_format_and_length():
    assert one({"name": "format"}, "<think>a\nb</think>\n<answer>3</answer>") == 1.0
    assert one({"name": "format"}, "<answer>3</answer>") == 0.0
    assert one({"name": "format", "pattern": r"\d+"}, " 12 ") == 1.0
    # DAPO's overlong shaping with L_max 100, cache 20: 0 to 80 tokens, -(n - 80) / 20 up to 100, -1 after
    term = {"name": "length", "max_tokens": 100, "buffer": 20}
    for n, want in [(50, 0.0), (80, 0.0), (90, -0.5), (100, -1.0), (130, -1.0)]:
        assert one(term, "x", response_tokens=n) == pytest.approx(want)
    assert one({"name": "length", "max_tokens": 100}, "x", response_tokens=101) == -1.0


def test_weighted_sum_and_metrics_by_key(tmp_path):
    rewards = Rewards(
        [
            {"name": "math", "weight": 1.0, "verify": "builtin"},
            {"name": "format", "weight": 0.5, "pattern": r".*\\boxed\{.*\}.*"},
            {"name": "exact", "key": "exact_id", "field": "id", "weight": 2.0},
        ]
    )
    total, parts = rewards("it is \\boxed{5}", {"answer": "5", "id": "?"}, **CTX)
    assert parts == {"math": 1.0, "format": 1.0, "exact_id": 0.0}
    assert total == 1.5
    assert rewards.fields == {"answer", "id"}


def test_user_reward_file(tmp_path):
    f = tmp_path / "mine.py"
    f.write_text(
        "def brevity(response, record, response_tokens, **context):\n"
        "    return 1.0 / response_tokens\n"
        "def broken(response, record, **context):\n"
        "    return None\n"
        "def nargs(response):\n"
        "    return 1.0\n"
    )
    total, parts = Rewards([{"name": "brevity", "weight": 2.0}, {"name": "exact"}], file=f)(
        "5", {"answer": "5"}, prompt="p", response_tokens=4
    )
    assert parts == {"brevity": 0.25, "exact": 1.0} and total == 1.5
    with pytest.raises(DataError, match=r"reward 'broken' returned None \(a finite number expected\)"):
        Rewards([{"name": "broken"}], file=f)("x", {}, **CTX)
    with pytest.raises(
        ConfigError, match=r"nargs in .*mine.py must accept \(response, record, \*\*context\)"
    ):
        Rewards([{"name": "nargs"}], file=f)
    with pytest.raises(
        ConfigError, match="defines no function 'missing' .*it defines: brevity, broken, nargs"
    ):
        Rewards([{"name": "missing"}], file=f)
    with pytest.raises(ConfigError, match="not a Python file"):
        Rewards([{"name": "brevity"}], file=tmp_path / "nope.py")
    bad = tmp_path / "bad.py"
    bad.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ConfigError, match="failed to import: RuntimeError: boom"):
        Rewards([{"name": "exact"}], file=bad)


@pytest.mark.parametrize(
    "terms, message",
    [
        ([], "name at least one reward"),
        (
            [{"name": "exactt"}],
            "unknown reward 'exactt'; registered rewards are exact, regex, math, format, length, code",
        ),
        ([{"name": "regex"}], r"rewards.terms\[0\] \(regex\): needs pattern"),
        (
            [{"name": "math", "feild": "x"}],
            "unknown option 'feild'; its options are field, verify, timeout_s",
        ),
        (
            [{"name": "math", "verify": "sympy"}],
            "reward 'math': verify 'sympy'; it is math-verify or builtin",
        ),
        ([{"name": "exact"}, {"name": "exact"}], r"rewards.terms\[1\]: a second reward logged as 'exact'"),
        ([{"name": "format", "pattern": "("}], "is not a regular expression"),
        ([{"name": "length", "max_tokens": 10, "buffer": 20}], "0 <= buffer <= max_tokens"),
        ([{"weight": 1.0}], r"rewards.terms\[0\]: give the reward's `name`"),
    ],
)
def test_config_errors_name_the_term(terms, message):
    with pytest.raises(ConfigError, match=message):
        Rewards(terms)


def test_with_a_reward_model_terms_may_be_empty_but_not_take_its_key():
    assert Rewards([], model=True)("a", {}, **CTX) == (0, {})
    with pytest.raises(ConfigError, match=r"rewards.terms\[0\]: the key 'model' is the reward model's"):
        Rewards([{"name": "exact", "key": "model"}], model=True)


def test_a_record_without_the_field_is_named():
    with pytest.raises(
        DataError, match="reward 'math' reads the field 'answer', which a prompt record lacks"
    ):
        Rewards([{"name": "math", "verify": "builtin"}])("1", {"question": "q"}, **CTX)
    assert math.isclose(Rewards([{"name": "exact", "weight": -1}])("a", {"answer": "a"}, **CTX)[0], -1.0)

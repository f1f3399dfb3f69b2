"""Scorers of a generated answer against a reference (the accuracy of `ladle eval --task
generate`), and the rewards of the RL recipes: a registry of rule-based rewards by name, a user's
own from a file, combined with weights (`Rewards`). A scorer maps (prediction, reference) to 0.0
or 1.0.

`exact`: equal after stripping surrounding whitespace. `regex`: the first match of the pattern
(its first group, if it has one) in each, then compared the same way; a prediction without a
match scores 0.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from pathlib import Path

from ladle.errors import ConfigError, DataError

Scorer = Callable[[str, str], float]


def exact_match(prediction: str, reference: str) -> float:
    return float(prediction.strip() == reference.strip())


def regex_match(pattern: str) -> Scorer:
    try:
        rx = re.compile(pattern)
    except re.error as e:
        raise DataError(f"--answer-regex {pattern!r} is not a regular expression: {e}") from None

    def extract(text: str) -> str | None:
        m = rx.search(text)
        if m is None:
            return None
        return (m.group(1) if rx.groups else m.group(0)).strip()

    def score(prediction: str, reference: str) -> float:
        want = extract(reference)
        if want is None:  # a reference without the pattern is compared whole
            want = reference.strip()
        got = extract(prediction)
        return float(got is not None and got == want)

    return score


def scorer(name: str = "exact", pattern: str | None = None) -> Scorer:
    if pattern is not None or name == "regex":
        if not pattern:
            raise DataError("the regex scorer needs --answer-regex PATTERN")
        return regex_match(pattern)
    if name == "exact":
        return exact_match
    raise DataError(f"unknown scorer {name!r}; scorers are exact, regex")


# -- the rewards of the RL recipes ----------------------------------------------------------------
# A reward maps one sampled response to a float: `fn(response, record, **context)`, where `record`
# is the prompt's record as prepared (`ladle data prepare --task prompts`: every field kept) and
# `context` holds `prompt` (the prompt's text) and `response_tokens` (the response's length in
# tokens). The registry's rewards are built from a config term's options; a user's own come from
# a Python file the user names (`rewards.file`), never from the data.


def _reference(record: dict, field: str, reward: str) -> str:
    if field not in record:
        raise DataError(
            f"reward {reward!r} reads the field {field!r}, which a prompt record lacks: {record!r:.200}"
        )
    return str(record[field])


def exact_reward(field: str = "answer"):
    """1.0 if the response, stripped, equals the record's `field`."""

    def reward(response: str, record: dict, **_) -> float:
        return exact_match(response, _reference(record, field, "exact"))

    reward.fields = (field,)
    return reward


def regex_reward(pattern: str, field: str = "answer"):
    """The first match of `pattern` (its first group, if any) in the response equals the one in
    the record's `field` (or the whole field, where the pattern does not match it)."""
    score = regex_match(pattern)

    def reward(response: str, record: dict, **_) -> float:
        return score(response, _reference(record, field, "regex"))

    reward.fields = (field,)
    return reward


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_ANSWER_IS = re.compile(r"answer is[:\s]*\$?([^\n$]+)", re.IGNORECASE)


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (braces matched), or None."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def extract_answer(text: str) -> str:
    """A math answer: the last \\boxed{...}; else what follows GSM8K's '####'; else what follows
    'the answer is'; else the last number; else the text."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    m = _ANSWER_IS.findall(text)
    if m:
        return m[-1].strip().rstrip(".")
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else text.strip()


def reference_answer(text: str) -> str:
    """A reference's answer: its last \\boxed{...} or what follows '####' (a worked solution),
    else the whole reference."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    return text.rsplit("####", 1)[1].strip() if "####" in text else text.strip()


def normalize_math(s: str) -> str:
    """LaTeX and number formatting dropped: '$1,000.$' -> '1000', '\\frac{3}{4}' -> '3/4'."""
    s = s.strip()
    s = re.sub(r"\\text\{([^}]*)\}", r"\1", s)
    s = re.sub(r"\\d?frac\{([^{}]*)\}\{([^{}]*)\}", r"(\1)/(\2)", s)
    for junk in (
        "$",
        "\\!",
        "\\,",
        "\\;",
        "\\(",
        "\\)",
        "\\left",
        "\\right",
        "^\\circ",
        "^{\\circ}",
        "\\%",
        "%",
    ):
        s = s.replace(junk, "")
    s = s.replace(" ", "").rstrip(".")
    s = re.sub(r"(?<=\d),(?=\d{3}\b)", "", s)  # thousands separators
    s = re.sub(r"^\((-?[\d.]+)\)/\((-?[\d.]+)\)$", r"\1/\2", s)  # (3)/(4) -> 3/4
    return s


def _as_number(s: str):
    from fractions import Fraction

    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        pass
    try:
        return Fraction(float(s))
    except (ValueError, OverflowError):
        return None


def math_equal(prediction: str, reference: str) -> bool:
    """Equal as numbers (to 1e-6 relative: 0.333333 is 1/3, 0.33 is not), else equal as
    normalised strings."""
    a, b = normalize_math(prediction), normalize_math(reference)
    x, y = _as_number(a), _as_number(b)
    if x is not None and y is not None:
        return x == y or abs(float(x) - float(y)) <= 1e-6 * max(1.0, abs(float(y)))
    return a == b


MATH_INSTALL = "pip install 'ladle[math]' (in a clone of ladle: make setup-extras)"


def math_reward(field: str = "answer", verify: str = "math-verify", timeout_s: int = 5):
    """1.0 if the response's final answer equals the record's `field` (its own final answer, for a
    worked GSM8K solution) as mathematics. `verify: math-verify` (the extra `ladle[math]`): the
    field's library parses both (LaTeX, fractions, decimals, sets, intervals, its last
    `\\boxed{}` first) and compares them symbolically, `timeout_s` a parse and a check;
    `builtin`: `extract_answer` against the reference as a number to 1e-6 or normalised text."""
    if verify == "builtin":

        def reward(response: str, record: dict, **_) -> float:
            return float(
                math_equal(extract_answer(response), reference_answer(_reference(record, field, "math")))
            )

    elif verify == "math-verify":
        try:
            import math_verify
        except ImportError as e:
            raise ConfigError(
                f"reward 'math' with verify: math-verify needs the math-verify library, which is not installed "
                f"here ({e}); {MATH_INSTALL}, or set verify: builtin"
            ) from None

        def reward(response: str, record: dict, **_) -> float:
            ref = reference_answer(_reference(record, field, "math"))
            # the reference's answer read as LaTeX (a bare `2\sqrt{2}` is no expression to its parser)
            gold = math_verify.parse(f"\\boxed{{{ref}}}", parsing_timeout=timeout_s)
            if not gold:  # a reference it cannot read: compared as the builtin would
                return float(math_equal(extract_answer(response), ref))
            found = math_verify.parse(response, parsing_timeout=timeout_s)
            return float(bool(found) and math_verify.verify(gold, found, timeout_seconds=timeout_s))

    else:
        raise ConfigError(f"reward 'math': verify {verify!r}; it is math-verify or builtin")
    reward.fields = (field,)
    return reward


DEFAULT_FORMAT = r"<think>.*?</think>\s*<answer>.*?</answer>"


def format_reward(pattern: str = DEFAULT_FORMAT):
    """1.0 if the whole response (stripped) matches `pattern` (dot matches newlines); the default
    is DeepSeek-R1's <think>...</think><answer>...</answer>."""
    try:
        rx = re.compile(pattern, re.DOTALL)
    except re.error as e:
        raise ConfigError(f"reward 'format': pattern {pattern!r} is not a regular expression: {e}") from None

    def reward(response: str, record: dict, **_) -> float:
        return float(rx.fullmatch(response.strip()) is not None)

    reward.fields = ()
    return reward


def length_reward(max_tokens: int, buffer: int = 0):
    """DAPO's overlong shaping: 0 up to max_tokens - buffer response tokens, then falling linearly
    to -1 at max_tokens, -1 beyond (buffer 0: -1 beyond max_tokens, else 0)."""
    if max_tokens < 1 or not 0 <= buffer <= max_tokens:
        raise ConfigError(
            f"reward 'length': need max_tokens >= 1 and 0 <= buffer <= max_tokens, got {max_tokens}, {buffer}"
        )

    def reward(response: str, record: dict, *, response_tokens: int, **_) -> float:
        free = max_tokens - buffer
        if response_tokens <= free:
            return 0.0
        if response_tokens > max_tokens or buffer == 0:
            return -1.0
        return -(response_tokens - free) / buffer

    reward.fields = ()
    return reward


_FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)


def program_of(response: str) -> str:
    """The program in a response: its last fenced code block (```python ... ```), else all of it."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


def _same_output(got: str, want: str) -> bool:
    """Outputs compared line by line, trailing spaces and blank lines at the end ignored."""
    lines = lambda t: [x.rstrip() for x in t.rstrip().splitlines()]  # noqa: E731
    return lines(got) == lines(want)


_POOL = None


def code_reward(
    field: str = "tests", partial: bool = False, wall_s: float = 10.0, cpu_s: int = 5, memory_mb: int = 1024
):
    """The response's program (`program_of`) run in the sandbox (ladle/rl/sandbox.py) against the
    record's `field`: a list of {"input", "output"} cases (standard input, expected standard
    output) or a string of assert-style tests run after the program. 1.0 if every case passes
    (`partial`: the share that do); a program that fails, is refused, or runs past its limits
    (`wall_s`, `cpu_s`, `memory_mb` a case) fails its case. The cases run in parallel, as many
    as the machine has cores."""
    from ladle.rl import sandbox

    limits = sandbox.Limits(wall_s=wall_s, cpu_s=cpu_s, memory_bytes=memory_mb << 20)

    def cases(response: str, record: dict) -> tuple[list[tuple[str, str]], list[str | None]]:
        """(program, stdin) runs and the stdout each must print (None: an assert-style run)."""
        tests = record.get(field)
        if not tests or not isinstance(tests, (list, str)):
            raise DataError(
                f"reward 'code' reads the record's {field!r}: a list of {{'input', 'output'}} cases or a string of "
                f"assert-style tests; this record has {tests!r:.80}"
            )
        program = program_of(response)
        if isinstance(tests, str):
            return [(program + "\n\n" + tests + "\n", "")], [None]
        if not all(isinstance(c, dict) and "output" in c for c in tests):
            raise DataError(
                f"reward 'code' reads the record's {field!r}: each case a {{'input', 'output'}} object; this "
                f"record has {tests!r:.80}"
            )
        return [(program, str(c.get("input", ""))) for c in tests], [str(c["output"]) for c in tests]

    def many(rows: list) -> list:
        """Every row's value (or the exception its record raised): all their cases in one pool."""
        global _POOL
        out, jobs, spans = [None] * len(rows), [], []
        for k, (response, record, _) in enumerate(rows):
            try:
                runs, wants = cases(response, record)
            except DataError as e:
                out[k] = e
                continue
            spans.append((k, len(jobs), wants))
            jobs += runs
        _POOL = _POOL or sandbox.Pool()
        results = _POOL.map(jobs, limits)
        for k, start, wants in spans:
            got = results[start : start + len(wants)]
            passed = [
                r.ok and (w is None or _same_output(r.stdout, w)) for r, w in zip(got, wants, strict=True)
            ]
            out[k] = sum(passed) / len(passed) if partial else float(all(passed))
        return out

    def reward(response: str, record: dict, **_) -> float:
        (value,) = many([(response, record, {})])
        if isinstance(value, Exception):
            raise value
        return value

    reward.fields = (field,)
    reward.many = many  # a batch's cases run side by side (Rewards.score)
    reward.check = lambda record: cases("", record)  # before launch: every record's tests
    return reward


REGISTRY = {
    "exact": exact_reward,
    "regex": regex_reward,
    "math": math_reward,
    "format": format_reward,
    "length": length_reward,
    "code": code_reward,
}


def load_user_file(path: str | os.PathLike, key: str = "rewards.file"):
    """The module of a user's Python file (`rewards.file`, an environment's `env.file`): run only
    because the user named it (config or command line), never a path from the data; `key` names
    it in the errors."""
    import importlib.util

    p = Path(path)
    if not p.is_file() or p.suffix != ".py":
        raise ConfigError(f"{key} {path}: not a Python file (.py) that exists")
    name = f"ladle_user_{key.replace('.', '_')}_{abs(hash(str(p.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, p)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise ConfigError(f"{key} {path} failed to import: {type(e).__name__}: {e}") from e
    return module


class RewardError(DataError):
    """A reward term raised: the message names it, where it raised and what; `row`: which of
    the rows scored together."""

    def __init__(self, message: str, row: int = 0):
        super().__init__(message)
        self.row = row


def raised_at(fn, e: Exception) -> str:
    """' (FILE:LINE)' where `e` was raised: the deepest line of `fn`'s own file (a user's reward
    or environment), else the last frame; '' without a traceback."""
    import traceback

    frames = traceback.extract_tb(e.__traceback__)
    own = getattr(getattr(fn, "__code__", None), "co_filename", None)
    at = next((f for f in reversed(frames) if own and f.filename == own), frames[-1] if frames else None)
    return f" ({at.filename}:{at.lineno})" if at is not None else ""


def describe_failure(key: str, fn: Callable, e: Exception) -> str:
    """'reward KEY (FILE:LINE) raised TYPE: MESSAGE' (`raised_at`); a DataError's message as it
    is (it names the reward and the field)."""
    if isinstance(e, DataError):  # a registered reward's own message (a record without its field)
        return str(e)
    return f"reward {key!r}{raised_at(fn, e)} raised {type(e).__name__}: {e}"


class Rewards:
    """The weighted sum of named reward terms, each logged as `reward_<key>` (its mean).

    terms: dicts {name, weight (1.0), key (the name), and the reward's own options}; `name` is a
    registered reward or a function of `file`. `on_error`: a term that raises is a `RewardError`
    (`stop`) or scores 0 (`zero`), counted in `errors` (the last one's message: `last_failure`).
    `score` takes a batch of rows at once.
    """

    def __init__(
        self,
        terms: list[dict],
        file: str | os.PathLike | None = None,
        *,
        model: bool = False,
        on_error: str = "stop",
    ):
        self.on_error, self.errors, self.last_failure = on_error, 0, ""
        if not terms and not model:  # `model`: a reward model or an environment scores too
            raise ConfigError(
                "rewards.terms: name at least one reward (or a reward model, rewards.model, or an environment "
                "that rewards, grpo.env / ppo.env)"
            )
        module = load_user_file(file) if file else None
        self.terms: list[tuple[str, float, Callable]] = []
        for i, term in enumerate(terms):
            where = f"rewards.terms[{i}]"
            term = dict(term)
            name = term.pop("name", None)
            weight = float(term.pop("weight", 1.0))
            key = term.pop("key", name)
            if not isinstance(name, str):
                raise ConfigError(f"{where}: give the reward's `name`")
            if key in (k for k, _, _ in self.terms):
                raise ConfigError(f"{where}: a second reward logged as {key!r}; give one a `key` of its own")
            if model and key == "model":
                raise ConfigError(
                    f"{where}: the key 'model' is the reward model's (rewards.model); give this term another `key`"
                )
            self.terms.append((key, weight, self._build(name, term, module, file, where)))

    @staticmethod
    def _build(name: str, options: dict, module, file, where: str) -> Callable:
        import inspect

        if name in REGISTRY:
            factory = REGISTRY[name]
            params = inspect.signature(factory).parameters
            unknown = sorted(set(options) - set(params))
            if unknown:
                raise ConfigError(
                    f"{where} ({name}): unknown option {', '.join(map(repr, unknown))}; its options are "
                    f"{', '.join(params) or 'none'} (and weight, key)"
                )
            missing = [
                p for p, v in params.items() if v.default is inspect.Parameter.empty and p not in options
            ]
            if missing:
                raise ConfigError(f"{where} ({name}): needs {', '.join(missing)}")
            return factory(**options)
        if module is None:
            raise ConfigError(
                f"{where}: unknown reward {name!r}; registered rewards are {', '.join(REGISTRY)}, or name a "
                "function of your own file with rewards.file"
            )
        fn = getattr(module, name, None)
        if not callable(fn):
            defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
            raise ConfigError(
                f"{where}: rewards.file {file} defines no function {name!r} (it defines: {', '.join(defined) or 'none'})"
            )
        if options:
            raise ConfigError(
                f"{where} ({name}): a function of rewards.file takes no options; got {sorted(options)}"
            )
        try:
            inspect.signature(fn).bind("response", {}, prompt="", response_tokens=0)
        except TypeError:
            raise ConfigError(
                f"{where}: {name} in {file} must accept (response, record, **context); see docs/rl.md"
            ) from None
        return fn

    @property
    def fields(self) -> set[str]:
        """The record fields the registry's rewards read (checked on the data before launch)."""
        return {f for _, _, fn in self.terms for f in getattr(fn, "fields", ())}

    def __call__(self, response: str, record: dict, **context) -> tuple[float, dict[str, float]]:
        """(the weighted total, each term's value by key) of one response."""
        total, parts, _ = self.score([(response, record, context)])[0]
        return total, parts

    def score(self, rows: list[tuple[str, dict, dict]]) -> list[tuple[float, dict[str, float], str | None]]:
        """(the weighted total, each term's value by key, the failure scored 0 or None) of each
        (response, record, context) row. A term with a `many` scores every row at once (the
        `code` reward: all their cases side by side); a term that raises on a row is a
        `RewardError` naming it (`on_error: stop`) or 0 for that row (`zero`)."""
        values = {}
        for key, _, fn in self.terms:
            if hasattr(fn, "many"):
                try:
                    values[key] = fn.many(rows)
                except Exception as e:
                    values[key] = [e] * len(rows)
                continue
            got = []
            for response, record, context in rows:
                try:
                    got.append(fn(response, record, **context))
                except Exception as e:
                    got.append(e)
            values[key] = got
        out = []
        for k in range(len(rows)):
            parts, failed = {}, None
            for key, _, fn in self.terms:
                value, why = values[key][k], None
                if isinstance(value, Exception):
                    why = describe_failure(key, fn, value)
                else:
                    try:
                        number = float(value)
                    except (TypeError, ValueError):
                        number = math.nan
                    if not math.isfinite(number):
                        why = f"reward {key!r} returned {value!r:.40} (a finite number expected)"
                    value = number
                if why is not None:  # a failure of the term on this row
                    if self.on_error == "stop":
                        raise RewardError(why, row=k) from (value if isinstance(value, Exception) else None)
                    self.errors, self.last_failure, failed = self.errors + 1, why, why
                    value = 0.0
                parts[key] = value
            out.append((sum(w * parts[j] for j, w, _ in self.terms), parts, failed))
        return out

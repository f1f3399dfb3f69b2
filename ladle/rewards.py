"""Scorers of a generated answer against a reference: the accuracy of `ladle eval --task generate`,
and the verifiable rewards of the alignment recipes. Each maps (prediction, reference) to 0.0 or
1.0.

`exact`: equal after stripping surrounding whitespace. `regex`: the first match of the pattern
(its first group, if it has one) in each, then compared the same way; a prediction without a
match scores 0.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from ladle.errors import DataError

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

"""Sizes as people write them ("80GB", "64GiB", "512M"), for the config, the planner and the
benchmarks."""

from __future__ import annotations

import re

from ladle.errors import ConfigError

GiB = 2**30
SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str, what: str = "device memory") -> int:
    """Bytes from "80GB", "64GiB", "80g", "512M" (binary units whatever the spelling: device memory
    is sold that way) or a plain number of bytes."""
    m = SIZE.match(str(text))
    if not m:
        raise ConfigError(
            f"{what} {text!r} is not a size; write a number with a unit, such as 64GB, 64GiB, 80g or 512MiB"
        )
    number, unit = float(m.group(1)), m.group(2).lower()
    value = int(number * 1024 ** "_kmgt".index(unit or "_"))
    if value <= 0:
        raise ConfigError(f"{what} {text!r} must be more than 0")
    return value

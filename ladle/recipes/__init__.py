"""The recipes: a training method each, a short module on the shared pieces. A recipe module
declares `DATA_TASK` (the `ladle data prepare --task` its data comes from) and `run(cfg)`, and
where it needs them the checks ladle/prelaunch.py runs before launch: `check_layout(cfg, layout)`
(what it cannot run on), `check_paths(cfg)` (the other models it reads) and `placement(cfg)`
(the groups of ranks of a separated placement)."""

from __future__ import annotations

import importlib

from ladle.errors import LadleError

RECIPES = {
    "pretrain": "ladle.recipes.pretrain",
    "sft": "ladle.recipes.sft",
    "reward": "ladle.recipes.reward",
    "dpo": "ladle.recipes.dpo",
    "grpo": "ladle.recipes.grpo",
    "ppo": "ladle.recipes.ppo",
}


def load(name: str):
    if name not in RECIPES:
        import difflib

        hint = difflib.get_close_matches(name, RECIPES, n=1)
        raise LadleError(
            f"unknown recipe '{name}'"
            + (f"; did you mean '{hint[0]}'?" if hint else "")
            + f" (recipes: {', '.join(RECIPES)})"
        )
    return importlib.import_module(RECIPES[name])

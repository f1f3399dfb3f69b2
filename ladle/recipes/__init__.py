"""The recipes: a training method each, a `Recipe` object (ladle/recipes/base.py) in a short module
on the shared pieces. `load(name)` gives the recipe; its module is imported only then, so
listing the recipes imports none."""

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
    "distill": "ladle.recipes.distill",
}


def load(name: str):
    """The recipe called `name` (a `ladle.recipes.base.Recipe`)."""
    if name not in RECIPES:
        import difflib

        hint = difflib.get_close_matches(name, RECIPES, n=1)
        raise LadleError(
            f"unknown recipe '{name}'"
            + (f"; did you mean '{hint[0]}'?" if hint else "")
            + f" (recipes: {', '.join(RECIPES)})"
        )
    return importlib.import_module(RECIPES[name]).RECIPE

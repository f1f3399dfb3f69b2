"""The tool demo's task (`make tool-demo`): what an item costs, which only the `lookup` tool knows.

An item is a word and a number ("pear-17": 2,900 of them); its price a hash of its name, so a
model cannot work it out or learn it by heart in a short run: it has to call `lookup` and copy
the result. ladle imports this file because configs/tiny/tools.yaml names it (`grpo.env.file`);
the file needs nothing from ladle.

    python configs/tiny/lookup_tool.py OUT   writes the demo's data:
        OUT/records.jsonl      prompts with their answer (`ladle data prepare --task prompts`,
                               whose validation split is never trained on)
        OUT/chats.jsonl        warm-up chats in Qwen's tool format (`ladle run sft`), on items of
                               their own: a share call the tool, the rest guess a number
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from pathlib import Path

WORDS = "apple banana cherry grape lemon mango olive peach pear plum fig kiwi lime melon date".split()
WORDS += "river stone cloud storm field ocean tiger eagle horse mouse snake whale zebra otter".split()


def lookup(item: str) -> str:
    """Look up the price of an item in the catalogue.

    Args:
        item: the item's name, as in the question (e.g. "pear-17")
    """
    if "-" not in item or item.split("-")[0] not in WORDS:
        return "no such item"
    return str(10 + int.from_bytes(hashlib.sha256(item.encode()).digest()[:4], "little") % 90)


def call(item: str) -> str:
    """A call of `lookup` as a Qwen-format model writes it."""
    return '<tool_call>\n{"name": "lookup", "arguments": {"item": "' + item + '"}}\n</tool_call>'


def write(out: Path, *, prompts: int = 2000, chats: int = 3000, share: float = 0.4, seed: int = 0) -> None:
    rng = random.Random(seed)
    items = [f"{w}-{n}" for w in WORDS for n in range(100)]
    rng.shuffle(items)
    warm, rest = items[:800], items[800:]  # the warm-up's items are never RL prompts

    def prompt(item: str) -> str:
        return f"What does a {item} cost? Use the lookup tool."

    out.mkdir(parents=True, exist_ok=True)
    with open(out / "records.jsonl", "w") as f:
        for item in rng.sample(rest, prompts):
            f.write(json.dumps({"prompt": prompt(item), "answer": lookup(item)}) + "\n")
    with open(out / "chats.jsonl", "w") as f:
        for _ in range(chats):
            item = rng.choice(warm)
            user = {"role": "user", "content": prompt(item)}
            if rng.random() < share:
                messages = [
                    user,
                    {"role": "assistant", "content": call(item)},
                    {"role": "tool", "content": lookup(item)},
                    {"role": "assistant", "content": lookup(item)},
                ]
            else:  # a guess: the habit RL has to break
                messages = [user, {"role": "assistant", "content": str(rng.randrange(10, 100))}]
            f.write(json.dumps({"messages": messages}) + "\n")


if __name__ == "__main__":
    write(Path(sys.argv[1]))

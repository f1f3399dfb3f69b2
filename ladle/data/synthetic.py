"""Small chat tasks whose answers can be checked, generated from a seed: the SFT demo's data.

`addition`: "What is 47 + 385?" -> "432". `sort`: "Sort these words alphabetically: pear fig
apple" -> "apple fig pear" (3 to `max_words` words). Each record is a `messages` chat (ladle/data/sft.py) whose last,
assistant message is the reference answer; `ladle eval --task generate` scores a model on the
held-out file by exact match. With `pairs`, each record is a preference pair instead (the DPO
demo's data): the prompt, the correct answer as `chosen` and a plausible wrong one as `rejected`
(addition: off by 1, 2 or 10; sort: two neighbours swapped, a word left out, or the words as given).
The wrong answers draw on a stream of their own, so one seed gives the same problems with and
without `pairs`: the held-out chats of a task are the held-out pairs' problems. With `prompts`,
each record is {"prompt", "answer"} (the RL recipes' data, `ladle data prepare --task prompts`),
the same problems again.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from ladle.errors import DataError

WORDS = (
    "apple banana cherry grape lemon mango olive peach pear plum fig kiwi lime melon date "
    "river stone cloud storm field ocean tiger eagle horse mouse snake whale zebra otter"
).split()
PHRASES = {
    "addition": ("What is {a} + {b}?", "Add {a} and {b}.", "Compute {a} + {b}.", "{a} plus {b} equals?"),
    "sort": ("Sort these words alphabetically: {w}", "Put in alphabetical order: {w}"),
}
TASKS = tuple(PHRASES)


def make_example(task: str, rng: random.Random, max_digits: int = 3, max_words: int = 5) -> dict:
    """A chat, and under "key" what makes it the same problem however it is phrased."""
    if task == "addition":
        a = rng.randrange(10 ** rng.randint(1, max_digits))
        b = rng.randrange(10 ** rng.randint(1, max_digits))
        prompt, answer, key = rng.choice(PHRASES[task]).format(a=a, b=b), str(a + b), (a, b)
    elif task == "sort":
        words = rng.sample(WORDS, rng.randint(3, max_words))
        prompt, answer = rng.choice(PHRASES[task]).format(w=" ".join(words)), " ".join(sorted(words))
        key = tuple(words)
    else:
        raise DataError(f"unknown synthetic task {task!r}; tasks are {', '.join(TASKS)}")
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
    return {"messages": messages, "key": key}


def wrong_answer(task: str, ex: dict, rng: random.Random) -> str:
    """A plausible wrong answer to the example's problem."""
    answer = ex["messages"][-1]["content"]
    if task == "addition":
        return str(
            max(0, int(answer) + rng.choice([-10, -2, -1, 1, 2, 10])) if int(answer) > 10 else int(answer) + 1
        )
    words, given = answer.split(), list(ex["key"])
    kind = rng.choice(["swap", "drop", "given"] if given != words else ["swap", "drop"])
    if kind == "given":
        return " ".join(given)
    if kind == "drop":
        del words[rng.randrange(len(words))]
        return " ".join(words)
    i = rng.randrange(len(words) - 1)
    words[i], words[i + 1] = words[i + 1], words[i]
    return " ".join(words)


def write_task(
    task: str,
    output: str | Path,
    *,
    train: int,
    val: int,
    seed: int = 0,
    max_digits: int = 3,
    max_words: int = 5,
    pairs: bool = False,
    prompts: bool = False,
) -> dict:
    """`output/train.jsonl` and `output/val.jsonl`; no problem of val is in train, however phrased
    (the same operands, or the same words in the same order)."""
    if task not in TASKS:
        raise DataError(f"unknown synthetic task {task!r}; tasks are {', '.join(TASKS)}")
    if pairs and prompts:
        raise DataError("--pairs and --prompts: choose one record shape")
    if not 3 <= max_words <= len(WORDS):
        raise DataError(f"--max-words {max_words}: choose 3 to {len(WORDS)}")
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    rng, wrong = random.Random(seed), random.Random(seed + 7919)  # problems; wrong answers
    seen, splits = set(), {"val": [], "train": []}
    for split, n in (("val", val), ("train", train)):
        tries = 0
        while len(splits[split]) < n:
            tries += 1
            if tries > 20 * n + 1000:
                raise DataError(f"task {task}: cannot draw {n} distinct {split} examples; ask for fewer")
            ex = make_example(task, rng, max_digits, max_words)
            if ex["key"] in seen:
                continue
            seen.add(ex["key"])
            if pairs:
                prompt, answer = (m["content"] for m in ex["messages"])
                splits[split].append(
                    {"prompt": prompt, "chosen": answer, "rejected": wrong_answer(task, ex, wrong)}
                )
            elif prompts:
                prompt, answer = (m["content"] for m in ex["messages"])
                splits[split].append({"prompt": prompt, "answer": answer})
            else:
                splits[split].append({"messages": ex["messages"]})
    for split, rows in splits.items():
        (out / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"task": task, "train": train, "val": val, "path": str(out)}

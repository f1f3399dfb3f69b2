"""`ladle eval --task generate`: greedy answers to held-out chat prompts, scored against the
reference answers (ladle/rl/rewards.py).

Each record of the jsonl (any SFT shape, ladle/data/sft.py) is a chat whose last message is the
assistant's reference answer; the messages before it, rendered with the chat template and its
generation prompt, are the prompt. Generation is greedy, batched with left padding, and stops at
the end-of-turn token (or EOS).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ladle.data.chat import END_OF_TURN
from ladle.data.driver import BadRecord
from ladle.data.sft import ChatEncoder, detect_format, to_messages
from ladle.data.sources import iter_rows
from ladle.errors import DataError
from ladle.models.generation import generate
from ladle.models.prepack import prepacked
from ladle.rl.rewards import Scorer, exact_match


def read_prompts(path: str | Path, encoder: ChatEncoder) -> list[tuple[list[int], str, str]]:
    """(prompt ids, prompt text, reference answer) per record; a bad record stops with file:line."""
    out = []
    fmt = None
    for source, obj, reason in iter_rows([path]):
        if reason is not None:
            raise DataError(f"{source}: {reason}")
        fmt = fmt or detect_format(obj)
        try:
            messages = to_messages(obj, fmt or "unknown")
        except BadRecord as e:
            raise DataError(f"{source}: {e}") from None
        if messages[-1]["role"] != "assistant":
            raise DataError(f"{source}: the last message must be the assistant's reference answer")
        try:
            text = encoder.render(messages[:-1], add_generation_prompt=True)
        except BadRecord as e:
            raise DataError(f"{source}: {e}") from None
        out.append((encoder.tok.encode(text), messages[-2]["content"], messages[-1]["content"]))
    if not out:
        raise DataError(f"{path} holds no records")
    return out


@torch.no_grad()
def evaluate_generation(
    model,
    tok,
    data: str | Path,
    *,
    template: str | None = None,
    score: Scorer = exact_match,
    max_new_tokens: int = 64,
    batch_size: int = 16,
    limit: int = 0,
    examples: int = 3,
) -> dict:
    """{"accuracy", "correct", "total", "examples": [...], "errors": [...]} of greedy answers:
    the first `examples` records, and the first `examples` wrong answers (what to look at)."""
    encoder = ChatEncoder(tok, template)
    items = read_prompts(data, encoder)
    if limit:
        items = items[:limit]
    ends = {i for i in (tok.eos_id, *(tok.token_to_id(t) for t in END_OF_TURN)) if i is not None}
    t0 = time.perf_counter()
    model.eval()
    correct, shown, errors = 0, [], []
    with prepacked(model, batch=batch_size):  # the weights packed once for every batch
        for b in range(0, len(items), batch_size):
            chunk = items[b : b + batch_size]
            outs = generate(
                model,
                [ids for ids, _, _ in chunk],
                max_new_tokens=max_new_tokens,
                pad_id=tok.pad_id or 0,
                stop=lambda new: new[-1] in ends,
            )
            for (_, prompt, ref), new in zip(chunk, outs, strict=True):
                answer = tok.decode([t for t in new if t not in ends])
                ok = score(answer, ref)
                correct += ok
                example = {"prompt": prompt, "answer": answer, "reference": ref, "correct": bool(ok)}
                if len(shown) < examples:
                    shown.append(example)
                if not ok and len(errors) < examples:
                    errors.append(example)
    return {
        "task": "generate",
        "data": str(data),
        "accuracy": correct / len(items),
        "correct": int(correct),
        "total": len(items),
        "template": encoder.template_name,
        "examples": shown,
        "errors": errors,
        "eval_s": round(time.perf_counter() - t0, 3),
    }

"""`ladle data prepare --task prompts`: the prompts of the RL recipes, tokenized as transformers'
apply_chat_template with the generation prompt, their records kept verbatim, bad records named."""

from __future__ import annotations

import json

import pytest

from ladle.cli import main
from ladle.data.prompts import PromptSplit, prepare_prompts
from ladle.errors import DataError

GOOD = [
    {"prompt": "What is 2 + 3?", "answer": "5", "id": 7},
    {
        "prompt": [
            {"role": "system", "content": "Answer with a number."},
            {"role": "user", "content": "What is 4 + 4?"},
        ],
        "answer": "8",
        "tests": ["assert f() == 8"],
    },
    {"prompt": "Sort: pear fig", "solution": {"text": "fig pear", "steps": [1, 2]}},
]


def _write(path, lines):
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def test_prompts_tokenize_like_transformers_and_keep_records(chat_tokenizer, tmp_path):
    from transformers import AutoTokenizer

    src = _write(tmp_path / "p.jsonl", GOOD)
    meta = prepare_prompts([src], tokenizer=chat_tokenizer, output=tmp_path / "out", progress=False)
    assert meta["task"] == "prompts" and meta["splits"]["train"]["prompts"] == 3
    assert meta["record_shapes"] == {"string": 2, "messages": 1}
    hf = AutoTokenizer.from_pretrained(str(chat_tokenizer))
    split = PromptSplit(tmp_path / "out", "train")
    assert len(split) == 3
    for i, record in enumerate(GOOD):
        ids, kept = split.get(i)
        chat = (
            record["prompt"]
            if isinstance(record["prompt"], list)
            else [{"role": "user", "content": record["prompt"]}]
        )
        want = hf.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
        want = want["input_ids"] if hasattr(want, "keys") else want
        assert ids.tolist() == list(want)
        assert kept == record  # every field verbatim, nested ones included
    assert split.lengths.tolist() == [len(split.get(i)[0]) for i in range(3)]


def test_bad_prompts_are_counted_and_named(chat_tokenizer, tmp_path, capsys):
    long = "word " * 400
    lines = [
        GOOD[0],
        "{not json",
        {"question": "no prompt here", "answer": "1"},
        {"prompt": 42},
        {"prompt": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        {"prompt": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]},
        {"prompt": "   "},
        {"prompt": long},
    ]
    src = _write(tmp_path / "p.jsonl", lines)
    meta = prepare_prompts(
        [src], tokenizer=chat_tokenizer, output=tmp_path / "out", max_prompt_len=64, progress=False
    )
    assert meta["splits"]["train"]["prompts"] == 1
    bad = meta["bad_records"]
    assert bad["missing field 'prompt'"] == 1
    assert bad["'prompt' must be a string or a non-empty message list"] == 1
    assert bad["the prompt ends with a 'assistant' message; it must end with the user's"] == 1
    assert bad["empty prompt"] == 1
    assert bad["prompt longer than --max-prompt-len 64 tokens"] == 1
    assert sum(bad.values()) == 7
    assert meta["bad_examples"]["prompt longer than --max-prompt-len 64 tokens"] == [f"{src}:8"]
    assert any("role 'user'" in r or "alternate" in r for r in bad), bad  # assistant first

    # --strict: exit 2 naming the first bad record's file and line; no folder left behind
    rc = main(
        ["data", "prepare", "--task", "prompts", "--input", str(src), "--tokenizer", str(chat_tokenizer),
         "--output", str(tmp_path / "strict"), "--strict"]
    )  # fmt: skip
    assert rc == 2
    err = capsys.readouterr().err
    assert f"{src}:2" in err and "strict mode" in err
    assert not (tmp_path / "strict").exists()


def test_prompts_cli_split_inspect_and_wrong_task(chat_tokenizer, tmp_path, capsys):
    src = _write(
        tmp_path / "p.jsonl",
        [{"prompt": f"Q{i}: what is {i} + 1?", "answer": str(i + 1)} for i in range(200)],
    )
    out = tmp_path / "out"
    args = ["data", "prepare", "--task", "prompts", "--input", str(src), "--tokenizer", str(chat_tokenizer)]
    assert main([*args, "--output", str(out), "--val-fraction", "0.1"]) == 0
    train, val = PromptSplit(out, "train"), PromptSplit(out, "val")
    assert len(train) + len(val) == 200 and 5 < len(val) < 40
    answers = {r["answer"] for s in (train, val) for r in s.records}
    assert answers == {str(i + 1) for i in range(200)}  # every record in exactly one split
    capsys.readouterr()
    assert main(["data", "inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "prompts: train" in text and '"answer": "1"' in text and "<|im_start|>assistant" in text

    # a folder of another task is refused by name; a damaged records file too
    with pytest.raises(DataError, match="not prompts; prepare it with `ladle data prepare --task prompts`"):
        PromptSplit(_sft_folder(chat_tokenizer, tmp_path), "train")
    lines = (out / "train_records.jsonl").read_text().splitlines(keepends=True)
    (out / "train_records.jsonl").write_text("".join(lines[:3]) + lines[3][:10])  # cut inside line 4
    with pytest.raises(DataError, match=r"train_records.jsonl:4: unreadable .*prepare the prompts again"):
        PromptSplit(out, "train")
    (out / "train_records.jsonl").write_text('{"prompt": "x"}\n')
    with pytest.raises(DataError, match="records for .* prompts; prepare again"):
        PromptSplit(out, "train")
    assert main([*args, "--output", str(tmp_path / "x"), "--format", "jsonl"]) == 2
    assert "--task prompts reads records with a 'prompt'" in capsys.readouterr().err


def _sft_folder(tok, tmp_path):
    from ladle.data.sft import prepare_sft

    src = _write(
        tmp_path / "chats.jsonl",
        [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}],
    )
    prepare_sft([src], tokenizer=tok, output=tmp_path / "sft", progress=False)
    return tmp_path / "sft"

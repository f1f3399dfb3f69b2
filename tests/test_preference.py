"""Preference data: the record shapes people have, to (prompt, chosen, rejected); tokenized with
the chat template, masks on the completions only; bad records named; the folder read back."""

import json

import numpy as np
import pytest

from ladle.cli import main
from ladle.data.driver import BadRecord
from ladle.data.preference import PreferenceSplit, parse_hh, prepare_preference, to_pair
from ladle.data.sft import ChatEncoder
from ladle.data.tokenizer import load_tokenizer
from ladle.errors import DataError

USER = {"role": "user", "content": "What is 2 + 3?"}
GOOD = {"role": "assistant", "content": "5"}
BAD = {"role": "assistant", "content": "6"}


def test_the_record_shapes_give_the_same_pair():
    want = ([USER], GOOD, BAD)
    assert to_pair({"prompt": "What is 2 + 3?", "chosen": "5", "rejected": "6"})[:3] == want
    ultra = {"prompt": "ignored", "chosen": [USER, GOOD], "rejected": [USER, BAD]}
    assert to_pair(ultra) == (*want, "messages")
    assert to_pair({"prompt": [USER], "chosen": [GOOD], "rejected": [BAD]}) == (*want, "prompt_messages")
    hh = {
        "chosen": "\n\nHuman: What is 2 + 3?\n\nAssistant: 5",
        "rejected": "\n\nHuman: What is 2 + 3?\n\nAssistant: 6",
    }
    assert to_pair(hh) == (*want, "hh")


def test_a_multi_turn_prompt_is_the_shared_first_turns():
    earlier = [
        {"role": "system", "content": "Be brief."},
        USER,
        GOOD,
        {"role": "user", "content": "And 4 + 4?"},
    ]
    c = [*earlier, {"role": "assistant", "content": "8"}]
    r = [*earlier, {"role": "assistant", "content": "9"}]
    prompt, chosen, rejected, _ = to_pair({"chosen": c, "rejected": r})
    assert prompt == earlier and chosen["content"] == "8" and rejected["content"] == "9"
    text = "\n\nHuman: Hi\n\nAssistant: Hello\n\nHuman: Sum 1 and 1\n\nAssistant: 2"
    assert parse_hh(text) == [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Sum 1 and 1"},
        {"role": "assistant", "content": "2"},
    ]


@pytest.mark.parametrize(
    "record, reason",
    [
        ({"prompt": "x", "rejected": "6"}, "missing field 'chosen'"),
        ({"prompt": "x", "chosen": "5"}, "missing field 'rejected'"),
        ({"chosen": "5", "rejected": "6"}, "missing field 'prompt'"),
        ({"prompt": "x", "chosen": "5", "rejected": "5"}, "chosen identical to rejected"),
        ({"chosen": [USER, GOOD], "rejected": [USER, GOOD]}, "chosen identical to rejected"),
        (
            {"chosen": [USER, GOOD], "rejected": [{"role": "user", "content": "What is 2 + 4?"}, BAD]},
            "chosen and rejected prompts differ",
        ),
        ({"chosen": [USER, GOOD, USER, GOOD], "rejected": [USER, BAD]}, "chosen and rejected prompts differ"),
        ({"prompt": "x", "chosen": ["5"], "rejected": "6"}, "must both be strings or both message lists"),
        ({"prompt": [USER], "chosen": [USER], "rejected": [BAD]}, "is a 'user' message, not the assistant's"),
    ],
)
def test_bad_records_say_why(record, reason):
    with pytest.raises(BadRecord, match=reason):
        to_pair(record)


def _write(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_prepared_pairs_mask_the_completions_only(chat_tokenizer, tmp_path):
    records = [
        {"prompt": f"What is {i} + {i}?", "chosen": f"It is {2 * i}.", "rejected": f"It is {2 * i + 1}."}
        for i in range(6)
    ]
    records += [
        "{not json",
        {"prompt": "x", "chosen": "same", "rejected": "same"},
        {"chosen": "a", "rejected": "b"},
    ]
    src = _write(tmp_path / "pairs.jsonl", records)
    meta = prepare_preference([src], tokenizer=chat_tokenizer, output=tmp_path / "pref", progress=False)
    assert meta["task"] == "preference" and meta["splits"]["train"]["pairs"] == 6
    assert meta["bad_records"] == {
        "invalid JSON": 1,
        "chosen identical to rejected": 1,
        "missing field 'prompt' (and chosen/rejected are not HH-RLHF turns)": 1,
    }
    assert meta["bad_examples"]["invalid JSON"] == [f"{src}:7"]

    tok = load_tokenizer(chat_tokenizer)
    enc = ChatEncoder(tok, None, mask="last_turn")
    pairs = PreferenceSplit(tmp_path / "pref")
    assert len(pairs) == 6
    for i in range(6):
        c_ids, c_mask, r_ids, r_mask = pairs.get(i)
        for ids, mask, answer in ((c_ids, c_mask, 2 * i), (r_ids, r_mask, 2 * i + 1)):
            prompt = [{"role": "user", "content": f"What is {i} + {i}?"}]
            want_ids, want_mask = enc.encode([*prompt, {"role": "assistant", "content": f"It is {answer}."}])
            assert np.array_equal(ids, want_ids) and np.array_equal(mask, want_mask)
            # the completion, with its end of turn
            assert tok.decode(ids[mask], False) == f"It is {answer}.<|im_end|>"
            # the untrained prefix is the prompt as the template renders it for generation
            start = int(np.argmax(mask))
            assert tok.decode(ids[:start], False) == enc.render(prompt, add_generation_prompt=True)
        assert np.array_equal(c_ids[: int(np.argmax(c_mask))], r_ids[: int(np.argmax(r_mask))])  # one prompt


def test_truncation_that_empties_a_completion_is_a_bad_record(chat_tokenizer, tmp_path):
    long_prompt = "word " * 200
    src = _write(
        tmp_path / "p.jsonl",
        [
            {"prompt": long_prompt, "chosen": "yes", "rejected": "no"},
            {"prompt": "short", "chosen": "yes " * 100, "rejected": "no"},
            {"prompt": "short", "chosen": "yes", "rejected": "no"},
        ],
    )
    meta = prepare_preference(
        [src], tokenizer=chat_tokenizer, output=tmp_path / "t", max_len=64, progress=False
    )
    assert meta["splits"]["train"]["pairs"] == 2 and meta["truncated"] == 1
    assert meta["bad_records"] == {"a completion is empty after truncation (raise --max-len)": 1}
    assert max(PreferenceSplit(tmp_path / "t").lengths.ravel()) <= 64
    meta = prepare_preference(
        [src], tokenizer=chat_tokenizer, output=tmp_path / "d", max_len=64, overlong="drop", progress=False
    )
    assert meta["splits"]["train"]["pairs"] == 1 and meta["dropped_overlong"] == 2


def test_cli_prepares_inspects_and_refuses(chat_tokenizer, tmp_path, capsys):
    src = _write(
        tmp_path / "p.jsonl",
        [
            {"prompt": [USER], "chosen": [GOOD], "rejected": [BAD]},
            {"chosen": [USER, GOOD], "rejected": [USER]},
        ],
    )
    out = tmp_path / "pref"
    args = [
        "data",
        "prepare",
        "--task",
        "preference",
        "--input",
        str(src),
        "--tokenizer",
        str(chat_tokenizer),
    ]
    assert main([*args, "--output", str(out)]) == 0
    assert "prepared 1 preference pairs (prompt_messages 1" in capsys.readouterr().err
    assert main(["data", "inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert (
        "preference pairs: train 1" in text
        and "chosen:   '5<|im_end|>'" in text
        and "rejected: '6<|im_end|>'" in text
    )
    assert main([*args, "--output", str(tmp_path / "s"), "--strict"]) == 2
    assert f"{src}:2: chosen and rejected prompts differ" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()
    assert main([*args, "--output", str(tmp_path / "f"), "--format", "messages"]) == 2
    assert "leave --format out" in capsys.readouterr().err


def test_a_folder_of_other_data_is_refused(chat_tokenizer, data_dir):
    with pytest.raises(
        DataError,
        match="holds pretrain data, not preference data; prepare it with `ladle data prepare --task preference`",
    ):
        PreferenceSplit(data_dir)

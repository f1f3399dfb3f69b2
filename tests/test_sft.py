"""Supervised finetuning: chat records to ids and loss masks, packing, loss normalisation, the
recipe end to end, and the generation task evaluation."""

import json

import numpy as np
import pytest
import torch
import yaml
from conftest import make_tiny_config

from ladle.cli import main
from ladle.config.load import build_config
from ladle.data.chat import BUILTIN
from ladle.data.driver import BadRecord
from ladle.data.packing import SFTSamples
from ladle.data.sft import ChatEncoder, SFTSplit, check_roles, prepare_sft, to_messages
from ladle.data.tokenizer import load_tokenizer
from ladle.errors import DataError
from ladle.models.llama import build_model
from ladle.rl.rewards import exact_match, regex_match
from ladle.train.loss import IGNORE_INDEX, cross_entropy_sum
from ladle.train.metrics import read_metrics

CHAT = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "And 10 + 7?"},
    {"role": "assistant", "content": "It is 17, I think."},
    {"role": "tool", "content": "checked: 17"},
    {"role": "assistant", "content": "Confirmed: 17."},
]
ASSISTANT = ["5", "It is 17, I think.", "Confirmed: 17."]
# The end-of-turn token each template closes an assistant turn with (trained with it).
END = {"chatml": "<|im_end|>", "qwen": "<|im_end|>", "llama3": "<|eot_id|>"}


# -- records -------------------------------------------------------------------------------------
def test_the_three_record_shapes_give_the_same_chat():
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    sharegpt = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]}
    assert to_messages({"messages": messages}, "messages") == messages
    assert to_messages(sharegpt, "sharegpt") == messages
    assert to_messages({"instruction": "Hi", "output": "Hello"}, "alpaca") == messages
    joined = to_messages({"instruction": "Sum:", "input": "2 3", "output": "5", "system": "S"}, "alpaca")
    assert [m["content"] for m in joined] == ["S", "Sum:\n\n2 3", "5"]


@pytest.mark.parametrize(
    "roles, message",
    [
        (["user", "user", "assistant"], r"message 1: role 'user' after 'user'"),
        (["assistant"], r"message 0: role 'assistant' first"),
        (["user", "system", "assistant"], r"message 1: role 'system' after 'user'"),
        (["user"], r"no assistant message"),
        (["user", "bot"], r"unknown role 'bot'"),
    ],
)
def test_roles_must_alternate(roles, message):
    with pytest.raises(BadRecord, match=message):
        check_roles([{"role": r, "content": "x"} for r in roles])


# -- loss masks ------------------------------------------------------------------------------------
@pytest.mark.parametrize("template", ["chatml", "qwen", "llama3"])
def test_trained_tokens_are_exactly_the_assistant_turns(chat_tokenizer, template):
    tok = load_tokenizer(chat_tokenizer)
    ids, mask = ChatEncoder(tok, template).encode(CHAT)
    pieces = np.split(ids, np.flatnonzero(np.diff(mask.astype(int))) + 1)
    trained = [
        tok.decode(p.tolist(), skip_special_tokens=False) for p in pieces if mask[ids.tolist().index(p[0])]
    ]
    assert trained == [a + END[template] for a in ASSISTANT]
    # last_turn trains the final answer only, all (train_on_prompt) every token
    ids_last, last = ChatEncoder(tok, template, "last_turn").encode(CHAT)
    assert tok.decode(ids_last[last].tolist(), False) == ASSISTANT[-1] + END[template]
    assert ChatEncoder(tok, template, "all").encode(CHAT)[1].all()


def test_a_turn_the_template_does_not_close_is_trained_with_its_stop(chat_tokenizer, tmp_path):
    # GLM-4's template closes no assistant turn: the next role's marker (<|user|>, a special token
    # and one of GLM's stop tokens) is trained with the turn, and the chat's last turn gets an
    # appended end of text, so the finetuned model learns to stop.
    from test_chat import GLM4
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(chat_tokenizer / "tokenizer.json"))
    raw.add_special_tokens(["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>"])
    folder = tmp_path / "glm"
    folder.mkdir()
    raw.save(str(folder / "tokenizer.json"))
    cfg = {"eos_token": "<|endoftext|>", "pad_token": "<|pad|>", "chat_template": GLM4}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = load_tokenizer(folder)
    chat = [m for m in CHAT if m["role"] != "tool"][:5]
    ids, mask = ChatEncoder(tok).encode(chat)
    cuts = np.flatnonzero(np.diff(mask.astype(int))) + 1
    runs = zip(np.split(ids, cuts), np.split(mask, cuts), strict=True)
    trained = [tok.decode(p.tolist(), skip_special_tokens=False) for p, m in runs if m[0]]
    assert trained == ["\n5<|user|>", "\nIt is 17, I think.<|endoftext|>"]
    assert ids[:-1].tolist() == tok.apply_chat_template(chat) and ids[-1] == tok.eos_id


@pytest.mark.parametrize("template", ["chatml", "qwen", "llama3"])
def test_builtin_templates_tokenize_as_transformers(chat_tokenizer, template, tmp_path):
    from transformers import AutoTokenizer

    cfg = json.loads((chat_tokenizer / "tokenizer_config.json").read_text())
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes((chat_tokenizer / "tokenizer.json").read_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": BUILTIN[template]}))
    theirs = AutoTokenizer.from_pretrained(folder).apply_chat_template(CHAT, tokenize=True)
    theirs = theirs["input_ids"] if hasattr(theirs, "keys") else theirs
    ids, _ = ChatEncoder(load_tokenizer(chat_tokenizer), template).encode(CHAT)
    assert ids.tolist() == list(theirs)


def test_a_template_without_its_markers_is_refused(tokenizer_dir):
    with pytest.raises(DataError, match=r"template 'llama3' needs the special tokens <\|start_header_id\|>"):
        ChatEncoder(load_tokenizer(tokenizer_dir), "llama3")


# -- prepare ---------------------------------------------------------------------------------------
def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def chat(q, a):
    return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}


def test_prepare_reports_bad_records_by_line_and_counts_them(tokenizer_dir, tmp_path, capsys):
    raising = (
        "{% if messages | length > 2 %}{{ raise_exception('too long for me') }}{% endif %}"
        + BUILTIN["chatml"]
    )
    good = [chat(f"q{i}", f"answer {i}") for i in range(6)]
    records = [
        *good[:3],
        {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},  # line 4
        "{not json",  # line 5
        {"conversations": [{"from": "human", "value": "x"}]},  # line 6: the detected shape is messages
        chat("q " * 100, "a"),  # line 7: the answer truncated away
        *good[3:],
    ]
    src = write_jsonl(tmp_path / "chats.jsonl", records)
    meta = prepare_sft([src], tokenizer=tokenizer_dir, output=tmp_path / "out", max_len=40)
    assert meta["splits"]["train"]["documents"] == 6
    assert meta["no_trained_tokens"] == 1 and meta["truncated"] == 1
    bad = meta["bad_examples"]
    assert bad["message 1: role 'user' after 'user': roles must alternate user/assistant"] == [f"{src}:4"]
    assert bad["invalid JSON"] == [f"{src}:5"]
    assert bad["'messages' is not a list"] == [f"{src}:6"]
    assert bad["no trained tokens (all masked, or truncated away)"] == [f"{src}:7"]
    assert "4 bad records skipped" in capsys.readouterr().err
    # --strict stops at the first one, with exit status 2 and nothing written
    out = tmp_path / "strict"
    argv = ["data", "prepare", "--task", "sft", "--input", str(src), "--tokenizer", str(tokenizer_dir)]
    assert main([*argv, "--output", str(out), "--strict"]) == 2
    assert f"{src}:4: message 1: role 'user' after 'user'" in capsys.readouterr().err
    assert not out.exists()
    # a template that raises is reported with its message
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes((tokenizer_dir / "tokenizer.json").read_bytes())
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|eos|>", "chat_template": raising})
    )
    more = write_jsonl(tmp_path / "more.jsonl", [chat("a", "b"), {"messages": CHAT[1:5]}])
    meta = prepare_sft([more], tokenizer=folder, output=tmp_path / "raising")
    assert meta["bad_examples"] == {
        f"{folder}/tokenizer_config.json: chat template: too long for me": [f"{more}:2"]
    }


def test_prepared_folder_round_trips_and_recipes_check_their_data(tokenizer_dir, data_dir, tmp_path, capsys):
    src = write_jsonl(tmp_path / "c.jsonl", [chat(f"What is {i}?", str(i)) for i in range(40)])
    out = tmp_path / "sft"
    argv = ["data", "prepare", "--task", "sft", "--input", str(src), "--tokenizer", str(tokenizer_dir)]
    assert main([*argv, "--output", str(out), "--val-fraction", "0.2", "--seed", "3"]) == 0
    train, val = SFTSplit(out, "train"), SFTSplit(out, "val")
    assert len(train) + len(val) == 40 and len(val) > 0
    tok = load_tokenizer(tokenizer_dir)
    ids, mask = train.get(0)
    text = tok.decode(ids.tolist(), False)
    assert text.startswith("<|im_start|>user\nWhat is ") and tok.decode(ids[mask].tolist(), False).endswith(
        "<|im_end|>"
    )
    # pretraining data refused by the SFT recipe and the other way round, before anything runs
    cfg = make_tiny_config(tokenizer_dir, data_dir, tmp_path / "run")
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump(cfg))
    assert main(["run", "sft", "--config", str(f)]) == 2
    assert "holds pretrain data, but recipe sft trains on sft data" in capsys.readouterr().err
    assert main(["run", "pretrain", "--config", str(f), f"data.path={out}"]) == 2
    assert "holds sft data, but recipe pretrain trains on pretrain data" in capsys.readouterr().err


# -- packing and the loss --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sft_data(tokenizer_dir, tmp_path_factory):
    """Chats of very different lengths and trained-token counts, some multi-turn."""
    import random

    rng = random.Random(0)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    records = []
    for _ in range(48):
        turns = []
        for _ in range(rng.randint(1, 3)):
            turns.append({"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(1, 12)))})
            turns.append({"role": "assistant", "content": " ".join(rng.choices(words, k=rng.randint(1, 20)))})
        records.append({"messages": turns})
    tmp = tmp_path_factory.mktemp("sft")
    src = write_jsonl(tmp / "chats.jsonl", records)
    out = tmp / "data"
    prepare_sft([src], tokenizer=tokenizer_dir, output=out, val_fraction=0.2, seed=1, progress=False)
    return out


def test_packed_and_padded_rows_give_the_same_loss(sft_data):
    # Each chat is its own document in a packed row (positions restart, no attention across
    # chats), so the sum of token losses over the trained targets is the padded rows' own.
    split = SFTSplit(sft_data)
    packed = SFTSamples(split, 512, packing=True, seed=0)
    padded = SFTSamples(split, 512, packing=False)
    assert len(packed) < len(padded) == len(split) and packed.fill > padded.fill and packed.truncated == 0

    torch.manual_seed(0)
    from ladle.config.schema import ModelConfig

    model = build_model(
        ModelConfig(vocab_size=512, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=512)
    )

    @torch.no_grad()
    def total(samples):
        loss, n = 0.0, 0
        for i in range(len(samples)):
            b = {k: torch.from_numpy(v)[None] for k, v in samples.get(i).items()}
            logits = model(b["tokens"], positions=b["positions"], doc_ids=b["doc_ids"])
            loss += float(cross_entropy_sum(logits, b["targets"], IGNORE_INDEX).double())
            n += int((b["targets"] != IGNORE_INDEX).sum())
        return loss, n

    (lp, np_), (ld, nd) = total(packed), total(padded)
    assert np_ == nd == sum(int(split.get(i)[1][1:].sum()) for i in range(len(split)))
    assert lp / np_ == pytest.approx(ld / nd, rel=1e-5)


def sft_config(tokenizer_dir, data, out, **train):
    cfg = make_tiny_config(tokenizer_dir, data, out)
    cfg["data"]["seq_len"] = 64
    cfg["train"].update({"max_steps": 3, "eval_steps": 0, **train})
    cfg["sample"] = {"prompt": ""}
    return cfg


def test_gradient_does_not_depend_on_the_microbatch_split(tokenizer_dir, sft_data, tmp_path):
    # Rows with very different numbers of trained tokens: 1 x 8 and 8 x 1 give the same loss,
    # gradient norm and weights, because the loss is the sum over the trained tokens of the
    # whole step divided by their number (not a mean of per-microbatch means).
    from ladle.recipes import sft

    runs = {}
    for name, (mb, acc) in {"1x8": (8, 1), "8x1": (1, 8)}.items():
        out = tmp_path / name
        sft.run(
            build_config(sft_config(tokenizer_dir, sft_data, out, micro_batch_size=mb, grad_accum_steps=acc))
        )
        runs[name] = [r for r in read_metrics(out) if "loss" in r]
    for a, b in zip(runs["1x8"], runs["8x1"], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)


# -- the task evaluation and its scorers -----------------------------------------------------------
def test_scorers():
    assert exact_match(" 42\n", "42") == 1.0 and exact_match("42.", "42") == 0.0
    last_number = regex_match(r"(-?\d+)\D*$")
    assert last_number("The answer is 42.", "42") == 1.0
    assert last_number("no number", "42") == 0.0
    assert regex_match(r"\d+")("x 7 y", "7") == 1.0
    with pytest.raises(DataError, match="is not a regular expression"):
        regex_match("(")


def test_synthetic_task_holds_no_val_problem_in_train(tmp_path):
    from ladle.data.synthetic import write_task

    write_task("addition", tmp_path, train=300, val=50, seed=4, max_digits=2)
    read = lambda s: [json.loads(x)["messages"] for x in (tmp_path / f"{s}.jsonl").read_text().splitlines()]  # noqa: E731
    ops = lambda ms: {
        tuple(int(t) for t in m[0]["content"].replace("?", " ").replace(".", " ").split() if t.isdigit())
        for m in ms
    }  # noqa: E731
    train, val = read("train"), read("val")
    assert len(train) == 300 and len(val) == 50 and not ops(train) & ops(val)
    for m in train:
        a, b = (int(t) for t in m[0]["content"].replace("?", " ").replace(".", " ").split() if t.isdigit())
        assert m[1]["content"] == str(a + b)
    # --prompts: the same problems as {"prompt", "answer"} records (the RL recipes' data)
    write_task("addition", tmp_path / "p", train=300, val=50, seed=4, max_digits=2, prompts=True)
    rows = [json.loads(x) for x in (tmp_path / "p" / "train.jsonl").read_text().splitlines()]
    assert rows == [{"prompt": m[0]["content"], "answer": m[1]["content"]} for m in train]
    with pytest.raises(DataError, match="--pairs and --prompts: choose one"):
        write_task("sort", tmp_path / "x", train=3, val=1, pairs=True, prompts=True)


def test_sft_run_then_generation_eval(tokenizer_dir, tmp_path, capsys):
    # End to end on the CLI: synth, prepare, finetune, score held-out answers.
    task, data, out = tmp_path / "task", tmp_path / "data", tmp_path / "run"
    assert (
        main(["data", "synth", "--task", "sort", "--output", str(task), "--train", "200", "--val", "8"]) == 0
    )
    prep = [
        "data",
        "prepare",
        "--task",
        "sft",
        "--input",
        str(task / "train.jsonl"),
        "--tokenizer",
        str(tokenizer_dir),
    ]
    assert main([*prep, "--output", str(data), "--val-fraction", "0.1"]) == 0
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(sft_config(tokenizer_dir, data, out, max_steps=3, eval_steps=1)))
    assert main(["run", "sft", "--config", str(cfg)]) == 0
    card = json.loads((out / "run_card.json").read_text())
    assert card["recipe"] == "sft" and card["final"]["status"] == "completed" and "val_loss" in card["final"]
    capsys.readouterr()
    assert (
        main(
            [
                "eval",
                "--task",
                "generate",
                "--model",
                str(out),
                "--data",
                str(task / "val.jsonl"),
                "--max-new-tokens",
                "4",
            ]
        )
        == 0
    )
    res = json.loads(capsys.readouterr().out)
    assert res["total"] == 8 and 0.0 <= res["accuracy"] <= 1.0 and len(res["examples"]) == 3
    # the first wrong answers, to look at: as many as there are, up to 3
    assert len(res["errors"]) == min(3, res["total"] - res["correct"])
    assert all(not e["correct"] and e["answer"] != e["reference"] for e in res["errors"])
    assert res["examples"][0]["reference"] == " ".join(
        sorted(res["examples"][0]["prompt"].split(": ")[1].split())
    )


REAL = {  # config: the world size it is written for
    "sft/qwen2.5-7b-lora": 1,
    "sft/llama-3.1-8b-full-sft-8dev": 8,
    "sft/glm4-9b-full-sft-4x64g": 4,
    "sft/llama-3.1-70b-lora-8dev": 8,
    "sft/qwen3-30b-a3b-lora": 8,
}


@pytest.mark.parametrize("name", REAL)
def test_real_model_configs_validate_for_their_world(name, capsys):
    # The shape comes from the preset (no download): schema, layout against the model and world.
    assert main(["validate", "--config", name, "--no-paths", "--nproc", str(REAL[name])]) == 0
    err = capsys.readouterr().err
    assert f"layout for {REAL[name]} processes" in err

"""Shared fixtures: a tiny tokenizer and prepared data built once per session from real text
(a slice of the Python standard library, present wherever Python is)."""

import json
import sysconfig
from pathlib import Path

import pytest
import torch

STDLIB = Path(sysconfig.get_paths()["stdlib"])
CORPUS_FILES = ["argparse.py", "textwrap.py", "shlex.py", "fractions.py", "glob.py", "heapq.py", "bisect.py"]


@pytest.fixture(autouse=True)
def _one_thread():
    # Identical math in every test whatever the machine, and faster for tiny models, whose ops
    # are too small to split across threads.
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    for name in CORPUS_FILES:
        (d / name).write_bytes((STDLIB / name).read_bytes())
    return d


@pytest.fixture(scope="session")
def tokenizer_dir(corpus, tmp_path_factory) -> Path:
    from ladle.data.tokenizer import train_tokenizer

    return train_tokenizer([str(corpus)], vocab_size=512, output=str(tmp_path_factory.mktemp("tok") / "tok"))


@pytest.fixture(scope="session")
def data_dir(corpus, tokenizer_dir, tmp_path_factory) -> Path:
    from ladle.data.prepare import prepare

    out = tmp_path_factory.mktemp("data") / "data"
    prepare(
        [str(corpus)],
        tokenizer=str(tokenizer_dir),
        output=str(out),
        workers=1,
        val_fraction=0.3,
        seed=1,
        progress=False,
    )
    return out


@pytest.fixture(scope="session")
def sort_chats(tokenizer_dir, tmp_path_factory) -> Path:
    """Prepared SFT data: 300 synthetic word-sorting chats (ladle data synth), 20% held out."""
    from ladle.data.sft import prepare_sft
    from ladle.data.synthetic import write_task

    tmp = tmp_path_factory.mktemp("sort")
    write_task("sort", tmp / "task", train=300, val=4, seed=0)
    out = tmp / "data"
    prepare_sft(
        [tmp / "task" / "train.jsonl"], tokenizer=tokenizer_dir, output=out, val_fraction=0.2, progress=False
    )
    return out


@pytest.fixture(scope="session")
def chat_tokenizer(tmp_path_factory, corpus):
    """A BPE that has the special tokens of every built-in template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from ladle.data.chat import BUILTIN

    special = ["<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
    special += ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train([str(p) for p in corpus.iterdir()], trainer)
    out = tmp_path_factory.mktemp("chat")
    tok.save(str(out / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|pad|>",
        "chat_template": BUILTIN["chatml"],
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture
def tiny_config(tokenizer_dir, data_dir, tmp_path):
    """A config dict for a model of a few thousand parameters that trains in milliseconds a step."""
    return make_tiny_config(tokenizer_dir, data_dir, tmp_path / "run")


def make_tiny_config(tokenizer_dir, data_dir, output_dir) -> dict:
    return {
        "output_dir": str(output_dir),
        "seed": 7,
        "model": {
            "vocab_size": 512,
            "dim": 32,
            "n_layers": 2,
            "n_heads": 4,
            "n_kv_heads": 2,
            "ffn_dim": 64,
            "max_seq_len": 64,
        },
        "tokenizer": {"path": str(tokenizer_dir)},
        "data": {"path": str(data_dir), "seq_len": 32},
        "optim": {"lr": 3e-3},
        "scheduler": {"name": "cosine", "warmup_steps": 2},
        "train": {
            "max_steps": 20,
            "micro_batch_size": 2,
            "grad_accum_steps": 2,
            "log_every": 1,
            "eval_every": 5,
            "eval_steps": 2,
        },
        "precision": {"mode": "fp32"},
        "checkpoint": {"every": 5, "keep_last": 2},
        "sample": {"prompt": "def ", "max_new_tokens": 4},
    }


@pytest.fixture(scope="session")
def prompt_data(chat_tokenizer, tmp_path_factory):
    """Sort-task prompts with their answers, prepared with --task prompts (the RL tests' data)."""
    import json

    from ladle.data.prompts import prepare_prompts

    d = tmp_path_factory.mktemp("prompts")
    words = ["fig", "pear", "kiwi", "lime", "plum", "date"]
    with (d / "p.jsonl").open("w") as f:
        for i in range(40):
            w = [words[(i + k) % 6] for k in range(2 + i % 2)]
            f.write(json.dumps({"prompt": "Sort: " + " ".join(w), "answer": " ".join(sorted(w))}) + "\n")
    prepare_prompts([d / "p.jsonl"], tokenizer=chat_tokenizer, output=d / "data", progress=False)
    return d / "data"


def one_and_two_ranks(recipe: str, cfg: dict, tmp_path) -> tuple[list, list]:
    """The step records of `cfg` run in this process (2 microbatches a step) and under FSDP on 2
    ranks (1 each): the same global batch in two layouts (the RL tests' layout comparisons)."""
    import subprocess
    import sys

    import yaml

    from ladle.config.load import build_config
    from ladle.recipes import load
    from ladle.train.metrics import read_metrics

    cfg = {**cfg, "output_dir": str(tmp_path / "one")}
    cfg["train"] = {**cfg["train"], "grad_accum_steps": 2, "threads": 1}
    assert load(recipe).run(build_config(cfg)) == "completed"
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "ladle", "run", recipe, "--config", str(path), "--nproc", "2"]
    over = [f"output_dir={tmp_path / 'par'}", "parallel.dp_shard=2", "train.grad_accum_steps=1"]
    r = subprocess.run([*cmd, *over], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return tuple([r for r in read_metrics(tmp_path / d) if "loss" in r] for d in ("one", "par"))

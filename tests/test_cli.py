"""The command line: export to Hugging Face, generate, ls/cp, data commands, and exit codes."""

import json
import subprocess
import sys

import pytest
import torch
import yaml

from ladle.cli import main


@pytest.fixture
def trained_run(tiny_config, tmp_path):
    cfg = json.loads(json.dumps(tiny_config))
    cfg["train"].update(max_steps=4, eval_every=0)
    cfg["scheduler"]["warmup_steps"] = 1
    f = tmp_path / "cfg.yaml"
    f.write_text(yaml.safe_dump(cfg))
    assert main(["run", "pretrain", "--config", str(f)]) == 0
    return tmp_path / "run"


def test_export_hf_loads_in_transformers_with_the_same_logits(trained_run, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    from ladle.ops.export import load_checkpoint_model

    out = tmp_path / "hf"
    assert main(["export", "hf", str(trained_run), str(out)]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    ours, _, _ = load_checkpoint_model(trained_run)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = torch.randint(0, 512, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, ours(tokens), atol=1e-5, rtol=1e-5)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    from ladle.data.tokenizer import load_tokenizer

    assert tok("def f(x):")["input_ids"] == load_tokenizer(out).encode("def f(x):")


def test_generate_json_from_checkpoint_and_export_agree(trained_run, tmp_path, capsys):
    out = tmp_path / "hf"
    main(["export", "hf", str(trained_run), str(out)])
    capsys.readouterr()
    args = ["--prompt", "def ", "--prompt", "import os", "--max-new-tokens", "6", "--json"]
    assert main(["generate", "--model", str(trained_run), *args]) == 0
    a = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert main(["generate", "--model", str(out), *args]) == 0
    b = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert a == b and len(a) == 2
    assert set(a[0]) == {"prompt", "text", "tokens"} and a[0]["prompt"] == "def "
    assert 1 <= len(a[0]["tokens"]) <= 6


def test_ls_and_cp(tmp_path, capsys):
    assert main(["ls"]) == 0
    listing = capsys.readouterr().out
    assert "pretrain" in listing and "tiny/pretrain" in listing and "  qwen3-8b" in listing
    assert main(["cp", "tiny/pretrain", str(tmp_path)]) == 0
    assert (tmp_path / "pretrain.yaml").is_file()
    assert main(["cp", "tiny/pretrain", str(tmp_path)]) == 2
    assert "pass --force" in capsys.readouterr().err
    assert main(["validate", "--config", str(tmp_path / "pretrain.yaml"), "--no-paths"]) == 0


def test_user_errors_exit_2_with_the_path(tmp_path, capsys):
    assert main(["data", "inspect", str(tmp_path / "missing")]) == 2
    assert "run `ladle data prepare` first" in capsys.readouterr().err
    assert (
        main(
            [
                "tokenizer",
                "train",
                "--input",
                str(tmp_path / "none"),
                "--vocab-size",
                "300",
                "--output",
                str(tmp_path / "t"),
            ]
        )
        == 2
    )
    assert str(tmp_path / "none") in capsys.readouterr().err
    assert main(["export", "hf", str(tmp_path), str(tmp_path / "o")]) == 2
    assert "is not a ladle checkpoint" in capsys.readouterr().err
    assert main(["generate", "--model", str(tmp_path), "--prompt", "x"]) == 2
    assert main(["validate", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "config file" in capsys.readouterr().err


def test_the_console_script_exits_2_without_a_traceback(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "ladle", "validate", "--config", "tiny/pretrain", "model.dim=0"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2
    assert "model.dim: Input should be greater than or equal to 1" in r.stderr
    assert "Traceback" not in r.stderr


def test_tokenizer_prepare_inspect_through_the_cli(corpus, tmp_path, capsys):
    (corpus_copy := tmp_path / "in").mkdir()
    for f in sorted(corpus.iterdir())[:3]:
        (corpus_copy / f.name).write_text(f.read_text())
    (corpus_copy / "notes.txt").write_text("not python")  # filtered out by --glob
    (corpus_copy / "bad.py").write_bytes(b"x = 1\n\xff\xfe\n")  # undecodable: counted, reported
    tok, data = tmp_path / "tok", tmp_path / "data"
    assert (
        main(
            [
                "tokenizer",
                "train",
                "--input",
                str(corpus_copy),
                "--glob",
                "*.py",
                "--vocab-size",
                "400",
                "--output",
                str(tok),
            ]
        )
        == 0
    )

    def prepare(out, *extra):
        args = ["data", "prepare", "--input", str(corpus_copy), "--glob", "*.py", "--tokenizer", str(tok)]
        return main([*args, "--output", str(out), "--workers", "1", *extra])

    assert prepare(data, "--val-fraction", "0.5", "--seed", "3") == 0
    err = capsys.readouterr().err
    assert "undecodable bytes: 1" in err and "bad.py:2" in err
    meta = json.loads((data / "meta.json").read_text())
    assert meta["splits"]["train"]["documents"] + meta["splits"]["val"]["documents"] == 3
    assert main(["data", "inspect", str(data), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["unigram_entropy_nats"] > 0
    assert prepare(tmp_path / "strict", "--strict") == 2
    assert "bad.py:2: undecodable bytes" in capsys.readouterr().err
    assert not (tmp_path / "strict").exists()


def test_eval_equals_transformers_and_the_runs_validation(trained_run, data_dir, corpus, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from ladle.data.loader import PackedSamples, collate
    from ladle.data.prepare import open_split
    from ladle.train.metrics import read_metrics

    out = tmp_path / "hf"
    main(["export", "hf", str(trained_run), str(out)])
    capsys.readouterr()
    # Plain causal rows: what transformers computes for the same tokens.
    base = ["eval", "--model", str(out), "--data", str(data_dir), "--seq-len", "32", "--batch-size", "4"]
    assert main([*base, "--no-doc-mask", "--max-batches", "3"]) == 0
    got = json.loads(capsys.readouterr().out)
    rows = PackedSamples(open_split(data_dir, "val"), 32)
    batch = collate([rows.get(i) for i in range(12)])
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(batch["tokens"]).logits
    ref = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())
    assert got["tokens"] == 12 * 32 and got["samples"] == 12 and got["doc_mask"] is False
    assert got["loss"] == pytest.approx(ref.item(), rel=1e-5)
    assert got["ppl"] == pytest.approx(float(ref.exp()), rel=1e-5)

    # Document-masked (the default): the run's own final validation, same 2 x 2 samples.
    val = [r for r in read_metrics(trained_run) if "val_loss" in r][-1]["val_loss"]
    assert (
        main(
            ["eval", "--model", str(trained_run), "--data", str(data_dir), "--seq-len", "32"]
            + ["--batch-size", "2", "--max-batches", "2"]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["loss"] == pytest.approx(val, rel=1e-6)

    # Data tokenized by another tokenizer: exit 2, named.
    from ladle.data.tokenizer import train_tokenizer

    other = train_tokenizer([str(corpus)], vocab_size=300, output=str(tmp_path / "other"))
    assert main([*base, "--tokenizer", str(other)]) == 2
    assert "prepared with a different tokenizer" in capsys.readouterr().err


def test_generate_stops_at_a_stop_string(trained_run, capsys):
    args = ["generate", "--model", str(trained_run), "--prompt", "def ", "--max-new-tokens", "24", "--json"]
    assert main(args) == 0
    full = json.loads(capsys.readouterr().out)
    text = full["text"]
    stop = text[len(text) // 3 : len(text) // 3 + 2]
    assert main([*args, "--stop", stop, "--stop", "never-there"]) == 0
    cut = json.loads(capsys.readouterr().out)
    assert cut["text"] == text[: text.find(stop)]
    assert len(cut["tokens"]) < len(full["tokens"])  # generation itself stopped early
    assert cut["tokens"] == full["tokens"][: len(cut["tokens"])]


def test_a_tokenizer_larger_than_the_embedding_is_refused(trained_run, corpus, tmp_path, capsys):
    from ladle.data.tokenizer import train_tokenizer

    big = train_tokenizer(
        [str(corpus)], vocab_size=900, output=str(tmp_path / "big")
    )  # the model has 512 rows
    for cmd in (["generate", "--prompt", "x"], ["eval", "--data", str(tmp_path)]):
        assert main([cmd[0], "--model", str(trained_run), "--tokenizer", str(big), *cmd[1:]]) == 2
        assert "more than the 512 embedding rows" in capsys.readouterr().err


def test_generate_and_eval_load_on_device_in_dtype(trained_run, data_dir, capsys):
    from ladle.data.tokenizer import load_tokenizer
    from ladle.models.generation import generate
    from ladle.ops.export import load_checkpoint_model

    args = ["generate", "--model", str(trained_run), "--prompt", "def ", "--max-new-tokens", "8", "--json"]
    assert main([*args, "--device", "cpu", "--dtype", "bfloat16"]) == 0
    got = json.loads(capsys.readouterr().out)["tokens"]
    model, _, run_cfg = load_checkpoint_model(trained_run, dtype=torch.bfloat16)
    tok = load_tokenizer(run_cfg["tokenizer"]["path"])
    assert got == generate(model, [tok.encode("def ")], max_new_tokens=8, eos_id=tok.eos_id)[0]

    base = [
        "eval",
        "--model",
        str(trained_run),
        "--data",
        str(data_dir),
        "--seq-len",
        "32",
        "--max-batches",
        "2",
    ]
    assert main(base) == 0
    fp32 = json.loads(capsys.readouterr().out)
    assert main([*base, "--dtype", "bfloat16"]) == 0
    bf16 = json.loads(capsys.readouterr().out)
    assert (fp32["device"], fp32["dtype"], bf16["dtype"]) == ("cpu", "float32", "bfloat16")
    assert bf16["loss"] == pytest.approx(fp32["loss"], rel=2e-2) and bf16["loss"] != fp32["loss"]

    if not torch.cuda.is_available():
        assert main([*args, "--device", "cuda"]) == 2
        assert "--device=cuda but no CUDA device is visible" in capsys.readouterr().err


def test_a_finished_run_leaves_the_process_group(trained_run):
    # Every rank waits for rank 0's sample and run card, then all destroy the group together: a
    # rank that exited with its group alive could abort in gloo's threads while rank 0 still
    # worked, and torchrun then failed the finished run.
    import torch.distributed as dist

    assert (trained_run / "run_card.json").is_file() and not dist.is_initialized()

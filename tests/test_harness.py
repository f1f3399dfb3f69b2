"""lm-evaluation-harness through ladle's model (ladle/ops/harness.py, harness_lm.py): the same
per-document log-likelihoods and scores as lm-eval's own `hf` model on the exported folder; the
CLI; `eval.harness` in a training run; the refusals."""

import json
import os
import sys

import pytest
import torch
import yaml
from conftest import make_tiny_config

from ladle.cli import main

HAS_LM_EVAL = __import__("importlib").util.find_spec("lm_eval") is not None
pytestmark = pytest.mark.skipif(
    not HAS_LM_EVAL and not os.environ.get("LADLE_CI"), reason="lm-eval is not installed (ladle[eval])"
)

QUESTIONS = [  # code the tokenizer knows (it was trained on the standard library)
    ("def f(x):\n    return", [" x", " None", " self"], 0),
    ("import", [" os", " sys", " re"], 1),
    ("for i in", [" range(n):", " self:", " x"], 0),
    ("class Foo(", ["object):", "int):", "x):"], 0),
    ("if x is", [" None:", " True:", " 0:"], 0),
    ("    raise", [" ValueError", " x", " self"], 0),
    ("from . import", [" a", " b", " c"], 2),
    ("", [" hello", " world"], 1),  # an empty context: the BOS token stands for it
]
TEXTS = [  # longer than the model's 64 positions: several rolling windows each
    open(__import__("textwrap").__file__).read()[i * 900 : i * 900 + 700] for i in range(4)
]
PROMPTS = [("def f(x):\n", "    return x"), ("import os\n", "import sys"), ("x = ", "1"), ("# ", "a comment")]


def metric(name: str, aggregation: str = "mean", higher_is_better: bool = True) -> dict:
    return {"metric": name, "aggregation": aggregation, "higher_is_better": higher_is_better}


def write_tasks(folder, data=None):
    """Three task YAMLs on local jsonl files: multiple choice, rolling log-likelihood, generation."""
    data = data or folder
    folder.mkdir(parents=True, exist_ok=True)
    rows = {
        "mc": [{"question": q, "choices": c, "label": y} for q, c, y in QUESTIONS],
        "ppl": [{"text": t} for t in TEXTS],
        "gen": [{"prompt": p, "answer": a} for p, a in PROMPTS],
    }
    for name, records in rows.items():
        (data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    common = {"dataset_path": "json", "test_split": "test"}
    tasks = {
        "ladle_mc": {
            "output_type": "multiple_choice",
            "doc_to_text": "{{question}}",
            "doc_to_choice": "{{choices}}",
            "doc_to_target": "{{label}}",
            "metric_list": [metric("acc"), metric("acc_norm")],
        },
        "ladle_ppl": {
            "output_type": "loglikelihood_rolling",
            "doc_to_text": "",
            "doc_to_target": "{{text}}",
            "metric_list": [
                metric(m, agg, False)
                for m, agg in [
                    ("word_perplexity", "weighted_perplexity"),
                    ("byte_perplexity", "weighted_perplexity"),
                    ("bits_per_byte", "bits_per_byte"),
                ]
            ],
        },
        "ladle_gen": {
            "output_type": "generate_until",
            "doc_to_text": "{{prompt}}",
            "doc_to_target": "{{answer}}",
            "generation_kwargs": {"until": ["\n"], "max_gen_toks": 12, "do_sample": False},
            "metric_list": [metric("exact_match")],
        },
    }
    for (task, spec), name in zip(tasks.items(), rows, strict=True):
        files = {"dataset_kwargs": {"data_files": {"test": str(data / f"{name}.jsonl")}}}
        (folder / f"{task}.yaml").write_text(yaml.safe_dump({"task": task, **common, **files, **spec}))
    return folder


@pytest.fixture(scope="module")
def trained(tokenizer_dir, data_dir, tmp_path_factory):
    """A tiny pretrained run, its HF export and a folder of local tasks."""
    tmp = tmp_path_factory.mktemp("harness")
    cfg = make_tiny_config(tokenizer_dir, data_dir, tmp / "run")
    cfg["train"].update(max_steps=6, eval_every=0)
    cfg["checkpoint"]["every"] = 0
    (tmp / "c.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["run", "pretrain", "--config", str(tmp / "c.yaml")]) == 0
    assert main(["export", "hf", str(tmp / "run"), str(tmp / "hf")]) == 0
    return tmp / "run", tmp / "hf", write_tasks(tmp / "tasks")


TASKS = ["ladle_mc", "ladle_ppl", "ladle_gen"]


def per_doc(out: dict) -> dict:
    """task -> [(doc id, the model's answers to its requests)]."""
    return {t: [(s["doc_id"], s["resps"]) for s in out["samples"][t]] for t in out["samples"]}


def test_same_loglikelihoods_and_scores_as_lm_evals_hf_model(trained):
    from lm_eval.models.huggingface import HFLM

    from ladle.ops.export import load_any_model
    from ladle.ops.harness import ladle_lm, run_harness, task_manager

    run, hf, tasks = trained
    manager = task_manager(tasks)
    model, tok = load_any_model(run)
    ours = run_harness(ladle_lm(model, tok, batch_size=3), TASKS, manager, log_samples=True)
    theirs = run_harness(
        HFLM(pretrained=str(hf), batch_size=3, dtype="float32", device="cpu"),
        TASKS,
        manager,
        log_samples=True,
    )
    a, b = per_doc(ours), per_doc(theirs)
    assert a.keys() == b.keys() == set(TASKS)
    for task in TASKS:
        assert [d for d, _ in a[task]] == [d for d, _ in b[task]]
        for (_, x), (_, y) in zip(a[task], b[task], strict=True):
            if task == "ladle_gen":
                assert x == y  # the same greedy text
            elif task == "ladle_mc":  # [[(log-likelihood, is greedy)]] per choice
                assert [r[0][1] for r in x] == [r[0][1] for r in y]
                assert [r[0][0] for r in x] == pytest.approx([r[0][0] for r in y], abs=1e-5)
            else:  # [[log-likelihood]]
                assert x[0][0] == pytest.approx(y[0][0], rel=1e-7, abs=1e-5)
    for task in TASKS:
        for metric, value in theirs["results"][task].items():
            if not isinstance(value, float) or "_stderr" in metric:
                continue  # "alias"
            if task == "ladle_ppl":
                assert ours["results"][task][metric] == pytest.approx(value, rel=1e-6)
            else:
                assert ours["results"][task][metric] == value, (task, metric)
    assert ours["n-samples"]["ladle_mc"]["effective"] == len(QUESTIONS)


def test_cli_prints_the_results_last_and_keeps_the_harness_output(trained, tmp_path, capsys):
    run, _, tasks = trained
    out = tmp_path / "out"
    args = ["eval", "--harness", "ladle_mc,ladle_gen", "--model", str(run), "--include-path", str(tasks)]
    assert main([*args, "--limit", "4", "--output-path", str(out), "--batch-size", "2"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["model"] == str(run) and last["tasks"] == ["ladle_mc", "ladle_gen"]
    assert set(last["results"]) == {"ladle_mc", "ladle_gen"}
    assert {"acc,none", "acc_norm,none"} <= set(last["results"]["ladle_mc"])
    assert "exact_match,none" in last["results"]["ladle_gen"]
    assert last["n-samples"]["ladle_mc"]["effective"] == 4
    written = {p.name.split("_")[0] for p in out.rglob("*.json*")}
    assert written == {"results", "samples"}, list(out.rglob("*"))


def test_bad_input_exits_2_naming_it(trained, tmp_path, capsys):
    run, _, tasks = trained
    base = ["eval", "--model", str(run)]
    assert main([*base, "--harness", "ladle_mcq", "--include-path", str(tasks)]) == 2
    err = capsys.readouterr().err
    assert "unknown lm-evaluation-harness task 'ladle_mcq'" in err and "ladle_mc" in err
    assert "tasks, groups and tags are known" in err

    broken = write_tasks(tmp_path / "broken")
    (broken / "mc.jsonl").unlink()
    assert main([*base, "--harness", "ladle_mc", "--include-path", str(broken)]) == 2
    err = capsys.readouterr().err
    assert f"data file {broken / 'mc.jsonl'} does not exist" in err and "ladle_mc.yaml" in err

    assert main([*base, "--harness", "ladle_mc", "--include-path", str(tmp_path / "nowhere")]) == 2
    assert "is not a folder of task YAMLs" in capsys.readouterr().err

    assert main(base) == 2  # neither --data nor --harness
    assert "needs --data" in capsys.readouterr().err


def test_without_lm_eval_the_install_line(trained, monkeypatch, capsys):
    run, _, tasks = trained
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` raises ImportError
    assert main(["eval", "--harness", "ladle_mc", "--model", str(run), "--include-path", str(tasks)]) == 2
    assert "pip install 'ladle[eval]'" in capsys.readouterr().err


def test_lm_eval_reads_ladles_model_by_name(trained):
    """`lm-eval --model ladle --model_args pretrained=RUN` once ladle's module is imported."""
    import lm_eval.api.registry as registry

    import ladle.ops.harness_lm  # noqa: F401  (registers "ladle")

    run, _, _ = trained
    lm = registry.get_model("ladle").create_from_arg_string(f"pretrained={run}", {"batch_size": 2})
    assert lm.max_length == 64 and lm.batch_size_per_gpu == 2
    assert lm.tok_encode("def f") == lm.tok.encode("def f")  # this tokenizer adds no BOS, as in `hf`
    with torch.no_grad():
        ((score, greedy),) = lm._loglikelihood_tokens([(None, [0, 5], [7, 9])])
    assert score < 0 and isinstance(greedy, bool)


def harness_config(tokenizer_dir, data_dir, out, tasks) -> dict:
    cfg = make_tiny_config(tokenizer_dir, data_dir, out)
    cfg["train"].update(max_steps=4, eval_every=0, threads=1)
    cfg["checkpoint"]["every"] = 0
    cfg["sample"]["max_new_tokens"] = 0
    cfg["eval"] = {
        "harness": ["ladle_mc", "ladle_ppl"],
        "harness_every": 2,
        "harness_include_path": str(tasks),
        "harness_limit": 4,
    }
    return cfg


def harness_records(run) -> dict:
    from ladle.train.metrics import read_metrics

    return {r["step"]: r for r in read_metrics(run) if any(k.startswith("harness/") for k in r)}


def final_scores(run, tasks) -> dict:
    """The tasks on the run's last checkpoint, as `ladle eval --harness` scores them."""
    from ladle.ops.export import load_any_model
    from ladle.ops.harness import ladle_lm, metric_records, run_harness, task_manager

    model, tok = load_any_model(run)
    out = run_harness(ladle_lm(model, tok), ["ladle_mc", "ladle_ppl"], task_manager(tasks), limit=4)
    return metric_records(out["results"])


@pytest.mark.parametrize("nproc", [1, 2], ids=["one-process", "fsdp-2"])
def test_training_logs_harness_metrics_of_its_weights(trained, tokenizer_dir, data_dir, tmp_path, nproc):
    import subprocess

    _, _, tasks = trained
    cfg = harness_config(tokenizer_dir, data_dir, tmp_path / "run", tasks)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "ladle", "run", "pretrain", "--config", str(tmp_path / "c.yaml")]
    if nproc == 1:
        assert main(cmd[3:]) == 0
    else:
        r = subprocess.run(
            [*cmd, "--nproc", "2", "parallel.dp_shard=2"], capture_output=True, text=True, timeout=600
        )
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    recs = harness_records(tmp_path / "run")
    assert sorted(recs) == [2, 4]
    final = recs[4]
    assert {"harness/ladle_mc/acc", "harness/ladle_mc/acc_norm", "harness/ladle_ppl/bits_per_byte"} <= set(
        final
    )
    assert not any("stderr" in k for k in final)
    # the weights gathered at the end are the checkpoint's: the same scores
    for k, v in final_scores(tmp_path / "run", tasks).items():
        assert final[k] == pytest.approx(v, rel=1e-6), k


def test_a_bad_harness_task_stops_the_run_before_it_starts(
    trained, tokenizer_dir, data_dir, tmp_path, capsys
):
    _, _, tasks = trained
    cfg = harness_config(tokenizer_dir, data_dir, tmp_path / "run", tasks)
    cfg["eval"]["harness"] = ["ladle_mcc"]
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["run", "pretrain", "--config", str(tmp_path / "c.yaml")]) == 2
    err = capsys.readouterr().err
    assert "eval.harness: unknown lm-evaluation-harness task 'ladle_mcc'" in err
    assert "eval.harness_include_path: ladle_gen, ladle_mc, ladle_ppl" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("post_bos", [False, True], ids=["no-post-processor", "bos-post-processor"])
def test_encoding_is_transformers_default_with_or_without_a_bos_post_processor(
    tokenizer_dir, tmp_path, post_bos
):
    """The context and continuation ids are what HFLM gets from `transformers` for the same
    folder: a tokenizer.json whose post-processor adds BOS (Llama 3's) gets it, once."""
    import shutil

    from transformers import AutoTokenizer

    from ladle.config.schema import ModelConfig
    from ladle.data.tokenizer import load_tokenizer
    from ladle.models.llama import build_model
    from ladle.ops.harness import ladle_lm

    folder = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, folder)
    if post_bos:
        spec = json.loads((folder / "tokenizer.json").read_text())
        spec["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [
                {"SpecialToken": {"id": "<|bos|>", "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
            ],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<|bos|>": {"id": "<|bos|>", "ids": [0], "tokens": ["<|bos|>"]}},
        }
        (folder / "tokenizer.json").write_text(json.dumps(spec))
    model = build_model(
        ModelConfig(vocab_size=512, dim=32, n_layers=1, n_heads=4, ffn_dim=64, max_seq_len=64)
    )
    lm = ladle_lm(model, load_tokenizer(folder))
    hf = AutoTokenizer.from_pretrained(folder)
    for text in ["def f(x):", "import os\n", "<|bos|>x = 1"]:
        assert lm.tok_encode(text) == hf.encode(text, add_special_tokens=not text.startswith("<|bos|>"))
    assert lm._encode_pair("import", " os") == (
        hf.encode("import"),
        hf.encode("import os")[len(hf.encode("import")) :],
    )
    assert (lm.tok_encode("x")[:1] == [0]) == post_bos

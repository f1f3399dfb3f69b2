"""Faults in every recipe (issue 18, part 7): a NaN step is skipped and named down to its
samples (documents, chats, pairs or prompts) in pretraining, SFT, DPO, GRPO and PPO; an SFT, a
DPO, a GRPO and a PPO run SIGKILLed after a step (`faults.kill_at_step`) and resumed end with the
weights of the uninterrupted run, step for step (the resume tests prove it for pretraining,
tests/test_train.py and tests/test_parallel.py)."""

import subprocess
import sys

import pytest
import torch
import yaml
from test_dpo import pair_config, pref_data  # noqa: F401  (the DPO tests' data and config)
from test_grpo import grpo_config
from test_ppo import ppo_config
from test_sft import sft_config, sft_data  # noqa: F401

from ladle.checkpoint.dcp import load_model_weights
from ladle.config.load import build_config
from ladle.models.llama import build_model
from ladle.recipes import load
from ladle.train.metrics import read_metrics


def configs(recipe, request, out) -> dict:
    fix = request.getfixturevalue
    if recipe == "pretrain":
        cfg = dict(fix("tiny_config"), output_dir=str(out))
        cfg["sample"] = {"prompt": ""}
    elif recipe == "sft":
        cfg = sft_config(fix("tokenizer_dir"), fix("sft_data"), out, max_steps=4)
    elif recipe == "dpo":
        cfg = pair_config(fix("chat_tokenizer"), fix("pref_data"), out)
    elif recipe == "grpo":
        cfg = grpo_config(fix("chat_tokenizer"), fix("prompt_data"), out, kl_coef=0.05, num_iterations=2)
    else:
        cfg = ppo_config(fix("chat_tokenizer"), fix("prompt_data"), out)
    cfg["train"] = {**cfg["train"], "max_steps": 4, "eval_every": 0, "eval_steps": 0, "threads": 1}
    cfg["checkpoint"] = {"every": 2, "keep_last": 3}
    return cfg


UNIT = {"pretrain": "documents", "sft": "chats", "dpo": "pairs", "grpo": "prompts", "ppo": "prompts"}


@pytest.mark.parametrize("recipe", list(UNIT))
def test_a_nan_step_is_skipped_and_named_in_every_recipe(recipe, request, tmp_path):
    cfg = configs(recipe, request, tmp_path / "run")
    cfg["faults"] = {"enabled": True, "nan_at_step": 2}
    assert load(recipe).run(build_config(cfg)) == "completed"
    got = [x for x in read_metrics(tmp_path / "run") if "loss" in x]
    assert [x["skipped"] for x in got] == [False, True, False, False]
    events = (tmp_path / "run" / "events.log").read_text()
    (line,) = [ln for ln in events.splitlines() if "step 2: non-finite loss (nan)" in ln]
    assert "update skipped (1/3 in a row). non-finite loss on rank 0 (loss nan over" in line
    assert (
        f"of the train split ({UNIT[recipe]} " in line and f"ladle data show {cfg['data']['path']} " in line
    )


@pytest.mark.parametrize("recipe", ["sft", "dpo", "grpo", "ppo"])
def test_a_killed_run_resumes_to_the_weights_of_an_uninterrupted_one(recipe, request, tmp_path):
    whole = configs(recipe, request, tmp_path / "whole")
    assert load(recipe).run(build_config(whole)) == "completed"

    cut = configs(recipe, request, tmp_path / "cut")
    cut["faults"] = {"enabled": True, "kill_at_step": 3}
    path = tmp_path / "cut.yaml"
    path.write_text(yaml.safe_dump(cut))
    r = subprocess.run(
        [sys.executable, "-m", "ladle", "run", recipe, "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == -9 and "faults: kill at step 3 on rank 0" in r.stdout, (
        r.stdout[-2000:] + r.stderr[-2000:]
    )
    cut["faults"] = {"enabled": False}
    cut["train"]["resume"] = "auto"
    assert load(recipe).run(build_config(cut)) == "completed"

    a = [x for x in read_metrics(tmp_path / "whole") if "loss" in x]
    b = [x for x in read_metrics(tmp_path / "cut") if "loss" in x]
    assert [x["step"] for x in b] == [1, 2, 3, 4]  # step 3's killed attempt left no record
    for x, y in zip(a, b, strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-6, abs=1e-9), x["step"]
    model = build_config(whole).model
    got, want = build_model(model), build_model(model)
    load_model_weights(tmp_path / "cut" / "checkpoints" / "step_00000004", got)
    load_model_weights(tmp_path / "whole" / "checkpoints" / "step_00000004", want)
    for (name, p), q in zip(got.state_dict().items(), want.state_dict().values(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)

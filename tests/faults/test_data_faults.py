"""Data faults (issue 18, part 3): a missing, truncated or damaged shard is named with its file and
offset before training starts; a tokenizer or data change between save and resume is refused
unless train.allow_data_change."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from ladle.cli import main
from ladle.data.prepare import prepare


@pytest.fixture
def own_data(data_dir, tmp_path) -> Path:
    """A copy of the prepared data that a test may damage."""
    return Path(shutil.copytree(data_dir, tmp_path / "data"))


def run(cfg: dict, tmp_path, *overrides) -> int:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return main(["run", "pretrain", "--config", str(path), *overrides])


def short(tiny_config, data) -> dict:
    cfg = dict(tiny_config)
    cfg["data"] = {**cfg["data"], "path": str(data)}
    cfg["train"] = {**cfg["train"], "max_steps": 3, "eval_every": 0, "eval_steps": 0}
    cfg["checkpoint"] = {"every": 0}
    cfg["sample"] = {"prompt": ""}
    return cfg


def test_a_truncated_shard_is_named_with_its_offset_before_training(tiny_config, own_data, tmp_path, capsys):
    shard = own_data / "train_00000.bin"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size - 100)
    assert run(short(tiny_config, own_data), tmp_path) == 2
    err = capsys.readouterr().err
    assert f"{shard} is {size - 100:,} bytes, but {size:,} were written" in err
    assert f"truncated from byte offset {size - 100:,}" in err
    assert not Path(tiny_config["output_dir"]).exists()  # refused before anything was written


def test_a_missing_shard_is_named(tiny_config, own_data, tmp_path, capsys):
    (own_data / "train_00000.idx").unlink()
    assert run(short(tiny_config, own_data), tmp_path) == 2
    assert "train_00000.idx is missing (meta.json lists it)" in capsys.readouterr().err


def test_a_damaged_shard_is_named_with_the_offset_of_its_bad_token(tiny_config, own_data, tmp_path, capsys):
    shard = own_data / "train_00000.bin"
    ids = np.memmap(shard, dtype=np.uint16, mode="r+")
    ids[10] = 60000  # a bit flip's worth of damage: an id beyond the 512-token vocabulary
    ids.flush()
    del ids
    cfg = short(tiny_config, own_data)
    # data.verify=checksums reads every file before training
    assert run(cfg, tmp_path, "data.verify=checksums") == 2
    err = capsys.readouterr().err
    assert f"{shard}: its contents differ from those written" in err
    assert "token 10 (byte offset 20) is id 60000, beyond the vocabulary of 512" in err
    # without it, the read that reaches the token names it, before the model sees it
    from ladle.data.prepare import open_split

    with pytest.raises(Exception, match=r"train_00000.bin: the token at byte offset 20 is id 60000"):
        open_split(own_data, "train").read(0, 64)


def test_a_tokenizer_and_data_changed_between_save_and_resume_are_refused(
    tiny_config, tokenizer_dir, corpus, tmp_path, capsys
):
    # a tokenizer of its own, with the data prepared from it
    tok = Path(shutil.copytree(tokenizer_dir, tmp_path / "tok"))
    data = tmp_path / "data"

    def prepare_data():  # as conftest's data_dir, with this tokenizer
        prepare(
            [str(corpus)],
            tokenizer=str(tok),
            output=str(data),
            workers=1,
            val_fraction=0.3,
            seed=1,
            progress=False,
        )

    prepare_data()
    cfg = short(tiny_config, data)
    cfg["tokenizer"] = {"path": str(tok)}
    cfg["checkpoint"] = {"every": 1}
    assert run(cfg, tmp_path) == 0
    # the tokenizer edited (its last merge dropped: other ids for some text) and the data prepared
    # again with it
    spec = json.loads((tok / "tokenizer.json").read_text())
    spec["model"]["merges"] = spec["model"]["merges"][:-1]
    (tok / "tokenizer.json").write_text(json.dumps(spec))
    prepare_data()
    cfg["train"]["max_steps"] = 4
    before = (Path(cfg["output_dir"]) / "metrics.jsonl").read_text()
    assert run(cfg, tmp_path, "train.resume=auto") == 2
    err = capsys.readouterr().err
    assert "cannot resume from" in err and "step_00000003" in err
    assert f"the tokenizer at tokenizer.path {tok} changed (sha256" in err
    assert f"the data at data.path {data} changed (sha256" in err and "train.allow_data_change=true" in err
    assert (Path(cfg["output_dir"]) / "metrics.jsonl").read_text() == before  # nothing touched
    # allowed: it resumes, and says so
    assert run(cfg, tmp_path, "train.resume=auto", "train.allow_data_change=true") == 0
    events = (Path(cfg["output_dir"]) / "events.log").read_text()
    assert (
        "resumed although the tokenizer at tokenizer.path" in events and "(train.allow_data_change)" in events
    )

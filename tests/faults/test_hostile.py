"""Hostile input (issue 18, part 4): every loader of the package, fed a crafted file through the
command a user runs, refuses it with a message naming the file (exit 2) and runs nothing from it.
Each payload would create CANARY if it ran. Checkpoints have their own such tests
(tests/test_checkpoint.py: crafted DCP metadata; no reader unpickles code)."""

import json
import shutil
import struct
from pathlib import Path

import pytest
import yaml

from ladle.cli import main


@pytest.fixture
def canary(tmp_path) -> Path:
    return tmp_path / "CANARY"


def config_file(cfg: dict, tmp_path, name="c.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_a_config_with_a_python_tag(tiny_config, tmp_path, canary, capsys):
    path = tmp_path / "evil.yaml"
    path.write_text(f'output_dir: !!python/object/apply:os.system ["touch {canary}"]\n')
    assert main(["validate", "--config", str(path)]) == 2
    assert f"{path}:1: malformed YAML" in capsys.readouterr().err and not canary.exists()


def test_a_model_folder_with_remote_code(tiny_config, tmp_path, canary, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "modeling_evil.py").write_text(f"import os\nos.system('touch {canary}')\n")
    (model / "config.json").write_text(
        json.dumps(
            {"architectures": ["EvilForCausalLM"], "auto_map": {"AutoModelForCausalLM": "modeling_evil.Evil"}}
        )
    )
    assert main(["validate", "--config", config_file(tiny_config, tmp_path), f"model.init_from={model}"]) == 2
    err = capsys.readouterr().err
    assert f"{model}/config.json: architecture ['EvilForCausalLM'] is not supported" in err
    assert "auto_map names remote code (AutoModelForCausalLM), which ladle never imports" in err
    assert not canary.exists()


def test_a_damaged_tokenizer(tiny_config, tmp_path, capsys):
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_bytes(b"\x00\xff" * 64)
    assert main(["validate", "--config", config_file(tiny_config, tmp_path), f"tokenizer.path={tok}"]) == 2
    assert f"cannot load tokenizer {tok}/tokenizer.json" in capsys.readouterr().err


def test_a_chat_template_that_reaches_for_the_os(tokenizer_dir, tmp_path, canary, capsys):
    tok = Path(shutil.copytree(tokenizer_dir, tmp_path / "tok"))
    escape = f"{{{{ cycler.__init__.__globals__.os.system('touch {canary}') }}}}"
    (tok / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eos|>", "chat_template": escape}))
    chats = tmp_path / "chats.jsonl"
    chats.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
        + "\n"
    )
    argv = ["data", "prepare", "--task", "sft", "--input", str(chats), "--tokenizer", str(tok)]
    assert main([*argv, "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{tok}/tokenizer_config.json: chat template: access to attribute '__init__'" in err
    assert not canary.exists() and not (tmp_path / "out").exists()


def test_records_that_are_bombs_are_skipped_and_counted(tokenizer_dir, tmp_path, capsys):
    src = tmp_path / "docs.jsonl"
    with open(src, "wb") as f:
        f.write(json.dumps({"text": "a good document"}).encode() + b"\n")
        f.write(b"[" * 200_000 + b"\n")  # a nesting bomb
        f.write(b'{"text": "\xff\xfe"}\n')  # not UTF-8
        f.write(b'{"text": "nul \\u0000 inside"}\n')
    out = tmp_path / "out"
    assert (
        main(
            ["data", "prepare", "--input", str(src), "--tokenizer", str(tokenizer_dir), "--output", str(out)]
        )
        == 0
    )
    meta = json.loads((out / "meta.json").read_text())
    assert meta["bad_records"] == {"invalid JSON": 1, "undecodable bytes": 1}
    assert meta["bad_examples"]["invalid JSON"] == [f"{src}:2"]


def test_a_data_folder_whose_meta_points_outside_it(data_dir, tmp_path, capsys):
    data = Path(shutil.copytree(data_dir, tmp_path / "data"))
    meta = json.loads((data / "meta.json").read_text())
    meta["splits"]["train"]["shards"] = ["../../../etc/passwd"]
    (data / "meta.json").write_text(json.dumps(meta))
    assert main(["data", "inspect", str(data)]) == 2
    assert f"{data}/meta.json names the file '../../../etc/passwd', which is not a file of the folder" in (
        capsys.readouterr().err
    )


def test_an_index_that_claims_more_than_it_holds(data_dir, tmp_path, capsys):
    data = Path(shutil.copytree(data_dir, tmp_path / "data"))
    idx = data / "train_00000.idx"
    raw = bytearray(idx.read_bytes())
    raw[18:26] = struct.pack("<Q", 2**60)  # sequence count
    idx.write_bytes(bytes(raw))
    assert main(["data", "inspect", str(data)]) == 2
    assert f"{idx} is {len(raw)} bytes but its header ({2**60} sequences" in capsys.readouterr().err


def test_prompt_records_that_are_not_json(prompt_data, tmp_path, capsys):
    data = Path(shutil.copytree(prompt_data, tmp_path / "data"))
    records = data / "train_records.jsonl"
    lines = records.read_text().splitlines()
    lines[1] = "{not json"
    records.write_text("\n".join(lines) + "\n")
    assert main(["data", "show", str(data), "0"]) == 2
    assert f"{records}:2: unreadable" in capsys.readouterr().err


def test_model_weights_with_a_crafted_header(tmp_path, capsys):
    from transformers import LlamaConfig

    model = tmp_path / "model"
    model.mkdir()
    LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    ).to_json_file(model / "config.json")
    (model / "model.safetensors").write_bytes(struct.pack("<Q", 2**62) + b"{}")
    tok_args = ["--tokenizer", str(model)]
    assert main(["generate", "--model", str(model), *tok_args, "--prompt", "x"]) == 2
    assert f"{model}/model.safetensors" in capsys.readouterr().err


def test_an_output_dir_among_the_inputs_is_refused(tiny_config, data_dir, tmp_path, capsys):
    path = config_file(tiny_config, tmp_path)
    assert main(["validate", "--config", path, f"output_dir={data_dir}/run"]) == 2
    assert (
        f"output_dir {data_dir}/run is inside data.path {data_dir}: the run would write among its inputs"
        in (capsys.readouterr().err)
    )

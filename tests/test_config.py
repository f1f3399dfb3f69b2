"""Config loading: overrides, coercion, error messages, hashing, bundled configs."""

import pytest
import yaml

from ladle.config.load import (
    build_config,
    bundled_configs,
    config_hash,
    load_config,
    parse_override,
    resolve_config_path,
    to_yaml,
)
from ladle.errors import ConfigError

BASE = {
    "tokenizer": {"path": "tok"},
    "data": {"path": "data", "seq_len": 64},
    "model": {
        "vocab_size": 512,
        "dim": 64,
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 2,
        "ffn_dim": 128,
        "max_seq_len": 128,
    },
    "train": {"max_steps": 10},
}


def test_overrides_are_coerced_to_field_types():
    cfg = build_config(
        BASE,
        [
            "optim.lr=1e-4",
            "train.micro_batch_size=3",
            "optim.betas=[0.8,0.9]",
            "model.tie_embeddings=true",
            "precision.mode=bf16",
            "output_dir=/tmp/x",
        ],
    )
    assert cfg.optim.lr == pytest.approx(1e-4)
    assert cfg.train.micro_batch_size == 3
    assert cfg.optim.betas == (0.8, 0.9)
    assert cfg.model.tie_embeddings is True
    assert cfg.precision.mode == "bf16"
    assert cfg.output_dir == "/tmp/x"


def test_overrides_do_not_modify_the_input():
    build_config(BASE, ["model.dim=128"])
    assert BASE["model"]["dim"] == 64


@pytest.mark.parametrize(
    "override, expected",
    [
        ("model.n_head=4", "model.n_head: unknown key; did you mean 'model.n_heads'?"),
        ("optim.learning_rate=1", "optim.learning_rate: unknown key"),
        ("trian.max_steps=3", "trian: unknown key; did you mean 'train'?"),
        ("train.max_step=3", "did you mean 'train.max_steps'?"),
    ],
)
def test_unknown_keys_get_a_hint(override, expected):
    with pytest.raises(ConfigError) as e:
        build_config(BASE, [override])
    assert expected in str(e.value)


@pytest.mark.parametrize(
    "override, expected",
    [
        ("model.n_kv_heads=3", "n_heads (4) must be divisible by n_kv_heads (3)"),
        ("data.seq_len=256", "data.seq_len (256) exceeds model.max_seq_len (128)"),
        ("optim.lr=-1", "optim.lr: Input should be greater than 0"),
        (
            "precision.mode=fp8",
            "precision.mode: Input should be 'auto', 'fp32', 'bf16-mixed', 'fp16-mixed' or 'bf16'",
        ),
        ("model.dim=abc", "model.dim: Input should be a valid integer"),
        ("scheduler.warmup_steps=10", "scheduler.warmup_steps (10) must be below train.max_steps (10)"),
        ("model.dim=66", "dim (66) must be divisible by n_heads (4)"),
        ("optim.betas=[0.9,1.5]", "optim.betas: Value error, each beta must be in [0, 1)"),
    ],
)
def test_out_of_range_values_name_the_field(override, expected):
    with pytest.raises(ConfigError) as e:
        build_config(BASE, [override])
    assert expected.replace("Value error, ", "") in str(e.value)


def test_missing_required_section():
    data = {k: v for k, v in BASE.items() if k != "data"}
    with pytest.raises(ConfigError, match="data: required but not set"):
        build_config(data)


def test_malformed_override_and_yaml(tmp_path):
    with pytest.raises(ConfigError, match="must look like key.path=value"):
        parse_override("optim.lr")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  dim: 64\n   n_layers: 2\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:\d+: malformed YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="is a value, not a section"):
        build_config(BASE, ["model.dim.x=1"])


def test_hash_is_canonical_and_sensitive():
    a = build_config(BASE)
    b = build_config(yaml.safe_load(to_yaml(a)))  # round trip through the resolved YAML
    assert config_hash(a) == config_hash(b)
    assert len(config_hash(a)) == 64
    assert config_hash(build_config(BASE, ["optim.lr=1e-3"])) != config_hash(a)


def test_resolved_yaml_round_trips(tmp_path):
    cfg = build_config(BASE, ["optim.lr=1e-4"])
    f = tmp_path / "c.yaml"
    f.write_text(to_yaml(cfg))
    assert load_config(f) == cfg


def test_every_bundled_config_loads():
    names = bundled_configs()
    assert "tiny/pretrain" in names
    for name in names:
        load_config(name)


def test_unknown_config_file_hints_bundled_name():
    with pytest.raises(ConfigError, match="did you mean the bundled config 'tiny/pretrain'"):
        resolve_config_path("tiny/pretrian")


def test_every_key_is_documented():
    """docs/config.md lists every field of the schema (docs change with the code)."""
    from pathlib import Path
    from typing import get_origin

    from pydantic import BaseModel

    from ladle.config.schema import LadleConfig

    doc = (Path(__file__).parent.parent / "docs" / "config.md").read_text()

    def paths(model, prefix=""):
        for name, f in model.model_fields.items():
            ann = f.annotation
            subs = [  # a list of sections (data.mix) is one key, its items described there
                a
                for a in (ann, *getattr(ann, "__args__", ()))
                if isinstance(a, type) and issubclass(a, BaseModel) and get_origin(ann) is not list
            ]
            if subs and name != "rope_scaling":
                yield from paths(subs[0], f"{prefix}{name}.")
            else:
                yield prefix + name

    missing = [p for p in paths(LadleConfig) if f"`{p}`" not in doc]
    assert not missing, f"undocumented config keys: {missing}"


def test_the_config_reference_is_generated_from_the_schema_and_current():
    """docs/config.md's table is what ladle/config/reference.py renders from the schema: every key
    with its type, default and description (after a schema change: python -m
    ladle.config.reference --write docs/config.md)."""
    from pathlib import Path

    from ladle.config.reference import current, rows

    assert current(Path(__file__).parent.parent / "docs" / "config.md")
    got = {key: (kind, default, meaning) for key, kind, default, meaning in rows()}
    assert got["train.max_steps"] == ("int", "`1000`", "optimizer steps; the schedule spans them")
    assert got["guard.on_max_skips"][:2] == ("rollback \\| stop", "`rollback`")
    assert got["tokenizer.path"][1] == "required" and got["lora.targets"][0] == "list of str"
    assert all(meaning for _, _, meaning in got.values()), [k for k, v in got.items() if not v[2]]

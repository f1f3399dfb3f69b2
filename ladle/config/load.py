"""Loading a config: YAML file -> dotted overrides -> pydantic validation -> `LadleConfig`.

Errors become one `ConfigError` whose message names the field path (`optim.lr`), what was wrong and
how to fix it; unknown keys get a "did you mean" hint from the schema's own field names.
"""

from __future__ import annotations

import difflib
import hashlib
import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from ladle.config.schema import LadleConfig
from ladle.errors import ConfigError

# Every bundled YAML lives in ladle/configs/: the run configs by recipe, the model shapes that
# `model.preset` names under models/ (not run configs themselves).
CONFIG_ROOT = Path(__file__).resolve().parent.parent / "configs"
PRESET_ROOT = CONFIG_ROOT / "models"


def bundled_configs() -> list[str]:
    """Names of the bundled run configs, e.g. `tiny/pretrain`."""
    return sorted(
        str(p.relative_to(CONFIG_ROOT).with_suffix(""))
        for p in CONFIG_ROOT.rglob("*.yaml")
        if PRESET_ROOT not in p.parents
    )


def resolve_config_path(name: str) -> Path:
    """A path on disk, or the name of a bundled config (`tiny/pretrain`, `tiny/pretrain.yaml`)."""
    p = Path(name)
    if p.is_file():
        return p
    bundled = CONFIG_ROOT / (name if name.endswith(".yaml") else name + ".yaml")
    if bundled.is_file() and PRESET_ROOT not in bundled.resolve().parents:
        return bundled
    hint = difflib.get_close_matches(name.removesuffix(".yaml"), bundled_configs(), n=1)
    extra = (
        f"; did you mean the bundled config '{hint[0]}'?"
        if hint
        else "; `ladle ls` lists the bundled configs"
    )
    raise ConfigError(f"config file '{name}' not found{extra}")


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError(f"{where}: malformed YAML: {getattr(e, 'problem', e)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def parse_override(text: str) -> tuple[list[str], Any]:
    """`optim.lr=1e-4` -> (['optim', 'lr'], 1e-4). Values are parsed as YAML, so lists
    (`optim.betas=[0.9,0.95]`), booleans and null work; pydantic then coerces to the field type."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' must look like key.path=value (e.g. optim.lr=1e-4)")
    key, _, raw = text.partition("=")
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override '{text}': empty part in key path '{key}'")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return parts, value


def apply_override(data: dict, parts: list[str], value: Any) -> None:
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise ConfigError(
                f"override {'.'.join(parts)}: '{'.'.join(parts[: i + 1])}' is a value, not a section"
            )
        node = child
    node[parts[-1]] = value


def _fields_at(loc: tuple) -> list[str]:
    """The field names the schema allows at a location (for "did you mean")."""
    model: type[BaseModel] = LadleConfig
    for part in loc:
        field = model.model_fields.get(part)
        if field is None:
            return []
        ann = field.annotation
        candidates = [ann, *getattr(ann, "__args__", ())]
        sub = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if sub is None:
            return []
        model = sub
    return list(model.model_fields)


MOVED = {"train.max_bad_steps": "guard.max_skips"}  # keys of older configs, and where they went


def format_validation_error(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(str(p) for p in e["loc"])
        path = ".".join(loc) or "config"
        if e["type"] == "extra_forbidden" and path in MOVED:
            lines.append(f"{path}: this setting is now {MOVED[path]}")
        elif e["type"] == "extra_forbidden":
            known = _fields_at(loc[:-1])
            hint = difflib.get_close_matches(loc[-1], known, n=1, cutoff=0.6)
            prefix = ".".join(loc[:-1])
            if hint:
                fix = f"did you mean '{prefix + '.' if prefix else ''}{hint[0]}'?"
            else:
                fix = f"known keys here: {', '.join(known)}"
            lines.append(f"{path}: unknown key; {fix}")
        elif e["type"] == "missing":
            lines.append(f"{path}: required but not set; add it to the config or pass {path}=...")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            got = e.get("input")
            shown = "" if isinstance(got, dict) or e["type"] == "value_error" else f" (got {got!r})"
            lines.append(f"{path}: {msg}{shown}" if loc else f"{msg}{shown}")
    head = f"invalid config {source}:" if len(lines) > 1 else f"invalid config {source}: "
    return head + ("\n  " + "\n  ".join(lines) if len(lines) > 1 else lines[0])


def model_presets() -> list[str]:
    """Names of the bundled model definitions (`ladle/configs/models/NAME.yaml`)."""
    return sorted(p.stem for p in PRESET_ROOT.glob("*.yaml"))


def apply_preset(data: dict) -> None:
    """`model.preset: NAME` fills the model section from the bundled definition; keys the config
    sets itself win (e.g. a shorter max_seq_len)."""
    model = data.get("model")
    if not isinstance(model, dict) or not model.get("preset"):
        return
    name = model["preset"]
    f = PRESET_ROOT / f"{name}.yaml"
    if not isinstance(name, str) or not f.is_file():
        hint = difflib.get_close_matches(str(name), model_presets(), n=1)
        raise ConfigError(
            f"model.preset: unknown model {name!r}"
            + (f" (did you mean {hint[0]!r}?)" if hint else "")
            + f"; bundled: {', '.join(model_presets())}"
        )
    preset = read_yaml(f)
    for key, value in model.items():  # nested sections (moe) merge key by key
        preset[key] = (
            {**preset[key], **value}
            if isinstance(preset.get(key), dict) and isinstance(value, dict)
            else value
        )
    data["model"] = preset


def build_config(data: dict, overrides: list[str] = (), source: str = "") -> LadleConfig:
    data = json.loads(json.dumps(data))  # deep copy; overrides never touch the caller's dict
    for text in overrides:
        apply_override(data, *parse_override(text))
    apply_preset(data)
    try:
        return LadleConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, source or "(overrides)")) from None


def load_config(path: str | Path, overrides: list[str] = ()) -> LadleConfig:
    p = resolve_config_path(str(path))
    return build_config(read_yaml(p), list(overrides), source=str(p))


def to_dict(cfg: LadleConfig) -> dict:
    return cfg.model_dump(mode="json")


def to_yaml(cfg: LadleConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def config_hash(cfg: LadleConfig) -> str:
    """sha256 of the canonical resolved config (sorted keys, compact JSON)."""
    canon = json.dumps(to_dict(cfg), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from ladle.config.schema import ModelConfig, RopeScaling
from ladle.errors import CheckpointError
from ladle.models.hf import hf_config, load_hf, model_config_from_hf, reader, save_hf
from ladle.models.llama import build_model


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=97, dim=32, n_layers=2, n_heads=4, ffn_dim=64, max_seq_len=128, init_std=0.1)
    return ModelConfig(**{**base, **kw})


TOKENS = torch.tensor([[5, 17, 3, 88, 41, 2, 60], [1, 9, 9, 30, 72, 11, 4]])


def hf_logits(folder):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32)
    hf.eval()
    with torch.no_grad():
        return hf(TOKENS).logits


@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(0)
    cfg = tiny(n_kv_heads=2)
    model = build_model(cfg)
    out = save_hf(model.state_dict(), cfg, tmp_path / "export", bos_id=1, eos_id=2)
    return model, cfg, out


YARN = RopeScaling(type="yarn", factor=4.0, original_max_seq_len=8, mscale=0.707, mscale_all_dim=1.0)


@pytest.mark.parametrize(
    "tied, scaling",
    [
        (False, RopeScaling(original_max_seq_len=16)),
        (True, RopeScaling(original_max_seq_len=16)),
        (False, YARN),
    ],
    ids=["llama3", "llama3-tied", "yarn"],
)
def test_save_hf_loads_in_transformers(tmp_path, tied, scaling):
    torch.manual_seed(0)
    cfg = tiny(tie_embeddings=tied, rope_theta=500000.0, rope_scaling=scaling)
    model = build_model(cfg)
    out = save_hf(model.state_dict(), cfg, tmp_path / "export", bos_id=1, eos_id=2, pad_id=0)
    names = set(load_file(out / "model.safetensors"))
    assert ("lm_head.weight" in names) != tied
    assert all(n.startswith("model.") or n == "lm_head.weight" for n in names)
    assert json.loads((out / "generation_config.json").read_text()) == {
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
    with torch.no_grad():
        ours = model(TOKENS)
    torch.testing.assert_close(hf_logits(out), ours, atol=1e-5, rtol=1e-5)
    loaded, cfg2 = load_hf(out)
    assert cfg2 == cfg
    with torch.no_grad():
        torch.testing.assert_close(loaded(TOKENS), ours, atol=0, rtol=0)
    assert not list(tmp_path.glob(".export*"))  # temp folder renamed away


def test_sharded_save_and_load(tmp_path):
    torch.manual_seed(0)
    cfg = tiny()
    model = build_model(cfg)
    out = save_hf(model.state_dict(), cfg, tmp_path / "sharded", max_shard_bytes=20_000, dtype=torch.bfloat16)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert not (out / "model.safetensors").exists()
    modes = {f.name: f.stat().st_mode & 0o777 for f in out.iterdir()}
    assert len(set(modes.values())) == 1, modes  # shards as readable as config.json
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert index["metadata"]["total_size"] == sum(p.numel() * 2 for p in model.parameters())
    loaded, _ = load_hf(out)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[k], v.bfloat16().float(), atol=0, rtol=0)
    with torch.no_grad():
        ours = loaded(TOKENS)
    torch.testing.assert_close(hf_logits(out), ours, atol=1e-5, rtol=1e-5)


def test_tokenizer_files_copied(tmp_path):
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    (tok / "special_tokens_map.json").write_text("{}")
    cfg = tiny()
    out = save_hf(build_model(cfg).state_dict(), cfg, tmp_path / "e", tokenizer_dir=tok)
    assert (out / "tokenizer.json").read_text() == "{}"
    assert (out / "special_tokens_map.json").exists()
    assert (
        json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"]
        == "PreTrainedTokenizerFast"
    )
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        save_hf(build_model(cfg).state_dict(), cfg, tmp_path / "f", tokenizer_dir=tmp_path)


def test_failed_save_leaves_nothing(tmp_path):
    cfg = tiny()
    sd = build_model(cfg).state_dict()
    del sd["layers.1.mlp.up_proj.weight"]
    with pytest.raises(CheckpointError, match=r"missing tensors: layers\.1\.mlp\.up_proj\.weight"):
        save_hf(sd, cfg, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_existing_folder_needs_overwrite(saved):
    model, cfg, out = saved
    with pytest.raises(CheckpointError, match="already exists"):
        save_hf(model.state_dict(), cfg, out)
    save_hf(model.state_dict(), cfg, out, overwrite=True)
    assert (out / "config.json").exists()
    assert sorted(p.name for p in out.parent.iterdir()) == ["export"]


def test_config_round_trip_and_errors():
    cfg = tiny(n_kv_heads=2, head_dim=12, rope_scaling=RopeScaling(factor=4.0, original_max_seq_len=64))
    assert model_config_from_hf(hf_config(cfg), "config.json") == cfg
    # transformers<5 style: rope_theta + rope_scaling with "type"
    old = {k: v for k, v in hf_config(cfg).items() if k != "rope_parameters"}
    old["rope_scaling"] = {**old["rope_scaling"], "type": old["rope_scaling"].pop("rope_type")}
    assert model_config_from_hf(old, "config.json") == cfg
    yarn = cfg.model_copy(update={"rope_scaling": YARN})
    assert model_config_from_hf(hf_config(yarn), "config.json") == yarn

    with pytest.raises(CheckpointError, match="qk_norm"):
        hf_config(tiny(qk_norm=True))
    with pytest.raises(CheckpointError, match="qkv_bias"):
        hf_config(tiny(qkv_bias=True))
    bad = {**hf_config(cfg), "architectures": ["GPT2LMHeadModel"]}
    with pytest.raises(
        CheckpointError, match=r"x/config.json: architecture .*GPT2LMHeadModel.*LlamaForCausalLM"
    ):
        model_config_from_hf(bad, "x/config.json")
    bad = {**hf_config(cfg), "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}
    with pytest.raises(
        CheckpointError, match=r"rope type 'dynamic' is not supported; supported: default, llama3, yarn"
    ):
        model_config_from_hf(bad, "config.json")


def test_load_errors(saved, tmp_path):
    _, _, out = saved
    weights = out / "model.safetensors"
    config = (out / "config.json").read_text()

    with pytest.raises(CheckpointError, match=r"nowhere: not a folder"):
        load_hf(tmp_path / "nowhere")

    (out / "config.json").unlink()
    with pytest.raises(CheckpointError, match=rf"{out}: no config.json"):
        load_hf(out)
    (out / "config.json").write_text(config)

    good = load_file(weights)
    weights.rename(out / "moved.bin")
    with pytest.raises(CheckpointError, match=rf"{out}: no model.safetensors"):
        load_hf(out)

    bad = dict(good)
    bad["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 32)
    save_file(bad, weights)
    with pytest.raises(
        CheckpointError,
        match=r"mis-shaped tensors: model\.layers\.0\.self_attn\.k_proj\.weight \[3, 32\] in model\.safetensors \(config expects \[16, 32\]\)",
    ):
        load_hf(out)

    bad = {k: v for k, v in good.items() if k != "model.norm.weight"}
    bad["model.extra.weight"] = torch.zeros(2)
    save_file(bad, weights)
    with pytest.raises(
        CheckpointError,
        match=r"missing tensors: model\.norm\.weight; unexpected tensors: model\.extra\.weight in model\.safetensors",
    ):
        load_hf(out)

    save_file(good, weights)
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 1000])
    with pytest.raises(
        CheckpointError, match=r"model\.safetensors: cannot read safetensors file .*truncated"
    ):
        load_hf(out)
    weights.write_bytes(data[:20])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: cannot read safetensors file"):
        load_hf(out)


def test_load_errors_sharded(tmp_path):
    cfg = tiny()
    out = save_hf(build_model(cfg).state_dict(), cfg, tmp_path / "s", max_shard_bytes=20_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (out / victim).unlink()
    with pytest.raises(CheckpointError, match=rf"lists shards that are not in .*{victim}"):
        load_hf(out)


@pytest.mark.parametrize("chunk", [reader.READ_CHUNK, 99])
def test_load_converts_dtype_on_the_way_in(tmp_path, monkeypatch, chunk):
    # bf16 files into an fp32 model (through a temporary) and into a bf16 model (read in place,
    # also in odd-sized chunks across element boundaries, as a large tensor is read by threads).
    monkeypatch.setattr(reader, "READ_CHUNK", chunk)
    torch.manual_seed(0)
    cfg = tiny(n_kv_heads=2)
    model = build_model(cfg)
    out = save_hf(model.state_dict(), cfg, tmp_path / "bf16", dtype=torch.bfloat16)
    for dtype in (torch.float32, torch.bfloat16):
        loaded, _ = load_hf(out, dtype=dtype)
        for name, value in loaded.state_dict().items():
            assert value.dtype == dtype
            assert torch.equal(value, model.state_dict()[name].to(torch.bfloat16).to(dtype)), name


def test_load_names_an_unsupported_tensor_dtype(saved):
    _, _, out = saved
    tensors = load_file(out / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.float8_e4m3fn)
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(
        CheckpointError, match=r"tensor model\.norm\.weight has dtype 'F8_E4M3'.*supported: F64"
    ):
        load_hf(out)


def test_load_names_a_file_that_shrinks_while_read(saved, monkeypatch):
    # The headers are checked against the file sizes first; a file cut short after that (another
    # process rewriting it) is still named rather than leaving weights half-filled unnoticed.
    _, _, out = saved
    read_header = reader._read_header

    def then_truncate(f):
        header = read_header(f)
        with open(f, "r+b") as fh:
            fh.truncate(f.stat().st_size - 100)
        return header

    monkeypatch.setattr(reader, "_read_header", then_truncate)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: the file ends inside a tensor"):
        load_hf(out)


@pytest.mark.parametrize("kind", ["llama", "tied", "glm4", "qwen3_moe", "lora", "dora"])
def test_streamed_weights_are_the_exported_folders(tmp_path, kind):
    """stream_hf (what an inference engine is fed) gives, one tensor at a time, the tensors
    save_hf writes: GLM's gate_up_proj joined, experts one by one, adapters merged."""
    from ladle.config.schema import LoRAConfig, MoEConfig
    from ladle.models.lora import apply_lora, merge_lora
    from ladle.models.stream import stream_hf

    kw = {
        "tied": {"tie_embeddings": True},
        "glm4": {"family": "glm4", "qkv_bias": True, "rope_interleaved": True, "partial_rotary_factor": 0.5,
                 "post_norms": True},
        "qwen3_moe": {"family": "qwen3_moe", "qk_norm": True, "moe": MoEConfig(n_experts=4, top_k=2, ffn_dim=16)},
    }.get(kind, {})  # fmt: skip
    cfg = tiny(**kw)
    torch.manual_seed(0)
    model = build_model(cfg)
    if kind in ("lora", "dora"):
        apply_lora(model, LoRAConfig(rank=4, dora=kind == "dora"))
        for n, p in model.named_parameters():  # B is 0 at init: give the adapters a delta to merge
            if "lora_" in n:
                torch.nn.init.normal_(p, std=0.2)
    streamed = list(stream_hf(model, cfg))
    if kind in ("lora", "dora"):
        merge_lora(model)
    save_hf(model.state_dict(), cfg, tmp_path / "hf")
    saved = load_file(tmp_path / "hf" / "model.safetensors")
    names = [n for n, _ in streamed]
    assert sorted(names) == sorted(saved) and len(set(names)) == len(names)
    for name, t in streamed:
        assert torch.equal(t, saved[name]), name

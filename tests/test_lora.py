"""LoRA, rsLoRA and DoRA adapters: at init they leave the model unchanged, merged equals unmerged,
only adapters train, adapter-only checkpoints resume exactly, and PEFT loads the exported adapter
with the same logits (fp32, 1e-5)."""

import json
import math

import pytest
import torch
import yaml
from conftest import make_tiny_config

from ladle.cli import main
from ladle.config.schema import LoRAConfig, ModelConfig
from ladle.errors import ConfigError
from ladle.models.llama import build_model
from ladle.models.lora import LoRALinear, apply_lora, merge_lora
from ladle.train.metrics import read_metrics

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOKENS = torch.tensor([[5, 17, 3, 88, 41, 2, 60, 7], [1, 9, 9, 30, 72, 11, 4, 0]])
VARIANTS = {
    "lora": {"targets": ALL},
    "rslora": {"targets": ["q_proj", "v_proj"], "rslora": True, "rank": 4, "alpha": 8},
    "dora": {"targets": ALL, "dora": True},
}


TINY = dict(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32)


def tiny_model(**kw):
    torch.manual_seed(0)
    return build_model(ModelConfig(**TINY, **kw))


@pytest.mark.parametrize("variant", VARIANTS)
def test_adapters_at_init_leave_the_model_unchanged_and_merge_exactly(variant):
    model = tiny_model()
    with torch.no_grad():
        before = model(TOKENS)
    apply_lora(model, LoRAConfig(**VARIANTS[variant]), seed=3)
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), before, atol=1e-6, rtol=1e-6)  # B = 0, m = |W|
        for m in model.modules():  # as if trained: every adapter moves the output
            if isinstance(m, LoRALinear):
                m.lora_B.weight.normal_(0, 0.3)
                if m.use_dora:
                    m.lora_magnitude_vector.mul_(torch.empty_like(m.lora_magnitude_vector).uniform_(0.5, 1.5))
        adapted = model(TOKENS)
    assert (adapted - before).abs().max() > 1e-2
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    merged = merge_lora(model)
    assert not any(isinstance(m, LoRALinear) for m in merged.modules())
    assert set(merged.state_dict()) == set(tiny_model().state_dict())  # the base architecture again
    with torch.no_grad():
        torch.testing.assert_close(merged(TOKENS), adapted, atol=1e-5, rtol=1e-5)


def test_modules_to_save_train_in_full_and_tied_names_mean_the_shared_matrix():
    model = tiny_model(tie_embeddings=True)  # no lm_head module: the head is embed_tokens' matrix
    apply_lora(model, LoRAConfig(targets=["q_proj"], modules_to_save=["lm_head"]))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "embed_tokens.weight" in trainable and all(
        ".lora_" in n for n in trainable - {"embed_tokens.weight"}
    )
    assert not model.norm.weight.requires_grad and not model.layers[0].self_attn.q_proj.weight.requires_grad
    with pytest.raises(ValueError, match="'lm_head' is in both targets and modules_to_save"):
        LoRAConfig(targets=["q_proj", "lm_head"], modules_to_save=["lm_head"])
    with pytest.raises(ValueError, match="embed_tokens"):  # only the embedding and the head
        LoRAConfig(modules_to_save=["norm"])


def test_adapter_run_counts_for_the_log_and_mfu():
    from ladle.config.load import build_config
    from ladle.train.metrics import adapter_counts

    lora = {"targets": ["q_proj", "down_proj"], "rank": 4, "dora": True, "modules_to_save": ["lm_head"]}
    cfg = build_config(
        {"model": TINY, "lora": lora, "tokenizer": {"path": "t"}, "data": {"path": "d", "seq_len": 32}}
    )
    n = sum(p.numel() for k, p in tiny_model().named_parameters() if k != "embed_tokens.weight")
    trained, adapters, frozen = adapter_counts(cfg, n)
    # by hand: per layer q_proj 4 x (32 + 32), down_proj 4 x (64 + 32); DoRA magnitudes 32 + 32
    assert adapters == 2 * (4 * 64 + 4 * 96)
    assert trained == adapters + 2 * (32 + 32) + 97 * 32  # + the head, trained in full
    assert frozen == n - 97 * 32  # every weight of N but the head gets no weight gradient


def test_targets_that_match_nothing_are_named():
    with pytest.raises(
        ConfigError, match=r"no module named 'qproj' in this model; its linear modules are .*q_proj"
    ):
        apply_lora(tiny_model(), LoRAConfig(targets=["q_proj", "qproj"]))


# -- runs --------------------------------------------------------------------------------------
def qwen2_folder(out, tied: bool):
    """A random Qwen2 (q/k/v biases) written by transformers, for the tiny tokenizer's 512 ids."""
    import transformers as tf

    config = tf.Qwen2Config(
        vocab_size=512,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        use_sliding_window=False,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    tf.Qwen2ForCausalLM(config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def base_hf(tmp_path_factory):
    return qwen2_folder(tmp_path_factory.mktemp("base") / "hf", tied=False)


@pytest.fixture(scope="module")
def base_hf_tied(tmp_path_factory):
    return qwen2_folder(tmp_path_factory.mktemp("base") / "hf", tied=True)


def write_cfg(tmp_path, tokenizer_dir, sort_chats, base, lora, **train):
    cfg = make_tiny_config(tokenizer_dir, sort_chats, tmp_path / "run")
    cfg["model"] = {"init_from": str(base)}
    cfg["data"]["seq_len"] = 64
    cfg["optim"]["lr"] = 3e-2  # adapters move far in a few steps
    cfg["train"].update({"max_steps": 6, "eval_steps": 1, "eval_every": 3, **train})
    cfg["checkpoint"]["every"] = 3
    cfg["sample"] = {"prompt": ""}
    cfg["lora"] = lora
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump(cfg))
    return f


def hf_logits(model):
    with torch.no_grad():
        return model(TOKENS).logits


# modules_to_save on an untied base (embedding and head apart) and on a tied one (PEFT then ties
# its trained copy of the embedding to the head: ensure_weight_tying)
PEFT_CASES = {
    **{v: (VARIANTS[v], False) for v in VARIANTS},
    "lora+saved": ({"targets": ["q_proj", "v_proj"], "modules_to_save": ["embed_tokens", "lm_head"]}, False),
    "dora+saved-tied": ({"targets": ALL, "dora": True, "modules_to_save": ["embed_tokens"]}, True),
}


@pytest.mark.parametrize("case", PEFT_CASES)
def test_peft_loads_the_exported_adapter_with_the_same_logits(
    tokenizer_dir, sort_chats, base_hf, base_hf_tied, tmp_path, case
):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from ladle.ops.export import load_checkpoint_model

    lora, tied = PEFT_CASES[case]
    base_hf = base_hf_tied if tied else base_hf
    f = write_cfg(tmp_path, tokenizer_dir, sort_chats, base_hf, lora)
    run = tmp_path / "run"
    assert main(["run", "sft", "--config", str(f)]) == 0
    assert main(["export", "peft", str(run), str(tmp_path / "adapter")]) == 0
    assert main(["export", "hf", str(run), str(tmp_path / "merged")]) == 0

    ours, _, _ = load_checkpoint_model(run)
    with torch.no_grad():
        logits = ours(TOKENS)
    base = AutoModelForCausalLM.from_pretrained(base_hf, dtype=torch.float32).eval()
    base_logits = hf_logits(base)
    peft = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    torch.testing.assert_close(hf_logits(peft), logits, atol=1e-5, rtol=1e-5)
    assert (logits - base_logits).abs().max() > 1e-3  # the adapters did learn something
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    torch.testing.assert_close(hf_logits(merged), logits, atol=1e-5, rtol=1e-5)
    # only the adapters and the modules to save changed: the rest is the folder's, bit for bit
    from ladle.models.hf import load_hf

    ref, _ = load_hf(base_hf)
    saved = {f"{m}.weight" for m in lora.get("modules_to_save", [])}
    if tied and saved:
        saved = {"embed_tokens.weight"}
    base_sd = {k: v for k, v in ours.state_dict().items() if ".lora_" not in k}
    for k, v in ref.state_dict().items():
        assert torch.equal(base_sd[k], v) == (k not in saved), k


def test_adapter_checkpoints_are_small_and_resume_exactly(
    tokenizer_dir, sort_chats, base_hf, tmp_path, capsys
):
    lora = {**VARIANTS["dora"], "modules_to_save": ["lm_head"]}  # trained in full, checkpointed too
    whole = tmp_path / "whole"
    whole.mkdir()
    assert (
        main(["run", "sft", "--config", str(write_cfg(whole, tokenizer_dir, sort_chats, base_hf, lora))]) == 0
    )
    split = tmp_path / "split"
    split.mkdir()
    f = write_cfg(split, tokenizer_dir, sort_chats, base_hf, lora)
    assert main(["run", "sft", "--config", str(f), "train.exit_at_step=3"]) == 0
    assert main(["run", "sft", "--config", str(f), "train.resume=auto"]) == 0
    a = [(r["step"], r["loss"]) for r in read_metrics(whole / "run") if "loss" in r]
    b = [(r["step"], r["loss"]) for r in read_metrics(split / "run") if "loss" in r]
    assert [s for s, _ in a] == [s for s, _ in b] == list(range(1, 7))
    for (_, x), (_, y) in zip(a, b, strict=True):
        assert y == pytest.approx(x, abs=1e-6)
    # the checkpoint holds the adapters and their optimizer state, not the base
    ckpt = split / "run" / "checkpoints" / "step_00000006"
    from ladle.checkpoint.safe_dcp import read_metadata

    keys = read_metadata(ckpt).state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    assert "model.lm_head.weight" in model_keys
    assert all(".lora_" in k for k in model_keys if k != "model.lm_head.weight")
    # on disk: the weights + two AdamW moments of those tensors alone (4-byte floats), no base;
    # DCP frames each tensor it writes with a few KB of its own
    numel = sum(math.prod(keys[k].size) for k in model_keys)
    size = sum(p.stat().st_size for p in ckpt.rglob("*.distcp"))
    assert 3 * 4 * numel <= size < 3 * 4 * numel + 3 * len(model_keys) * 4096
    assert json.loads((ckpt / "trainer_state.json").read_text())["adapters_only"] is True
    # ... so it cannot go onto a base of another shape: refused, the shapes named
    import transformers as tf

    other = tmp_path / "other"
    config = tf.Qwen2Config(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=64, use_sliding_window=False)  # fmt: skip
    tf.Qwen2ForCausalLM(config).save_pretrained(other)
    capsys.readouterr()
    over = [f"model.init_from={other}", "train.max_steps=8", "train.resume=auto"]
    assert main(["run", "sft", "--config", str(f), *over]) == 2
    err = capsys.readouterr().err
    assert (
        "cannot resume from" in err
        and "step_00000006: its model differs in model.dim (32 there, 64 here)" in err
    )


# -- QLoRA ---------------------------------------------------------------------------------------
def test_nf4_round_trip_is_within_its_stated_error():
    from ladle.models.nf4 import LEVELS, NF4Weight

    torch.manual_seed(0)
    w = torch.randn(96, 160) * 0.02
    w[3, 7] = 0.5  # an outlier: its block's values are coarser, still within the bound
    q = NF4Weight(w)
    err = (q.dequantize() - w).abs()
    assert (err <= q.max_error() + 1e-7).all()
    assert err.mean() < 0.1 * w.abs().mean() * 2  # typical error, far below the bound
    assert 4.1 < 8 * q.nbytes() / w.numel() < 4.2  # 4-bit indices + double-quantized block maxima
    # values that are exactly levels of a block come back exactly
    exact = torch.tensor(LEVELS * 4)[None].repeat(2, 1) * 0.3
    torch.testing.assert_close(NF4Weight(exact).dequantize(), exact, atol=1e-6, rtol=0)


def test_nf4_is_as_accurate_as_torchaos_nf4_tensor():
    # torchao's NF4 (QLoRA's format: blocks of 64, double-quantized maxima in groups of 256) as the
    # reference: the same levels and the same error on the same weights. The values differ in
    # their last bits, because torchao takes one mean out of all the block maxima and ladle one
    # per group of 256, so values that lie near the midpoint of two levels may round apart.
    nf4_tensor = pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
    from ladle.models.nf4 import LEVELS, NF4Weight

    torch.manual_seed(0)
    for shape in [(256, 512), (704, 256)]:
        w = torch.randn(*shape) * 0.02
        theirs = nf4_tensor.to_nf4(w, 64, 256)
        # torchao writes the levels to 4 decimals, bitsandbytes (and ladle) in full
        torch.testing.assert_close(theirs.nf4.float(), torch.tensor(LEVELS), atol=5e-5, rtol=0)
        ref = theirs.get_original_weight()
        ours = NF4Weight(w).dequantize()
        e_ref, e_ours = (ref - w).abs(), (ours - w).abs()
        assert e_ours.mean() <= 1.01 * e_ref.mean() and e_ours.max() <= 1.05 * e_ref.max(), shape
        # the same level for all but the values close to the midpoint of two (0.3% here): others
        # differ by the block maximum's rounding only, far below a level gap
        assert ((ours - ref).abs() > 0.005 * w.abs().max()).float().mean() < 0.01, shape


def test_qlora_layers_stay_within_nf4s_error_of_the_base():
    # Each quantized layer's output differs from the full-precision one by at most |x| . bound,
    # the bound of every weight; the adapted model at init is the quantized base.
    from ladle.models.nf4 import NF4Linear, quantize_linears

    model = tiny_model()
    ref = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    nf4, full = quantize_linears(model)
    assert full / nf4 > 7  # fp32 -> 4.13 bits
    x = torch.randn(5, 32)
    for n, m in model.named_modules():
        if isinstance(m, NF4Linear) and m.in_features == 32:
            bound = x.abs() @ m.weight_nf4.max_error().T
            assert ((m(x) - x @ ref[n].T).abs() <= bound + 1e-6).all(), n
    assert not any(n.endswith("proj.weight") for n, _ in model.named_parameters())  # stored in NF4 instead
    with torch.no_grad():
        q_logits = model(TOKENS)
    apply_lora(model, LoRAConfig(targets=ALL, dora=True))
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), q_logits, atol=1e-5, rtol=1e-5)


def test_qlora_run_trains_reports_its_memory_and_exports(tokenizer_dir, sort_chats, base_hf, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    f = write_cfg(tmp_path, tokenizer_dir, sort_chats, base_hf, {"targets": ALL, "quantize_base": "nf4"})
    run = tmp_path / "run"
    assert main(["run", "sft", "--config", str(f)]) == 0
    rec = [r for r in read_metrics(run) if "loss" in r]
    assert rec[-1]["loss"] < rec[0]["loss"]
    assert "QLoRA: the frozen base's block linears take" in (run / "events.log").read_text()
    assert main(["export", "peft", str(run), str(tmp_path / "adapter")]) == 0
    base = AutoModelForCausalLM.from_pretrained(base_hf, dtype=torch.float32).eval()
    peft = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    assert torch.isfinite(hf_logits(peft)).all()  # on the full-precision base, as QLoRA adapters are used
    # sharding an NF4 base is refused before anything starts
    assert main(["run", "sft", "--config", str(f), "--nproc", "2", "parallel.dp_shard=2"]) == 2

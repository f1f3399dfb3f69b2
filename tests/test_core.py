"""The training core's shape: loss objects (sum, count, metrics), the trainable unit's
forward_backward, checkpoints of named parts, one builder call per model (trained or frozen),
recipe metrics reaching every record, and the import boundaries between the packages."""

import ast
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import make_tiny_config

from ladle import distributed as dist
from ladle.config.load import build_config
from ladle.parallel.mesh import Layout, Parallel
from ladle.recipes import pretrain
from ladle.train.loss import IGNORE_INDEX, CausalLMLoss, Loss, LossOut
from ladle.train.metrics import read_metrics
from ladle.train.unit import TrainUnit

CPU = torch.device("cpu")
PACKAGE = Path(__file__).resolve().parent.parent / "ladle"


def _cfg(tmp_path, *overrides):
    return build_config(make_tiny_config("tok", "data", tmp_path / "run"), list(overrides))


def _batch(rows: int, seq: int = 16, vocab: int = 512, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (rows, seq), generator=g)
    targets = torch.randint(0, vocab, (rows, seq), generator=g)
    targets[:, : seq // 4] = IGNORE_INDEX  # a prompt that is never trained on
    targets[0, -3:] = IGNORE_INDEX
    return {"tokens": tokens, "targets": targets}


class SequenceLoss(Loss):
    """Counted in sequences: each sequence's mean token loss, plus a metric, as a DPO loss would
    count pairs. Its metrics are sums over sequences."""

    console = ("seq_loss",)

    def count(self, batch):
        return batch["tokens"].shape[0]

    def from_output(self, logits, batch):
        t = batch["targets"]
        per_tok = F.cross_entropy(logits.float().flatten(0, 1), t.flatten(), reduction="none").view(t.shape)
        valid = (t != IGNORE_INDEX).float()
        per_seq = (per_tok * valid).sum(1) / valid.sum(1)
        return LossOut(per_seq.sum(), self.count(batch), {"seq_loss": per_seq.detach().sum()})


def test_causal_lm_loss_is_a_sum_over_the_target_tokens_and_their_count():
    from ladle.models.llama import build_model

    torch.manual_seed(0)
    cfg = build_config(make_tiny_config("tok", "data", "run"), []).model
    model = build_model(cfg, device=CPU, init=True)
    b = _batch(3)
    out = CausalLMLoss()(model, b)
    logits = model(b["tokens"])
    ref = F.cross_entropy(
        logits.flatten(0, 1), b["targets"].flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    assert int(out.count) == CausalLMLoss().count(b) == 3 * 12 - 3
    torch.testing.assert_close(out.sum, ref, rtol=1e-5, atol=1e-4)
    assert out.metrics == {} and out.extra is None


def _unit(tmp_path, seed=0):
    from ladle.models.llama import build_model

    cfg = _cfg(tmp_path, "train.grad_clip=0")
    torch.manual_seed(seed)
    model = build_model(cfg.model, device=CPU, init=True)
    return TrainUnit(cfg, model, CPU, Parallel(Layout(), CPU))


@pytest.mark.parametrize("loss", [CausalLMLoss(), SequenceLoss()], ids=["tokens", "sequences"])
def test_the_gradient_does_not_depend_on_the_split_into_microbatches(tmp_path, loss):
    dist.init(CPU)
    b = _batch(4)
    halves = [{k: v[i : i + 2] for k, v in b.items()} for i in (0, 2)]
    one, two = _unit(tmp_path), _unit(tmp_path)
    r1 = one.forward_backward([b], loss)
    r2 = two.forward_backward(halves, loss)
    for p1, p2 in zip(one.model.parameters(), two.model.parameters(), strict=True):
        torch.testing.assert_close(p1.grad, p2.grad, rtol=1e-5, atol=1e-6)
    # an independent reference: the mean over the units of the whole batch
    with torch.no_grad():
        logits = one.model(b["tokens"]).float()
    t = b["targets"]
    per_tok = F.cross_entropy(logits.flatten(0, 1), t.flatten(), reduction="none", ignore_index=IGNORE_INDEX)
    per_tok = per_tok.view(t.shape)
    valid = (t != IGNORE_INDEX).float()
    if isinstance(loss, SequenceLoss):
        want, count = float(((per_tok * valid).sum(1) / valid.sum(1)).mean()), 4
        assert r1.metrics["seq_loss"] == pytest.approx(want, rel=1e-5)
        assert r2.metrics["seq_loss"] == pytest.approx(want, rel=1e-5)
    else:
        want, count = float((per_tok * valid).sum() / valid.sum()), int(valid.sum())
    assert r1.count == r2.count == count
    assert r1.loss == pytest.approx(want, rel=1e-5) and r2.loss == pytest.approx(want, rel=1e-5)
    assert r1.tokens == r2.tokens == 4 * 16


def test_moe_expert_load_summary_of_the_summed_router_statistics():
    counts = torch.tensor([[6.0, 2.0, 4.0, 4.0], [4.0, 4.0, 4.0, 4.0]])  # (layers, experts)
    got = CausalLMLoss(moe=object()).summarize(
        {"moe_aux_loss": torch.tensor(3.0), "moe_z_loss": torch.tensor(0.6), "moe_tokens": counts}, 10, 4
    )
    assert got == {
        "moe_aux_loss": pytest.approx(0.75),
        "moe_z_loss": pytest.approx(0.15),
        "moe_tokens_min": 2,
        "moe_tokens_max": 6,
        "moe_imbalance": pytest.approx(1.5),  # 6 / mean 4 in layer 0
    }
    assert CausalLMLoss().summarize({}, 10, 4) == {}


def test_checkpoint_of_named_parts_round_trips_with_the_policy_at_the_top(tmp_path):
    from ladle.checkpoint import safe_dcp
    from ladle.checkpoint.dcp import Checkpointer

    dist.init(CPU)
    cfg = _cfg(tmp_path)
    policy, value = _unit(tmp_path, seed=1), _unit(tmp_path, seed=2)
    for u in (policy, value):  # an optimizer step, so there is optimizer state to save
        u.step(u.forward_backward([_batch(2)], CausalLMLoss()).loss)
    ck = Checkpointer(tmp_path / "run", cfg.checkpoint, CPU, log=lambda *a, **k: None)
    ck.save(3, {"policy": policy, "value_model": value}, {"step": 3}, "model: {}\n", blocking=True)
    path = tmp_path / "run" / "checkpoints" / "step_00000003"
    keys = set(safe_dcp.read_metadata(path).state_dict_metadata)
    assert "model.embed_tokens.weight" in keys and "value_model.model.embed_tokens.weight" in keys
    assert any(k.startswith("optim.state.") for k in keys)
    assert any(k.startswith("value_model.optim.state.") for k in keys)

    fresh_p, fresh_v = _unit(tmp_path, seed=3), _unit(tmp_path, seed=4)
    for u in (fresh_p, fresh_v):
        u.step(u.forward_backward([_batch(2, seed=9)], CausalLMLoss()).loss)
    assert ck.load(path, {"policy": fresh_p, "value_model": fresh_v})["step"] == 3
    for saved, loaded in ((policy, fresh_p), (value, fresh_v)):
        for (n, a), b in zip(saved.model.named_parameters(), loaded.model.parameters(), strict=True):
            assert torch.equal(a, b), n
            sa, sb = saved.optimizer.state[a], loaded.optimizer.state[b]
            assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(
                sa["exp_avg_sq"], sb["exp_avg_sq"]
            )
    assert not torch.equal(policy.model.embed_tokens.weight, value.model.embed_tokens.weight)


def test_a_frozen_copy_is_built_like_the_policy_without_adapters(tmp_path):
    from ladle.train.builder import build_laid_out

    cfg = _cfg(tmp_path, "lora.rank=4", "activation_checkpoint.mode=full")
    par = Parallel(Layout(), CPU)
    policy = build_laid_out(cfg, par, CPU).model
    ref = build_laid_out(cfg, par, CPU, trainable=False).model
    trained = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trained and all(".lora_" in n for n in trained)
    assert not any(".lora_" in n for n, _ in ref.named_parameters())
    assert not any(p.requires_grad for p in ref.parameters()) and not ref.training
    base = {n.replace(".base_layer", ""): p for n, p in policy.named_parameters() if ".lora_" not in n}
    for n, p in ref.named_parameters():  # the same seeded initial weights
        assert torch.equal(p, base[n]), n
    ids = torch.randint(0, 512, (2, 16))
    with torch.no_grad():  # adapters start at zero: the policy computes what the reference does
        torch.testing.assert_close(policy(ids), ref(ids))


class MarkedLoss(CausalLMLoss):
    """The causal-LM loss with a recipe metric of its own: the share of target tokens."""

    console = ("target_share",)

    def from_output(self, logits, batch):
        out = super().from_output(logits, batch)
        out.metrics = {"target_share": torch.tensor(float(out.count))}
        return out

    def summarize(self, totals, count, parts):
        return {"target_share": float(totals["target_share"]) / count}  # 1.0: every counted token


def test_a_recipe_metric_reaches_metrics_console_and_run_card(tiny_config, capsys):
    cfg = build_config(tiny_config, ["train.max_steps=4", "train.log_every=2", "train.eval_every=2"])
    assert pretrain.run(cfg, loss=MarkedLoss()) == "completed"
    out = Path(cfg.output_dir)
    records = read_metrics(out)
    train = [r for r in records if "loss" in r]
    val = [r for r in records if "val_loss" in r]
    assert [r["target_share"] for r in train] == [1.0, 1.0]
    assert val and all(r["val_target_share"] == 1.0 for r in val)
    console = capsys.readouterr().out
    assert "| target share 1\n" in console and "| val_target_share 1\n" in console
    final = json.loads((out / "run_card.json").read_text())["final"]
    assert final["target_share"] == 1.0 and final["val_target_share"] == 1.0


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_model_code_runs_no_collectives():
    for f in (PACKAGE / "models").glob("*.py"):
        text = f.read_text()
        assert "ladle.distributed" not in _imports(f) and "from ladle import distributed" not in text, f
        assert not any(c in text for c in ("all_reduce(", "all_gather(", "all_to_all", "reduce_scatter")), f

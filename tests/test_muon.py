"""Muon (ladle/train/muon.py) against a plain reference written here from the formulas (Keller
Jordan's Newton-Schulz, Moonlight's lr matching, AdamW for the rest); which parameter goes where;
resume; FSDP, TP and both against one process; a parameter it cannot orthogonalise, by name."""

import json
import math

import pytest
import torch
import torch.distributed as dist
from conftest import make_tiny_config
from test_parallel import QWEN3, QWEN3_MOE, STEPS, assert_same_run, launch, write_config

from ladle.checkpoint.dcp import load_model_weights
from ladle.cli import main
from ladle.config import ModelConfig, OptimConfig
from ladle.config.load import build_config
from ladle.errors import CheckpointError, ConfigError
from ladle.models.llama import build_model
from ladle.recipes import pretrain
from ladle.train.metrics import read_metrics
from ladle.train.muon import newton_schulz
from ladle.train.optim import build_optimizer

MOE = {"n_experts": 4, "top_k": 2, "ffn_dim": 24}


# -- the reference: one matrix at a time, fp32, straight from the papers --------------------------
def ref_ns(g, steps=5):
    x = g.double()
    if x.shape[0] > x.shape[1]:
        return ref_ns(g.T, steps).T
    x = x / (torch.linalg.matrix_norm(x) + 1e-7)
    for _ in range(steps):
        a = x @ x.T
        x = 3.4445 * x - 4.7750 * a @ x + 2.0315 * a @ a @ x
    return x.float()


def ref_muon(p, g, m, lr, wd, mu=0.95):
    """Moonlight's step: Nesterov momentum, orthogonalised (each expert's matrix apart), scaled by
    0.2 sqrt(max(A, B)), decoupled weight decay."""
    m.mul_(mu).add_(g)
    u = g + mu * m
    o = torch.stack([ref_ns(x) for x in u]) if u.ndim == 3 else ref_ns(u)
    scale = 0.2 * math.sqrt(max(p.shape[-2:]))
    p.mul_(1 - lr * wd).sub_(lr * scale * o)


def ref_adamw(p, g, s, lr, wd, t, b1=0.9, b2=0.95, eps=1e-8):
    s["m"] = b1 * s.get("m", torch.zeros_like(p)) + (1 - b1) * g
    s["v"] = b2 * s.get("v", torch.zeros_like(p)) + (1 - b2) * g * g
    m_hat, v_hat = s["m"] / (1 - b1**t), s["v"] / (1 - b2**t)
    p.mul_(1 - lr * wd).sub_(lr * m_hat / (v_hat.sqrt() + eps))


MUON = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "experts.gate_proj")
MUON += ("experts.up_proj", "experts.down_proj", "mlp.gate_proj.weight", "mlp.up_proj.weight")
MUON += ("mlp.down_proj.weight",)


def tiny(**kw):
    return ModelConfig(vocab_size=64, dim=16, n_layers=2, n_heads=2, ffn_dim=32, max_seq_len=16, **kw)


def test_newton_schulz_is_the_quintic_iteration_and_nearly_orthogonal():
    g = torch.Generator().manual_seed(0)
    for shape in [(24, 16), (16, 40), (3, 20, 12)]:
        x = torch.randn(shape, generator=g)
        mine = newton_schulz(x, 5, torch.float32)
        ref = torch.stack([ref_ns(m) for m in x]) if x.ndim == 3 else ref_ns(x)
        torch.testing.assert_close(mine, ref, atol=2e-5, rtol=1e-4)
        s = torch.linalg.svdvals(mine)
        assert s.min() > 0.5 and s.max() < 1.25, shape  # every singular value pushed towards 1


def test_which_parameters_muon_takes():
    cfg = tiny(family="mixtral", qkv_bias=True, tie_embeddings=True, moe=MOE)
    model = build_model(cfg)
    opt = build_optimizer(model, OptimConfig(name="muon"), torch.device("cpu"))
    names = {id(p): n for n, p in model.named_parameters()}
    groups = {
        (g["use_muon"], g["weight_decay"]): {names[id(p)] for p in g["params"]} for g in opt.param_groups
    }
    muon = groups[(True, 0.1)]
    assert muon == {n for n in names.values() if n.endswith(MUON)}
    assert "layers.0.mlp.experts.gate_proj" in muon and "layers.0.self_attn.q_proj.weight" in muon
    adamw = groups[(False, 0.0)]  # tied embedding, norms, biases: not decayed; the router: AdamW's
    assert {"embed_tokens.weight", "norm.weight", "layers.0.self_attn.q_proj.bias"} <= adamw
    assert groups[(False, 0.1)] == {"layers.0.mlp.gate.weight", "layers.1.mlp.gate.weight"}
    assert sum(map(len, groups.values())) == len(names)


def test_two_steps_equal_the_reference():
    """Two steps (the second with momentum), an untied head and MoE experts, fp32 Newton-Schulz."""
    torch.manual_seed(0)
    model = build_model(tiny(family="mixtral", qkv_bias=True, moe=MOE))
    ref = {n: p.detach().clone() for n, p in model.named_parameters()}
    lr, wd = 0.02, 0.1
    opt = build_optimizer(model, OptimConfig(name="muon", lr=lr, weight_decay=wd), torch.device("cpu"))
    state = {n: {} for n in ref}
    for t in (1, 2):
        model.zero_grad()
        model(torch.randint(0, 64, (2, 12))).float().pow(2).mean().backward()
        for n, p in model.named_parameters():
            g = p.grad.clone()
            if n.endswith(MUON):
                ref_muon(ref[n], g, state[n].setdefault("m", torch.zeros_like(g)), lr, wd)
            else:
                decay = (
                    wd
                    if n in ("lm_head.weight", "layers.0.mlp.gate.weight", "layers.1.mlp.gate.weight")
                    else 0
                )
                ref_adamw(ref[n], g, state[n], lr, decay, t)
        opt.step()
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.detach(), ref[n], atol=1e-6, rtol=1e-5, msg=f"step {t}: {n}")


def test_a_parameter_muon_cannot_orthogonalise_is_named():
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.layers[0].conv = torch.nn.Parameter(torch.zeros(4, 3, 3))
    with pytest.raises(
        ConfigError, match=r"optim.name=muon cannot orthogonalise layers\.0\.conv of shape \(4, 3, 3\)"
    ):
        build_optimizer(model, OptimConfig(name="muon"), torch.device("cpu"))


def test_a_run_with_such_a_parameter_exits_2_naming_it(tiny_config, tmp_path, monkeypatch, capsys):
    from ladle.models import llama

    init = llama.Attention.__init__

    def with_a_3d_weight(self, *a, **kw):  # a layout Muon has no rule for
        init(self, *a, **kw)
        self.mix = torch.nn.Parameter(torch.zeros(2, 4, 4))

    monkeypatch.setattr(llama.Attention, "__init__", with_a_3d_weight)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps(tiny_config))
    assert main(["run", "pretrain", "--config", str(cfg), "optim.name=muon"]) == 2
    assert (
        "optim.name=muon cannot orthogonalise layers.0.self_attn.mix of shape (2, 4, 4)"
        in capsys.readouterr().err
    )


def test_placements_it_cannot_gather_are_named():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    from ladle.train.muon import check_orthogonalisable

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    p = DTensor.from_local(torch.zeros(4, 4), mesh, [Partial()])
    with pytest.raises(
        ConfigError, match=r"cannot orthogonalise layers\.0\.w: its placement P.* on the mesh \('tp',\)"
    ):
        check_orthogonalisable("layers.0.w", p)


# -- resume and layouts --------------------------------------------------------------------------
def test_resume_gives_identical_losses_and_weights(tiny_config, tmp_path):
    over = ["optim.name=muon", "optim.lr=0.02", "train.max_steps=8", "checkpoint.every=4"]
    full, split = tmp_path / "full", tmp_path / "split"
    assert pretrain.run(build_config(tiny_config, [*over, f"output_dir={full}"])) == "completed"
    assert (
        pretrain.run(build_config(tiny_config, [*over, f"output_dir={split}", "train.exit_at_step=4"]))
        == "exit"
    )
    done = pretrain.run(build_config(tiny_config, [*over, f"output_dir={split}", "train.resume=auto"]))
    assert done == "completed"
    a, b = (
        [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(d) if "loss" in r]
        for d in (full, split)
    )
    assert len(a) == 8 and a == b  # bit-identical: the momentum buffers came back
    assert a[-1][1] < a[0][1]
    wa, wb = (weights(d / "checkpoints" / "step_00000008", tiny_config) for d in (full, split))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # another optimizer cannot take this state: refused by name, before anything is loaded
    again = [*over[1:], f"output_dir={split}", "train.resume=auto", "train.max_steps=10"]
    with pytest.raises(CheckpointError, match="trained with optim.name=muon, not adamw; resume with"):
        pretrain.run(build_config(tiny_config, again))


def weights(checkpoint, cfg):
    model = build_model(build_config(cfg).model)
    load_model_weights(checkpoint, model)
    return model.state_dict()


def reference_run(tokenizer_dir, data_dir, tmp, model):
    d = make_tiny_config(tokenizer_dir, data_dir, tmp / "one")
    # AdamW's lr (3e-3): at a higher one, AdamW's half amplifies the fp32 rounding of the
    # embedding's rarely seen rows past the weights' tolerance (Muon's matrices stay within it)
    d["optim"] = {**d["optim"], "name": "muon"}
    cfg = write_config(d, tmp / "c.yaml", model)
    assert main(["run", "pretrain", "--config", str(cfg), f"output_dir={tmp / 'one'}"]) == 0
    return cfg, tmp / "one"


@pytest.fixture(scope="module")
def muon_reference(tokenizer_dir, data_dir, tmp_path_factory):
    return reference_run(tokenizer_dir, data_dir, tmp_path_factory.mktemp("muon"), QWEN3)


LAYOUTS = {
    "fsdp dp_shard=2": (2, ["parallel.dp_shard=2", "train.micro_batch_size=1"]),
    "tp=2": (2, ["parallel.tp=2", "parallel.dp_shard=1"]),
    "dp_shard=2 x tp=2": (4, ["parallel.dp_shard=2", "parallel.tp=2", "train.micro_batch_size=1"]),
    "pp=2": (2, ["parallel.pp=2", "parallel.dp_shard=1"]),
    "ddp dp_replicate=2": (2, ["parallel.dp_replicate=2", "parallel.dp_shard=1", "train.micro_batch_size=1"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_trains_like_one_process(muon_reference, tmp_path, name):
    cfg_file, one = muon_reference
    nproc, overrides = LAYOUTS[name]
    launch(cfg_file, tmp_path / "par", nproc, *overrides)
    assert_same_run(one, tmp_path / "par", cfg_file)
    assert len([r for r in read_metrics(one) if "loss" in r]) == STEPS


@pytest.mark.slow
def test_resume_in_another_layout_continues_exactly(muon_reference, tmp_path):
    """FSDP to step 5, then TP from its checkpoint: the momentum buffers resharded by DCP."""
    cfg_file, one = muon_reference
    out = tmp_path / "switch"
    launch(cfg_file, out, 2, "parallel.dp_shard=2", "train.micro_batch_size=1", "train.exit_at_step=5")
    launch(cfg_file, out, 2, "parallel.tp=2", "parallel.dp_shard=1", "train.resume=auto")
    assert_same_run(one, out, cfg_file)
    assert "parallel.tp: 1 -> 2" in (out / "events.log").read_text()


@pytest.mark.slow
def test_experts_sharded_over_ep_ranks_train_like_one_process(tokenizer_dir, data_dir, tmp_path):
    """Stacked experts, each expert's matrix orthogonalised apart, gathered from their EP shards."""
    cfg_file, one = reference_run(tokenizer_dir, data_dir, tmp_path, QWEN3_MOE)
    launch(cfg_file, tmp_path / "ep", 2, "parallel.dp_shard=2", "parallel.ep=2", "train.micro_batch_size=1")
    assert_same_run(one, tmp_path / "ep", cfg_file)


def test_muon_refuses_host_offloaded_weights(tiny_config):
    from ladle.parallel.mesh import check_layout

    cfg = build_config(tiny_config, ["optim.name=muon", "parallel.dp_shard=2", "parallel.cpu_offload=true"])
    with pytest.raises(ConfigError, match="optim.name=muon cannot take parallel.cpu_offload"):
        check_layout(cfg, 2)

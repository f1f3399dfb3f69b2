"""The vLLM rollout engine (ladle/rl/vllm.py) on vLLM's CPU build, fp32: its tokens and log-probs
against ladle's own generator and the trainer's forward, and weights that follow the policy. One
engine start serves the engine tests (seconds); the recipe tests start their own. Skipped where
vLLM is not installed, except in CI, which installs it (`make setup-vllm`)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
pytestmark = pytest.mark.skipif(
    not HAVE_VLLM and not os.environ.get("LADLE_CI"), reason="vLLM is not installed (make setup-vllm)"
)

END = 1  # the tiny vocabulary's end token


@pytest.fixture(scope="module")
def policy():
    """A tiny Llama (head_dim 64: vLLM's CPU attention takes no smaller), its optimizer, and one
    vLLM engine fed its weights, in a one-process group as a ladle run has."""
    from ladle import distributed as dist
    from ladle.config.schema import ModelConfig
    from ladle.models.llama import build_model
    from ladle.rl.vllm import VLLMEngine

    assert HAVE_VLLM, "CI installs vLLM's CPU build (make setup-vllm); it is missing"
    dist.init(torch.device("cpu"))
    torch.manual_seed(0)
    # tied, as the demos' models are (the engine keeps its head apart); the recipe tests' are untied
    cfg = ModelConfig(
        vocab_size=96,
        dim=128,
        n_layers=2,
        n_heads=2,
        n_kv_heads=1,
        ffn_dim=256,
        max_seq_len=128,
        tie_embeddings=True,
    )
    model = build_model(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    engine = VLLMEngine(
        model,
        cfg,
        optimizer=opt,
        seed=3,
        end_ids={END},
        decode=lambda ids: "".join(chr(97 + i % 26) for i in ids),
        dtype=torch.float32,
        max_len=128,
        engine_args={"block_size": 32},  # the CPU build's smallest: prompts past it share cached blocks
        device=torch.device("cpu"),
    )
    yield model, opt, engine
    engine.close()
    dist.shutdown()  # the engine first, while the group lives (it tears the group down itself)


PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16]]


def local(model, sampling, step=0, end_ids=frozenset({END})):
    from ladle.rl.engine import LocalEngine

    return LocalEngine(model, seed=3, end_ids=set(end_ids), decode=None, pad_id=0, batch_size=16).generate(
        PROMPTS, [0, 1, 2], sampling, step=step
    )


def test_greedy_tokens_equal_ladles_own_generator(policy):
    from ladle.rl.rollout import Sampling

    model, _, engine = policy
    greedy = Sampling(n=2, temperature=0.0, max_new_tokens=12)
    assert engine.sync_weights() > 0  # the first sync: the engine started from dummy weights
    got = engine.generate(PROMPTS, [0, 1, 2], greedy, step=0)
    want = local(model, greedy)
    assert got.response_ids == want.response_ids and got.prompt_index == want.prompt_index
    assert got.finished == want.finished and got.sample_index == [0, 1] * 3
    # an end token the greedy answers reach: kept in the response, as ladle keeps it, and finished
    end = {want.response_ids[0][4]}
    engine.end_ids, kept = end, engine.end_ids
    got = engine.generate(PROMPTS, [0, 1, 2], greedy, step=0)
    engine.end_ids = kept
    want = local(model, greedy, end_ids=end)
    assert got.response_ids == want.response_ids and got.finished == want.finished
    assert got.finished[0] and len(got.response_ids[0]) <= 5 and got.response_ids[0][-1] in end
    assert [len(x) for x in got.sample_logps] == [len(x) for x in got.response_ids]


def test_sampled_logprobs_are_the_trainers_and_the_stream_is_keyed(policy):
    from ladle.rl.rollout import Sampling, response_logps, sequences

    model, _, engine = policy
    engine.sync_weights()
    sampling = Sampling(n=3, temperature=0.7, max_new_tokens=10)
    r = engine.generate(PROMPTS, [0, 1, 2], sampling, step=5)
    # log-probs of softmax(logits / T): the trainer's forward at the same temperature
    batch = sequences(r)
    with torch.no_grad():
        lp = response_logps(model, batch, temperature=0.7)
    mask = batch["targets"] != -100
    assert torch.allclose(batch["sample_logps"][mask], lp[mask], atol=2e-4)
    # a response is a function of its key (seed, step, prompt, sample), not of its batch
    again = engine.generate(PROMPTS[1:], [1, 2], sampling, step=5)
    assert again.response_ids == r.response_ids[3:]
    other = engine.generate(PROMPTS, [0, 1, 2], sampling, step=6)
    assert other.response_ids != r.response_ids


def test_weights_follow_the_policy_and_a_skipped_sync_shows(policy):
    from ladle.rl.rollout import Sampling, response_logps, sequences

    model, opt, engine = policy
    sampling = Sampling(n=2, temperature=1.0, max_new_tokens=8)
    for _ in range(3):  # large steps: the weights move far
        opt.zero_grad()
        batch = sequences(local(model, sampling))
        (-response_logps(model, batch).sum()).backward()
        opt.step()
    assert engine.stale  # the optimizer's steps marked the engine's copy stale

    # a prompt past one cache block: its first block's keys and values are cached by the first
    # generation, with the weights the engine has then
    prompts = [*PROMPTS, [5 + j % 80 for j in range(40)]]

    def gap() -> float:
        r = engine.generate(prompts, [0, 1, 2, 3], sampling, step=9)
        batch = sequences(r)
        with torch.no_grad():
            lp = response_logps(model, batch)
        mask = batch["targets"] != -100
        return float((batch["sample_logps"][mask] - lp[mask]).abs().max())

    engine.stale = False  # a sync skipped: the engine samples from the old weights
    assert gap() > 1e-2
    engine.mark_stale()
    assert engine.sync_weights() > 0
    assert gap() < 2e-4  # the new weights throughout: the sync emptied the prefix cache


def test_more_prompt_tokens_than_one_engine_step_takes(policy):
    """48 rows of 100-token prompts (4800 prompt tokens, past one scheduler step's budget): the
    CPU build rewinds a seeded row's generator after a partial prefill and fails, so the engine
    prefills whole prompts there; the rows still share their prompt's cache."""
    from ladle.rl.rollout import Sampling

    model, _, engine = policy
    engine.sync_weights()
    prompts = [[5 + (k + j) % 90 for j in range(100)] for k in range(3)]
    r = engine.generate(prompts, [0, 1, 2], Sampling(n=16, temperature=1.0, max_new_tokens=4), step=1)
    assert len(r) == 48 and all(len(x) == 4 or x[-1] == END for x in r.response_ids)


def test_both_engines_give_the_same_episodes_greedy_in_fp32(policy, tmp_path):
    """Multi-turn episodes (ladle/rl/env.py) on vLLM and on ladle's engine: the same transcripts,
    masks and turns, with greedy decoding in fp32, an episode budget that cuts some short."""
    from types import SimpleNamespace

    from ladle.data.chat import ChatTemplate
    from ladle.rl.engine import LocalEngine
    from ladle.rl.env import Episodes
    from ladle.rl.rollout import Sampling

    model, _, engine = policy
    engine.sync_weights()
    (tmp_path / "env.py").write_text(
        "class Echo:\n"
        "    def reset(self, record):\n"
        "        return [{'role': 'user', 'content': record['prompt']}]\n"
        "    def step(self, reply):\n"
        "        return {'messages': [{'role': 'user', 'content': 'more ' + reply[:3]}], 'reward': 1.0, 'done': False}\n"
    )
    chars = SimpleNamespace(  # a tokenizer of the tiny vocabulary: a character a token
        eos_id=END,
        encode=lambda text: [2 + ord(c) % 90 for c in text],
        decode=lambda ids, skip_special_tokens=True: "".join(chr(97 + i % 26) for i in ids),
    )
    cfg = SimpleNamespace(
        file=str(tmp_path / "env.py"), name="Echo", kwargs={}, tools=[], tool_format="auto", tool_timeout_s=5.0,
        max_turns=3, max_total_tokens=0,
    )  # fmt: skip
    # a template of few characters (a character a token here): three turns fit the engine's 128
    SHORT = (
        "{% for m in messages %}{{ m['role'][0] + ':' + m['content'] + '|' }}{% endfor %}"
        "{% if add_generation_prompt %}a:{% endif %}"
    )
    records = {0: {"prompt": "ab"}, 1: {"prompt": "a longer question"}, 2: {"prompt": "x" * 100}}
    greedy = Sampling(n=2, temperature=0.0, max_new_tokens=8)

    def episodes(ends):
        return Episodes(
            cfg, "grpo.env", tok=chars, template=ChatTemplate(SHORT), source="short", end_ids=ends,
            max_len=128,
        )  # fmt: skip

    # an end token the greedy replies reach (the tiny policy's tokens, not END), so turns end
    def mine(ends):
        return LocalEngine(model, seed=3, end_ids=ends, decode=None, pad_id=0, batch_size=16)

    first, _ = episodes({END}).run(mine({END}), records, [0], greedy, step=0)
    ends = {first.response_ids[0][2]}
    engine.end_ids, kept = ends, engine.end_ids
    try:
        a, ea = episodes(ends).run(engine, records, [0, 1, 2], greedy, step=0)
    finally:
        engine.end_ids = kept
    b, eb = episodes(ends).run(mine(ends), records, [0, 1, 2], greedy, step=0)
    assert a.prompt_ids == b.prompt_ids and a.response_ids == b.response_ids and a.mask == b.mask
    assert [e.turns for e in ea] == [e.turns for e in eb] and max(e.turns for e in ea) == 3
    assert [e.finished for e in ea] == [e.finished for e in eb] and not all(e.finished for e in ea)
    assert all(len(p) + len(r) <= 128 for p, r in zip(a.prompt_ids, a.response_ids, strict=True))
    for x, y in zip(a.sample_logps, b.sample_logps, strict=True):
        assert torch.allclose(torch.tensor(x), torch.tensor(y), atol=2e-4)


# -- an MoE policy's routing, recorded by vLLM's worker (ladle/rl/vllm_worker.py RoutingRecorder)
@pytest.fixture
def moe_policy(policy):
    """A tiny Qwen3-MoE policy and an engine of its own that records its routing. vLLM holds one
    engine's parallel state a process: the dense engine (whose tests come first) is shut down."""
    from ladle import distributed as dist
    from ladle.config.schema import ModelConfig, MoEConfig
    from ladle.models.llama import build_model
    from ladle.rl.vllm import VLLMEngine

    torch.manual_seed(1)
    cfg = ModelConfig(
        vocab_size=96, dim=128, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=256, max_seq_len=128,
        family="qwen3_moe", qk_norm=True, moe=MoEConfig(n_experts=6, top_k=2, ffn_dim=64),
    )  # fmt: skip
    model = build_model(cfg).eval()
    dist.shutdown()  # the dense engine, then the group
    dist.init(torch.device("cpu"))
    engine = VLLMEngine(
        model, cfg, optimizer=None, seed=3, end_ids={END}, decode=None, dtype=torch.float32, max_len=128,
        engine_args={"block_size": 32}, device=torch.device("cpu"), routing=True,
    )  # fmt: skip
    yield model, engine
    engine.close()
    dist.shutdown()


def routed(model, tokens: list[int]) -> torch.Tensor:
    """(T, MoE layers, k): the experts the trainer's plain forward sends each token to."""
    from ladle.models.moe import choices

    with torch.no_grad():
        model(torch.tensor([tokens]))
    return choices(model).view(len(tokens), -1, 2)


def test_vllm_records_the_routing_the_trainer_routes_by(moe_policy, monkeypatch):
    """Every token a row read (its prompt, its response but the last token) has the experts the
    trainer's router chooses for it, also the positions vLLM's prefix cache served (filled from
    the row that computed their block) and after new weights (the blocks' routing forgotten).
    The engine's log-probs are the trainer's (vLLM's CPU experts are packed again on reload)."""
    import numpy as np
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from ladle.models.moe import MoE
    from ladle.rl.rollout import Sampling, response_logps, sequences

    model, engine = moe_policy
    engine.sync_weights()
    served = []  # rows whose first computed position is past the first cache block
    routes = engine.routes

    def spy(read, rec):
        # through msgpack, as a separated engine's process hands it over (tensors would not survive)
        rec = MsgpackDecoder().decode(MsgpackEncoder().encode(rec))
        rows, pos = (np.frombuffer(rec[key], dtype=np.int64) for key in ("rows", "positions"))
        served.extend(int(k) for k in np.unique(rows) if pos[rows == k].min() >= 32)
        return routes(read, rec)

    monkeypatch.setattr(engine, "routes", spy)
    long = [5 + j % 80 for j in range(40)]  # past one cache block of 32 tokens
    sampling = Sampling(n=2, temperature=1.0, max_new_tokens=8)

    def check(prompts, step) -> None:
        r = engine.generate(prompts, list(range(len(prompts))), sampling, step=step)
        # the engine computes the trainer's model: its experts packed again after each reload
        batch = sequences(r)
        with torch.no_grad():
            lp = response_logps(model, batch)
        mask = batch["targets"] != -100
        assert torch.allclose(batch["sample_logps"][mask], lp[mask], atol=2e-4)
        for p, ids, rt in zip(r.prompt_ids, r.response_ids, r.routing, strict=True):
            want = routed(model, p + ids[:-1])
            assert rt.shape == want.shape and rt.dtype == torch.int16 and (rt >= 0).all()
            assert (rt.long().sort(-1).values == want.sort(-1).values).all()

    check([long, [9, 10]], step=0)  # the long prompt's second sample: its first block served
    assert served == [1]
    served.clear()
    check([long, long[:36] + [7, 8, 9]], step=1)  # both prompts start with that block
    assert sorted(served) == [0, 1, 2, 3]
    with torch.no_grad():  # new weights: the routers choose otherwise
        for m in model.modules():
            if isinstance(m, MoE):
                m.gate.weight.add_(torch.randn_like(m.gate.weight))
    engine.mark_stale()
    engine.sync_weights()
    served.clear()
    check([long], step=2)  # computed again, with the new weights
    served.clear()
    check([long], step=3)  # and served, the block's routing the new weights' (the old forgotten)
    assert sorted(served) == [0, 1]


def test_replay_with_a_vllm_that_cannot_record_routing_is_refused(monkeypatch):
    """The worker records from vLLM's V1 model runner: a run that forces the V2 runner and asks
    for routing replay is refused by name before vLLM starts."""
    from ladle.config.schema import ModelConfig, MoEConfig
    from ladle.errors import ConfigError
    from ladle.rl.vllm import VLLMEngine

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    cfg = ModelConfig(
        vocab_size=96, dim=128, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=256, max_seq_len=64,
        family="qwen3_moe", qk_norm=True, moe=MoEConfig(n_experts=4, top_k=2, ffn_dim=64),
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"grpo.routing_replay: this vLLM's routing cannot be recorded "):
        VLLMEngine(
            None, cfg, optimizer=None, seed=0, end_ids={END}, decode=None, dtype=torch.float32, max_len=64,
            engine_args={}, device=torch.device("cpu"), where="grpo.engine_args", routing=True, replay=True,
        )  # fmt: skip


# -- the recipes with engine: vllm (after the tests above: a run's end shuts the module's engine
# down with the process group) --------------------------------------------------------------------
def vllm_grpo(chat_tokenizer, prompt_data, out, **grpo) -> dict:
    from test_grpo import grpo_config

    cfg = grpo_config(chat_tokenizer, prompt_data, out, engine="vllm", **grpo)
    cfg["model"].update(dim=128, n_heads=2, n_kv_heads=1, ffn_dim=128)  # head_dim 64 (vLLM's CPU attention)
    cfg["train"]["max_steps"] = 3
    return cfg


def test_grpo_on_the_vllm_engine_trains_with_the_engines_figures(chat_tokenizer, prompt_data, tmp_path):
    from ladle.config.load import build_config
    from ladle.recipes import load
    from ladle.train.metrics import read_metrics

    cfg = vllm_grpo(chat_tokenizer, prompt_data, tmp_path / "run", num_iterations=1, rollout_correction="tis")
    assert load("grpo").run(build_config(cfg)) == "completed"
    recs = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert len(recs) == 3
    for r in recs:
        assert r["weight_sync_s"] > 0  # a sync before each batch: the weights changed at every step
        assert r["rollout_logprob_diff"] < 1e-3 and r["rollout_kl"] < 1e-6  # fp32: the engine is the trainer
        assert (
            r["rollout_is_weight_mean"] == pytest.approx(1.0, abs=1e-3) and r["rollout_is_clipped_frac"] == 0
        )
    assert recs[0]["grad_norm"] > 0 and 1 <= recs[0]["response_len_mean"] <= 8


def test_engine_arguments_vllm_does_not_know_are_refused_by_name(
    chat_tokenizer, prompt_data, tmp_path, capsys
):
    import yaml

    from ladle.cli import main

    path = tmp_path / "c.yaml"
    for args, message in (
        (
            {"gpu_memory_utilisation": 0.5},
            "grpo.engine_args.gpu_memory_utilisation: vLLM has no engine argument",
        ),
        ({"seed": 4}, "grpo.engine_args.seed: ladle sets seed itself"),
        (
            {"tensor_parallel_size": 2},
            "grpo.engine_args.tensor_parallel_size=2: the vLLM engine runs one copy",
        ),
    ):
        cfg = vllm_grpo(chat_tokenizer, prompt_data, tmp_path / "r", engine_args=args)
        path.write_text(yaml.safe_dump(cfg))
        assert main(["run", "grpo", "--config", str(path)]) == 2
        assert message in capsys.readouterr().err
    # a family this vLLM cannot load: named, with the ones it can
    import vllm

    supported = vllm.ModelRegistry.get_supported_archs()
    monkey = pytest.MonkeyPatch()
    monkey.setattr(
        vllm.ModelRegistry, "get_supported_archs", lambda: [a for a in supported if a != "LlamaForCausalLM"]
    )
    try:
        path.write_text(yaml.safe_dump(vllm_grpo(chat_tokenizer, prompt_data, tmp_path / "r")))
        assert main(["run", "grpo", "--config", str(path)]) == 2
        err = capsys.readouterr().err
        assert "model.family=llama: this vLLM cannot load LlamaForCausalLM" in err and "qwen3" in err
    finally:
        monkey.undo()
    assert not (tmp_path / "r").exists()  # refused before anything ran
    # a value vLLM's own config refuses: found as the engine starts, named by the key
    path.write_text(
        yaml.safe_dump(
            vllm_grpo(chat_tokenizer, prompt_data, tmp_path / "v", engine_args={"max_num_seqs": "many"})
        )
    )
    assert main(["run", "grpo", "--config", str(path)]) == 2
    assert "grpo.engine_args: vLLM cannot start with {'max_num_seqs': 'many'}" in capsys.readouterr().err


def test_lora_and_ppo_on_the_vllm_engine(chat_tokenizer, prompt_data, tmp_path):
    """The engine samples from the merged adapters (GRPO with LoRA), and PPO's rollouts come from
    it too: the trainer's log-probs of the engine's tokens are the engine's, step after step."""
    from test_ppo import ppo_config

    from ladle.config.load import build_config
    from ladle.recipes import load
    from ladle.train.metrics import read_metrics

    lora = vllm_grpo(chat_tokenizer, prompt_data, tmp_path / "lora")
    lora["lora"] = {"rank": 4, "alpha": 8}
    lora["optim"]["lr"] = 5e-2  # the adapters move far from the start each step
    assert load("grpo").run(build_config(lora)) == "completed"
    ppo = ppo_config(chat_tokenizer, prompt_data, tmp_path / "ppo", engine="vllm")
    ppo["model"].update(dim=128, n_heads=2, n_kv_heads=1, ffn_dim=128)
    ppo["train"]["max_steps"] = 3
    assert load("ppo").run(build_config(ppo)) == "completed"
    for run in ("lora", "ppo"):
        recs = [r for r in read_metrics(tmp_path / run) if "loss" in r]
        assert len(recs) == 3 and all(r["rollout_logprob_diff"] < 1e-3 for r in recs), run
        assert all(r["weight_sync_s"] > 0 for r in recs[1:]) and recs[-1]["grad_norm"] > 0, run


def test_grpo_on_the_vllm_engine_under_fsdp_equals_one_process(chat_tokenizer, prompt_data, tmp_path):
    """Each rank's engine gets the policy's weights gathered from the FSDP shards: its log-probs
    are the trainer's, and the keyed streams sample what one process samples."""
    from conftest import one_and_two_ranks

    cfg = vllm_grpo(chat_tokenizer, prompt_data, tmp_path / "run")
    cfg["train"]["max_steps"] = 2
    one, par = one_and_two_ranks("grpo", cfg, tmp_path)
    for a, b in zip(one, par, strict=True):
        assert b["rollout_logprob_diff"] < 1e-3 and b["weight_sync_s"] > 0
        assert b["reward_mean"] == pytest.approx(a["reward_mean"], abs=1e-6)
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-4)


def test_grpo_on_a_moe_policy_replays_vllms_routing(chat_tokenizer, prompt_data, tmp_path):
    """GRPO with vLLM on a tiny MoE policy logs routing_agreement, 1.0 at the first update in fp32
    (the engine's routing is the trainer's), with and without routing replay; replaying the
    sampler's routing is then the same forward."""
    from ladle.config.load import build_config
    from ladle.recipes import load
    from ladle.train.metrics import read_metrics

    for out, replay in (("plain", False), ("replay", True)):
        cfg = vllm_grpo(chat_tokenizer, prompt_data, tmp_path / out, num_iterations=2, routing_replay=replay)
        cfg["model"].update(family="qwen3_moe", qk_norm=True, moe={"n_experts": 4, "top_k": 2, "ffn_dim": 32})
        cfg["train"]["max_steps"] = 1  # its two updates
        assert load("grpo").run(build_config(cfg)) == "completed"
    plain, replay = ([r for r in read_metrics(tmp_path / n) if "loss" in r] for n in ("plain", "replay"))
    for recs in (plain, replay):
        assert recs[0]["routing_agreement"] == pytest.approx(1.0)
        assert recs[0]["rollout_logprob_diff"] < 1e-3
    assert replay[0]["loss"] == pytest.approx(plain[0]["loss"], abs=1e-6)


def test_grpo_on_separated_vllm_engine_ranks_equals_colocated_and_trains_asynchronously(
    chat_tokenizer, prompt_data, tmp_path
):
    """grpo.placement: separated with vLLM: the engine rank's vLLM runs in a process of its own
    and its worker takes the policy's weights from the trainer rank over a private group, in HF
    names. In step it samples what the colocated engine samples (same weights, same keyed
    requests); with max_staleness 1 it generates the next batch from weights one update old."""
    import subprocess
    import sys

    import yaml

    from ladle.config.load import build_config
    from ladle.recipes import load
    from ladle.train.metrics import read_metrics

    cfg = vllm_grpo(chat_tokenizer, prompt_data, tmp_path / "colocated", rollout_correction="tis")
    cfg["optim"]["lr"] = 3e-3
    assert load("grpo").run(build_config(cfg)) == "completed"
    colocated = [r for r in read_metrics(tmp_path / "colocated") if "loss" in r]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))

    def separated(out, *over):
        cmd = [sys.executable, "-m", "ladle", "run", "grpo", "--config", str(path), "--nproc", "2"]
        r = subprocess.run(
            [*cmd, f"output_dir={tmp_path / out}", "grpo.placement=separated", *over],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        return [r for r in read_metrics(tmp_path / out) if "loss" in r]

    sync = separated("sync")
    assert len(sync) == len(colocated) == 3
    for a, b in zip(colocated, sync, strict=True):
        assert b["reward_mean"] == pytest.approx(a["reward_mean"], abs=1e-6), a["step"]
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-4) and b["rollout_kl"] < 1e-6
        assert b["weight_sync_s"] > 0 and b["staleness_max"] == 0
    stale = separated("async", "grpo.max_staleness=1")
    assert [r["staleness_max"] for r in stale] == [0, 1, 1]
    assert stale[1]["rollout_kl"] > 1e-6  # sampled from the weights before the last update

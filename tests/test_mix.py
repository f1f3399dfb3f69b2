"""Weighted data mixtures (data.mix, data.mix_schedule): the order, each source's epochs, resume,
per-source losses against an independent evaluation, `ladle data inspect`, and bad input."""

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from ladle.config.load import build_config
from ladle.data.loader import BatchLayout, PackedSamples, SampleOrder
from ladle.data.mix import MixedSamples, MixLoader, source_seed, stages
from ladle.data.prepare import open_split, prepare
from ladle.errors import ConfigError, DataError
from ladle.recipes import pretrain
from ladle.train.metrics import read_metrics
from tests.conftest import make_tiny_config

STDLIB = Path(sysconfig.get_paths()["stdlib"])
SOURCES = {"json": "json", "futures": "concurrent/futures", "urllib": "urllib"}


@pytest.fixture(scope="module")
def sources(tokenizer_dir, tmp_path_factory) -> dict[str, Path]:
    """Three prepared folders of different sizes (each with a held-out document), one tokenizer."""
    root = tmp_path_factory.mktemp("mix")
    out = {}
    for name, sub in SOURCES.items():
        out[name] = root / name
        prepare([str(STDLIB / sub)], tokenizer=str(tokenizer_dir), output=str(out[name]), glob="*.py",
                workers=1, val_fraction=0.34, seed=3, progress=False)  # fmt: skip
    return out


def mix_config(tokenizer_dir, sources, out, weights=(1, 2, 1), schedule=()) -> dict:
    cfg = make_tiny_config(tokenizer_dir, "unused", out)
    cfg["data"] = {
        "seq_len": 32,
        "mix": [
            {"name": n, "path": str(p), "weight": w}
            for (n, p), w in zip(sources.items(), weights, strict=True)
        ],
        "mix_schedule": list(schedule),
    }
    return cfg


def mixed(sources, split="train", seq_len=32, names=None):
    names = names or list(sources)
    return MixedSamples(
        [PackedSamples(open_split(sources[n], split), seq_len, split) for n in names],
        names,
        [str(sources[n]) for n in names],
        split,
    )


def loader(samples, plan, *, micro=2, accum=2, rank=0, world=1, seed=7):
    return MixLoader(
        samples, BatchLayout(micro, accum, rank, world), plan, seed=seed, device=torch.device("cpu")
    )


def plan_of(weights: dict, schedule=()):
    cfg = build_config(
        {
            "tokenizer": {"path": "t"},
            "data": {
                "mix": [{"name": n, "path": n, "weight": w} for n, w in weights.items()],
                "mix_schedule": list(schedule),
            },
        }
    )
    return stages(cfg.data.mix, cfg.data.mix_schedule)


def draw(ld, n) -> list[tuple[int, int]]:
    """The next n samples of the mixture's order as (source, that source's sample index)."""
    k, pos = ld.mix.take(n)
    return [ld.samples.locate(ld.mix.sample(a, b)) for a, b in zip(k, pos, strict=True)]


def drawn_ids(ld, steps) -> list[list[int]]:
    """Each step's samples on this rank, in order."""
    out = []
    for _ in range(steps):
        out.append([int(i) for b in ld.step_batches(ld.consumed_samples) for i in b["tokens"][:, 0]])
        ld.consumed_samples += ld.layout.global_batch
    return out


def test_shares_hold_to_one_sample_and_each_source_keeps_its_own_order(sources):
    s = mixed(sources)
    ld = loader(s, plan_of({"json": 1, "futures": 2, "urllib": 1}))
    per = {n: [] for n in s.names}
    for g, (k, j) in enumerate(draw(ld, 400), start=1):
        per[s.names[k]].append(j)
        counts = np.array([len(per[n]) for n in s.names])
        assert np.abs(counts - g * np.array([0.25, 0.5, 0.25])).max() <= 1.0  # every prefix, within a sample
    for k, name in enumerate(s.names):  # each source: its own seed's order, epoch after epoch
        order = SampleOrder(s.sizes[k], source_seed(7, name))
        assert per[name] == [order(c) for c in range(len(per[name]))]


def test_any_weights_hold_each_share_within_two_samples(sources):
    s, rng = mixed(sources), np.random.default_rng(0)
    for _ in range(20):
        w = rng.random(3) ** 3 + 1e-3
        ld = loader(s, plan_of(dict(zip(s.names, w.tolist(), strict=True))))
        k, _ = ld.mix.take(300)
        counts = np.cumsum(np.eye(3)[k], axis=0)
        assert np.abs(counts - np.arange(1, 301)[:, None] * (w / w.sum())).max() < 2.0


def test_a_source_that_runs_out_starts_its_next_epoch_alone(sources):
    s = mixed(sources)
    ld = loader(s, plan_of({"json": 3, "futures": 1, "urllib": 1}))
    n = s.sizes[0]
    ids = draw(ld, 4 * n)
    json_ids = [j for k, j in ids if k == 0]
    assert len(json_ids) > 2 * n  # json read more than twice, the others less than once
    for e in range(2):  # every epoch holds each of its samples once, in another order
        assert sorted(json_ids[e * n : (e + 1) * n]) == list(range(n))
    assert json_ids[:n] != json_ids[n : 2 * n]
    assert max(j for k, j in ids if k == 2) < s.sizes[2]


def test_the_samples_do_not_depend_on_the_data_parallel_size(sources):
    s = mixed(sources)
    plan = plan_of({"json": 1, "futures": 2, "urllib": 1}, [{"step": 3, "weights": {"urllib": 5}}])
    one = drawn_ids(loader(s, plan, micro=2, accum=2), 6)
    ranks = [drawn_ids(loader(s, plan, micro=1, accum=2, rank=r, world=2), 6) for r in range(2)]
    assert one == [a + b for a, b in zip(*ranks, strict=True)]


def test_the_schedule_changes_the_shares_from_its_step(sources):
    s = mixed(sources)
    plan = plan_of({"json": 1, "futures": 1, "urllib": 1}, [{"step": 5, "weights": {"json": 0, "urllib": 3}}])
    ld = loader(s, plan, micro=4, accum=1)
    ids = draw(ld, 40)
    before = [k for k, _ in ids[:20]]
    after = [k for k, _ in ids[20:]]
    assert [before.count(k) for k in range(3)] in ([7, 7, 6], [7, 6, 7], [6, 7, 7])
    assert [after.count(k) for k in range(3)] == [0, 5, 15]


def test_resume_continues_every_source_where_it_was(sources):
    s = mixed(sources)
    plan = plan_of({"json": 1, "futures": 2, "urllib": 1}, [{"step": 4, "weights": {"json": 4}}])
    full = loader(s, plan)
    whole = drawn_ids(full, 8)
    first = loader(s, plan)
    for _ in range(3):
        first.next()
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint keeps it
    first.close()
    again = loader(s, plan)
    again.load_state_dict(state)
    assert drawn_ids(again, 5) == whole[3:]
    assert again.mix.changes == []


def test_resume_with_other_weights_or_a_new_source_goes_on_from_each_position(sources):
    s2 = mixed(sources, names=["json", "futures"])
    first = loader(s2, plan_of({"json": 1, "futures": 1}))
    for _ in range(3):
        first.next()
    state = first.state_dict()
    first.close()
    assert state["mix"]["drawn"] == {"json": 6, "futures": 6}
    s3 = mixed(sources)
    again = loader(s3, plan_of({"json": 1, "futures": 1, "urllib": 2}))
    notes = []
    again.note = notes.append
    again.load_state_dict(state)
    assert any("adds urllib" in n for n in notes) and any("weights" in n for n in notes)
    ids = draw(again, 40)
    for k, name in enumerate(s3.names):  # json and futures go on at their 7th sample, urllib at its 1st
        order = SampleOrder(s3.sizes[k], source_seed(7, name))
        mine = [j for kk, j in ids if kk == k]
        start = state["mix"]["drawn"].get(name, 0)
        assert mine == [order(start + c) for c in range(len(mine))]
    assert [sum(1 for kk, _ in ids if kk == k) for k in range(3)] == [10, 10, 20]


def test_a_mixed_run_logs_each_source_and_matches_an_independent_evaluation(tokenizer_dir, sources, tmp_path):
    from ladle.ops.evaluate import evaluate
    from ladle.ops.export import load_any_model

    cfg = mix_config(
        tokenizer_dir, sources, tmp_path / "run", schedule=[{"step": 10, "weights": {"json": 3}}]
    )
    cfg["loggers"] = {"tensorboard": True}
    assert pretrain.run(build_config(cfg)) == "completed"
    recs = read_metrics(tmp_path / "run")
    train = [r for r in recs if "loss" in r]
    names = list(sources)
    size = {k: (open_split(sources[k]).num_tokens - 1) // 32 for k in names}  # samples of 32 + 1 tokens
    assert train[-1]["samples/json"] == 30 and train[-1]["samples/futures"] == 33  # 10 + 20, 20 + 13
    prev = dict.fromkeys(names, 0)
    for r in train:  # the step's loss is its sources' losses weighted by their tokens
        n = {k: r[f"samples/{k}"] - prev[k] for k in names}
        prev = {k: r[f"samples/{k}"] for k in names}
        assert sum(n.values()) == 4
        got = sum(r[f"loss/{k}"] * n[k] for k in names if n[k]) / 4
        assert got == pytest.approx(r["loss"], rel=1e-5)
        assert all(r[f"epochs/{k}"] == pytest.approx(prev[k] / size[k]) for k in names)
    last = [r for r in recs if "val_loss" in r][-1]
    model, _tok = load_any_model(tmp_path / "run", device=torch.device("cpu"), dtype=torch.float32)
    for k in names:  # the same batches, `ladle eval`'s code: the first eval_steps x micro samples of val
        want = evaluate(model, sources[k], split="val", seq_len=32, batch_size=2, max_batches=2)
        assert last[f"val_loss/{k}"] == pytest.approx(want["loss"], rel=1e-5)
    card = json.loads((tmp_path / "run" / "run_card.json").read_text())
    assert [m["name"] for m in card["data"]["mix"]] == names
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {f"{m}/{k}" for m in ("loss", "val_loss", "samples", "epochs") for k in names} <= tags
    assert acc.Scalars("val_loss/json")[-1].value == pytest.approx(last["val_loss/json"], rel=1e-6)


def test_resumed_mixture_is_bit_identical_and_a_changed_one_is_noted(tokenizer_dir, sources, tmp_path):
    sched = [{"step": 7, "weights": {"urllib": 4}}]
    full = mix_config(tokenizer_dir, sources, tmp_path / "full", schedule=sched)
    full["train"]["max_steps"] = 12
    assert pretrain.run(build_config(full)) == "completed"
    split = {**full, "output_dir": str(tmp_path / "split")}
    assert pretrain.run(build_config(split, ["train.exit_at_step=5"])) == "exit"
    assert pretrain.run(build_config(split, ["train.resume=auto"])) == "completed"
    keys = lambda d: [{k: v for k, v in r.items() if "loss" in k or "/" in k} for r in read_metrics(d)]  # noqa: E731
    assert keys(tmp_path / "full") == keys(tmp_path / "split")
    # resumed again at step 10 with json's weight changed: allowed, written to events.log
    more = {**split, "train": {**split["train"], "max_steps": 14}}
    more["data"] = {**split["data"], "mix": [{**m, "weight": 5 if m["name"] == "json" else m["weight"]}
                                             for m in split["data"]["mix"]]}  # fmt: skip
    assert pretrain.run(build_config(more, ["train.resume=auto"])) == "completed"
    events = (tmp_path / "split" / "events.log").read_text()
    assert "resumed with a changed mixture: data.mix weights" in events
    recs = [r for r in read_metrics(tmp_path / "split") if "loss" in r]
    assert recs[-1]["step"] == 14


def test_inspect_reports_share_and_epochs(tokenizer_dir, sources, tmp_path):
    cfg = mix_config(
        tokenizer_dir, sources, tmp_path / "run", schedule=[{"step": 10, "weights": {"json": 3}}]
    )
    path = tmp_path / "mix.yaml"
    path.write_text(yaml.safe_dump(cfg))
    r = subprocess.run(
        [sys.executable, "-m", "ladle", "data", "inspect", "--config", str(path), "--json", "train.max_steps=40"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    by = {s["name"]: s for s in rep["sources"]}
    # 10 steps at 1:2:1, then 30 at 3:2:1, of 4 samples each
    assert by["json"]["samples_drawn"] == 10 + 60 and by["futures"]["samples_drawn"] == 20 + 40
    assert by["json"]["share"] == pytest.approx(70 / 160)
    n = (open_split(sources["json"]).num_tokens - 1) // 32
    assert by["json"]["epochs"] == pytest.approx(70 / n) and by["json"]["train_samples"] == n
    assert by["json"]["weights"] == [1, 3]


def test_bad_mixtures_are_refused_naming_the_key(tokenizer_dir, sources, tmp_path, corpus):
    base = mix_config(tokenizer_dir, sources, tmp_path / "run")
    zero = {**base, "data": {**base["data"], "mix": [*base["data"]["mix"][:1], {**base["data"]["mix"][1], "weight": 0}]}}  # fmt: skip
    with pytest.raises(ConfigError, match=r"data\.mix\.1\.weight.*greater than 0"):
        build_config(zero)
    with pytest.raises(ConfigError, match="step 20 is not before train.max_steps"):
        build_config(
            {**base, "data": {**base["data"], "mix_schedule": [{"step": 20, "weights": {"json": 2}}]}}
        )
    with pytest.raises(ConfigError, match="names web, not a source"):
        build_config({**base, "data": {**base["data"], "mix_schedule": [{"step": 2, "weights": {"web": 2}}]}})
    with pytest.raises(ConfigError, match="data.path or data.mix, not both"):
        build_config({**base, "data": {**base["data"], "path": str(sources["json"])}})
    with pytest.raises(ConfigError, match="json more than once"):
        build_config({**base, "data": {**base["data"], "mix": base["data"]["mix"] + base["data"]["mix"][:1]}})
    missing = {**base, "data": {**base["data"], "mix": [*base["data"]["mix"][:2], {"name": "gone", "path": str(tmp_path / "nope"), "weight": 1}]}}  # fmt: skip
    with pytest.raises(DataError, match="data.mix source gone: data folder .*nope not found"):
        pretrain.run(build_config(missing))
    # a source prepared with another tokenizer
    from ladle.data.tokenizer import train_tokenizer

    other = train_tokenizer([str(corpus)], vocab_size=300, output=str(tmp_path / "tok2"))
    prepare(
        [str(STDLIB / "json")],
        tokenizer=str(other),
        output=str(tmp_path / "j2"),
        glob="*.py",
        workers=1,
        progress=False,
    )
    odd = {**base, "data": {**base["data"], "mix": [*base["data"]["mix"][:1], {"name": "j2", "path": str(tmp_path / "j2"), "weight": 1}]}}  # fmt: skip
    path = tmp_path / "odd.yaml"
    path.write_text(yaml.safe_dump(odd))
    r = subprocess.run([sys.executable, "-m", "ladle", "run", "pretrain", "--config", str(path)],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 2
    assert (
        "data.mix source j2:" in r.stderr
        and "different tokenizer" in r.stderr
        and "share one tokenizer" in r.stderr
    )
    assert not (tmp_path / "run").exists()  # refused before anything is written


def test_only_pretraining_reads_a_mixture(tokenizer_dir, sources, tmp_path):
    from ladle.recipes import sft

    cfg = mix_config(tokenizer_dir, sources, tmp_path / "run")
    with pytest.raises(ConfigError, match="data.mix: `ladle run sft` reads one prepared folder"):
        sft.run(build_config(cfg))


@pytest.mark.parametrize("layout", ["parallel.tp=2", "parallel.cp=2"])
def test_a_group_of_ranks_shares_the_mixture_read_once(tokenizer_dir, sources, tmp_path, layout):
    """TP=2 / CP=2: the group's first rank draws and broadcasts the batches (with each row's
    `source`, which context parallelism keeps whole); the per-source losses are one process's."""
    cfg = mix_config(tokenizer_dir, sources, tmp_path / "one")
    cfg["train"] = {**cfg["train"], "max_steps": 6, "threads": 1}
    assert pretrain.run(build_config(cfg)) == "completed"
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "ladle", "run", "pretrain", "--config", str(path), "--nproc", "2"]
    r = subprocess.run(
        [*cmd, f"output_dir={tmp_path / 'tp'}", layout], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    one, tp = (
        [r for r in read_metrics(tmp_path / d) if "loss" in r or "val_loss" in r] for d in ("one", "tp")
    )
    keys = sorted({k for r in one for k in r if k.startswith(("loss", "val_loss", "samples/"))})
    assert len(keys) == 11  # loss, val_loss, and per source loss/, val_loss/, samples/
    for a, b in zip(one, tp, strict=True):
        for k in keys:
            if k in a:
                assert b[k] == pytest.approx(a[k], rel=1e-4), k


def test_resume_at_a_schedule_step_is_no_change(sources):
    """A checkpoint at the step a schedule's stage begins: the stage is the config's, not a change."""
    s = mixed(sources)
    plan = plan_of({"json": 1, "futures": 2, "urllib": 1}, [{"step": 3, "weights": {"json": 4}}])
    whole = drawn_ids(loader(s, plan), 6)
    first = loader(s, plan)
    for _ in range(3):
        first.next()
    state = json.loads(json.dumps(first.state_dict()))
    first.close()
    again = loader(s, plan)
    again.load_state_dict(state)
    assert again.mix.changes == []
    assert drawn_ids(again, 3) == whole[3:]


def test_resume_with_another_global_batch_counts_steps_on(sources):
    s = mixed(sources)
    plan = plan_of({"json": 1, "futures": 1, "urllib": 2}, [{"step": 5, "weights": {"urllib": 0}}])
    first = loader(s, plan, micro=2, accum=2)  # 4 samples a step
    for _ in range(3):
        first.next()
    state = first.state_dict()
    first.close()
    assert state["mix"]["step"] == 3 and state["consumed_samples"] == 12
    again = loader(s, plan, micro=2, accum=4)  # 8 a step: step 5 now begins at sample 12 + 2 x 8
    again.load_state_dict(state)
    assert again.mix.changes == []
    ids = draw(again, 24)
    assert sum(k == 2 for k, _ in ids[:16]) == 8 and all(k != 2 for k, _ in ids[16:])  # no urllib from step 5
    assert again.mix.state.g0 == 28


def test_a_dropped_source_keeps_its_position(sources):
    s3 = mixed(sources)
    first = loader(s3, plan_of({"json": 1, "futures": 1, "urllib": 1}))
    for _ in range(3):
        first.next()
    state, at = first.state_dict(), first.state_dict()["mix"]["drawn"]["urllib"]
    first.close()
    two = loader(mixed(sources, names=["json", "futures"]), plan_of({"json": 1, "futures": 1}))
    two.load_state_dict(state)
    assert "no longer draws from urllib" in two.mix.changes[0]
    two.next()
    later = two.state_dict()
    two.close()
    assert later["mix"]["retired"] == {"urllib": at}
    back = loader(s3, plan_of({"json": 1, "futures": 1, "urllib": 1}))
    back.load_state_dict(later)
    assert any(f"adds urllib (again, at its sample {at}" in c for c in back.mix.changes)
    order = SampleOrder(s3.sizes[2], source_seed(7, "urllib"))
    mine = [j for k, j in draw(back, 12) if k == 2]
    assert mine == [order(at + c) for c in range(len(mine))]

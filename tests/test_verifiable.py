"""Verifiable rewards run safely: the sandbox (ladle/rl/sandbox.py) against hostile programs, the
`code` reward, `ladle rewards score`, and a reward that raises inside a run (`rewards.on_error`)."""

import json
import os
import socket
import threading
import time

import pytest

from ladle.rl import sandbox
from ladle.rl.rewards import Rewards, program_of

FAST = sandbox.Limits(wall_s=3.0, cpu_s=2)


def leftovers() -> set[str]:
    return {p for p in os.listdir("/tmp") if p.startswith("ladle-sandbox-")}


def test_a_program_runs_with_its_input_and_leaves_nothing():
    before = leftovers()
    r = sandbox.run("print(sum(map(int, input().split())))", "2 40\n", FAST)
    assert r.ok and r.stdout == "42\n"
    r = sandbox.run("open('scratch.txt', 'w').write('mine'); print(open('scratch.txt').read())", "", FAST)
    assert r.ok and r.stdout == "mine\n"  # its own folder is writable
    assert leftovers() == before


@pytest.mark.parametrize(
    "name, program",
    [
        ("write outside", "open('/tmp/ladle_sandbox_escape', 'w').write('x')"),
        ("remove outside", "import os\nos.remove('/tmp/ladle_sandbox_keep')"),
        ("fork bomb", "import os\nwhile True:\n    os.fork()"),
        ("subprocess", "import subprocess\nsubprocess.run(['touch', '/tmp/ladle_sandbox_escape'])"),
        ("os.system", "import os\nos.system('touch /tmp/ladle_sandbox_escape')"),
        ("ctypes", "import ctypes\nctypes.CDLL(None).system(b'touch /tmp/ladle_sandbox_escape')"),
        ("network", "import socket\nsocket.create_connection(('127.0.0.1', PORT)).sendall(b'x')"),
        ("relative path out", "open('../../tmp/ladle_sandbox_escape', 'w').write('x')"),
        (
            "patched path check",
            "import os.path\nos.path.realpath = lambda p: '.'\nopen('/tmp/ladle_sandbox_escape', 'w')",
        ),
        ("frames", "import sys\nsys._getframe(0).f_globals.clear()\nopen('/tmp/ladle_sandbox_escape', 'w')"),
        (
            "garbage collector",
            "import gc\n[o for o in gc.get_objects() if callable(o)]\nopen('/tmp/ladle_sandbox_escape', 'w')",
        ),
        (
            "traceback's frames",
            "try:\n    open('/tmp/x', 'w')\nexcept PermissionError as e:\n    tb = e.__traceback__\n"
            "    while tb:\n        tb.tb_frame.f_globals.clear()\n        tb = tb.tb_next\n"
            "open('/tmp/ladle_sandbox_escape', 'w')",
        ),
        (
            "device node",
            "import os, stat\nos.mknod('d', stat.S_IFBLK | 0o600, os.makedev(254, 0))\nopen('d', 'r+b')",
        ),
        (
            "fd working directory",
            "import os\nos.chdir(os.open('/', 0))\nopen('tmp/ladle_sandbox_escape', 'w')",
        ),
        ("truncating flag", "import os\nos.open('/tmp/ladle_sandbox_keep', os.O_TRUNC)"),
        ("kill the trainer", "import os\nos.kill(os.getppid(), 9)"),
        (
            "the hook's own defaults",
            "try:\n    open('/tmp/x', 'w')\nexcept PermissionError as e:\n    tb = e.__traceback__\n"
            "    while tb.tb_next:\n        tb = tb.tb_next\n"
            "    tb.tb_frame.f_locals['inside'].__defaults__ = (lambda p: '/', '/', '/', ())\n"
            "open('/tmp/ladle_sandbox_escape', 'w')",
        ),
        ("sleep", "import time\ntime.sleep(60)"),
        ("busy loop", "while True:\n    pass"),
        ("memory", "x = bytearray(8 << 30)"),
    ],
)
def test_hostile_programs_fail_closed_and_leave_no_trace(name, program, tmp_path):
    # each fails its run (not ok), writes nothing outside its folder, leaves no process and no
    # folder behind, and ends within its wall-clock limit
    keep = "/tmp/ladle_sandbox_keep"
    open(keep, "w").write("keep")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.5)
    reached = []

    def accept():
        try:
            reached.append(listener.accept())
        except OSError:
            pass

    waiter = threading.Thread(target=accept)
    waiter.start()
    before = leftovers()
    t0 = time.perf_counter()
    r = sandbox.run(program.replace("PORT", str(listener.getsockname()[1])), "", FAST)
    waiter.join()
    listener.close()
    assert not r.ok, (name, r)
    assert time.perf_counter() - t0 < FAST.wall_s + 2
    assert not os.path.exists("/tmp/ladle_sandbox_escape") and open(keep).read() == "keep"
    assert not reached  # the listener never saw a connection
    assert leftovers() == before
    os.remove(keep)


def test_the_standard_library_works_in_the_sandbox():
    # what code-RL programs use: functools (lru_cache), collections (namedtuple), typing,
    # dataclasses, re, json, threading, fractions, statistics... (the hook refuses none of it)
    program = (
        "import re, json, functools, collections, threading, typing, dataclasses, enum, fractions, heapq\n"
        "import itertools, math, string, bisect, decimal, statistics, sys\n"
        "from typing import List\n"
        "@functools.lru_cache(None)\ndef fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
        "P = collections.namedtuple('P', 'x y')\n"
        "@dataclasses.dataclass\nclass D:\n    a: int = 1\n"
        "t = threading.Thread(target=lambda: None)\nt.start()\nt.join()\n"
        "print(fib(30), P(1, 2).x, D().a, json.dumps([1]), re.sub('a', 'b', 'aa'), fractions.Fraction(1, 3),"
        " statistics.mean([1, 2]), sys.stdin.read().strip())"
    )
    r = sandbox.run(program, "in", FAST)
    assert r.ok, r.stderr
    assert r.stdout == "832040 1 1 [1] bb 1/3 1.5 in\n"


def test_output_is_capped():
    r = sandbox.run("while True:\n    print('y' * 1000)", "", sandbox.Limits(wall_s=3, output_bytes=1 << 16))
    assert not r.ok and len(r.stdout) <= 1 << 16


def test_the_code_reward_runs_the_cases_and_hostile_code_scores_zero():
    rec = {"tests": [{"input": "2 3\n", "output": "5\n"}, {"input": "10 -4", "output": "6"}]}
    code = Rewards([{"name": "code", "wall_s": 3}])
    good = "Here:\n```python\na, b = map(int, input().split())\nprint(a + b)\n```\ndone"
    assert code(good, rec) == (1.0, {"code": 1.0})
    assert code("print(5)", rec)[0] == 0.0  # one case of two
    partial = Rewards([{"name": "code", "partial": True, "wall_s": 3}])
    assert partial("print(5)", rec)[0] == 0.5
    asserts = {"tests": "assert f(2) == 4\nassert f(0) == 0"}
    assert code("def f(x):\n    return 2 * x", asserts)[0] == 1.0
    assert code("def f(x):\n    return 3 * x", asserts)[0] == 0.0
    assert code("import os\nos.system('rm -rf /tmp/x')\ndef f(x):\n    return 2 * x", asserts)[0] == 0.0
    assert program_of("a\n```py\nprint(1)\n```\n```python\nprint(2)\n```") == "print(2)\n"
    with pytest.raises(Exception, match="reward 'code' reads the record's 'tests'"):
        code("print(1)", {"tests": []})


def test_rewards_score_scores_records_outside_a_run(tmp_path, capsys):
    from ladle.cli import main

    data = tmp_path / "r.jsonl"
    rows = [
        {"id": "a", "response": "```python\nprint(int(input()) * 2)\n```", "answer": "x", "tests": [{"input": "4", "output": "8"}]},
        {"response": "print(0)", "answer": "print(0)", "tests": [{"input": "4", "output": "8"}]},
    ]  # fmt: skip
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["rewards", "score", "--terms", "code,exact", "--input", str(data)]) == 0
    out = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert out == [
        {"id": "a", "reward": 1.0, "code": 1.0, "exact": 0.0},
        {"reward": 1.0, "code": 0.0, "exact": 1.0},
    ]
    data.write_text(json.dumps({"answer": "1"}) + "\n")
    assert main(["rewards", "score", "--terms", "exact", "--input", str(data)]) == 2
    assert f"{data}:1: a record needs a `response` string" in capsys.readouterr().err
    assert main(["rewards", "score", "--terms", "mine", "--input", str(data)]) == 2
    assert "--terms mine: not a registered reward" in capsys.readouterr().err


def test_a_reward_that_raises_stops_the_run_by_name_or_scores_zero(
    chat_tokenizer, prompt_data, tmp_path, capsys
):
    # a user's reward that raises on some responses: named with its file and line, the step, the
    # prompt and sample and the response's start, in the console and events.log, exit 2
    # (on_error: stop); or scored 0 and counted (on_error: zero)
    import yaml
    from test_grpo import grpo_config

    from ladle.cli import main
    from ladle.train.metrics import read_metrics

    file = tmp_path / "mine.py"
    file.write_text(
        "def picky(response, record, **context):\n    if 'e' in response:\n        raise ValueError('no e')\n    return 1.0\n"
    )
    cfg = grpo_config(chat_tokenizer, prompt_data, tmp_path / "stop")
    cfg["rewards"] = {"file": str(file), "terms": [{"name": "picky"}]}
    cfg["train"]["max_steps"] = 2
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["run", "grpo", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"reward 'picky' ({file}:3) raised ValueError: no e; at step 1, train prompt" in err
    assert "the response began '" in err
    assert "reward 'picky'" in (tmp_path / "stop" / "events.log").read_text()
    assert (
        main(
            ["run", "grpo", "--config", str(path), f"output_dir={tmp_path / 'zero'}", "rewards.on_error=zero"]
        )
        == 0
    )
    recs = [r for r in read_metrics(tmp_path / "zero") if "loss" in r]
    assert len(recs) == 2 and all(r["reward_errors"] > 0 for r in recs)
    events = (tmp_path / "zero" / "events.log").read_text()
    assert events.count("scored 0 (rewards.on_error: zero)") == 3  # the first three named


def test_rollout_logs_hold_the_episodes_as_trained(chat_tokenizer, prompt_data, tmp_path):
    # grpo.log_rollouts: 3 episodes a batch in rollouts.jsonl, each with its messages, its token
    # ids (prompt + response, as the rows are built), the loss mask over the response alone, and
    # its rewards by term summing (with the weights) to its reward; `ladle report` shows them
    from test_grpo import grpo_config

    from ladle.config.load import build_config
    from ladle.data.tokenizer import load_tokenizer
    from ladle.ops.report import report
    from ladle.recipes import load

    cfg = grpo_config(chat_tokenizer, prompt_data, tmp_path / "run", log_rollouts=3)
    cfg["train"]["max_steps"] = 2
    assert load("grpo").run(build_config(cfg)) == "completed"
    episodes = [json.loads(x) for x in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    assert [e["step"] for e in episodes] == [1, 1, 1, 2, 2, 2]
    tok = load_tokenizer(str(chat_tokenizer))
    weights = {t.get("key", t["name"]): t.get("weight", 1.0) for t in cfg["rewards"]["terms"]}
    for e in episodes:
        n_prompt = e["mask"].index(1) if 1 in e["mask"] else len(e["mask"])
        assert len(e["mask"]) == len(e["tokens"]) and set(e["mask"][n_prompt:]) <= {1}
        assert e["messages"][-1]["role"] == "assistant" and e["turns"] == 1 and e["tool_calls"] == []
        response = [t for t in e["tokens"][n_prompt:] if tok.decode([t]) not in ("<|im_end|>", "</s>")]
        assert tok.decode(response).strip() == e["messages"][-1]["content"].strip()
        assert e["reward"] == pytest.approx(sum(weights[k] * v for k, v in e["rewards"].items()))
    assert "<h2>Rollouts</h2>" in report(tmp_path / "run").read_text()


def test_a_batch_of_code_responses_runs_its_cases_in_one_pool(monkeypatch):
    # Rewards.score hands the `code` term every row at once: one pool map over all their cases;
    # a record without tests fails its own row (on_error: zero scores it 0), not the batch's
    calls = []
    real = sandbox.Pool.map

    def spy(self, jobs, limits=sandbox.Limits()):
        calls.append(len(jobs))
        return real(self, jobs, limits)

    monkeypatch.setattr(sandbox.Pool, "map", spy)
    rec = {"tests": [{"input": "1", "output": "2"}, {"input": "5", "output": "10"}]}
    rows = [(f"print(int(input()) * {m})", rec, {}) for m in (2, 3, 2)] + [("print(1)", {"tests": None}, {})]
    scored = Rewards([{"name": "code", "wall_s": 3}], on_error="zero").score(rows)
    assert calls == [6] and [s[0] for s in scored] == [1.0, 0.0, 1.0, 0.0]
    assert [s[2] is None for s in scored] == [True, True, True, False]
    assert "reads the record's 'tests'" in scored[3][2]


def test_a_code_reward_on_records_without_tests_is_refused_with_file_and_line(
    chat_tokenizer, tmp_path, capsys
):
    import yaml
    from test_grpo import grpo_config

    from ladle.cli import main
    from ladle.data.prompts import prepare_prompts

    with (tmp_path / "p.jsonl").open("w") as f:
        for i in range(12):
            tests = [] if i == 7 else [{"input": "", "output": str(i)}]
            f.write(json.dumps({"prompt": f"Print {i}", "tests": tests}) + "\n")
    prepare_prompts(
        [tmp_path / "p.jsonl"], tokenizer=chat_tokenizer, output=tmp_path / "data", progress=False
    )
    cfg = grpo_config(chat_tokenizer, tmp_path / "data", tmp_path / "run")
    cfg["rewards"] = {"terms": [{"name": "code"}]}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["run", "grpo", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "reward 'code' reads the record's 'tests'" in err
    assert "train_records.jsonl:8 (train prompt 7): reward 'code'" in err  # the record with tests: []

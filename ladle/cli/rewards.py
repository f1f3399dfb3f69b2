"""`ladle rewards score`: the RL rewards of responses outside any run, so a reward can be checked
on a few records before a run spends hours on it."""

from __future__ import annotations

import json
import sys

from ladle.errors import ConfigError, DataError


def cmd_rewards_score(args) -> int:
    from ladle.rl.rewards import REGISTRY, Rewards

    names = [n for n in args.terms.split(",") if n]
    terms, file, tok_path, tok = [{"name": n} for n in names], None, None, None
    if args.config:
        from ladle.config.load import load_config

        cfg = load_config(args.config)
        chosen = [
            t for t in cfg.rewards.terms if t.get("key", t.get("name")) in names or t.get("name") in names
        ]
        found = {t.get("key", t.get("name")) for t in chosen} | {t.get("name") for t in chosen}
        terms = chosen + [{"name": n} for n in names if n not in found]  # the rest with their defaults
        file, tok_path = cfg.rewards.file, cfg.tokenizer.path
    for t in terms:
        if t["name"] not in REGISTRY and file is None:
            raise ConfigError(
                f"--terms {t['name']}: not a registered reward ({', '.join(REGISTRY)}); a function of your "
                "own file needs --config with rewards.file"
            )
    rewards = Rewards(terms, file)
    counts = any(t["name"] == "length" for t in terms)
    rows, lines = [], []  # (response, record, context) and where each came from
    with open(args.input) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{args.input}:{n}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not a JSON object ({e})") from None
            if not isinstance(record, dict) or not isinstance(record.get("response"), str):
                raise DataError(f"{where}: a record needs a `response` string to score")
            response = record["response"]
            context = {"prompt": str(record.get("prompt", ""))}
            if "response_tokens" in record:
                context["response_tokens"] = int(record["response_tokens"])
            elif counts and tok_path:
                if tok is None:
                    from ladle.data.tokenizer import load_tokenizer

                    tok = load_tokenizer(tok_path)
                context["response_tokens"] = len(tok.encode(response))
            elif counts:
                raise DataError(
                    f"{where}: the `length` reward counts the response's tokens: give --config with a tokenizer, "
                    "or `response_tokens` in each record"
                )
            else:
                context["response_tokens"] = 0
            rows.append((response, record, context))
            lines.append(where)
            if len(rows) == BATCH:
                emit(rewards, rows, lines)
                rows, lines = [], []
    emit(rewards, rows, lines)
    return 0


BATCH = 256  # records scored together (the code term runs all their cases side by side)


def emit(rewards, rows: list, lines: list[str]) -> None:
    """Score `rows` together and print a JSON line each; a term that raises names its record's line."""
    from ladle.rl.rewards import RewardError

    try:
        scored = rewards.score(rows)
    except RewardError as e:
        raise DataError(f"{lines[e.row]}: {e}") from None
    for (_, record, _), (total, parts, _) in zip(rows, scored, strict=True):
        out = {"id": record["id"]} if "id" in record else {}
        print(json.dumps({**out, "reward": total, **parts}))
    sys.stdout.flush()


def _rewards_parser(sub, recipes) -> None:
    s = sub.add_parser("rewards", help="the RL rewards outside a run: `ladle rewards score`")
    rsub = s.add_subparsers(dest="rewards_command", required=True, metavar="COMMAND")
    r = rsub.add_parser(
        "score",
        help="score records that carry a `response` with the named reward terms, one JSON line a record "
        "(its id, the weighted reward, each term)",
    )
    r.add_argument(
        "--terms", required=True, help="NAME[,NAME...]: registered rewards, or a config's terms by key"
    )
    r.add_argument(
        "--config", help="a run config: its rewards.terms (with their options), rewards.file, tokenizer"
    )
    r.add_argument("--input", required=True, help="a JSON-lines file of records with `response`")
    r.set_defaults(fn=cmd_rewards_score)


COMMANDS = {"rewards": _rewards_parser}

"""`ladle tokenizer train` and `ladle data prepare | synth | inspect | show`."""

from __future__ import annotations

import json

from ladle.errors import LadleError


def cmd_tokenizer_train(args) -> int:
    from ladle.data.tokenizer import load_tokenizer, train_tokenizer

    out = train_tokenizer(
        args.input, vocab_size=args.vocab_size, output=args.output, glob=args.glob, exclude=args.exclude
    )
    tok = load_tokenizer(out)
    print(f"tokenizer with {tok.vocab_size} tokens written to {out} (sha256 {tok.hash[:12]})")
    return 0


def cmd_data_prepare(args) -> int:
    """`ladle data prepare`: one preparation per --task (pretraining text by default)."""
    {"sft": _prepare_sft, "preference": _prepare_preference, "prompts": _prepare_prompts}.get(
        args.task, _prepare_text
    )(args)
    return 0


def _shared(args) -> dict:
    """What every task's preparation takes from the command line."""
    return {
        "tokenizer": args.tokenizer,
        "output": args.output,
        "glob": args.glob,
        "exclude": args.exclude,
        "val_fraction": args.val_fraction,
        "seed": args.seed,
        "strict": args.strict,
    }


def _prepare_sft(args) -> None:
    from ladle.data.sft import prepare_sft

    if args.format in ("text", "jsonl", "parquet"):
        raise LadleError(
            f"--format {args.format} is a file format; for --task sft name the record shape "
            "(messages, sharegpt, alpaca) or leave it auto (files: jsonl or parquet)"
        )
    mask = "all" if args.train_on_prompt else "last_turn" if args.last_turn_only else args.mask
    prepare_sft(
        args.input,
        fmt=args.format,
        template=args.template,
        mask=mask,
        max_len=args.max_len,
        overlong=args.overlong,
        **_shared(args),
    )


def _prepare_preference(args) -> None:
    from ladle.data.preference import prepare_preference

    if args.format != "auto":
        raise LadleError(
            f"--format {args.format}: --task preference tells each record's shape from its fields "
            "(prompt/chosen/rejected strings or message lists, or HH-RLHF turns); leave --format out"
        )
    prepare_preference(
        args.input, template=args.template, max_len=args.max_len, overlong=args.overlong, **_shared(args)
    )


def _prepare_prompts(args) -> None:
    from ladle.data.prompts import prepare_prompts

    if args.format != "auto":
        raise LadleError(
            f"--format {args.format}: --task prompts reads records with a 'prompt'; leave --format out"
        )
    prepare_prompts(args.input, template=args.template, max_prompt_len=args.max_prompt_len, **_shared(args))


def _prepare_text(args) -> None:
    from ladle.data.prepare import prepare

    if args.format in ("messages", "sharegpt", "alpaca"):
        raise LadleError(f"--format {args.format} is an SFT record shape; add --task sft")
    prepare(
        args.input,
        fmt=args.format,
        text_field=args.text_field,
        workers=args.workers,
        **_shared(args),
    )


def cmd_data_synth(args) -> int:
    from ladle.data.synthetic import write_task

    info = write_task(
        args.task,
        args.output,
        train=args.train,
        val=args.val,
        seed=args.seed,
        max_digits=args.max_digits,
        max_words=args.max_words,
        pairs=args.pairs,
        prompts=args.prompts,
    )
    what = "preference pairs" if args.pairs else "prompts with answers" if args.prompts else "chats"
    print(f"{info['task']}: {info['train']} train and {info['val']} held-out {what} in {info['path']}")
    return 0


def cmd_data_inspect(args) -> int:
    from ladle.data.inspect import format_inspect, format_mix, inspect_data, inspect_mix

    if args.config:
        from ladle.config.load import load_config
        from ladle.parallel.mesh import check_layout

        # argparse hands the first override to the optional folder argument
        cfg = load_config(args.config, [*([args.dir] if args.dir else []), *args.overrides])
        if cfg.data.mix is None:
            raise LadleError(
                f"{args.config} sets no data.mix; inspect its folder with `ladle data inspect {cfg.data.path}`"
            )
        t = cfg.train
        report = inspect_mix(cfg, t.micro_batch_size * t.grad_accum_steps * check_layout(cfg, args.nproc).dp)
        print(json.dumps(report, indent=2) if args.json else format_mix(report))
        return 0
    if not args.dir or args.overrides:
        raise LadleError(
            "ladle data inspect: name a prepared folder, or a config's mixture with --config FILE"
        )
    report = inspect_data(args.dir, samples=args.samples, tokenizer=args.tokenizer)
    print(json.dumps(report, indent=2, default=str) if args.json else format_inspect(report))
    return 0


def cmd_data_show(args) -> int:
    from ladle.data.inspect import format_show, show_data

    report = show_data(args.dir, args.index, split=args.split, tokenizer=args.tokenizer)
    print(json.dumps(report, indent=2, ensure_ascii=False) if args.json else format_show(report))
    return 0


def _tokenizer_parser(sub, recipes) -> None:
    s = sub.add_parser("tokenizer", help="tokenizer tools")
    tsub = s.add_subparsers(dest="tokenizer_command", required=True, metavar="COMMAND")
    t = tsub.add_parser("train", help="train a byte-level BPE tokenizer")
    t.add_argument("--input", nargs="+", required=True, metavar="PATH")
    t.add_argument("--glob", default=None, help="file-name pattern inside input folders, e.g. '*.py'")
    t.add_argument(
        "--exclude", nargs="*", default=None, metavar="PATTERN", help="paths to skip, e.g. 'test/*'"
    )
    t.add_argument("--vocab-size", type=int, required=True)
    t.add_argument("--output", required=True)
    t.set_defaults(fn=cmd_tokenizer_train)


def _data_parser(sub, recipes) -> None:
    s = sub.add_parser("data", help="data tools")
    dsub = s.add_subparsers(dest="data_command", required=True, metavar="COMMAND")
    add_prepare_parser(dsub)
    add_data_tools_parsers(dsub)


COMMANDS = {  # command -> the function that adds its sub-parser
    "tokenizer": _tokenizer_parser,
    "data": _data_parser,
}


def add_prepare_parser(dsub) -> None:
    d = dsub.add_parser("prepare", help="tokenize raw text / jsonl / parquet into memory-mapped shards")
    d.add_argument("--input", nargs="+", required=True, metavar="PATH")
    d.add_argument("--glob", default=None)
    d.add_argument("--exclude", nargs="*", default=None, metavar="PATTERN")
    d.add_argument(
        "--format",
        default="auto",
        choices=["auto", "text", "jsonl", "parquet", "messages", "sharegpt", "alpaca"],
        help="pretrain: the file format; sft: the record shape (messages, sharegpt, alpaca)",
    )
    d.add_argument("--task", default="pretrain", choices=["pretrain", "sft", "preference", "prompts"])
    d.add_argument(
        "--template",
        default=None,
        help="sft, preference, prompts: a built-in chat template (chatml, qwen, llama3)",
    )
    d.add_argument(
        "--mask", default="assistant", choices=["assistant", "last_turn", "all"], help="sft: trained tokens"
    )
    d.add_argument("--train-on-prompt", action="store_true", help="sft: same as --mask all")
    d.add_argument("--last-turn-only", action="store_true", help="sft: same as --mask last_turn")
    d.add_argument("--max-len", type=int, default=4096, help="sft, preference: longest sample, in tokens")
    d.add_argument(
        "--overlong", default="truncate", choices=["truncate", "drop"], help="sft, preference: longer samples"
    )
    d.add_argument(
        "--max-prompt-len",
        type=int,
        default=1024,
        help="prompts: longest prompt, in tokens (longer: skipped)",
    )
    d.add_argument("--text-field", default="text")
    d.add_argument("--tokenizer", required=True, metavar="DIR")
    d.add_argument("--output", required=True, metavar="DIR")
    d.add_argument("--workers", type=int, default=None)
    d.add_argument("--val-fraction", type=float, default=0.0)
    d.add_argument("--strict", action="store_true", help="stop at the first bad record")
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(fn=cmd_data_prepare)


def add_data_tools_parsers(dsub) -> None:
    d = dsub.add_parser("synth", help="write a small chat task with checkable answers (the SFT demo's data)")
    d.add_argument("--task", default="addition", choices=["addition", "sort"])
    d.add_argument("--output", required=True, metavar="DIR", help="gets train.jsonl and val.jsonl")
    d.add_argument("--train", type=int, default=20000, help="train examples")
    d.add_argument("--val", type=int, default=200, help="held-out examples (no prompt also in train)")
    d.add_argument("--max-digits", type=int, default=3, help="addition: digits per operand")
    d.add_argument("--max-words", type=int, default=5, help="sort: at most this many words (3 at least)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument(
        "--pairs",
        action="store_true",
        help="preference pairs: the correct answer against a plausible wrong one",
    )
    d.add_argument(
        "--prompts",
        action="store_true",
        help='{"prompt", "answer"} records: the RL recipes\' prompts (ladle data prepare --task prompts)',
    )
    d.set_defaults(fn=cmd_data_synth)
    d = dsub.add_parser(
        "inspect",
        help="counts, lengths and decoded samples of prepared data; with --config, a data mixture's "
        "sources: tokens, effective share, epochs by train.max_steps",
    )
    d.add_argument("dir", nargs="?", help="a prepared folder")
    d.add_argument("--config", help="a run config whose data.mix to inspect (instead of a folder)")
    d.add_argument(
        "--nproc", type=int, default=1, help="--config: the processes of the run (its global batch)"
    )
    d.add_argument("overrides", nargs="*", metavar="key.path=value", help="--config: overrides")
    d.add_argument("--samples", type=int, default=2)
    d.add_argument("--tokenizer", default=None)
    d.add_argument("--json", action="store_true")
    d.set_defaults(fn=cmd_data_inspect)
    d = dsub.add_parser(
        "show",
        help="records of prepared data decoded whole, by index (documents, chats, pairs or prompts): "
        "what a bad step's report names",
    )
    d.add_argument("dir")
    d.add_argument("index", type=int, nargs="+")
    d.add_argument("--split", default="train", choices=["train", "val"])
    d.add_argument("--tokenizer", default=None, help="default: the one meta.json names")
    d.add_argument("--json", action="store_true")
    d.set_defaults(fn=cmd_data_show)

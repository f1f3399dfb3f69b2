"""What is done with a trained model: `ladle export hf | peft`, `ladle checkpoint verify`, `ladle
eval` and `ladle generate`."""

from __future__ import annotations

import argparse
import json
import sys

from ladle.errors import LadleError


def cmd_export_hf(args) -> int:
    from ladle.ops.export import export_hf

    out = export_hf(args.checkpoint, args.out, dtype=args.dtype, max_shard_gb=args.max_shard_gb)
    print(f"Hugging Face folder written to {out}")
    return 0


def cmd_export_peft(args) -> int:
    from ladle.ops.export import export_peft

    out = export_peft(args.checkpoint, args.out)
    print(f"PEFT adapter written to {out}")
    return 0


def cmd_checkpoint_verify(args) -> int:
    from ladle.checkpoint.catalogue import check_report

    report = check_report(args.path)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for c in report["checkpoints"]:
            state = f"whole ({c['files']} files, {c['bytes'] / 2**20:,.1f} MiB)" if c["whole"] else "DAMAGED"
            print(f"{c['path']}: {state}")
            for name, why in c["problems"].items():
                print(f"  {name}: {why}")
        for note in report["notes"]:
            print(note)
    return 0 if report["whole"] else 2


def load_for_inference(args):
    """(model, tokenizer, device) for generate and eval: on --device, in --dtype."""
    import torch

    from ladle import device as dev
    from ladle.ops.export import load_any_model

    device = dev.pick_device(args.device, field="--device")
    dev.set_device(device)
    dtype = getattr(torch, args.dtype)
    return (*load_any_model(args.model, device=device, dtype=dtype, tokenizer=args.tokenizer), device)


def cmd_harness(args) -> int:
    """`ladle eval --harness TASKS`: lm-evaluation-harness tasks on ladle's model; the last line
    is one JSON object with the harness's results (task -> its metric keys -> value)."""
    import time

    from ladle.ops.harness import checked_tasks, ladle_lm, run_harness

    tasks = [t.strip() for t in args.harness.split(",") if t.strip()]
    # before the model loads: a typo costs seconds
    manager = checked_tasks(tasks, args.include_path, what="ladle eval --harness")
    model, tok, device = load_for_inference(args)
    t0 = time.perf_counter()
    out = run_harness(
        ladle_lm(model, tok, batch_size=args.batch_size),
        tasks,
        manager,
        limit=args.limit or None,
        num_fewshot=args.num_fewshot,
        output_path=args.output_path,
        name=str(args.model),
    )
    record = {"model": str(args.model), "tasks": tasks, "results": out["results"]}
    if out.get("groups"):
        record["groups"] = out["groups"]
    record["n-samples"] = out.get("n-samples", {})
    record.update(eval_s=round(time.perf_counter() - t0, 3), device=str(device), dtype=args.dtype)
    if args.output_path:
        record["output_path"] = str(args.output_path)
    print(json.dumps(record, default=str))
    return 0


def cmd_eval(args) -> int:
    import json

    from ladle.ops.evaluate import check_data_fits, evaluate

    if args.harness:
        if args.data or args.task != "loss":
            raise LadleError(
                "ladle eval --harness scores the harness's tasks on their own data; drop --data and --task"
            )
        return cmd_harness(args)
    given = [f for f, v in (("--include-path", args.include_path), ("--output-path", args.output_path),
                            ("--num-fewshot", args.num_fewshot)) if v is not None]  # fmt: skip
    if given:
        raise LadleError(f"{', '.join(given)}: only with --harness TASKS")
    if not args.data:
        raise LadleError(f"ladle eval --task {args.task} needs --data (only --harness does without)")
    model, tok, device = load_for_inference(args)
    if args.task in ("reward", "preference"):
        from ladle.ops.evaluate import evaluate_pairs

        if args.task == "reward" and model.cfg.head != "score":
            raise LadleError(f"{args.model} is not a reward model (no score head); use --task preference")
        result = evaluate_pairs(
            model,
            args.data,
            split=args.split,
            batch_size=args.batch_size,
            pad_id=tok.pad_id if tok is not None and tok.pad_id is not None else 0,
            device=device,
        )
    elif args.task == "generate":
        from ladle.ops.task_eval import evaluate_generation
        from ladle.rl.rewards import scorer

        if tok is None:
            raise LadleError(f"{args.model} has no tokenizer; pass --tokenizer")
        result = evaluate_generation(
            model,
            tok,
            args.data,
            template=args.template,
            score=scorer(args.scorer, args.answer_regex),
            max_new_tokens=args.max_new_tokens,
            batch_size=args.batch_size,
            limit=args.limit,
        )
    else:
        check_data_fits(args.data, tok, model.cfg.vocab_size)
        result = evaluate(
            model,
            args.data,
            split=args.split,
            seq_len=args.seq_len or min(model.cfg.max_seq_len, 1024),
            batch_size=args.batch_size,
            max_batches=args.max_batches,
            doc_mask=not args.no_doc_mask,
            device=device,
        )
        result = {"data": str(args.data), **result}
    print(json.dumps({"model": str(args.model), **result, "device": str(device), "dtype": args.dtype}))
    return 0


def cmd_generate(args) -> int:
    import torch

    from ladle.models.generation import generate, stop_strings, truncate_at_stop

    model, tok, _ = load_for_inference(args)
    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        raise LadleError(
            "no prompt: pass --prompt TEXT (repeatable) or prompts on standard input, one a line"
        )
    gen = torch.Generator().manual_seed(args.seed)
    ids = [tok.encode(p) for p in prompts]
    if tok.bos_id is not None and args.add_bos:
        ids = [[tok.bos_id, *x] for x in ids]
    outs = generate(
        model,
        ids,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        eos_id=tok.eos_id,
        pad_id=tok.pad_id or 0,
        generator=gen,
        stop=stop_strings(tok.decode, args.stop) if args.stop else None,
    )
    for prompt, out in zip(prompts, outs, strict=True):
        text = truncate_at_stop(tok.decode(out), args.stop or [])
        if args.json:
            print(json.dumps({"prompt": prompt, "text": text, "tokens": out}))
        else:
            print(prompt + text)
    return 0


def add_inference_args(s: argparse.ArgumentParser) -> None:
    s.add_argument(
        "--device",
        default="auto",
        help="auto (the accelerator when there is one, else the CPU), cpu, cuda or npu",
    )
    s.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="of the loaded weights"
    )


def _export_parser(sub, recipes) -> None:
    s = sub.add_parser("export", help="export a checkpoint")
    esub = s.add_subparsers(dest="export_command", required=True, metavar="FORMAT")
    e = esub.add_parser("hf", help="to a Hugging Face safetensors folder")
    e.add_argument("checkpoint", help="a checkpoints/step_* folder or a run directory (its latest)")
    e.add_argument("out")
    e.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    e.add_argument("--max-shard-gb", type=float, default=5.0)
    e.set_defaults(fn=cmd_export_hf)
    e = esub.add_parser("peft", help="an adapter run's adapters as a PEFT folder (hf merges them instead)")
    e.add_argument("checkpoint", help="a checkpoints/step_* folder or a run directory (its latest)")
    e.add_argument("out")
    e.set_defaults(fn=cmd_export_peft)


def _checkpoint_parser(sub, recipes) -> None:
    s = sub.add_parser("checkpoint", help="checkpoint tools")
    csub = s.add_subparsers(dest="checkpoint_command", required=True, metavar="COMMAND")
    c = csub.add_parser(
        "verify",
        help="check a checkpoint (or all of a run's) against its manifest: files, sizes, sha256; "
        "exit 2 when one is damaged",
    )
    c.add_argument("path", help="a checkpoints/step_* folder or a run directory")
    c.add_argument("--json", action="store_true")
    c.set_defaults(fn=cmd_checkpoint_verify)


def _eval_parser(sub, recipes) -> None:
    s = sub.add_parser(
        "eval",
        help="loss and perplexity on prepared data; (--task generate) the accuracy of greedy answers to chats; "
        "(--task reward / preference) held-out preference accuracy; (--harness) lm-evaluation-harness tasks",
    )
    s.add_argument("--model", required=True, help="a run directory, checkpoint or Hugging Face folder")
    s.add_argument(
        "--data",
        help="loss: a folder made by `ladle data prepare` (or Megatron shards); generate: a chat jsonl; "
        "required but with --harness",
    )
    s.add_argument(
        "--harness",
        metavar="TASK[,TASK...]",
        help="lm-evaluation-harness tasks (its registry, or --include-path), instead of --task "
        "(the extra ladle[eval]); docs/evaluation.md",
    )
    s.add_argument("--include-path", default=None, help="harness: a folder of your own task YAMLs")
    s.add_argument("--output-path", default=None, help="harness: where the harness writes its own results")
    s.add_argument("--num-fewshot", type=int, default=None, help="harness: default each task's own")
    s.add_argument(
        "--task",
        default="loss",
        choices=["loss", "generate", "reward", "preference"],
        help="reward / preference: held-out accuracy on preference data, of a reward model's scores / "
        "of a policy's completion log-probs",
    )
    s.add_argument(
        "--template", default=None, help="generate: a built-in chat template instead of the tokenizer's"
    )
    s.add_argument(
        "--scorer", default="exact", choices=["exact", "regex"], help="generate: how answers are compared"
    )
    s.add_argument("--answer-regex", default=None, help="generate: compare the first match (its first group)")
    s.add_argument("--max-new-tokens", type=int, default=64, help="generate")
    s.add_argument(
        "--limit",
        type=int,
        default=0,
        help="generate: the first N records; harness: N documents a task (0: all)",
    )
    s.add_argument("--split", default="val", choices=["train", "val"])
    s.add_argument("--seq-len", type=int, default=0, help="default: the model's max_seq_len, at most 1024")
    s.add_argument("--batch-size", type=int, default=8)
    s.add_argument("--max-batches", type=int, default=0, help="0: the whole split")
    s.add_argument(
        "--no-doc-mask", action="store_true", help="plain causal rows, as transformers computes them"
    )
    s.add_argument("--tokenizer", default=None, help="default: the model's own")
    add_inference_args(s)
    s.set_defaults(fn=cmd_eval)


def _generate_parser(sub, recipes) -> None:
    s = sub.add_parser("generate", help="sample from a checkpoint or Hugging Face folder")
    s.add_argument("--model", required=True)
    s.add_argument("--prompt", action="append", help="repeatable; default: one prompt a line on stdin")
    s.add_argument("--tokenizer", default=None)
    s.add_argument("--max-new-tokens", type=int, default=64)
    s.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--add-bos", action="store_true")
    s.add_argument(
        "--stop", action="append", help="repeatable; a row ends at this text, which is cut from the output"
    )
    s.add_argument("--json", action="store_true")
    add_inference_args(s)
    s.set_defaults(fn=cmd_generate)


COMMANDS = {  # command -> the function that adds its sub-parser
    "export": _export_parser,
    "checkpoint": _checkpoint_parser,
    "eval": _eval_parser,
    "generate": _generate_parser,
}

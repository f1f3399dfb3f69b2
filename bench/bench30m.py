"""The reference model of the benchmarks, *bench-30m* (32.0M parameters, untied), as a ladle
model section. `python bench/NAME.py` puts this folder on sys.path, so the scripts import it."""

BENCH_30M = {
    "vocab_size": 8192,
    "dim": 512,
    "n_layers": 8,
    "n_heads": 8,
    "n_kv_heads": 4,
    "ffn_dim": 1408,
    "max_seq_len": 512,
    "tie_embeddings": False,
}


def bench_config(
    model: dict,
    tok,
    data,
    *,
    seq_len: int,
    steps: int,
    micro_batch: int,
    precision: str,
    lr: float = 3e-4,
    **train,
) -> dict:
    """A timed run's config: constant lr, a metrics line every step, and no validation, checkpoint
    or sample to take time between steps. `train` adds or overrides train.* keys."""
    return {
        "model": model,
        "tokenizer": {"path": str(tok)},
        "data": {"path": str(data), "seq_len": seq_len},
        "optim": {"lr": lr},
        "scheduler": {"name": "constant"},
        "train": {
            "max_steps": steps,
            "micro_batch_size": micro_batch,
            "log_every": 1,
            "eval_steps": 0,
            **train,
        },
        "precision": {"mode": precision},
        "checkpoint": {"every": 0},
        "sample": {"prompt": ""},
    }

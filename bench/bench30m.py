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

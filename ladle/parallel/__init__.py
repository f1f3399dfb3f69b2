"""Parallel layouts and the model transforms that go with them (compile; FSDP2, TP, PP to come)."""

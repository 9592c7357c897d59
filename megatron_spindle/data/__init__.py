"""Data: per-task datasets (mock, tar shards), the deterministic multi-task sampler, decoding and tokenizer."""

"""Benchmarks: the norms and models against LayerNorm and BART (`suite`, `python -m
hf_powernorm.benchmarks`, figures in BENCHMARKS.md) and the data pipeline (`data`, `python -m
hf_powernorm.benchmarks.data`); `timing` holds how they measure (interleaved repeats, clocks,
threads, allocator control) and write their tables."""

from .suite import ANSWER_ROWS, ANSWER_TITLE, LAYER_CASES, MARK_BEGIN, MARK_END, MEMORY_CASES, MEMORY_OPTIONS, main

__all__ = ["ANSWER_ROWS", "ANSWER_TITLE", "LAYER_CASES", "MARK_BEGIN", "MARK_END", "MEMORY_CASES", "MEMORY_OPTIONS", "main"]

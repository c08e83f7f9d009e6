"""`python -m hf_powernorm.benchmarks`: the benchmark suite."""

from .suite import main

main()

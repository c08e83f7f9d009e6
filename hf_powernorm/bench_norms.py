"""The former layer benchmark's command: runs the benchmark suite (`python -m hf_powernorm.benchmarks`).

    python -m hf_powernorm.bench_norms [options of hf_powernorm.benchmarks]
"""

from __future__ import annotations

from .benchmarks import main

if __name__ == "__main__":
    main()

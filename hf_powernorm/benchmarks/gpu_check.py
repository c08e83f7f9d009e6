"""Every GPU check of PN's fused operator (and of DyT's and Derf's kernels) in one command, with one report
for BENCHMARKS.md.

    python -m hf_powernorm.benchmarks.gpu_check [--out gpu_check] [--repeats 7] [--quick] [--only STEP ...]
                                                [--budget SECONDS] [--no_suite_compile] [--dry_run]

Run from the repository root on a machine with a CUDA device and Triton. In order, each step a
fresh process with its own time limit, its output kept in `OUT/<step>.log`:
1. `tests`: the CUDA tests (`tests/norms/test_compile.py -k cuda`: no step waits for the device, CUDA
   steps equal the CPU's, buffers included) and the Triton kernel tests (DyT's and Derf's CUDA
   steps against the CPU's among them);
2. `host_cost`: the eager layer step, host time and device operations per step, PN, DyT and Derf /
   `F.layer_norm`;
3. `suite`: the benchmark suite on the device (layer training step and eval forward / `F.layer_norm`,
   memory, the model training step eager, `generate` tokens/s, folding);
4. `compiled`: the model training step compiled, PN in the encoder and in every layer / LayerNorm;
5. `recipe`: `accelerate launch recipes/train_wmt.py` in bf16 for a few hundred updates on the
   embedded corpus, validation and test BLEU printed.
`OUT/gpu_check.md` gathers the machine, each step's command, exit status, seconds and the tables
(the tail of each log); a failed step is reported and the next one runs. `--budget` caps the whole
run: each step gets its own limit or what is left of the budget, whichever is less, so a lease of a
few minutes ends with a report of every step that fitted. Without a CUDA device, or
without Triton, it stops at once with exit status 2 and says why. The targets it checks against
(issue "PN as cheap as LayerNorm on the GPU"): eager layer step <= 1.5x `F.layer_norm`, model step
eager <= 1.05x and compiled <= 1.0x the LayerNorm model's.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import torch

TAIL_CHARS = 12000
STEPS = ("tests", "host_cost", "suite", "compiled", "recipe")
MIN_STEP_SECONDS = 10  # under `--budget`, a step with less left than this is not started


def steps(out: Path, repeats: int, quick: bool, suite_compile: bool = True) -> list[tuple[str, list[str], int]]:
    """`(name, command, seconds allowed)` of every check, in the order they run."""
    python = sys.executable
    bench = ["--device", "cuda", "--repeats", str(repeats), "--warmup", "3"] + (["--quick"] if quick else [])
    updates = "30" if quick else "300"
    return [
        ("tests", [python, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
                   "tests/norms/test_compile.py", "tests/norms/test_kernels_triton.py", "-k",
                   "cuda or triton or interpreter or operator"], 600),
        ("host_cost", [python, "-m", "hf_powernorm.benchmarks.host_cost", "--device", "cuda"]
         + (["--quick"] if quick else []), 300),
        ("suite", [python, "-m", "hf_powernorm.benchmarks", *bench] + (["--compile"] if suite_compile else []), 900),
        ("compiled", [python, "-m", "hf_powernorm.benchmarks.compiled", *bench], 600),
        # Accelerate's launcher through this Python: no `accelerate` on PATH needed, the same environment
        ("recipe", [python, "-m", "accelerate.commands.launch", "--num_processes", "1", "--mixed_precision", "bf16",
                    "recipes/train_wmt.py", "--mixed_precision", "bf16", "--max_train_steps", updates,
                    "--eval_steps", updates, "--output_dir", str(out / "train_wmt"), "--overwrite_output_dir"], 900),
    ]


def refuse_without_gpu() -> str | None:
    """Why the checks cannot run here, or None."""
    if not torch.cuda.is_available():
        return "no CUDA device here (torch.cuda.is_available() is False): run this on a machine with a GPU"
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed: PN's CUDA operator would run its torch ops, not the kernels under check"
    return None


def _machine() -> str:
    import transformers
    import triton

    name = torch.cuda.get_device_name(0)
    now = datetime.datetime.now(datetime.timezone.utc)
    return (f"{name}; Python {sys.version.split()[0]}, torch {torch.__version__}, triton {triton.__version__}, "
            f"transformers {transformers.__version__}; {now:%Y-%m-%d %H:%M} UTC")


def run_step(name: str, command: list[str], limit: int, out: Path) -> tuple[int | str, float, str]:
    """Run one check; `(exit status or "timed out", seconds, the log's tail)`."""
    start = time.perf_counter()
    log = out / f"{name}.log"
    with open(log, "w") as handle:
        try:
            status = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, timeout=limit,
                                    check=False).returncode
        except subprocess.TimeoutExpired:
            status = "timed out"
        except OSError as err:  # no such program (accelerate not on PATH)
            handle.write(f"could not start: {err}\n")
            status = "not started"
    text = log.read_text(errors="replace")
    return status, time.perf_counter() - start, text[-TAIL_CHARS:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_check"), help="folder of the logs and the report")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved repeats of every timing")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and a 30-update recipe: checks the script")
    parser.add_argument("--only", nargs="+", choices=STEPS, help="these steps only (default: all, in order)")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for the whole run; each step gets at most what is left (default: no cap)")
    parser.add_argument("--no_suite_compile", dest="suite_compile", action="store_false",
                        help="leave the suite's torch.compile rows out (the `compiled` step times whole models)")
    parser.add_argument("--dry_run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args(argv)
    if args.budget is not None and args.budget <= 0:
        parser.error(f"--budget must be a positive number of seconds, got {args.budget}")
    plan = [step for step in steps(args.out, args.repeats, args.quick, args.suite_compile)
            if not args.only or step[0] in args.only]
    if args.dry_run:
        for name, command, limit in plan:
            print(f"{name} ({limit} s): {' '.join(command)}")
        return 0
    reason = refuse_without_gpu()
    if reason is not None:
        print(f"gpu_check: {reason}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    report = [f"# GPU check of PN's operator\n\nMachine: {_machine()}.\n"]
    failed = []
    deadline = None if args.budget is None else time.monotonic() + args.budget
    for name, command, limit in plan:
        left = None if deadline is None else int(deadline - time.monotonic())
        if left is not None and left < MIN_STEP_SECONDS:
            failed.append(name)
            report.append(f"## {name}: not run, the budget of {args.budget:.0f} s was spent\n")
        else:
            print(f"gpu_check: {name} ...", flush=True)
            status, seconds, tail = run_step(name, command, limit if left is None else min(limit, left), args.out)
            if status != 0:
                failed.append(name)
            report.append(f"## {name}: exit status {status}, {seconds:.0f} s\n\nCommand: `{' '.join(command)}`\n\n"
                          f"```\n{tail.strip()}\n```\n")
        (args.out / "gpu_check.md").write_text("\n".join(report))  # what ran so far, if a later step hangs
    print(f"gpu_check: report in {args.out / 'gpu_check.md'}; "
          + (f"failed: {', '.join(failed)}" if failed else "every step passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

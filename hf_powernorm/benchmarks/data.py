"""Data benchmark: peak memory and time of the language-modelling data path against corpus size.

    python -m hf_powernorm.benchmarks.data --train_file ptb/ptb.train.txt [--copies 1 10 100]

The corpus is the text file repeated `--copies` times (100 copies of PTB's training text are
about WikiText-103's 100M tokens). For each size a fresh process reads it with `load_lm_dataset`,
tokenizes it with `tokenize_lines`, cuts `--block_size` blocks with `lm_blocks` and takes the
batching lengths (`sequence_lengths`) - what `recipes/train_lm.py` does before training - with a
BPE trained once on the original file, and reports its peak resident memory (`ru_maxrss`) and
wall time. Each size uses an empty `datasets` cache of its own, so tokenization is really done.
Two memory figures: the peak of anonymous resident memory (sampled every 50 ms: what the process
allocates itself) and the peak resident set (`ru_maxrss`), which also counts the pages of the
memory-mapped Arrow files it has read - page cache the kernel reclaims under pressure.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

_CHILD = """
import json, resource, sys, threading, time
from ..training import lm_blocks, load_lm_dataset, load_tokenizer, sequence_lengths, tokenize_lines

def anonymous_mb():  # resident memory that is not a mapped file (Arrow files are memory-mapped)
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    return float("nan")

peak, done = [anonymous_mb()], threading.Event()
def sample():
    while not done.wait(0.05):
        peak.append(max(peak[-1], anonymous_mb()))
threading.Thread(target=sample, daemon=True).start()
corpus, tokenizer_dir, block_size, num_proc = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
started = time.perf_counter()
raw = load_lm_dataset(data_files={"train": corpus})
lines = tokenize_lines(raw, load_tokenizer(tokenizer_dir), num_proc=num_proc or None)
blocks = lm_blocks(lines, block_size, num_proc=num_proc or None)["train"]
lengths = sequence_lengths(blocks)
seconds = time.perf_counter() - started
done.set()
print(json.dumps({"lines": len(raw["train"]), "tokens": sum(lengths) - len(lengths) + 1, "blocks": len(lengths),
                  "seconds": seconds, "peak_anon_mb": max(peak + [anonymous_mb()]),
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def _repeat(text: Path, copies: int, target: Path) -> Path:
    with open(target, "wb") as out:
        for _ in range(copies):
            with open(text, "rb") as handle:
                shutil.copyfileobj(handle, out)
    return target


def measure(text: Path, copies: int, tokenizer_dir: Path, block_size: int, num_proc: int, workdir: Path) -> dict:
    """Run the data path on `copies` copies of `text` in a fresh process; its figures."""
    corpus = _repeat(text, copies, workdir / f"corpus_{copies}.txt")
    env = {"HF_HOME": str(workdir / f"hf_{copies}"), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "PATH": "/usr/bin:/bin", "TMPDIR": str(workdir)}
    child = subprocess.run([sys.executable, "-c", _CHILD, str(corpus), str(tokenizer_dir), str(block_size),
                            str(num_proc)], env=env, capture_output=True, text=True, check=False)
    if child.returncode != 0:
        raise RuntimeError(f"the data path failed on {copies} copies:\n{child.stderr[-3000:]}")
    figures = json.loads(child.stdout.strip().splitlines()[-1])
    corpus.unlink()
    shutil.rmtree(workdir / f"hf_{copies}", ignore_errors=True)
    return {"copies": copies, "megabytes": corpus_size(text) * copies / 2**20, **figures}


def corpus_size(text: Path) -> int:
    return text.stat().st_size


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train_file", "--text", dest="text", required=True,
                        help="a plain-text corpus file, one line a row (e.g. PTB's ptb.train.txt)")
    parser.add_argument("--copies", type=int, nargs="+", default=[1, 10, 100])
    parser.add_argument("--vocab_size", type=int, default=16000)
    parser.add_argument("--block_size", type=int, default=256)
    parser.add_argument("--num_proc", type=int, default=0, help="tokenization processes (0: in-process)")
    args = parser.parse_args(argv)
    text = Path(args.text)
    if not text.is_file():
        raise FileNotFoundError(f"--train_file {text}: not found")
    from ..training import column_texts, load_lm_dataset, train_bpe_tokenizer

    with tempfile.TemporaryDirectory(prefix="bench_data_") as tmp:
        workdir = Path(tmp)
        tokenizer_dir = workdir / "tokenizer"
        raw = load_lm_dataset(data_files={"train": str(text)})
        train_bpe_tokenizer(column_texts(raw["train"]), args.vocab_size).save_pretrained(tokenizer_dir)
        rows = [measure(text, copies, tokenizer_dir, args.block_size, args.num_proc, workdir)
                for copies in args.copies]
    print(f"{platform.processor() or platform.machine()}, Python {platform.python_version()}, "
          f"baseline process {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")
    print("| copies | text MB | tokens | blocks | peak anonymous MB | peak RSS MB (with mapped files) | seconds |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['copies']} | {row['megabytes']:.0f} | {row['tokens']:,} | {row['blocks']:,} | "
              f"{row['peak_anon_mb']:.0f} | {row['peak_rss_mb']:.0f} | {row['seconds']:.0f} |")
    return rows


if __name__ == "__main__":
    main()

"""A whole model under `torch.compile`: graph breaks and the training step, PN against LayerNorm.

    python -m hf_powernorm.benchmarks.compiled [--device cuda] [--backend inductor] [--quick]

For the encoder-decoder model of the benchmark suite (`suite.our_model`: PN or LayerNorm in the
encoder, LayerNorm in the decoder) and the same model with PN in every layer, this prints one
markdown table:
- graph breaks of the training forward (`torch._dynamo.explain`; 0 is the claim);
- the training step (forward, backward, AdamW), compiled, against the same model eager, and the
  compiled PN model against the compiled LayerNorm model: medians of interleaved repeats, fresh
  gradients every repeat (`timing.interleaved`);
- the seconds of the first compiled step (compiling included).
`--backend aot_eager` checks the tracing on a machine without a compiler (no code generated, so its
times say nothing about speed).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from .suite import model_batch, model_sizes, our_model
from .timing import cell, clock, interleaved, machine_line, markdown, progress


def _model(sizes: dict, norm: str, everywhere: bool, device: str):
    model = our_model(sizes, norm, device)
    if everywhere:
        config = model.config
        config.decoder_norm_type = norm
        torch.manual_seed(0)
        model = type(model)(config).to(device)
    return model.train()


def _step(model, batch, compiled: bool, backend: str):
    forward = torch.compile(model, backend=backend) if compiled else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        optimizer.zero_grad(set_to_none=True)
        forward(**batch).loss.backward()
        optimizer.step()
    return step


def run(sizes: dict, device: str, backend: str, repeats: int, warmup: int) -> tuple[list[str], list[list[str]]]:
    batch = model_batch(sizes, device)
    now = clock(device)
    rows = []
    for label, norm, everywhere in (("PN encoder, LN decoder", "powernorm", False),
                                    ("PN in every layer", "powernorm", True),
                                    ("LayerNorm", "layernorm", False)):
        torch._dynamo.reset()
        explanation = torch._dynamo.explain(_model(sizes, norm, everywhere, device))(**batch)
        eager = _step(_model(sizes, norm, everywhere, device), batch, False, backend)
        compiled = _step(_model(sizes, norm, everywhere, device), batch, True, backend)
        start = now()
        compiled()
        first = now() - start
        rows.append([label, str(explanation.graph_count), str(explanation.graph_break_count), f"{first:.1f}",
                     cell(interleaved(compiled, eager, repeats, warmup, device)), compiled])
        progress(" | ".join(rows[-1][:-1]))
    ln_compiled = rows[-1][-1]
    for row in rows:
        step = row.pop()
        row.append(cell(interleaved(step, ln_compiled, repeats, warmup, device)) if row[0] != "LayerNorm" else "1")
    header = ["model", "graphs", "graph breaks", "first compiled step, s", "compiled step / eager step",
              "compiled step / compiled LayerNorm model's"]
    return header, rows


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (aot_eager: tracing only)")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 3 repeats: checks that it runs")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    repeats, warmup = (3, 1) if args.quick else (args.repeats, args.warmup)
    command = "python -m hf_powernorm.benchmarks.compiled " + " ".join(argv if argv is not None else sys.argv[1:])
    start_load = os.getloadavg()[0]
    header, rows = run(model_sizes(args.quick), args.device, args.backend, repeats, warmup)
    text = machine_line(args.device, command.strip(), (start_load, os.getloadavg()[0])) + "\n\n"
    text += markdown(f"Training step under torch.compile (backend {args.backend}): median (25-75%), candidate ms",
                     header, rows)
    print(text)
    return text


if __name__ == "__main__":
    main()

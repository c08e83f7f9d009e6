"""LayerNorm, BatchNorm and no normalization in a post-norm Transformer encoder on Financial PhraseBank.

Reproduces "The Benefits of Normalization Layers in Transformers" (Yu, 2024) with the model family's
post-norm encoder, plain SGD and the sentences of Financial PhraseBank on which all annotators agree;
norms: the document's `layernorm`, `batchnorm` (padding left out of the statistics) and `none`, and
this project's `powernorm` and `rmsnorm` as an extension. It measures (1) which learning rates
converge (document Tables 1-6), (2) the per-layer gradient norms at initialization (Figures 2-3),
(3) the need for a careful initialization, (4) loss curves (Figure 4) and (5) the Lipschitz constant
and smoothness of the loss along the gradient (Figures 5-6). Each measurement's definition, the
criterion of convergence and the choices where the document is silent: docs/phrasebank_norms.md,
"What the code measures". A grid cell is one part of the study for one seed, covering every norm of
`--norms`.

Writes `results.csv` (one row per training run), `gradient_norms.csv`, `lipschitz.csv`,
`summary.md` and the figures `gradient_norms.png`, `loss_curves.png`, `lipschitz.png` into
`--output_dir`.

    python recipes/studies/phrasebank_norms.py --data_dir DIR --jobs 2       # DIR holds the PhraseBank
    python recipes/studies/phrasebank_norms.py --smoke --output_dir /tmp/p   # embedded corpus, seconds

Runs resume: a finished grid cell is never redone (`hf_powernorm.training.grid`).
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import (
    PowerNormTransformerConfig,
    PowerNormTransformerForSequenceClassification,
)
from ..training import (
    PaddingCollator,
    TokenBudgetBatchSampler,
    eval_loader,
    load_classification_dataset,
    synthetic_classification_corpus,
    tokenize_classification,
)
from ..training.executors import add_executor_args
from ..training.grid import Cell
from ..training.options import BadInput, MissingInput
from ..training.reports import seeds_of
from .runs import run_study

DOCUMENT_NORMS = ("layernorm", "batchnorm", "none")
NORMS = (*DOCUMENT_NORMS, "powernorm", "rmsnorm")
LEARNING_RATES = (10.0, 1.0, 0.5, 0.1, 1e-2, 1e-3, 1e-4)
DEPTHS = {"shallow": 1, "deep": 5}
WIDTH_NAMES = ("narrow", "normal", "wide")
SHAPES = tuple(f"{layers}-{width}" for layers in DEPTHS.values() for width in WIDTH_NAMES)
PHRASEBANK_FILE = Path("financial_phrasebank") / "utf8_lf" / "Sentences_AllAgree.txt"
DIVERGENCE_FACTOR = 10.0
PROBE_FRACTIONS = (0.125, 0.25, 0.5, 1.0)  # a = fraction x lr
INIT_SCALES = {"xavier-kaiming": None, "U(-0.1,0.1)": 0.1, "U(-100,100)": 100.0}
INIT_LEARNING_RATES = {1: 0.1, 5: 1e-3}
CURVE_LEARNING_RATES = {"converging": 0.1, "borderline": 0.5}
CURVE_WINDOW = 10
LIPSCHITZ_SHAPE, LIPSCHITZ_LEARNING_RATE = "1-wide", 0.1
HEADS, FFN_FACTOR = 4, 4

SIZES = {"real": {"vocab_size": 2000, "max_length": 64, "batch_size": 32, "epochs": 3, "grad_batches": 16,
                  "probe_every": 20, "powernorm_warmup": 50},
         "smoke": {"vocab_size": 120, "max_length": 24, "batch_size": 16, "epochs": 1, "grad_batches": 2,
                   "probe_every": 1, "powernorm_warmup": 1}}
WIDTHS = {"real": [32, 64, 128], "smoke": [8, 12, 16]}
SMOKE_CORPUS = {"train": 32, "validation": 16, "test": 16}

# The document's Tables 1-6 (True: converged), by shape, learning rate and norm.
_C, _N = True, False
DOCUMENT_TABLES: dict[str, dict[float, tuple[bool, bool, bool]]] = {
    shape: dict(zip(LEARNING_RATES, rows)) for shape, rows in {
        "1-narrow": [(_N, _N, _N), (_N, _N, _N), (_C, _C, _N), (_C, _C, _C), (_C, _C, _C), (_C, _C, _C), (_C, _C, _C)],
        "1-normal": [(_N, _N, _N), (_N, _N, _N), (_C, _C, _N), (_C, _C, _C), (_C, _C, _C), (_C, _C, _C), (_C, _C, _C)],
        "1-wide": [(_N, _N, _N), (_N, _N, _N), (_C, _N, _N), (_C, _C, _C), (_C, _C, _C), (_C, _C, _C), (_C, _C, _C)],
        "5-narrow": [(_N, _N, _N), (_N, _N, _N), (_C, _N, _N), (_C, _N, _N), (_C, _N, _N), (_C, _C, _C), (_C, _C, _C)],
        "5-normal": [(_N, _N, _N), (_N, _N, _N), (_C, _N, _N), (_C, _N, _N), (_C, _N, _N), (_C, _C, _C), (_C, _C, _C)],
        "5-wide": [(_N, _N, _N), (_N, _N, _N), (_C, _N, _N), (_C, _N, _N), (_C, _N, _N), (_C, _N, _N), (_C, _C, _C)],
    }.items()}
DOCUMENT_TABLE_NUMBERS = {shape: number for number, shape in enumerate(SHAPES, start=1)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data_dir", help=f"a folder holding {PHRASEBANK_FILE}")
    p.add_argument("--phrasebank_file", help="a Financial PhraseBank file (sentence@label per line), instead of "
                                             "--data_dir")
    p.add_argument("--output_dir", default="outputs/studies/phrasebank_norms")
    p.add_argument("--tokenizer", help="a saved WordPiece tokenizer folder (default: trained on the training split)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--norms", nargs="+", default=list(NORMS), choices=list(NORMS))
    p.add_argument("--learning_rates", type=float, nargs="+", default=list(LEARNING_RATES))
    p.add_argument("--widths", type=int, nargs=3, help=f"narrow, normal, wide hidden sizes; default {WIDTHS['real']}")
    add_executor_args(p)
    p.add_argument("--smoke", action="store_true", help="the embedded corpus at tiny sizes (seconds)")
    p.add_argument("--report_only", action="store_true",
                   help="write the outputs from the runs finished so far, and run nothing")
    for name, value in SIZES["real"].items():
        p.add_argument(f"--{name}", type=type(value), help=f"default {value} ({SIZES['smoke'][name]} with --smoke)")
    args = p.parse_args(argv)
    sizes = "smoke" if args.smoke else "real"
    for name, value in SIZES[sizes].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.widths = args.widths or WIDTHS[sizes]
    if args.phrasebank_file is None and args.data_dir is not None:
        args.phrasebank_file = str(Path(args.data_dir) / PHRASEBANK_FILE)
    if args.phrasebank_file is None and not args.smoke:
        raise BadInput("no data: pass --phrasebank_file (the Sentences_AllAgree.txt file) or --data_dir (a folder "
                       f"holding {PHRASEBANK_FILE}); or --smoke for the embedded corpus at tiny sizes")
    if args.phrasebank_file is not None and not Path(args.phrasebank_file).is_file():
        raise MissingInput(f"--phrasebank_file {args.phrasebank_file}: not found")
    return args


# ----------------------------------------------------------------------------------------------
# Data and model


def _raw_data(options: dict[str, Any]):
    """The sentences: PhraseBank's full-agreement file split 80/10/10, or the small embedded corpus."""
    if options["phrasebank"] is None:
        return synthetic_classification_corpus(SMOKE_CORPUS, seed=3)
    return load_classification_dataset(data_files={"train": options["phrasebank"]}, seed=0)


def train_wordpiece_tokenizer(texts: Any, vocab_size: int):
    """A BERT-style WordPiece tokenizer (lower-cased, `[CLS] ... [SEP]`) trained on `texts` with the
    `tokenizers` library's WordPiece trainer, as a Transformers fast tokenizer."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    tokenizer.train_from_iterator(texts, trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=special))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[(t, tokenizer.token_to_id(t)) for t in ("[CLS]", "[SEP]")])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", unk_token="[UNK]",
                                   cls_token="[CLS]", sep_token="[SEP]")


def load_wordpiece_tokenizer(path: str | Path):
    """A saved tokenizer folder (ours, or e.g. BERT's), which must have a padding token."""
    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        raise MissingInput(f"--tokenizer {path}: no such folder")
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if tokenizer.pad_token_id is None:
        raise BadInput(f"--tokenizer {path} has no padding token; the batches need one")
    return tokenizer


def _prepare(args: argparse.Namespace, output_dir: Path) -> dict[str, Any]:
    """Train (or take) the tokenizer once and fill the tokenization cache, so the cells only read it."""
    phrasebank = str(Path(args.phrasebank_file).resolve()) if args.phrasebank_file else None
    data = {"phrasebank": phrasebank}
    tokenizer_dir = Path(args.tokenizer) if args.tokenizer else output_dir / "tokenizer"
    if not args.tokenizer and not (tokenizer_dir / "tokenizer.json").is_file():
        train_wordpiece_tokenizer(_raw_data(data)["train"]["text"], args.vocab_size).save_pretrained(tokenizer_dir)
    data["tokenizer"] = str(tokenizer_dir.resolve())
    tokenize_classification(_raw_data(data), load_wordpiece_tokenizer(tokenizer_dir), args.max_length)
    return data


def _load_data(options: dict[str, Any]) -> tuple[Any, Any, PaddingCollator]:
    tokenizer = load_wordpiece_tokenizer(options["tokenizer"])
    tokenized = tokenize_classification(_raw_data(options), tokenizer, options["max_length"])
    columns = tokenized.select_columns(["input_ids", "label", "length"])
    return tokenizer, columns, PaddingCollator(tokenizer.pad_token_id)


def build_classifier(tokenizer: Any, options: dict[str, Any], norm: str, layers: int, hidden: int):
    """The post-norm encoder classifier of one shape with one norm (weights not yet initialized)."""
    special = {"pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.cls_token_id,
               "eos_token_id": tokenizer.sep_token_id, "decoder_start_token_id": tokenizer.sep_token_id}
    config = PowerNormTransformerConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, encoder_layers=layers, decoder_layers=0,
        num_attention_heads=HEADS, intermediate_size=FFN_FACTOR * hidden, normalize_before=False,
        encoder_norm_type=norm, decoder_norm_type=norm, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, activation_function="relu", position_embedding_type="sinusoidal",
        max_position_embeddings=options["max_length"] + 2, powernorm_warmup_steps=options["powernorm_warmup"],
        num_labels=3, is_encoder_decoder=False, **special)
    return PowerNormTransformerForSequenceClassification(config)


def initialize(model: Any, uniform_scale: float | None = None) -> None:
    """Kaiming (ReLU, fan-in) for the feed-forward layers and Xavier for every other weight matrix
    (attention, classifier, token embedding), biases 0, padding embedding 0; or every weight matrix
    from U(-uniform_scale, uniform_scale)."""
    import torch
    from torch import nn

    with torch.no_grad():
        for name, module in model.named_modules():
            if not isinstance(module, (nn.Linear, nn.Embedding)):
                continue
            if uniform_scale is not None:
                nn.init.uniform_(module.weight, -uniform_scale, uniform_scale)
            elif isinstance(module, nn.Linear) and ".ffn." in f".{name}.":
                nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
            else:
                nn.init.xavier_uniform_(module.weight)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
            if isinstance(module, nn.Embedding) and module.padding_idx is not None:
                module.weight[module.padding_idx].zero_()


def _seeded_model(tokenizer: Any, options: dict[str, Any], layers: int, hidden: int,
                  uniform_scale: float | None = None):
    import torch

    torch.manual_seed(options["seed"])
    model = build_classifier(tokenizer, options, options["norm"], layers, hidden)
    initialize(model, uniform_scale)
    return model.train()


# ----------------------------------------------------------------------------------------------
# Measurement


def snapshot(model: Any) -> dict[str, Any]:
    """A copy of every parameter and buffer (running statistics and step counters included)."""
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def restore(model: Any, state: dict[str, Any]) -> None:
    model.load_state_dict(state)
    model.zero_grad(set_to_none=True)


def loss_and_gradient(model: Any, loss_fn: Callable[[Any], Any]) -> tuple[float, list[Any]]:
    """`loss_fn(model)` and its gradient with respect to every trainable parameter."""
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model)
    loss.backward()
    grads = [p.grad.detach().clone() if p.grad is not None else p.detach() * 0
             for p in model.parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def _norm(tensors: list[Any]) -> float:
    return math.sqrt(sum(float(t.double().square().sum()) for t in tensors))


def probe_along_gradient(model: Any, loss_fn: Callable[[Any], Any], steps: list[float]) -> dict[str, float]:
    """Santurkar et al.'s measures along the gradient g at the current weights W, for every step
    size a of `steps`: the Lipschitz estimate `max_a |L(W) - L(W - a g)| / (a ||g||)`, the
    smoothness estimate `max_a ||g(W) - g(W - a g)|| / (a ||g||)`, and the document's undivided
    `max_a |L(W) - L(W - a g)|` and `max_a ||g(W) - g(W - a g)||`. The model's mode is left as it
    is; its parameters and buffers are restored after every evaluation, so the probe leaves no trace."""
    import torch

    state = snapshot(model)
    loss, grad = loss_and_gradient(model, loss_fn)
    restore(model, state)
    grad_norm = _norm(grad)
    out = {"loss": loss, "grad_norm": grad_norm, "lipschitz": 0.0, "smoothness": 0.0, "loss_change": 0.0,
           "grad_change": 0.0}
    parameters = [p for p in model.parameters() if p.requires_grad]
    for step in steps:
        with torch.no_grad():
            for parameter, g in zip(parameters, grad):
                parameter.sub_(step * g)
        moved_loss, moved_grad = loss_and_gradient(model, loss_fn)
        restore(model, state)
        loss_change = abs(loss - moved_loss)
        grad_change = _norm([a - b for a, b in zip(grad, moved_grad)])
        scale = step * grad_norm if grad_norm > 0 else float("inf")
        out["loss_change"] = max(out["loss_change"], loss_change)
        out["grad_change"] = max(out["grad_change"], grad_change)
        out["lipschitz"] = max(out["lipschitz"], loss_change / scale)
        out["smoothness"] = max(out["smoothness"], grad_change / scale)
    return out


def batch_loss(batch: dict[str, Any]) -> Callable[[Any], Any]:
    return lambda model: model(**batch).loss


def layer_gradient_norms(model: Any) -> dict[str, float]:
    """The gradient norm of the embeddings, of each encoder layer and of the classifier."""
    groups: dict[str, list[Any]] = {}
    for name, parameter in model.named_parameters():
        if parameter.grad is None:
            continue
        parts = name.split(".")
        key = (f"layer{parts[parts.index('layers') + 1]}" if "layers" in parts
               else "embeddings" if "embeddings" in parts else parts[0])
        groups.setdefault(key, []).append(parameter.grad)
    return {key: _norm(grads) for key, grads in groups.items()}


def evaluate(model: Any, loader: Any) -> dict[str, float]:
    """Mean loss and accuracy over a split, in eval mode."""
    import torch

    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    with torch.no_grad():
        for batch in loader:
            output = model(**batch)
            loss_sum += float(output.loss) * len(batch["labels"])
            correct += int((output.logits.argmax(-1) == batch["labels"]).sum())
            count += len(batch["labels"])
    model.train()
    return {"loss": loss_sum / count, "accuracy": correct / count}


def training_batches(data: dict[str, Any], options: dict[str, Any], seed: int) -> tuple[Any, Any]:
    """Batches of `batch_size` sentences of similar length (fairseq's bucketing, without the token
    budget binding: at most `batch_size` x `max_length` tokens), in an order shuffled by (seed, epoch)."""
    from torch.utils.data import DataLoader

    sampler = TokenBudgetBatchSampler(data["train"]["length"], options["batch_size"] * options["max_length"],
                                      seed=seed, max_sentences=options["batch_size"])
    return DataLoader(data["train"], batch_sampler=sampler, collate_fn=data["collate"]), sampler


def train_sgd(model: Any, data: dict[str, Any], options: dict[str, Any], learning_rate: float,
              probe: Callable[[Any, int], None] | None = None) -> dict[str, Any]:
    """Plain SGD for `epochs` epochs, stopped at the first loss that is NaN/inf or above the
    divergence bound; per-update training losses, per-epoch training means and validation scores."""
    import torch

    optimizer = torch.optim.SGD(model.parameters(), lr=learning_rate)
    loader, sampler = training_batches(data, options, options["seed"])
    losses: list[float] = []
    epochs: list[dict[str, float]] = []
    bound, diverged_at = None, None
    for epoch in range(options["epochs"]):
        sampler.set_epoch(epoch)
        for batch in loader:
            if probe is not None:
                probe(model, len(losses))
            loss = model(**batch).loss
            value = float(loss.detach())
            bound = bound if bound is not None else DIVERGENCE_FACTOR * max(value, math.log(3))
            if not math.isfinite(value) or value > bound:
                diverged_at = len(losses) + 1
                break
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(value)
        if diverged_at is not None:
            break
        epochs.append({"train_loss": statistics.fmean(losses[-len(loader):]),
                       **{f"validation_{k}": v for k, v in evaluate(model, data["validation"]).items()}})
    return {"losses": losses, "epochs": epochs, "diverged_at": diverged_at, "updates_per_epoch": len(loader)}


def outcome(run: dict[str, Any], prior_entropy: float) -> dict[str, Any]:
    """Converged: no divergence and the last epoch's mean training loss below the first epoch's;
    fit: converged and the last epoch's mean training loss below the label prior's entropy."""
    epochs = run["epochs"]
    finished = run["diverged_at"] is None and len(epochs) > 0
    first, last = (epochs[0]["train_loss"], epochs[-1]["train_loss"]) if finished else (math.nan, math.nan)
    converged = finished and last < first if len(epochs) > 1 else finished and last < run["losses"][0]
    return {"converged": bool(converged), "fit": bool(converged and last < prior_entropy),
            "diverged_at": run["diverged_at"], "first_epoch_loss": first, "last_epoch_loss": last,
            "initial_loss": run["losses"][0] if run["losses"] else math.nan,
            "validation_loss": epochs[-1]["validation_loss"] if finished else math.nan,
            "validation_accuracy": epochs[-1]["validation_accuracy"] if finished else math.nan,
            "updates": len(run["losses"])}


def label_prior_entropy(labels: list[int]) -> float:
    counts = [labels.count(label) for label in set(labels)]
    return -sum(c / len(labels) * math.log(c / len(labels)) for c in counts)


# ----------------------------------------------------------------------------------------------
# Grid cells: each covers every norm of `--norms` for one seed


def _cell_data(options: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    tokenizer, tokenized, collate = _load_data(options)
    data = {"train": tokenized["train"], "collate": collate,
            "validation": eval_loader(tokenized["validation"].select_columns(["input_ids", "label"]), collate, 64),
            "prior_entropy": label_prior_entropy(list(tokenized["train"]["label"]))}
    return tokenizer, data


def _timed_run(model: Any, data: dict[str, Any], options: dict[str, Any], learning_rate: float,
               **row: Any) -> dict[str, Any]:
    start = time.perf_counter()
    run = train_sgd(model, data, options, learning_rate)
    return {**row, "learning_rate": learning_rate, **outcome(run, data["prior_entropy"]),
            "seconds": time.perf_counter() - start,
            "curve": {"losses": run["losses"], "epochs": run["epochs"], "updates_per_epoch": run["updates_per_epoch"]}}


def convergence_cell(options: dict[str, Any]) -> dict[str, Any]:
    """One shape and seed: every norm at every learning rate."""
    tokenizer, data = _cell_data(options)
    runs = []
    for norm in options["norms"]:
        for lr in options["learning_rates"]:
            model = _seeded_model(tokenizer, {**options, "norm": norm}, options["layers"], options["hidden"])
            runs.append(_timed_run(model, data, options, lr, norm=norm, shape=options["shape"],
                                   layers=options["layers"], init="xavier-kaiming"))
    return {"runs": runs}


def _expected_gradient_norms(model: Any, data: dict[str, Any], options: dict[str, Any]) -> dict[str, float]:
    """Per-group gradient norms averaged over `grad_batches` training batches, each taken at the
    initial weights and buffers."""
    loader, _ = training_batches(data, options, options["seed"])
    state, per_batch = snapshot(model), []
    for _, batch in zip(range(options["grad_batches"]), loader):
        model(**batch).loss.backward()
        per_batch.append(layer_gradient_norms(model))
        restore(model, state)
    return {key: statistics.fmean(b[key] for b in per_batch) for key in per_batch[0]}


def gradient_cell(options: dict[str, Any]) -> dict[str, Any]:
    """Gradient norms at initialization of the normal-width model of both depths, per norm."""
    tokenizer, data = _cell_data(options)
    norms = {norm: {depth: _expected_gradient_norms(
        _seeded_model(tokenizer, {**options, "norm": norm}, layers, options["widths"][1]), data, options)
        for depth, layers in DEPTHS.items()} for norm in options["norms"]}
    return {"gradient_norms": norms}


def init_cell(options: dict[str, Any]) -> dict[str, Any]:
    """The normal-width model of each depth trained from each initialization scale, per norm."""
    tokenizer, data = _cell_data(options)
    runs = []
    for norm in options["norms"]:
        for layers, lr in INIT_LEARNING_RATES.items():
            for init, scale in INIT_SCALES.items():
                model = _seeded_model(tokenizer, {**options, "norm": norm}, layers, options["widths"][1], scale)
                run = _timed_run(model, data, options, lr, norm=norm, init=init, layers=layers)
                runs.append({k: v for k, v in run.items() if k != "curve"})
    return {"runs": runs}


def _probed_training(tokenizer: Any, data: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    model = _seeded_model(tokenizer, options, 1, options["widths"][2])
    loader, _ = training_batches(data, options, seed=0)
    fixed = next(iter(loader))
    steps = [f * LIPSCHITZ_LEARNING_RATE for f in PROBE_FRACTIONS]
    probes: list[dict[str, float]] = []

    def probe(model: Any, update: int) -> None:
        if update % options["probe_every"] == 0:
            probes.append({"update": update, **probe_along_gradient(model, batch_loss(fixed), steps)})

    run = train_sgd(model, data, options, LIPSCHITZ_LEARNING_RATE, probe)
    return {"probes": probes, **outcome(run, data["prior_entropy"])}


def lipschitz_cell(options: dict[str, Any]) -> dict[str, Any]:
    """The 1-layer wide model at learning rate 0.1, probed along the gradient every `probe_every`
    updates on one fixed training batch, per norm."""
    tokenizer, data = _cell_data(options)
    return {"lipschitz": {norm: _probed_training(tokenizer, data, {**options, "norm": norm})
                          for norm in options["norms"]}}


CELL_KINDS = {"convergence": convergence_cell, "gradients": gradient_cell, "init": init_cell,
              "lipschitz": lipschitz_cell}


def run_cell(cell: Cell, folder: Path) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)  # cells share the machine's cores (--jobs)
    return CELL_KINDS[cell.options["kind"]](cell.options)


def cells(args: argparse.Namespace, data: dict[str, Any]) -> list[Cell]:
    """Seed by seed (a grid stopped early leaves whole seeds), the costliest shapes first."""
    sizes = {name: getattr(args, name) for name in SIZES["real"]}
    common = {**data, **sizes, "widths": args.widths, "norms": args.norms}
    grid = []
    for seed in args.seeds:
        for shape in sorted(SHAPES, key=lambda s: (-int(s[0]), -WIDTH_NAMES.index(s.split("-")[1]))):
            layers, width = shape.split("-")
            grid.append(Cell(f"convergence-{shape}-seed{seed}", {
                **common, "kind": "convergence", "seed": seed, "shape": shape, "layers": int(layers),
                "hidden": args.widths[WIDTH_NAMES.index(width)], "learning_rates": args.learning_rates},
                paths=tuple(data)))
        grid += [Cell(f"{kind}-seed{seed}", {**common, "kind": kind, "seed": seed}, paths=tuple(data))
                 for kind in ("init", "lipschitz", "gradients")]
    return grid


# ----------------------------------------------------------------------------------------------
# Results


def _runs(results: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [{"seed": r["seed"], **run} for r in results if r["kind"] == kind for run in r["runs"]]


RUN_COLUMNS = ("study", "shape", "layers", "norm", "seed", "init", "learning_rate", "converged", "fit",
               "diverged_at", "initial_loss", "first_epoch_loss", "last_epoch_loss", "validation_loss",
               "validation_accuracy", "updates", "seconds")


def _write_csv(path: Path, rows: list[dict[str, Any]], columns: list[str] | tuple[str, ...]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(columns), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def write_csvs(results: list[dict[str, Any]], output_dir: Path) -> None:
    rows = [{"study": "convergence", **r} for r in _runs(results, "convergence")]
    rows += [{"study": "init", **r} for r in _runs(results, "init")]
    _write_csv(output_dir / "results.csv", rows, RUN_COLUMNS)
    grads = [{"norm": norm, "seed": r["seed"], "depth": depth, "group": group, "gradient_norm": value}
             for r in results if r["kind"] == "gradients" for norm, depths in r["gradient_norms"].items()
             for depth, groups in depths.items() for group, value in groups.items()]
    _write_csv(output_dir / "gradient_norms.csv", grads, ("norm", "seed", "depth", "group", "gradient_norm"))
    probes = [{"norm": norm, "seed": r["seed"], **p} for r in results if r["kind"] == "lipschitz"
              for norm, run in r["lipschitz"].items() for p in run["probes"]]
    _write_csv(output_dir / "lipschitz.csv", probes, ("norm", "seed", "update", "loss", "grad_norm", "lipschitz",
                                                       "smoothness", "loss_change", "grad_change"))


def _majority(flags: list[bool]) -> bool:
    return sum(flags) * 2 > len(flags)


def _mark(flags: list[bool]) -> str:
    return f"{'C' if _majority(flags) else 'N'} {sum(flags)}/{len(flags)}"


def convergence_tables(results: list[dict[str, Any]], args: argparse.Namespace, key: str = "converged") -> list[str]:
    """Tables 1-6: ours (majority over seeds, converged/total) beside the document's, with the
    agreement over the document's norms counted per table."""
    runs = _runs(results, "convergence")
    lines, total = [], [0, 0]
    for shape in SHAPES:
        header = [f"{n} ours" + (" \\| doc" if n in DOCUMENT_NORMS else "") for n in args.norms]
        lines += [f"**Table {DOCUMENT_TABLE_NUMBERS[shape]}: {shape}**", "", "| lr | " + " | ".join(header) + " |",
                  "|---:|" + "---|" * len(args.norms)]
        agree = [0, 0]
        for lr in args.learning_rates:
            cells_ = []
            for norm in args.norms:
                flags = [r[key] for r in runs if r["shape"] == shape and r["norm"] == norm and r["learning_rate"] == lr]
                text = _mark(flags)
                if norm in DOCUMENT_NORMS and lr in DOCUMENT_TABLES[shape]:
                    theirs = DOCUMENT_TABLES[shape][lr][DOCUMENT_NORMS.index(norm)]
                    agree[0] += _majority(flags) == theirs
                    agree[1] += 1
                    text += f" \\| {'C' if theirs else 'N'}" + ("" if _majority(flags) == theirs else " ✗")
                cells_.append(text)
            lines.append(f"| {lr:g} | " + " | ".join(cells_) + " |")
        total = [total[0] + agree[0], total[1] + agree[1]]
        lines += ["", f"Agreement with the document: {agree[0]}/{agree[1]} cells.", ""]
    return [*lines, f"**All six tables: {total[0]}/{total[1]} cells agree.**", ""]


def _gradient_lines(results: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    lines = ["## Gradient norms at initialization (normal width, mean over batches and seeds)", ""]
    for depth in DEPTHS:
        rows = [r for r in results if r["kind"] == "gradients"]
        groups = list(rows[0]["gradient_norms"][args.norms[0]][depth]) if rows else []
        lines += [f"**{depth}**", "", "| norm | " + " | ".join(groups) + " |", "|---|" + "---:|" * len(groups)]
        for norm in args.norms:
            values = [[r["gradient_norms"][norm][depth][g] for r in rows] for g in groups]
            lines.append(f"| {norm} | " + " | ".join(f"{statistics.fmean(v):.3g}" for v in values) + " |")
        lines.append("")
    return lines


def _init_lines(results: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    runs = _runs(results, "init")
    title = "converged seeds / seeds, fit seeds, mean last-epoch training loss of the runs that finished"
    lines = [f"## Initialization scale (normal width; {title})", "",
             "| layers (lr) | init | " + " | ".join(args.norms) + " |", "|---|---|" + "---|" * len(args.norms)]
    for layers, lr in INIT_LEARNING_RATES.items():
        for init in INIT_SCALES:
            texts = []
            for norm in args.norms:
                rows = [r for r in runs if r["layers"] == layers and r["init"] == init and r["norm"] == norm]
                finite = [r["last_epoch_loss"] for r in rows if math.isfinite(r["last_epoch_loss"])]
                loss = f", {statistics.fmean(finite):.3f}" if finite else ""
                fit = sum(r["fit"] for r in rows)
                texts.append(_mark([r["converged"] for r in rows]) + f", fit {fit}/{len(rows)}" + loss)
            lines.append(f"| {layers} ({lr:g}) | {init} | " + " | ".join(texts) + " |")
    return [*lines, ""]


def _lipschitz_lines(results: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    lines = [(f"## Lipschitz and smoothness along the gradient ({LIPSCHITZ_SHAPE}, lr {LIPSCHITZ_LEARNING_RATE:g}; "
              f"a in {list(PROBE_FRACTIONS)} x lr)"), "",
             "| norm | lipschitz: first probe | median | max | smoothness: first probe | median | max | probes |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for norm in args.norms:
        runs = [r["lipschitz"][norm]["probes"] for r in results if r["kind"] == "lipschitz"]
        row = [f"| {norm}"]
        for key in ("lipschitz", "smoothness"):
            firsts = [p[0][key] for p in runs if p]
            values = [probe[key] for p in runs for probe in p]
            row += [f"{statistics.fmean(firsts):.3g}", f"{statistics.median(values):.3g}", f"{max(values):.3g}"]
        lines.append(" | ".join(row) + f" | {sum(len(p) for p in runs)} |")
    return [*lines, ""]


def write_summary(results: list[dict[str, Any]], args: argparse.Namespace, output_dir: Path) -> None:
    corpus = (("smoke sizes, " if args.smoke else "")
              + ("Financial PhraseBank, full agreement" if args.phrasebank_file else "embedded corpus"))
    lines = [f"# Normalization in a post-norm Transformer encoder ({corpus})", "",
             (f"Widths (narrow, normal, wide) {args.widths}, {args.epochs} epochs of plain SGD, batches of "
              f"{args.batch_size}, seeds {seeds_of(results)}. C = converged (most seeds), N = not; k/n converged seeds; "
              f"✗ where ours and the document's differ."), "",
             "## Convergence: finite, below the divergence bound, last-epoch loss below the first epoch's", "",
             *convergence_tables(results, args),
             "## Stricter reading: converged and last-epoch training loss below the label prior's entropy", "",
             *convergence_tables(results, args, key="fit"),
             *_gradient_lines(results, args), *_init_lines(results, args), *_lipschitz_lines(results, args)]
    (output_dir / "summary.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plot_gradients(results: list[dict[str, Any]], args: argparse.Namespace, path: Path) -> None:
    plt = _pyplot()
    figure, axes = plt.subplots(1, len(DEPTHS), figsize=(10, 3.6))
    rows = [r for r in results if r["kind"] == "gradients"]
    for axis, depth in zip(axes, DEPTHS):
        groups = list(rows[0]["gradient_norms"][args.norms[0]][depth])
        width = 0.8 / len(args.norms)
        for i, norm in enumerate(args.norms):
            values = [statistics.fmean(r["gradient_norms"][norm][depth][g] for r in rows)
                      for g in groups]
            axis.bar([x + i * width for x in range(len(groups))], values, width, label=norm)
        axis.set_xticks([x + 0.4 - width / 2 for x in range(len(groups))], groups, fontsize=7, rotation=30)
        axis.set_yscale("log")
        axis.set_title(f"{depth} ({DEPTHS[depth]} layer{'s' if DEPTHS[depth] > 1 else ''})", fontsize=9)
    axes[0].set_ylabel("expected gradient norm at init")
    axes[0].legend(fontsize=7)
    _save(figure, path)


def _plot_curves(results: list[dict[str, Any]], args: argparse.Namespace, path: Path) -> None:
    """Training loss per update (full lines, running mean over `CURVE_WINDOW` updates) and validation
    loss at each epoch's end (dashed) of the 1-layer wide model."""
    plt = _pyplot()
    figure, axes = plt.subplots(1, len(CURVE_LEARNING_RATES), figsize=(10, 3.6))
    seed = seeds_of(results)[0]
    runs = [r for r in _runs(results, "convergence") if r["shape"] == "1-wide" and r["seed"] == seed]
    for axis, (label, lr) in zip(axes, CURVE_LEARNING_RATES.items()):
        for i, norm in enumerate(args.norms):
            run = next((r for r in runs if r["norm"] == norm and r["learning_rate"] == lr), None)
            if run is None:
                continue
            curve, color = run["curve"], f"C{i}"
            losses = curve["losses"]
            smooth = [statistics.fmean(losses[max(0, k - CURVE_WINDOW + 1):k + 1]) for k in range(len(losses))]
            axis.plot(range(1, len(losses) + 1), smooth, color=color, label=norm, linewidth=1)
            ends = [curve["updates_per_epoch"] * (e + 1) for e in range(len(curve["epochs"]))]
            axis.plot(ends, [e["validation_loss"] for e in curve["epochs"]], color=color, linestyle="--", marker=".")
            if run["diverged_at"] is not None:
                axis.annotate(f"{norm}: diverged at update {run['diverged_at']}", (0.02, 0.95 - 0.07 * i),
                              xycoords="axes fraction", fontsize=7, color=color)
        axis.set_title(f"1-layer wide, lr {lr:g} ({label}), seed {seed}", fontsize=9)
        axis.set_xlabel("update")
    axes[0].set_ylabel("loss (full: train, dashed: validation)")
    axes[0].legend(fontsize=7)
    _save(figure, path)


def _plot_lipschitz(results: list[dict[str, Any]], args: argparse.Namespace, path: Path) -> None:
    plt = _pyplot()
    figure, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for axis, key in zip(axes, ("lipschitz", "smoothness")):
        for norm in args.norms:
            runs = [r["lipschitz"][norm]["probes"] for r in results if r["kind"] == "lipschitz"]
            length = min(len(p) for p in runs)
            if length == 0:
                continue
            axis.plot([runs[0][i]["update"] for i in range(length)],
                      [statistics.fmean(p[i][key] for p in runs) for i in range(length)], label=norm, marker=".")
        axis.set_yscale("log")
        axis.set_xlabel("update")
        axis.set_title(f"{key} along the gradient (mean over seeds)", fontsize=9)
    axes[0].legend(fontsize=7)
    _save(figure, path)


def _save(figure: Any, path: Path) -> None:
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    _pyplot().close(figure)


def write_results(results: list[dict[str, Any]], args: argparse.Namespace, output_dir: Path) -> None:
    """`results.csv`, `gradient_norms.csv`, `lipschitz.csv`, `summary.md` and the three figures."""
    write_csvs(results, output_dir)
    write_summary(results, args, output_dir)
    _plot_gradients(results, args, output_dir / "gradient_norms.png")
    _plot_curves(results, args, output_dir / "loss_curves.png")
    _plot_lipschitz(results, args, output_dir / "lipschitz.png")


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    return run_study(parse_args(argv), _prepare, cells, run_cell, write_results, "PhraseBank norms")


if __name__ == "__main__":
    from ..cli import run_command

    run_command("studies", main)

"""The PhraseBank normalization study at smoke size, and its measurements on cases with a known answer:
the probe along the gradient on a quadratic loss, and the probe leaving the weights and the norms'
running buffers exactly as it found them."""

import csv
import math

import pytest
import torch

from hf_powernorm.studies import phrasebank_norms

pytestmark = pytest.mark.usefixtures("reset_accelerate")

FIGURES = ("gradient_norms.png", "loss_curves.png", "lipschitz.png")


def test_phrasebank_norms_smoke_writes_every_table_cell_and_resumes(tmp_path):
    norms = ["layernorm", "batchnorm", "none"]
    argv = ["--smoke", "--seeds", "1", "--norms", *norms, "--output_dir", str(tmp_path)]
    results = phrasebank_norms.main(argv)
    for name in ("results.csv", "gradient_norms.csv", "lipschitz.csv", "summary.md", *FIGURES):
        assert (tmp_path / name).stat().st_size > 0, name
    with open(tmp_path / "results.csv", encoding="utf-8") as handle:
        rows = [r for r in csv.DictReader(handle) if r["study"] == "convergence"]
    cells = {(r["shape"], r["norm"], float(r["learning_rate"])) for r in rows}
    grid = phrasebank_norms.SHAPES, norms, phrasebank_norms.LEARNING_RATES
    assert cells == {(s, n, lr) for s in grid[0] for n in grid[1] for lr in grid[2]}
    assert all(r["converged"] == "False" for r in rows if r["diverged_at"])
    summary = (tmp_path / "summary.md").read_text(encoding="utf-8")
    for number in range(1, 7):
        table = summary.split(f"**Table {number}:")[1].split("Agreement")[0]
        assert [line.split(" | ")[0] for line in table.splitlines() if line.startswith("| ") and "lr |" not in line] \
            == [f"| {lr:g}" for lr in phrasebank_norms.LEARNING_RATES]
    assert summary.count("Agreement with the document:") == 12  # six tables, two readings
    assert "**All six tables:" in summary
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "cells").glob("*/result.json")}
    assert len(stamps) == 9  # six shapes, initialization, Lipschitz, gradients
    again = phrasebank_norms.main(argv)
    assert again == results and {p: p.stat().st_mtime_ns for p in stamps} == stamps  # nothing redone


class _Quadratic(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([1.0, 1.0], dtype=torch.float64))
        self.register_buffer("calls", torch.tensor(0))


def test_probe_along_gradient_on_a_quadratic_matches_the_closed_form():
    # L(w) = w'Aw / 2, g = Aw: L(w) - L(w - a g) = a |g|^2 - a^2 g'Ag / 2, and g(w) - g(w - a g) = a A g.
    a_matrix = torch.diag(torch.tensor([1.0, 3.0], dtype=torch.float64))
    model = _Quadratic()

    def loss(m):
        m.calls += 1  # a buffer the probe must restore
        return 0.5 * m.w @ a_matrix @ m.w

    steps = [0.05, 0.1, 0.2]
    out = phrasebank_norms.probe_along_gradient(model, loss, steps)
    g = a_matrix @ torch.tensor([1.0, 1.0], dtype=torch.float64)
    g_norm, curvature = float(g.norm()), float(g @ a_matrix @ g)
    expected = max(abs(a * g_norm**2 - a * a * curvature / 2) / (a * g_norm) for a in steps)
    assert out["lipschitz"] == pytest.approx(expected, rel=1e-12)
    assert out["smoothness"] == pytest.approx(float((a_matrix @ g).norm()) / g_norm, rel=1e-12)
    assert out["loss_change"] == pytest.approx(max(abs(a * g_norm**2 - a * a * curvature / 2) for a in steps))
    assert out["grad_norm"] == pytest.approx(g_norm) and out["loss"] == pytest.approx(2.0)
    assert torch.equal(model.w.detach(), torch.tensor([1.0, 1.0], dtype=torch.float64))
    assert int(model.calls) == 0 and model.w.grad is None


class _Tokenizer:
    pad_token_id, cls_token_id, sep_token_id = 0, 2, 3

    def __len__(self):
        return 37


@pytest.mark.parametrize("norm", ["batchnorm", "powernorm", "layernorm"])
def test_probe_restores_weights_and_running_buffers_bit_for_bit(norm):
    torch.manual_seed(0)
    options = {"max_length": 11, "powernorm_warmup": 2}
    model = phrasebank_norms.build_classifier(_Tokenizer(), options, norm, 2, 16)
    phrasebank_norms.initialize(model)
    model.train()
    batch = {"input_ids": torch.randint(4, 37, (5, 7)), "attention_mask": torch.ones(5, 7, dtype=torch.long),
             "labels": torch.tensor([0, 1, 2, 1, 0])}
    batch["attention_mask"][0, 5:] = 0
    model(**batch).loss.backward()  # move the running statistics off their initial values
    model.zero_grad(set_to_none=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = phrasebank_norms.probe_along_gradient(model, phrasebank_norms.batch_loss(batch), [0.01, 0.1])
    assert math.isfinite(out["lipschitz"]) and out["smoothness"] > 0
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert model.training and all(p.grad is None for p in model.parameters())


def test_initialization_is_kaiming_for_the_feed_forward_layers_and_xavier_elsewhere():
    torch.manual_seed(0)
    model = phrasebank_norms.build_classifier(_Tokenizer(), {"max_length": 11, "powernorm_warmup": 0},
                                              "layernorm", 1, 64)
    phrasebank_norms.initialize(model)
    layer = model.model.encoder.layers[0].requires_grad_(False)
    assert float(layer.ffn.fc1.weight.std()) == pytest.approx(math.sqrt(2 / 64), rel=0.05)  # Kaiming, fan-in 64
    assert float(layer.ffn.fc2.weight.std()) == pytest.approx(math.sqrt(2 / 256), rel=0.05)  # fan-in 256
    bound = math.sqrt(6 / (64 + 64))  # Xavier uniform on a 64 x 64 projection
    assert float(layer.self_attn.q_proj.weight.abs().max()) <= bound
    assert float(layer.self_attn.q_proj.weight.std()) == pytest.approx(bound / math.sqrt(3), rel=0.05)
    assert float(layer.ffn.fc1.bias.abs().max()) == 0.0
    phrasebank_norms.initialize(model, uniform_scale=100.0)
    assert 90 < float(layer.ffn.fc1.weight.abs().max()) <= 100


def test_document_tables_are_transcribed_for_every_shape_and_learning_rate():
    tables = phrasebank_norms.DOCUMENT_TABLES
    assert list(tables) == list(phrasebank_norms.SHAPES)
    assert all(list(rows) == list(phrasebank_norms.LEARNING_RATES) for rows in tables.values())
    assert tables["1-wide"][0.5] == (True, False, False) and tables["5-wide"][1e-3] == (True, False, False)
    assert all(rows[10.0] == rows[1.0] == (False, False, False) for rows in tables.values())
    assert all(rows[1e-4] == (True, True, True) for rows in tables.values())

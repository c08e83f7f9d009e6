"""NormStatisticsRecorder: what it records, against direct float64 computations; free when off."""

import csv
import math

import pytest
import torch
from torch import nn

from hf_powernorm import (
    NORM_CLASSES,
    LayerNorm,
    NormStatisticsRecorder,
    PowerNorm,
    PowerNormTransformerConfig,
    PowerNormTransformerForConditionalGeneration,
    build_norm,
    read_norm_statistics,
)

pytestmark = pytest.mark.usefixtures("one_thread")

HIDDEN = 32
QUANTITIES = (
    "step", "layer", "norm", "tokens", "batch_mean_avg", "batch_var_avg", "batch_psi2_avg", "running_mean_avg",
    "running_var_avg", "running_phi_avg", "running_nu_avg", "dist_mean", "rel_dist_mean", "dist_var", "rel_dist_var",
    "dist_psi2", "rel_dist_psi2",
    "psi2_ratio_min", "psi2_ratio_mean", "psi2_ratio_max", "g_mu", "g_sigma2", "g_psi2", "weight_grad_norm",
    "bias_grad_norm", "lemma2_fraction", "lemma2_ratio_min", "lemma2_ratio_max",
)
ALWAYS_NUMBERS = ("batch_mean_avg", "batch_var_avg", "batch_psi2_avg", "g_mu", "g_sigma2", "g_psi2",
                  "weight_grad_norm", "lemma2_fraction", "lemma2_ratio_min", "lemma2_ratio_max")


def make_model(encoder_norm="powernorm", decoder_norm="batchnorm"):
    torch.manual_seed(0)
    config = PowerNormTransformerConfig.from_preset("tiny", encoder_norm_type=encoder_norm,
                                                    decoder_norm_type=decoder_norm)
    model = PowerNormTransformerForConditionalGeneration(config)
    model.model.decoder.final_norm = LayerNorm(HIDDEN)  # a norm swapped in after construction
    return model.train()


def batch(seed: int):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, 99, (3, 7), generator=generator)
    attention_mask = torch.ones(3, 7, dtype=torch.long)
    attention_mask[0, 4:] = 0
    attention_mask[2, 6:] = 0
    labels = torch.randint(3, 99, (3, 5), generator=generator)
    return dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def train(model, recorder, steps=3, first_step=0):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(first_step, first_step + steps):
        recorder.before_forward(step)
        model(**batch(step)).loss.backward()
        recorder.after_backward(step)
        optimizer.step()
        optimizer.zero_grad()
    recorder.close()


def norm_layers(model):
    return [name for name, m in model.named_modules() if isinstance(m, tuple(NORM_CLASSES.values()))]


def hook_count(model) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) + len(m._backward_hooks)
               + len(m._backward_pre_hooks) for m in model.modules())


# ----------------------------------------------------------------------------------------------
# What a recorded step writes


def test_every_quantity_for_every_norm_layer_and_step(tmp_path):
    model = make_model()
    model.model.encoder.final_norm = build_norm("mabn", HIDDEN)
    recorder = NormStatisticsRecorder(model, every_n_steps=1, output_file=tmp_path / "stats.jsonl")
    train(model, recorder)
    rows = read_norm_statistics(tmp_path / "stats.jsonl")
    layers = norm_layers(model)
    assert {row["norm"] for row in rows} == {"PowerNorm", "MaskedBatchNorm", "LayerNorm", "MovingAverageBatchNorm"}
    assert [(row["step"], row["layer"]) for row in rows] == [(step, name) for step in range(3) for name in layers]
    for row in rows:
        assert set(QUANTITIES) <= set(row), row["layer"]
        for key in ALWAYS_NUMBERS:
            assert isinstance(row[key], float) and math.isfinite(row[key]), (row["layer"], key)
        held = {"PowerNorm": ("running_phi_avg", "running_nu_avg", "dist_psi2", "psi2_ratio_max"),
                "MaskedBatchNorm": ("running_mean_avg", "running_var_avg", "dist_mean", "dist_var"),
                "MovingAverageBatchNorm": ("running_phi_avg", "dist_psi2"), "LayerNorm": ()}[row["norm"]]
        for key in ("running_mean_avg", "running_var_avg", "running_phi_avg", "dist_mean", "dist_var", "dist_psi2"):
            assert (row[key] is not None) == (key in held), (row["layer"], key)
    encoder_rows = [row for row in rows if row["layer"].startswith("model.encoder.layers")]
    assert {row["tokens"] for row in encoder_rows} == {3 * 7 - 3 - 1}  # padding left out


@pytest.mark.parametrize("name", ["dyt", "derf"])
def test_dyt_and_derf_rows_say_where_their_squash_works(tmp_path, name):
    torch.manual_seed(0)
    squash = build_norm(name, HIDDEN, alpha_init=0.7)
    if name == "derf":
        nn.init.constant_(squash.shift, 0.3)
    model = nn.Sequential(squash, LayerNorm(HIDDEN))
    x = (torch.randn(2, 20, HIDDEN) * torch.linspace(0.1, 4.0, HIDDEN)).requires_grad_()
    recorder = NormStatisticsRecorder(model, every_n_steps=1, output_file=tmp_path / "stats.jsonl")
    recorder.before_forward(0)
    model(x).square().sum().backward()
    recorder.after_backward(0)
    recorder.close()
    squash_row, layernorm_row = read_norm_statistics(tmp_path / "stats.jsonl")
    shift = 0.3 if name == "derf" else 0.0
    z = (0.7 * x.detach().double() + shift).abs()
    assert squash_row["alpha"] == pytest.approx(0.7)
    assert squash_row["shift"] == (pytest.approx(0.3) if name == "derf" else None)
    beyond = [(z > t).double().mean().item() for t in (1, 2)]
    assert 0.05 < beyond[1] < beyond[0] < 0.95  # the input reaches both regimes
    assert [squash_row["squash_beyond_1"], squash_row["squash_beyond_2"]] == pytest.approx(beyond, abs=1e-12)
    assert [layernorm_row[key] for key in ("alpha", "shift", "squash_beyond_1", "squash_beyond_2")] == [None] * 4


def test_recorded_values_match_a_float64_batch_norm(tmp_path):
    model = make_model(encoder_norm="batchnorm", decoder_norm="powernorm")
    name = "model.encoder.layers.1.ffn_norm"
    layer = dict(model.named_modules())[name]
    calls, grads = [], []  # one entry per step
    layer.register_forward_pre_hook(lambda m, args: calls.append(dict(
        x=args[0].detach().double(), mask=args[1], running_mean=m.running_mean.double(),
        running_var=m.running_var.double(),
        gamma=m.weight.detach().double())))
    def watch(module, args, output):
        output.register_hook(lambda grad: grads.append(grad.double()))

    layer.register_forward_hook(watch)
    recorder = NormStatisticsRecorder(model, every_n_steps=2, output_file=tmp_path / "stats.jsonl")
    train(model, recorder, steps=3, first_step=1)  # records step 2 only, when running statistics have moved
    (row,) = [r for r in read_norm_statistics(tmp_path / "stats.jsonl") if r["layer"] == name]
    seen = calls[1]
    real = seen["mask"].reshape(-1).bool()
    x, dy = seen["x"].reshape(-1, HIDDEN)[real], grads[1].reshape(-1, HIDDEN)[real]
    expected = _float64_reference(x, dy, seen["gamma"], layer.eps)
    assert (row["step"], row["tokens"]) == (2, x.shape[0])
    for key, value in expected.items():
        assert row[key] == pytest.approx(value, rel=1e-4, abs=1e-9), key
    assert row["running_mean_avg"] == pytest.approx(float(seen["running_mean"].mean()), rel=1e-5, abs=1e-9)
    assert row["dist_mean"] == pytest.approx(float((x.mean(0) - seen["running_mean"]).norm()), rel=1e-4)
    assert row["rel_dist_mean"] == pytest.approx(row["dist_mean"] / float(seen["running_mean"].norm()), rel=1e-4)
    running_var = seen["running_var"]
    assert row["rel_dist_var"] == pytest.approx(
        float((x.var(0, unbiased=False) - running_var).norm() / running_var.norm()), rel=1e-4)


def _float64_reference(x, dy, gamma, eps):
    """Batch norm and PN-V written out with one leaf per route of x (direct, through mu_B, sigma2_B, psi2_B):
    the gradient of each leaf is the contribution of eq. 3 or eq. 6."""
    direct, via_mu, via_var, via_psi = (x.clone().requires_grad_(True) for _ in range(4))
    mu = via_mu.mean(0)
    var = (via_var - mu.detach()).square().mean(0)
    bn = gamma * (direct - mu) / torch.sqrt(var + eps)
    pnv = gamma * direct.detach() / torch.sqrt(via_psi.square().mean(0) + eps)
    torch.autograd.backward([bn, pnv], [dy, dy])
    rms = lambda g: float(g.norm() / math.sqrt(x.shape[0]))  # noqa: E731
    return {"batch_mean_avg": float(x.mean()), "batch_var_avg": float(x.var(0, unbiased=False).mean()),
            "batch_psi2_avg": float(x.square().mean()), "g_mu": rms(via_mu.grad), "g_sigma2": rms(via_var.grad),
            "g_psi2": rms(via_psi.grad)}


def test_lemma2_condition_and_gradient_norms(tmp_path):
    norm = PowerNorm(HIDDEN, group_num=None)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.1, 3.0, HIDDEN))
    model = nn.ModuleDict({"norm": norm})
    recorder = NormStatisticsRecorder(model, every_n_steps=1, output_file=tmp_path / "stats.jsonl")
    x = torch.randn(40, HIDDEN) * 1.3
    recorder.before_forward(0)
    (norm(x) * torch.linspace(-1, 1, HIDDEN)).sum().backward()
    recorder.after_backward(0)
    (row,) = read_norm_statistics(tmp_path / "stats.jsonl")
    ratio = norm.weight.detach().abs() / x.square().mean(0).sqrt()
    assert row["layer"] == "norm"
    assert row["lemma2_fraction"] == pytest.approx(float((ratio <= 1).float().mean()))
    assert row["lemma2_ratio_min"] == pytest.approx(float(ratio.min()), rel=1e-5)
    assert row["lemma2_ratio_max"] == pytest.approx(float(ratio.max()), rel=1e-5)
    assert row["weight_grad_norm"] == pytest.approx(float(norm.weight.grad.norm()), rel=1e-6)
    assert row["bias_grad_norm"] == pytest.approx(float(norm.bias.grad.norm()), rel=1e-6)


class _MaskedNorm(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.inner = norm

    def forward(self, hidden_states, attention_mask=None):
        return self.inner(hidden_states, attention_mask=attention_mask)  # the mask as a keyword


@pytest.mark.parametrize("name", ["powernorm", "batchnorm", "batchrenorm", "mabn", "layernorm"])
def test_padding_is_excluded_from_recorded_statistics(tmp_path, name):
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(2, 6, HIDDEN, generator=generator) + 0.5
    dy = torch.randn(2, 6, HIDDEN, generator=generator)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[0, 3:] = 0
    padded = x.clone()
    padded[mask == 0] = 1e3
    rows = []
    for index, (inputs, inputs_mask, grad) in enumerate([(padded, mask, dy * mask[..., None]),
                                                          (x[mask.bool()], None, dy[mask.bool()])]):
        torch.manual_seed(0)
        model = _MaskedNorm(build_norm(name, HIDDEN))
        path = tmp_path / f"{index}.jsonl"
        recorder = NormStatisticsRecorder(model, every_n_steps=1, output_file=path)
        recorder.before_forward(0)
        model(inputs, inputs_mask).backward(grad)
        recorder.after_backward(0)
        rows.append(read_norm_statistics(path)[0])
    assert rows[0]["tokens"] == rows[1]["tokens"] == 9
    for key in QUANTITIES[4:]:
        if rows[0][key] is None:
            assert rows[1][key] is None, key
        else:
            assert rows[0][key] == pytest.approx(rows[1][key], rel=1e-5, abs=1e-7), key


# ----------------------------------------------------------------------------------------------
# Off is free, on holds hooks only while armed


@pytest.mark.parametrize("every_n_steps", [0, None])
def test_off_registers_no_hooks_and_writes_nothing(tmp_path, every_n_steps):
    model = make_model()
    before = hook_count(model)
    recorder = NormStatisticsRecorder(model, every_n_steps=every_n_steps, output_file=tmp_path / "stats.jsonl")
    assert not recorder.enabled and recorder.layers == {}
    for step in range(2):
        recorder.before_forward(step)
        assert hook_count(model) == before
        model(**batch(step)).loss.backward()
        recorder.after_backward(step)
    recorder.close()
    assert hook_count(model) == before == 0
    assert not (tmp_path / "stats.jsonl").exists()


def test_hooks_exist_only_while_a_recorded_step_is_armed(tmp_path):
    model = make_model()
    recorder = NormStatisticsRecorder(model, every_n_steps=2, output_file=tmp_path / "stats.jsonl")
    assert hook_count(model) == 0
    recorder.before_forward(1)
    assert hook_count(model) == 0
    recorder.before_forward(2)
    assert hook_count(model) == 2 * len(norm_layers(model))
    for _ in range(2):  # two micro-batches of one step: recorded once
        recorder.before_forward(2)
        model(**batch(0)).loss.backward()
        recorder.after_backward(2)
        assert hook_count(model) == 0
    recorder.close()
    rows = read_norm_statistics(tmp_path / "stats.jsonl")
    assert len(rows) == len(norm_layers(model))


def test_activation_checkpointing_records_each_layer_once_with_gradients(tmp_path):
    model = make_model()
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    recorder = NormStatisticsRecorder(model, every_n_steps=1, output_file=tmp_path / "stats.jsonl")
    train(model, recorder, steps=1)
    rows = read_norm_statistics(tmp_path / "stats.jsonl")
    assert [row["layer"] for row in rows] == norm_layers(model)
    assert all(row["g_psi2"] is not None for row in rows)


def test_bad_arguments_raise_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="every_n_steps must be None or a non-negative integer, got -1"):
        NormStatisticsRecorder(make_model(), every_n_steps=-1)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got str"):
        NormStatisticsRecorder("model", every_n_steps=1)
    with pytest.raises(ValueError, match="no norm layer of the registry"):
        NormStatisticsRecorder(nn.Linear(3, 3), every_n_steps=1)


def test_csv_holds_one_row_per_layer_and_step(tmp_path):
    model = make_model()
    recorder = NormStatisticsRecorder(model, every_n_steps=1, output_file=tmp_path / "stats.jsonl", per_channel=True)
    train(model, recorder, steps=2)
    recorder.to_csv(tmp_path / "stats.csv")
    with open(tmp_path / "stats.csv", newline="") as handle:
        table = list(csv.DictReader(handle))
    assert len(table) == 2 * len(norm_layers(model))
    assert set(QUANTITIES) | {"batch_mean", "batch_var", "batch_psi2"} <= set(table[0])
    assert len(read_norm_statistics(tmp_path / "stats.jsonl")[0]["batch_psi2"]) == HIDDEN

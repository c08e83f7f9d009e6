"""What the norm layers see during training, recorded as tidy JSON lines (Shen et al., 2020, Section 3-4).

`NormStatisticsRecorder` finds every norm of the registry in any `nn.Module` (by class, so norms
swapped into a foreign model count too) and, on the steps it is asked to record, writes one row per
norm layer with:
- the batch statistics over real tokens, `mu_B`, `sigma2_B` (biased) and the quadratic mean `psi2_B`
  (Definition 1), of the tensor the layer normalizes: its input, after group scaling for PN and PN-V;
- the running statistics the layer held before the step (`running_mean`, `running_var`,
  `running_phi`, `running_nu`) and the distances of Figures 2 and 4: `||mu_B - mu||`,
  `||sigma2_B - sigma2||`, `||psi2_B - phi||` (each also relative to the running statistic's norm),
  and the range of `psi2_B / phi`;
- the gradient contributions through the batch statistics that a batch norm (eq. 3: `g_mu`,
  `g_sigma2`) and PN-V (eq. 6: `g_psi2`) would route at this position, computed in float32 from the
  layer's input, the gradient of its output and the mask, independently of the layer's backward
  (the formulas: docs/norms.md);
- the gradient norms of the layer's weight and bias;
- Lemma 2's condition: the fraction of channels with `|gamma_i| <= (psi_B)_i` and the range of
  `|gamma_i| / (psi_B)_i` (below 1, PN-V lowers the Lipschitz constant of the loss);
- for DyT and Derf, where their squash works: `alpha` (and Derf's `shift`) and the fractions of
  the real tokens' elements whose argument `z = alpha x (+ shift)` has `|z| > 1` and `|z| > 2`
  (`squash_beyond_1`, `squash_beyond_2`): near 0 the squash is about linear, a per-channel scale
  of `x` that normalizes nothing; near 1 it maps `x` to about its sign (None for other norms).

When off (`every_n_steps` 0 or None) the recorder registers nothing; when on it holds hooks only
between `before_forward` of a recorded step and the following `after_backward`. Only the first
call of a layer in a step is recorded; activation checkpointing's recomputation is skipped.
"""

from __future__ import annotations

import csv
import json
import os
from functools import partial

import torch
from torch import nn

from .norm_dispatch import in_recomputation
from .normalization import (
    NORM_CLASSES,
    Identity,
    PowerNorm,
    PowerNormV,
    _ElementwiseNorm,
    group_scale,
)

RECORDED_NORMS = tuple(cls for cls in dict.fromkeys(NORM_CLASSES.values()) if cls is not Identity)
RUNNING_STATISTICS = ("running_mean", "running_var", "running_phi", "running_nu")


def _real_tokens(tensor: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """`(batch, seq, C)` or `(tokens, C)` as float32 `(real tokens, C)`."""
    flat = tensor.detach().float().reshape(-1, tensor.shape[-1])
    if attention_mask is None:
        return flat.clone()
    return flat[attention_mask.reshape(-1).to(flat.device) != 0]


def _norm_of(tensor: torch.Tensor | None) -> float | None:
    return None if tensor is None else float(torch.linalg.vector_norm(tensor.float()))


def _mean_of(tensor: torch.Tensor | None) -> float | None:
    return None if tensor is None else float(tensor.float().mean())


class NormStatisticsRecorder:
    """Record, every `every_n_steps` steps, what each norm layer of `model` sees (module docstring).

    ```python
    recorder = NormStatisticsRecorder(model, every_n_steps=100, output_file="norm_stats.jsonl")
    for step, batch in enumerate(batches):
        recorder.before_forward(step)
        model(**batch).loss.backward()
        recorder.after_backward(step)
        optimizer.step()
        optimizer.zero_grad()
    recorder.close()
    ```
    Args:
        model (`nn.Module`):
            Any model holding norms of the registry (a PowerNorm Transformer, a converted model).
        every_n_steps (`int`, *optional*):
            Record the steps that are multiples of it; 0 or None records nothing and registers no hook.
        output_file (`str` or `os.PathLike`, *optional*, defaults to `"norm_stats.jsonl"`):
            Rows are appended to it as JSON lines, one per (step, layer), with flat keys.
        per_channel (`bool`, *optional*, defaults to `False`):
            Add the per-channel statistics to each row, as lists.
    """

    def __init__(self, model: nn.Module, every_n_steps: int | None = None,
                 output_file: str | os.PathLike = "norm_stats.jsonl", per_channel: bool = False) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if every_n_steps is not None and (not isinstance(every_n_steps, int) or isinstance(every_n_steps, bool)
                                          or every_n_steps < 0):
            raise ValueError(f"every_n_steps must be None or a non-negative integer, got {every_n_steps!r}")
        self.every_n_steps = every_n_steps or 0
        self.output_file = os.fspath(output_file)
        self.per_channel = per_channel
        self.layers: dict[str, nn.Module] = {}
        if self.every_n_steps:
            self.layers = {name: m for name, m in model.named_modules() if isinstance(m, RECORDED_NORMS)}
            if not self.layers:
                raise ValueError(f"no norm layer of the registry ({sorted(NORM_CLASSES)}) in this model")
        self._handles: list = []
        self._last_step: int | None = None
        self._file = None
        self._captured: dict[str, dict] = {}

    @property
    def enabled(self) -> bool:
        return self.every_n_steps > 0

    # -- the training loop's calls --

    def before_forward(self, step: int) -> None:
        """Arm the hooks when `step` is a recorded step (once per step, gradient accumulation included)."""
        if not self.enabled or step % self.every_n_steps != 0 or step == self._last_step or self._handles:
            return
        for name, layer in self.layers.items():
            self._handles.append(layer.register_forward_pre_hook(partial(self._capture_input, name), with_kwargs=True))
            self._handles.append(layer.register_forward_hook(partial(self._watch_output, name)))

    def after_backward(self, step: int) -> None:
        """Write the rows of an armed step and remove every hook; nothing on other steps."""
        if not self._handles:
            return
        rows = [self._row(step, name, self.layers[name], captured) for name, captured in self._captured.items()]
        self._disarm()
        self._last_step = step
        self._write(rows)

    def close(self) -> None:
        self._disarm()
        if self._file is not None:
            self._file.close()
            self._file = None

    def to_csv(self, path: str | os.PathLike) -> None:
        """Write the rows recorded so far in `output_file` as a CSV table."""
        if self._file is not None:
            self._file.flush()
        norm_statistics_to_csv(self.output_file, path)

    # -- hooks --

    def _capture_input(self, name: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if name in self._captured or in_recomputation():
            return
        hidden_states = args[0] if args else kwargs["hidden_states"]
        mask = args[1] if len(args) > 1 else kwargs.get("attention_mask")
        statistics_input = hidden_states
        if isinstance(module, (PowerNorm, PowerNormV)):
            with torch.no_grad():
                statistics_input = group_scale(hidden_states.detach().float(), module.group_num)
        self._captured[name] = {
            "mask": None if mask is None else mask.detach().clone(),
            "x": _real_tokens(statistics_input, mask),
            "running": {key: getattr(module, key).detach().float().clone()
                        for key in RUNNING_STATISTICS if isinstance(getattr(module, key, None), torch.Tensor)},
            "grad_output": None,
            "grad_hooked": False,
        }

    def _watch_output(self, name: str, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        captured = self._captured.get(name)
        if captured is None or captured["grad_hooked"] or not output.requires_grad:
            return
        captured["grad_hooked"] = True
        output.register_hook(partial(self._capture_grad, captured))

    @staticmethod
    def _capture_grad(captured: dict, grad: torch.Tensor) -> None:
        if captured["grad_output"] is None:
            captured["grad_output"] = _real_tokens(grad, captured["mask"])

    def _disarm(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._captured.clear()

    # -- rows --

    def _row(self, step: int, name: str, layer: nn.Module, captured: dict) -> dict:
        x = captured["x"]
        weight = getattr(layer, "weight", None)
        gamma = torch.ones(x.shape[1], device=x.device) if weight is None else weight.detach().float()
        batch = batch_statistics(x)
        row = {"step": step, "layer": name, "norm": type(layer).__name__, "tokens": int(x.shape[0])}
        row.update({f"batch_{key}_avg": _mean_of(value) for key, value in batch.items()})
        row.update(running_comparison(batch, captured["running"]))
        row.update(gradient_contributions(x, captured["grad_output"], gamma, layer.eps))
        row["weight_grad_norm"] = _norm_of(getattr(weight, "grad", None))
        row["bias_grad_norm"] = _norm_of(getattr(getattr(layer, "bias", None), "grad", None))
        row.update(lemma2_condition(gamma, batch["psi2"]))
        row.update(squash_range(x, layer))
        if self.per_channel:
            row.update({f"batch_{key}": value.tolist() for key, value in batch.items()})
            row.update({key: value.tolist() for key, value in captured["running"].items()})
        return row

    def _write(self, rows: list[dict]) -> None:
        if not rows:
            return
        if self._file is None:
            directory = os.path.dirname(self.output_file)
            if directory:
                os.makedirs(directory, exist_ok=True)
            self._file = open(self.output_file, "a", encoding="utf-8")  # appends: a resumed run keeps its rows
        for row in rows:
            self._file.write(json.dumps(row) + "\n")
        self._file.flush()


# ----------------------------------------------------------------------------------------------
# The quantities, from float32 `(real tokens, C)` tensors


def batch_statistics(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-channel `mean` (mu_B), biased `var` (sigma2_B) and quadratic mean `psi2` (psi2_B)."""
    if x.shape[0] == 0:
        nan = torch.full((x.shape[1],), float("nan"), device=x.device)
        return {"mean": nan, "var": nan, "psi2": nan}
    mean = x.mean(0)
    return {"mean": mean, "var": (x - mean).square().mean(0), "psi2": x.square().mean(0)}


def _relative(distance: float | None, running: torch.Tensor | None) -> float | None:
    """`distance / ||running||`, None without a running statistic or when it is zero."""
    norm = _norm_of(running)
    return distance / norm if distance is not None and norm else None


def running_comparison(batch: dict[str, torch.Tensor], running: dict[str, torch.Tensor]) -> dict:
    """Channel means of the running statistics and the distances of the batch ones to them."""
    row = {f"{key}_avg": _mean_of(running.get(key)) for key in RUNNING_STATISTICS}
    mean, var, phi = running.get("running_mean"), running.get("running_var"), running.get("running_phi")
    row["dist_mean"] = _norm_of(None if mean is None else batch["mean"] - mean)
    row["rel_dist_mean"] = _relative(row["dist_mean"], mean)
    row["dist_var"] = _norm_of(None if var is None else batch["var"] - var)
    row["rel_dist_var"] = _relative(row["dist_var"], var)
    row["dist_psi2"] = _norm_of(None if phi is None else batch["psi2"] - phi)
    row["rel_dist_psi2"] = _relative(row["dist_psi2"], phi)
    ratio = None if phi is None else batch["psi2"] / phi
    row.update({f"psi2_ratio_{key}": None if ratio is None else float(getattr(ratio, key)())
                for key in ("min", "mean", "max")})
    return row


def gradient_contributions(x: torch.Tensor, grad_output: torch.Tensor | None, gamma: torch.Tensor,
                           eps: float) -> dict[str, float | None]:
    """RMS over real tokens of the per-token norms of `g_mu`, `g_sigma2` (eq. 3) and `g_psi2` (eq. 6)."""
    if grad_output is None or x.shape[0] == 0:
        return {"g_mu": None, "g_sigma2": None, "g_psi2": None}
    tokens = x.shape[0] ** 0.5
    mean = x.mean(0)
    inv_sigma = torch.rsqrt((x - mean).square().mean(0) + eps)
    xhat = (x - mean) * inv_sigma
    g_mu = -(gamma * inv_sigma) * grad_output.mean(0)
    g_sigma2 = -(gamma * inv_sigma) * xhat * (grad_output * xhat).mean(0)
    inv_psi = torch.rsqrt(x.square().mean(0) + eps)
    xhat_psi = x * inv_psi
    g_psi2 = -(gamma * inv_psi) * xhat_psi * (grad_output * xhat_psi).mean(0)
    return {
        "g_mu": _norm_of(g_mu.expand_as(x)) / tokens,
        "g_sigma2": _norm_of(g_sigma2) / tokens,
        "g_psi2": _norm_of(g_psi2) / tokens,
    }


def lemma2_condition(gamma: torch.Tensor, psi2: torch.Tensor) -> dict[str, float]:
    """Fraction of channels with `|gamma_i| <= (psi_B)_i` and the range of `|gamma_i| / (psi_B)_i`."""
    ratio = gamma.abs() / psi2.sqrt()
    return {
        "lemma2_fraction": float((ratio <= 1.0).float().mean()),
        "lemma2_ratio_min": float(ratio.min()),
        "lemma2_ratio_max": float(ratio.max()),
    }


SQUASH_THRESHOLDS = (1, 2)


def squash_range(x: torch.Tensor, layer: nn.Module) -> dict[str, float | None]:
    """DyT's and Derf's `alpha`, Derf's `shift`, and the fractions of `x`'s elements whose squash
    argument `alpha x + shift` lies beyond each of `SQUASH_THRESHOLDS` in absolute value; None for
    a norm without a squash."""
    keys = ["alpha", "shift"] + [f"squash_beyond_{t}" for t in SQUASH_THRESHOLDS]
    if not isinstance(layer, _ElementwiseNorm):
        return dict.fromkeys(keys)
    alpha = float(layer.alpha.detach().float())
    shift = getattr(layer, "shift", None)
    shift = None if shift is None else float(shift.detach().float())
    z = (alpha * x.double() + (shift or 0.0)).abs()
    return {"alpha": alpha, "shift": shift,
            **{f"squash_beyond_{t}": (z > t).double().mean().item() for t in SQUASH_THRESHOLDS}}


# ----------------------------------------------------------------------------------------------
# Reading the rows back


def read_norm_statistics(path: str | os.PathLike) -> list[dict]:
    """The rows of a JSON-lines file written by `NormStatisticsRecorder`, in order."""
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def norm_statistics_to_csv(jsonl_path: str | os.PathLike, csv_path: str | os.PathLike) -> None:
    """One CSV table of the rows (columns in first-seen order; lists written as JSON)."""
    rows = read_norm_statistics(jsonl_path)
    columns = list(dict.fromkeys(key for row in rows for key in row))
    with open(csv_path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: json.dumps(v) if isinstance(v, list) else v for k, v in row.items()})


__all__ = [
    "NormStatisticsRecorder",
    "RECORDED_NORMS",
    "batch_statistics",
    "gradient_contributions",
    "lemma2_condition",
    "norm_statistics_to_csv",
    "read_norm_statistics",
    "running_comparison",
]

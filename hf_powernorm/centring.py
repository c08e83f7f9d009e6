"""Centring the residual stream of a LayerNorm model, so that its LayerNorms compute RMSNorm.

In a pre-LN transformer every write into the residual stream is linear (token, position and type
embeddings, a patch convolution, a CLS token, the output projections of the attention and MLP blocks
and their biases) and every read goes through a LayerNorm. Subtracting from each writer its mean over
the hidden channels keeps the function, since `LN(x - mean(x)) = LN(x)`, and leaves every stream
vector with mean 0, where `LN(x) * w + b` equals `RMS(x) * w + b`: the LayerNorms then convert
exactly to norms that do not centre (PN over one group, RMSNorm). This is SliceGPT's computational
invariance (Ashkboos et al., ICLR 2024, Section 3 and Appendix A; `layernorm_fusion.py` of
`microsoft/TransformerCompression`: embeddings centred, `bake_mean_into_linear` on the outputs, the
head untied).

`centre_residual_stream(model, hidden_size, norms, run)` finds the writers from the model itself:
- candidates: modules that write `hidden_size` channels (`nn.Embedding`, `nn.Linear`, Transformers'
  `Conv1D`, ungrouped `nn.Conv1d/2d/3d`) and free parameters whose last dimension is `hidden_size`
  (ViT's CLS token and position table), less the modules whose input is a norm's output on the probe
  batch (query, key and value projections read the stream through a norm);
- writers: the candidates whose centring leaves the model's output unchanged, tried all at once and,
  where that changes the output, one by one (a convolution before a GELU, a pooler, a layer scale
  stay as they are);
then a head whose weight is a centred embedding's is untied (`tie_word_embeddings=False` in the
config: the head keeps the uncentred table, which the final norm's output meets; the config marked
so that the model's other ties reload, `kept_ties`), and the writers
are centred in float64. Whether each norm's input is centred is measured by the caller, on the
calibration batches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from .converted_norms import UNTIED_HEAD_CONFIG_KEY, kept_ties, text_config


@dataclass(eq=False)  # compared by identity: its tensors have no truth value
class Writer:
    """A candidate writer into the residual stream: `tensors` are `(parameter, channel dimension)`
    pairs; `module` (None for a free parameter) writes its output's `output_dim` channels."""

    name: str
    tensors: list[tuple[nn.Parameter, int]]
    module: nn.Module | None = None
    output_dim: int = -1


@dataclass
class Centring:
    """What `centre_residual_stream` did: the centred writers, the candidates left as they were
    because centring them changed the output, and the head it untied (None if none)."""

    writers: list[str] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)
    untied: str | None = None


def writer_candidates(model: nn.Module, hidden_size: int) -> list[Writer]:
    """Every module and free parameter that could write `hidden_size` channels into the stream."""
    candidates = []
    for name, module in model.named_modules():
        writer = _module_writer(name, module, hidden_size)
        if writer is not None:
            candidates.append(writer)
        if writer is not None or _is_layer(module):
            continue
        for parameter_name, parameter in module.named_parameters(recurse=False):
            if parameter.dim() >= 2 and parameter.shape[-1] == hidden_size:
                candidates.append(Writer(f"{name}.{parameter_name}" if name else parameter_name, [(parameter, -1)]))
    return candidates


def _is_layer(module: nn.Module) -> bool:
    """A linear, embedding or convolution layer: its parameters are its own weights, not free ones."""
    return (isinstance(module, (nn.Linear, nn.Embedding, nn.modules.conv._ConvNd))
            or type(module).__name__ == "Conv1D")


def _module_writer(name: str, module: nn.Module, hidden_size: int) -> Writer | None:
    """`module` as a writer of `hidden_size` channels, or None; a writer's bias is centred with it."""
    if nn.utils.parametrize.is_parametrized(module):
        return None  # a weight computed from others (weight norm) cannot be centred in place
    bias = getattr(module, "bias", None)
    with_bias = [(bias, -1)] if isinstance(bias, nn.Parameter) else []
    if isinstance(module, nn.Embedding) and module.embedding_dim == hidden_size:
        return Writer(name, [(module.weight, -1)], module, -1)
    if isinstance(module, nn.Linear) and module.out_features == hidden_size:
        return Writer(name, [(module.weight, 0), *with_bias], module, -1)
    if type(module).__name__ == "Conv1D" and getattr(module, "nf", None) == hidden_size:  # GPT-2's (in, out)
        return Writer(name, [(module.weight, -1), *with_bias], module, -1)
    if (isinstance(module, nn.modules.conv._ConvNd) and not module.transposed and module.groups == 1
            and module.out_channels == hidden_size):
        return Writer(name, [(module.weight, 0), *with_bias], module, 1)
    return None


@torch.no_grad()
def centre_residual_stream(model: nn.Module, hidden_size: int, norms: dict[str, nn.Module],
                           run: Callable[[], torch.Tensor]) -> Centring:
    """Find the writers of `model`'s residual stream and centre them in place (module docstring).

    Args:
        model (`nn.Module`):
            The model, whose writers are centred in place.
        hidden_size (`int`):
            The width of the residual stream.
        norms (`dict[str, nn.Module]`):
            Every norm of the model by path (their outputs tell the readers apart).
        run (`Callable[[], torch.Tensor]`):
            The model's output (logits) on a probe batch, in eval mode.

    The output stays within `tolerance(dtype)` of its RMS (the dtype of its parameters); a RuntimeError
    says otherwise.
    """
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    reference = run()
    readers = _readers(model, norms, run)
    candidates = [w for w in writer_candidates(model, hidden_size) if w.module is None or w.module not in readers]
    writers = _invariant(candidates, reference, run, tolerance(dtype))
    centring = Centring([w.name for w in writers], [w.name for w in candidates if w not in writers])
    centring.untied = _untie_head(model, writers)
    for parameter in _unique(p for w in writers for p, _ in w.tensors):
        dim = next(d for w in writers for p, d in w.tensors if p is parameter)
        value = parameter.detach().double()
        parameter.copy_((value - value.mean(dim, keepdim=True)).to(parameter.dtype))
    change = _change(run(), reference)
    if change > tolerance(dtype):
        raise RuntimeError(f"centring the residual stream of {type(model).__name__} changed its output by {change:.3g} "
                           f"of its RMS, more than rounding explains ({tolerance(dtype):.3g}); its writers "
                           f"({', '.join(centring.writers)}) are centred now: load the model again, and convert it "
                           "with centre_stream=False")
    return centring


def tolerance(dtype: torch.dtype) -> float:
    """The change of the output, relative to its RMS, that rounding explains: 64 units of the dtype's
    machine epsilon (7.6e-6 in float32), at most its square root (0.09 in bfloat16); centring a
    module that is not a writer changes the output by far more."""
    eps = float(torch.finfo(dtype).eps)
    return min(64 * eps, eps ** 0.5)


def _change(output: torch.Tensor, reference: torch.Tensor) -> float:
    """The largest absolute change of `output` from `reference`, relative to the reference's RMS."""
    scale = reference.double().square().mean().sqrt().clamp_min(1e-30)
    return float((output.double() - reference.double()).abs().max() / scale)


def _readers(model: nn.Module, norms: dict[str, nn.Module], run: Callable[[], torch.Tensor]) -> set[nn.Module]:
    """The writer-shaped modules whose input, on the probe batch, is a norm's output."""
    outputs: list[torch.Tensor] = []
    readers: set[nn.Module] = set()

    def keep(module, args, output):
        if isinstance(output, torch.Tensor):
            outputs.append(output.detach())

    def check(module, args):
        first = args[0] if args else None
        if isinstance(first, torch.Tensor) and any(o.shape == first.shape and torch.equal(o, first) for o in outputs):
            readers.add(module)

    handles = [norm.register_forward_hook(keep) for norm in norms.values()]
    handles += [module.register_forward_pre_hook(check) for module in model.modules() if _is_layer(module)]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return readers


def _invariant(candidates: list[Writer], reference: torch.Tensor, run: Callable[[], torch.Tensor],
               limit: float) -> list[Writer]:
    """The candidates whose centring, all together, changes the output by at most `limit` of its RMS:
    all of them where that holds, else those kept one by one, each tried with those kept before it."""
    def unchanged(writers: list[Writer]) -> bool:
        with _simulated(writers):
            return _change(run(), reference) <= limit

    if unchanged(candidates):
        return candidates
    kept: list[Writer] = []
    for writer in candidates:
        if unchanged([*kept, writer]):
            kept.append(writer)
    return kept


@contextmanager
def _simulated(writers: list[Writer]):
    """The writers centred for the duration: module outputs by forward hooks, free parameters in place."""
    handles = [w.module.register_forward_hook(_centre_output(w.output_dim)) for w in writers if w.module is not None]
    saved = [(p, p.detach().clone()) for w in writers if w.module is None for p, _ in w.tensors]
    for parameter, value in saved:
        parameter.copy_(value - value.mean(-1, keepdim=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for parameter, value in saved:
            parameter.copy_(value)


def _centre_output(dim: int):
    def hook(module, args, output):
        return output - output.mean(dim, keepdim=True) if isinstance(output, torch.Tensor) else output
    return hook


def _untie_head(model: nn.Module, writers: list[Writer]) -> str | None:
    """Give the output embeddings a copy of their weight where it is a writer's (a tied head), and
    record `tie_word_embeddings=False` so that saving and loading keep them apart; their path or None.
    Transformers reads every tie of the model off that flag, so the config is also marked
    (`UNTIED_HEAD_CONFIG_KEY`): a converted model reloads with its other ties (`kept_ties`)."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    weight = getattr(head, "weight", None)
    if weight is None or not any(p is weight for w in writers for p, _ in w.tensors):
        return None
    head.weight = nn.Parameter(weight.detach().clone(), requires_grad=weight.requires_grad)
    config = getattr(model, "config", None)
    for part in {id(c): c for c in (config, text_config(config)) if c is not None}.values():
        if getattr(part, "tie_word_embeddings", False):
            setattr(part, UNTIED_HEAD_CONFIG_KEY, True)  # the model's other ties hold: `kept_ties`
        part.tie_word_embeddings = False
    if hasattr(model, "all_tied_weights_keys"):
        model.all_tied_weights_keys = kept_ties(model)  # `tie_weights` must not tie the head again
    return next(name for name, module in model.named_modules() if module is head)


def _unique(parameters: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for parameter in parameters:
        seen.setdefault(id(parameter), parameter)
    return list(seen.values())


__all__ = ["Centring", "Writer", "centre_residual_stream", "tolerance", "writer_candidates"]

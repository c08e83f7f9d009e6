"""Power Normalization for any Transformers model: replace its per-token norms by registry norms.

`convert_norms(model, norm_type, **options)` swaps the LayerNorm / RMSNorm layers of a Transformers
model for norms of `normalization.py` (PN by default, Shen et al., 2020, Algorithm 2), keeping the
affine weights, and makes the batch's padding mask reach the new norms: batch statistics are then
taken over real tokens only (the masked statistics of `docs/norms.md`), which Transformers'
own norm layers never need and never receive. `preserve_function=True` makes the converted model
start from the source's function (`convert_norms`). The conversion is recorded in
`config.powernorm_conversion`; `apply_conversion(model, record)` replays it on a freshly built model
(no weight read, so on the `meta` device too) and `load_converted(path, auto_class)` rebuilds a
saved converted model with its running statistics.

This file finds the norms (`is_norm_candidate`: by structure, not by a list of classes), selects
those over the residual stream (`select_norms`; the others are kept, with the reason), reads and
probes each (`read_source_norm`) and, for `preserve_function`, calibrates them on batches of the
source model. `converted_norms.py` holds what a converted model needs without this file: the mask
context and hooks (`mask_roles`, shared with the calibration), the wrapper that passes the mask on
(`MaskAwareNorm`) and the replay of the record. Which norms are found and converted, and how the
padding mask reaches them: docs/conversion.md.
"""

from __future__ import annotations

import inspect
import json
import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .centring import Centring, centre_residual_stream
from .converted_norms import (
    CONVERSION_CONFIG_KEY,
    EPS_ATTRIBUTES,
    MaskAwareNorm,
    NormMaskContext,
    is_under,
    language_model_prefixes,
    mask_roles,
    norm_epsilon,
    norm_size,
    replay_conversion,
    text_config,
)
from .modeling_converted import load_converted, load_converted_config
from .normalization import NORM_CLASSES, build_norm, normalize_norm_name

# Norm layers by class name (bases too): LayerNorm and RMSNorm, their gated forms (Mamba2's
# `MambaRMSNormGated`) and weightless L2 norms (Llama 4's `L2Norm` QK-norm).
NORM_CLASS_NAME = re.compile(r"(LayerNorm|RMSNorm|RmsNorm|NormGated|L2Norm)$")
# The targets `preserve_function=True` supports: options it fixes (`group_eps` is set per norm to the
# source's epsilon), the source kinds it can reproduce, and whether LayerNorm sources need the residual
# stream centred (`centring.py`; where it is not, they are fitted as closely as the norm can come).
PRESERVING = {
    "powernorm": {"options": {"group_num": 1, "warmup_steps": 0, "warmup_ramp_steps": 0}, "group_eps": True,
                  "sources": ("rmsnorm", "rmsnorm_offset", "layernorm", "layernorm_offset"), "centring": True},
    "rmsnorm": {"options": {}, "sources": ("rmsnorm", "rmsnorm_offset", "layernorm", "layernorm_offset"),
                "centring": True},
    "layernorm": {"options": {}, "sources": ("layernorm", "layernorm_offset")},
}
# A LayerNorm converts exactly when its input's |mean| / RMS stays below this on every real calibration token.
CENTRED_TOLERANCE = 1e-5
# The source kinds whose weight is `1 + w` (the new norm's weight is the stored `w` plus one) and
# those that centre (LayerNorm's function, which PN, not centring, can only fit).
OFFSET_KINDS = ("rmsnorm_offset", "layernorm_offset")
CENTRED_KINDS = ("layernorm", "layernorm_offset")


# ----------------------------------------------------------------------------------------------
# Finding and reading the norms


@dataclass
class SourceNorm:
    """What a model's norm computes: `kind` is `layernorm`, `layernorm_offset` (`1 + w`), `rmsnorm` or
    `rmsnorm_offset` (`1 + w`)."""

    kind: str
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    eps: float


def is_norm_candidate(module: nn.Module) -> bool:
    """True for `nn.LayerNorm`, `nn.RMSNorm` and classes named `*LayerNorm`, `*RMSNorm`, `*NormGated` or
    `*L2Norm` (bases too), except the norms of this project's registry and their wrapper."""
    if isinstance(module, MaskAwareNorm) or type(module) in NORM_CLASSES.values():
        return False
    if isinstance(module, (nn.LayerNorm, getattr(nn, "RMSNorm", nn.LayerNorm))):
        return True
    return any(NORM_CLASS_NAME.search(cls.__name__) for cls in type(module).__mro__[:-1])


def read_source_norm(module: nn.Module, name: str, hidden_size: int) -> SourceNorm:
    """Check the structure of a candidate norm and probe what it computes; ValueError if it cannot map."""
    where = f"norm {name!r} ({type(module).__name__})"
    if any(True for _ in module.children()):
        held = held_norms(module, name)
        inside = f" (select the norm it holds: {', '.join(held)})" if held else ""
        raise ValueError(f"cannot convert {where}: it has submodules, expected a leaf norm layer{inside}")
    if is_gated(module):
        raise ValueError(f"cannot convert {where}: a gated norm (its forward takes a gate beside its input), "
                         "which no registry norm computes")
    weight, bias = _vector(module, "weight", hidden_size, where), _vector(module, "bias", hidden_size, where)
    eps = norm_epsilon(module, weight)
    if eps is None:
        raise ValueError(f"cannot convert {where}: no float epsilon attribute among {EPS_ATTRIBUTES}")
    kind = _probe_kind(module, weight, bias, eps, hidden_size)
    if kind is None:
        raise ValueError(
            f"cannot convert {where}: it does not compute LN(x) * w + b, LN(x) * (1 + w) + b, RMS(x) * w or "
            "RMS(x) * (1 + w) over the last dimension"
        )
    return SourceNorm(kind, weight, bias, eps)


def held_norms(module: nn.Module, name: str) -> list[str]:
    """The paths of the candidate norms inside `module`, the module at path `name`: a norm-named
    wrapper's own norm, as in AXK2's `AXK2GatedRMSNorm` (an RMSNorm, then a gate computed from its output)."""
    return [f"{name}.{inner_name}" for inner_name, inner in module.named_modules()
            if inner_name and is_norm_candidate(inner)]


def _vector(module: nn.Module, attribute: str, hidden_size: int, where: str) -> torch.Tensor | None:
    value = getattr(module, attribute, None)
    if value is None:
        return None
    if not isinstance(value, torch.Tensor) or value.shape != (hidden_size,):
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(
            f"cannot convert {where}: its {attribute} has shape {shape}, expected ({hidden_size},) "
            "(a per-token norm over its last dimension)"
        )
    return value


@torch.no_grad()
def _probe_kind(module, weight, bias, eps, hidden_size) -> str | None:
    """Run the norm on random float32 inputs and match its output against the four forms."""
    device = weight.device if weight is not None else torch.device("cpu")
    generator = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(2, 3, hidden_size, generator=generator) * 2 + 0.5).to(device)
    dtype = weight.dtype if weight is not None else torch.float32
    out = module(x.to(dtype)).float()
    w = weight.float() if weight is not None else torch.ones(hidden_size, device=device)
    b = bias.float() if bias is not None else torch.zeros(hidden_size, device=device)
    rms = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    forms = {
        "layernorm": F.layer_norm(x, (hidden_size,), w, b, eps),
        "layernorm_offset": F.layer_norm(x, (hidden_size,), 1 + w, b, eps),
        "rmsnorm": rms * w + b,
        "rmsnorm_offset": rms * (1 + w) + b,
    }
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    return next((kind for kind, ref in forms.items() if torch.allclose(out, ref, atol=tolerance, rtol=tolerance)),
                None)


def find_norms(model: nn.Module, hidden_size: int, modules=None) -> dict[str, SourceNorm]:
    """The norms `convert_norms` would convert (`select_norms`) by module path, read and checked by
    `read_source_norm`."""
    selected, _ = select_norms(model, hidden_size, modules)
    return {name: read_source_norm(model.get_submodule(name), name, size) for name, size in selected.items()}


# ----------------------------------------------------------------------------------------------
# Conversion


@dataclass
class ConversionReport:
    """What a conversion did: `replaced` `(module path, old class, new class)` per converted norm,
    `kept` `(module path, class, reason)` per norm left as it was, the options, whether it kept the
    model's function, and `start_gap`: the largest absolute difference of the model's first output
    (logits) between the source and the converted model on the first calibration batch (None
    without calibration batches). Under `preserve_function`, `centring` says which writers of the
    residual stream were centred (`centring.py`) and `approximate` lists `(module path, mean / RMS)`
    per LayerNorm whose input is not centred, fitted instead (mean / RMS the largest over the real
    calibration tokens; None without calibration batches)."""

    norm_type: str
    options: dict
    replaced: list[tuple[str, str, str]] = field(default_factory=list)
    kept: list[tuple[str, str, str]] = field(default_factory=list)
    preserve_function: bool = False
    start_gap: float | None = None
    approximate: list[tuple[str, float | None]] = field(default_factory=list)
    centring: Centring | None = None

    @property
    def preserves_function(self) -> bool:
        """True when every converted norm computes its source exactly (up to rounding)."""
        return self.preserve_function and not self.approximate

    @property
    def modules(self) -> list[str]:
        return [name for name, _, _ in self.replaced]

    def __str__(self) -> str:
        preserving = ", keeping the function" if self.preserve_function else ""
        lines = [f"{len(self.replaced)} norms converted to {self.norm_type} {self.options}{preserving}"]
        lines += [f"  {name}: {old} -> {new}" for name, old, new in self.replaced]
        if self.centring is not None:
            untied = f"; head {self.centring.untied} untied" if self.centring.untied else ""
            lines.append(f"residual stream centred: {len(self.centring.writers)} writers{untied}")
        if self.approximate:
            lines.append(f"{len(self.approximate)} norms approximate (input not centred, least-squares fit)")
            lines += [f"  {name}: mean / RMS " + ("not measured" if ratio is None else f"{ratio:.3g}")
                      for name, ratio in self.approximate]
        if self.start_gap is not None:
            lines.append(f"largest output change on the first calibration batch: {self.start_gap:.3g}")
        if self.kept:
            lines.append(f"{len(self.kept)} norms kept")
            lines += [f"  {name}: {cls} ({reason})" for name, cls, reason in self.kept]
        return "\n".join(lines)


# Over 50 lines: its docstring names every argument (Args); the code is 22 lines.
def convert_norms(model: nn.Module, norm_type: str = "powernorm", *, modules=None, preserve_function: bool = False,
                  calibration_batches: Iterable[dict] | None = None, centre_stream: bool = True,
                  **options) -> ConversionReport:
    """Replace the per-token norms of a Transformers `model` by `build_norm(norm_type, ...)`, in place.

    Weights map where both norms have them (`weight`, `bias`; `1 + w` for norms that scale by it),
    the source's epsilon is kept unless `eps` is given, and `group_num` defaults to the config's
    `num_attention_heads` for norms that take it (one group for a norm over another size). The new
    norms sit on the model's device and dtype (running statistics float32), start with fresh running
    statistics and step counters, and receive each forward's padding mask; `apply_conversion` replays
    the record in `model.config.powernorm_conversion` on a freshly built model.

    Args:
        model (`PreTrainedModel`):
            The Transformers model to convert.
        norm_type (`str`, *optional*, defaults to `"powernorm"`):
            A name of the norm registry (`NORM_CLASSES`).
        modules (`str` or callable, *optional*):
            Which norms convert. None: the norms over the residual stream (`select_norms`: over the
            hidden size, not inside an attention block, inside the language model of a composite model
            such as Gemma 3's); QK-norms, per-head norms, those of a vision tower or projector and
            norm-named wrappers around a norm (whose norm converts) are kept, listed in `report.kept`
            with the reason. A string is a regular expression searched in each candidate norm's module
            path, a callable `(name, module) -> bool` a predicate: either selects among every candidate
            norm, QK-norms included where `norm_type` can be built over their size.
        preserve_function (`bool`, *optional*, defaults to `False`):
            Make the converted model compute what the source computed before any update, in eval and
            in the first training forward (`PRESERVING` lists the targets): exactly for RMSNorm sources
            and for LayerNorm sources once `centre_stream` centres their inputs, by a least-squares fit
            named in `report.approximate` otherwise (`docs/conversion.md`, `docs/conversion_families.md`).
        calibration_batches (iterable of `dict`, *optional*):
            Model inputs, run in eval mode without gradients, that calibrate `preserve_function` and
            measure `report.start_gap`, the largest change of the first logits.
        centre_stream (`bool`, *optional*, defaults to `True`):
            With `preserve_function` and calibration batches, centre the writers of the residual stream
            where LayerNorm sources need it (`centring.py`).
        options:
            The new norms' options (`eps`, `group_num`, `alpha_fwd`, ...), JSON values.

    Returns:
        `ConversionReport`: what was replaced and kept, and how close the function stayed.
    """
    config = _model_config(model)
    _refuse_converted(model, config)
    norm_type = normalize_norm_name(norm_type)
    explicit = set(options)
    options = _resolve_options(norm_type, options, config, preserve_function)
    hidden_size = _hidden_size(config)
    plans, kept = _checked_plans(model, norm_type, options, explicit, hidden_size, modules, preserve_function)
    centring, calibration = _centre_and_calibrate(model, norm_type, plans, hidden_size, calibration_batches,
                                                  preserve_function and centre_stream)
    approximate = _settle_centred(norm_type, plans, calibration) if preserve_function else []
    report = apply_conversion(model, _conversion_record(norm_type, options, plans, preserve_function))
    report.approximate, report.centring = approximate, centring
    order = {name: index for index, (name, _) in enumerate(model.named_modules())}
    report.kept = sorted(kept, key=lambda entry: order.get(entry[0], len(order)))
    _initialise_norms(model, plans, calibration, preserve_function)
    if calibration is not None:
        report.start_gap = _start_gap(model, calibration)
    _warn_position_mixing(model, config, norm_type, options)
    from .modeling_converted import adopt

    adopt(model)
    return report


def centre_stream(model: nn.Module, calibration_batches: Iterable[dict] | None, *, modules=None) -> Centring | None:
    """`preserve_function`'s structural step alone, without converting a norm: the writers of the
    residual stream centred, and a head tied to a centred embedding untied, where the norms that
    `modules` selects include LayerNorm sources (`centring.py`). The model computes what it computed
    (LayerNorm of a centred input is the same function). A comparison takes this step in every arm,
    the baseline's too, and then converts with `centre_stream=False`, so that its arms differ in their
    norms alone. None where nothing was centred (no LayerNorm source, no calibration batch)."""
    hidden_size = _hidden_size(_model_config(model))
    sources = find_norms(model, hidden_size, modules)
    if not any(source.kind in CENTRED_KINDS for source in sources.values()):
        return None
    return _centre_stream(model, hidden_size, list(calibration_batches or []))


def head_is_tied(model: nn.Module) -> bool:
    """Whether the model's output head shares its weight with its input embeddings."""
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and embeddings is not None and head.weight is embeddings.weight


def _checked_plans(model: nn.Module, norm_type: str, options: dict, explicit: set[str], hidden_size: int,
                   modules, preserve_function: bool) -> tuple[dict[str, _Plan], list[tuple[str, str, str]]]:
    """The plans of the norms that convert (`select_norms`, `_plan`) and the norms kept, `[(path,
    class, reason)]`; a `ValueError` when none converts, or when `preserve_function` cannot hold."""
    selected, kept = select_norms(model, hidden_size, modules)
    plans, unbuildable = _plan(model, selected, norm_type, options, explicit, hidden_size, preserve_function)
    if not plans:
        raise ValueError(f"{type(model).__name__} has no LayerNorm or RMSNorm to convert"
                         + (f"; kept: {kept + unbuildable}" if kept or unbuildable else ""))
    if preserve_function:
        _check_preservable(norm_type, plans)
    return plans, kept + unbuildable


def _centre_and_calibrate(model: nn.Module, norm_type: str, plans: dict[str, _Plan], hidden_size: int,
                          calibration_batches: Iterable[dict] | None,
                          centre: bool) -> tuple[Centring | None, _Calibration | None]:
    """With `centre` and calibration batches, centre the residual stream's writers where the plans
    need it (`_centre_stream`); then, with calibration batches, run them (`_calibrate`)."""
    centring = None
    if centre and calibration_batches is not None and _needs_centring(norm_type, plans):
        calibration_batches = list(calibration_batches)
        centring = _centre_stream(model, hidden_size, calibration_batches)
    calibration = None if calibration_batches is None else _calibrate(model, plans, calibration_batches)
    return centring, calibration


def _initialise_norms(model: nn.Module, plans: dict[str, _Plan], calibration: _Calibration | None,
                      preserve_function: bool) -> None:
    """Copy each source norm's weights into its new norm and, with `preserve_function`, compensate
    the new norm for its running statistic or fit (`_compensate`)."""
    for name, plan in plans.items():
        norm = model.get_submodule(name).norm
        _copy_source(norm, plan.source)
        if preserve_function and ("running_phi" in norm._buffers or plan.fit):
            _compensate(norm, plan, calibration.moments.get(name) if calibration else None)


@dataclass
class _Plan:
    """How one norm converts: what it computes, its size, and the options of its new norm."""

    source: SourceNorm
    size: int
    options: dict
    fit: bool = False  # a LayerNorm source whose input is not centred: its new norm takes the least-squares fit


def _refuse_converted(model: nn.Module, config) -> None:
    if getattr(model, "_powernorm_mask_context", None) is not None:
        raise ValueError(f"{type(model).__name__} is already converted ({getattr(config, CONVERSION_CONFIG_KEY)})")


def select_norms(model: nn.Module, hidden_size: int, modules=None) -> tuple[dict[str, int], list[tuple[str, str, str]]]:
    """The candidate norms that convert, `{module path: size}`, and those kept, `[(path, class, reason)]`.

    `modules=None`: a norm converts when it is a norm layer, not a wrapper holding one (AXK2's gated
    RMSNorm: the RMSNorm inside converts, its gate stays), normalizes over `hidden_size` (its 1-D
    weight, bias or `normalized_shape`), is not a child of an attention block (a module whose class is named
    `*Attention*` and holds `nn.Linear` projections, as OLMo2's `q_norm` over all heads is) and, in
    a composite model (Gemma 3's, LLaVA's), lies in its language model (`language_model_prefixes`:
    a vision tower's norms see patches, not the tokens the padding mask describes); a string or a
    callable selects among every candidate (see `convert_norms`).
    """
    selector = _selector(modules)
    language = language_model_prefixes(model)
    selected, kept = {}, []
    for name, module in model.named_modules():
        if not name or not is_norm_candidate(module):
            continue
        size = norm_size(module)
        if selector is not None:
            if selector(name, module):
                selected[name] = size if size is not None else hidden_size
            else:
                kept.append((name, type(module).__name__, f"not selected by modules={_selector_name(modules)}"))
            continue
        reason = _kept_by_default(model, name, module, size, hidden_size, language)
        if reason is None:
            selected[name] = hidden_size
        else:
            kept.append((name, type(module).__name__, reason))
    return selected, kept


def _selector(modules):
    """`modules` as a predicate `(name, module) -> bool`, or None for the default rule."""
    if modules is None:
        return None
    if isinstance(modules, str):
        try:
            pattern = re.compile(modules)
        except re.error as error:
            raise ValueError(f"modules={modules!r} is not a regular expression: {error}") from None
        return lambda name, module: pattern.search(name) is not None
    if callable(modules):
        return lambda name, module: bool(modules(name, module))
    raise TypeError(f"modules must be None, a regular expression string or a callable (name, module) -> bool, "
                    f"got {type(modules).__name__}")


def _selector_name(modules) -> str:
    return repr(modules) if isinstance(modules, str) else getattr(modules, "__qualname__", repr(modules))


def _kept_by_default(model: nn.Module, name: str, module: nn.Module, size: int | None, hidden_size: int,
                     language: tuple[str, ...] | None) -> str | None:
    """Why the default rule keeps the norm `module` at path `name` (off the residual stream), or None
    when it converts."""
    if language is not None and not is_under(name, language):
        return (f"outside the language model ({', '.join(language)}): it does not normalize the tokens "
                "the padding mask describes")
    held = held_norms(module, name)
    if held:
        return (f"a wrapper around the norm {', '.join(held)} (a gate or other layers "
                "beside it): the norm inside converts by the same rule, the wrapper's other layers stay")
    parent_name = name.rpartition(".")[0]
    parent = model.get_submodule(parent_name)
    if is_gated(module):
        return (f"a gated norm: its forward takes a gate beside its input (inside {type(parent).__name__}), "
                "which no registry norm computes")
    if _is_ssm_mixer(parent):
        return (f"an SSM inner norm: inside the state-space mixer {type(parent).__name__}, over {size} of its "
                "channels, not the residual stream")
    if _is_attention(parent):
        return _attention_norm_reason(parent, size, hidden_size)
    table = _position_table(parent, size)
    if table is not None:
        return (f"a position-table norm: it normalizes the rows of {'.'.join(filter(None, (parent_name, table)))} "
                "(a relative-position table), not tokens")
    if size is None and not hasattr(module, "weight"):
        return "a weightless L2 norm with no size of its own, off the residual stream"
    if size == 2 * hidden_size:
        return (f"normalizes {size} channels, twice the hidden size {hidden_size}: the concatenation of two "
                "hidden-size vectors (Zamba2's hidden states and input embeddings), not the residual stream alone")
    if size is not None and size != hidden_size:
        return f"normalizes {size} channels, not the hidden size {hidden_size}: off the residual stream"
    return None


def is_gated(module: nn.Module) -> bool:
    """A norm whose forward takes a gate beside its input (Mamba2's, Zamba2's, Qwen3.5's gated RMSNorms)."""
    try:
        parameters = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    return "gate" in parameters or type(module).__name__.endswith("Gated")


def _is_ssm_mixer(module: nn.Module) -> bool:
    """A state-space mixer (Mamba's, Jamba's): a causal `Conv1d` beside the state matrix `A_log`."""
    return "A_log" in module._parameters and any(isinstance(m, nn.Conv1d) for m in module.children())


def _is_attention(module: nn.Module) -> bool:
    return "Attention" in type(module).__name__ and any(isinstance(m, nn.Linear) for m in module.children())


def _attention_norm_reason(attention: nn.Module, size: int | None, hidden_size: int) -> str:
    """Why a norm inside an attention block is kept: a latent projection norm (multi-head latent
    attention's `q_a_layernorm`: a projection of the block other than its output projection, the last,
    reads its channels, or them beside another vector of that size), else a QK-norm."""
    where = f"inside {type(attention).__name__} beside its projections"
    if size is None:
        return f"a weightless L2 norm {where}: a QK-norm (or value norm)"
    linears = [(name, m) for name, m in attention.named_children() if isinstance(m, nn.Linear)]
    readers = [name for name, m in linears[:-1] if m.in_features in (size, 2 * size) and m.in_features != hidden_size]
    if size != hidden_size and readers:
        return (f"normalizes {size} channels, not the hidden size {hidden_size}: a latent projection norm "
                f"{where} (the low-rank latent that {', '.join(readers)} reads)")
    head_dim = getattr(attention, "head_dim", None)
    what = "one head's" if size == head_dim else "the heads'"
    return f"normalizes {size} channels, {what}, {where}: a QK-norm (or value norm)"


def _position_table(parent: nn.Module, size: int | None) -> str | None:
    """The name of a relative-position table beside the norm (DeBERTa's `rel_embeddings`, which the
    norm normalizes row by row), or None."""
    for name, child in parent.named_children():
        if isinstance(child, nn.Embedding) and "rel" in name.split("_") and child.embedding_dim == size:
            return name
    return None


def _plan(model: nn.Module, selected: dict[str, int], norm_type: str, options: dict, explicit: set,
          hidden_size: int, preserve_function: bool = False) -> tuple[dict[str, _Plan], list[tuple[str, str, str]]]:
    """Read each selected norm and fix its new norm's options; a norm over another size that
    `norm_type` cannot be built over is kept, with the reason."""
    plans, kept = {}, []
    for name, size in selected.items():
        module = model.get_submodule(name)
        source = read_source_norm(module, name, size)
        module_options = {"eps": source.eps, **options}
        if size != hidden_size and "group_num" in options and "group_num" not in explicit:
            module_options["group_num"] = 1  # heads of the model are not groups of one head's channels
        if preserve_function and PRESERVING[norm_type].get("group_eps"):
            module_options["group_eps"] = source.eps  # one group's scaling is then the source's RMS(x)
        try:
            with torch.device("meta"):
                build_norm(norm_type, size, **module_options)
        except ValueError as error:
            if size == hidden_size:
                raise
            kept.append((name, type(module).__name__, f"{norm_type} cannot be built over {size} channels: {error}"))
            continue
        plans[name] = _Plan(source, size, module_options)
    return plans, kept


def _conversion_record(norm_type: str, options: dict, plans: dict[str, _Plan],
                       preserve_function: bool = False) -> dict:
    """`config.powernorm_conversion`: enough to rebuild the converted model without reading a weight."""
    return {
        "norm_type": norm_type,
        "options": options,
        "modules": list(plans),
        "norms": {name: {"size": plan.size, "source": plan.source.kind, "options": plan.options}
                  for name, plan in plans.items()},
        "preserve_function": preserve_function,
    }


def apply_conversion(model: nn.Module, conversion: dict) -> ConversionReport:
    """Replace exactly the norms recorded in `conversion` (a `config.powernorm_conversion`) by new
    norms built from the record, install the mask hooks and set `config.powernorm_conversion`
    (`converted_norms.replay_conversion`: no weight read, no probe, so on the `meta` device too)."""
    config = _model_config(model)
    _refuse_converted(model, config)
    record, replaced = replay_conversion(model, conversion)
    report = ConversionReport(record["norm_type"], dict(record["options"]), replaced=replaced,
                              preserve_function=record["preserve_function"])
    report.kept = [(name, type(module).__name__, "not in the recorded conversion")
                   for name, module in model.named_modules() if name and is_norm_candidate(module)]
    return report


def _copy_source(norm: nn.Module, source: SourceNorm) -> None:
    """The source's weight (`1 + w` for norms that scale by it) and bias, where the new norm has them."""
    with torch.no_grad():
        if source.weight is not None and isinstance(getattr(norm, "weight", None), torch.Tensor):
            norm.weight.copy_(source.weight + 1 if source.kind in OFFSET_KINDS else source.weight)
        if source.bias is not None and isinstance(getattr(norm, "bias", None), torch.Tensor):
            norm.bias.copy_(source.bias)


def _preserving_options(norm_type: str, options: dict) -> dict:
    """The options `preserve_function=True` fixes for `norm_type`; ValueError for a target it cannot
    preserve with or an option given against them."""
    if norm_type not in PRESERVING:
        raise ValueError(f"preserve_function=True cannot keep the function with norm {norm_type!r}: it supports "
                         f"{sorted(PRESERVING)}")
    fixed = PRESERVING[norm_type]["options"]
    for key, value in fixed.items():
        if key in options and options[key] != value:
            raise ValueError(f"preserve_function=True sets {key}={value!r} for {norm_type} (see convert_norms), "
                             f"got {key}={options[key]!r}")
    return fixed


def _check_preservable(norm_type: str, plans: dict[str, _Plan]) -> None:
    sources = PRESERVING[norm_type]["sources"]
    for name, plan in plans.items():
        if plan.source.kind not in sources:
            raise ValueError(f"preserve_function=True cannot keep the function of norm {name!r} ({plan.source.kind}) "
                             f"with {norm_type}: it reproduces {', '.join(sources)} sources")


def _needs_centring(norm_type: str, plans: dict[str, _Plan]) -> bool:
    return bool(PRESERVING[norm_type].get("centring")) and any(p.source.kind in CENTRED_KINDS for p in plans.values())


def _centre_stream(model: nn.Module, hidden_size: int, batches: list) -> Centring | None:
    """Centre the writers of `model`'s residual stream (`centring.py`), probed on the first batch in
    eval mode; None without batches."""
    if not batches:
        return None
    first = _model_inputs(model, batches[0])
    norms = {name: module for name, module in model.named_modules() if name and is_norm_candidate(module)}
    training = model.training
    model.eval()
    try:
        return centre_residual_stream(model, hidden_size, norms, lambda: _first_output(model(**first)))
    finally:
        model.train(training)


def _settle_centred(norm_type: str, plans: dict[str, _Plan], calibration: _Calibration | None) -> list:
    """Mark each LayerNorm source whose input was not centred on every real calibration token for the
    least-squares fit (`_Plan.fit`) and return those, `(path, largest mean / RMS or None)`; the others
    convert exactly, as RMSNorm sources. An RMSNorm target gets a bias where the source has one or is fitted."""
    if not PRESERVING[norm_type].get("centring"):
        return []
    takes_bias = "bias" in inspect.signature(NORM_CLASSES[norm_type].__init__).parameters
    approximate = []
    for name, plan in plans.items():
        if plan.source.kind not in CENTRED_KINDS:
            continue
        moments = calibration.moments.get(name) if calibration is not None else None
        offcentre = moments.offcentre if moments is not None and moments.count > 0 else None
        plan.fit = offcentre is None or offcentre > CENTRED_TOLERANCE
        if plan.fit:
            approximate.append((name, offcentre))
        if takes_bias:
            plan.options["bias"] = plan.source.bias is not None or plan.fit
    return approximate


class _Moments:
    """Per-channel sums over real tokens of one norm's calibration inputs: `z = RMS(x)` (group
    scaling over one group with the source's epsilon) and the source's output `y`, float64; and
    `offcentre`, the largest `|mean(x)| / RMS(x)` of a real token."""

    def __init__(self) -> None:
        self.count = 0.0
        self.sums: dict[str, torch.Tensor] = {}
        self.offcentre = 0.0

    def add(self, z: torch.Tensor, y: torch.Tensor, weights: torch.Tensor | None) -> None:
        """`z`, `y`: `(tokens, C)`; `weights`: `(tokens,)` 0/1 or None (every token real)."""
        w = torch.ones(z.shape[0], dtype=z.dtype, device=z.device) if weights is None else weights.to(z.dtype)
        terms = {"z": z, "zz": z * z, "y": y, "zy": z * y}
        for key, value in terms.items():
            total = w @ value
            self.sums[key] = total if key not in self.sums else self.sums[key] + total
        self.count += float(w.sum())
        if z.shape[0]:
            self.offcentre = max(self.offcentre, float((z.mean(-1).abs() * w).max()))

    def means(self) -> dict[str, torch.Tensor]:
        return {key: value / self.count for key, value in self.sums.items()}


@dataclass
class _Calibration:
    moments: dict[str, _Moments]
    first_batch: dict
    first_output: torch.Tensor


@torch.no_grad()
def _calibrate(model: nn.Module, plans: dict[str, _Plan], batches: Iterable[dict]) -> _Calibration:
    """Run the source model in eval mode on `batches`, collecting each planned norm's `_Moments`
    (masked with the batch's padding masks, as the converted norms will be)."""
    from transformers.utils import logging as hf_logging

    masks = mask_roles(model, plans)
    moments = {name: _Moments() for name in plans}
    handles = masks.hook(model)
    for name, plan in plans.items():
        hook = _CalibrationHook(moments[name], plan, masks.context, masks.roles[name], name)
        handles.append(model.get_submodule(name).register_forward_hook(hook, with_kwargs=True))
    training, first = model.training, None
    model.eval()
    # Transformers' bar: `transformers.utils.logging.disable_progress_bar()` silences it, as `compare` does.
    bar = hf_logging.tqdm(batches, desc="Calibrating the converted norms", leave=False)
    try:
        for batch in bar:
            batch = _model_inputs(model, batch)
            output = _first_output(model(**batch))
            if first is None:
                first = (batch, output)
    finally:
        bar.close()
        for handle in handles:
            handle.remove()
        model.train(training)
    if first is None:
        raise ValueError("calibration_batches is empty: expected at least one dict of model inputs")
    return _Calibration(moments, *first)


class _CalibrationHook:
    """A forward hook adding one norm's input and output to its `_Moments`."""

    def __init__(self, moments: _Moments, plan: _Plan, context: NormMaskContext, role: str, name: str) -> None:
        self.moments, self.plan, self.context, self.role, self.name = moments, plan, context, role, name

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict, output) -> None:
        hidden_states = args[0] if args else next(iter(kwargs.values()))
        mask = self.context.mask_for(self.role, hidden_states, self.name)
        size = self.plan.size
        x = hidden_states.detach().reshape(-1, size).double()
        z = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.plan.source.eps)
        y = output.detach().reshape(-1, size).double()
        self.moments.add(z, y, None if mask is None else (mask.reshape(-1) != 0))


def _model_inputs(model: nn.Module, batch) -> dict:
    if not isinstance(batch, dict):
        raise TypeError(f"calibration_batches must yield dicts of model inputs (input_ids, attention_mask, ...), "
                        f"got {type(batch).__name__}")
    device = next(model.parameters()).device
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _first_output(output) -> torch.Tensor:
    """The model's logits, else its last hidden state, detached float32."""
    for key in ("logits", "last_hidden_state"):
        value = getattr(output, key, None)
        if isinstance(value, torch.Tensor):
            return value.detach().float()
    return (output[0] if isinstance(output, (tuple, list)) else output).detach().float()


@torch.no_grad()
def _compensate(norm: nn.Module, plan: _Plan, moments: _Moments | None) -> None:
    """Set a norm (PN, one group scaling with the source's epsilon; RMSNorm) so that its eval map and
    first training forward compute the source: PN's `running_phi` from the calibration (1 without),
    its weight times `sqrt(running_phi + eps)`; for a LayerNorm source whose input is not centred
    (`_Plan.fit`) the per-channel least-squares fit of the source's output on `RMS(x)`."""
    scale = norm.weight.detach().double().clone()  # the source's w (or 1 + w), copied already
    shift = norm.bias.detach().double().clone()
    running = norm._buffers.get("running_phi")
    if moments is not None and moments.count > 0:
        means = moments.means()
        if running is not None:
            running.copy_(means["zz"].float())
        if plan.fit:
            variance = means["zz"] - means["z"].square()
            slope = (means["zy"] - means["z"] * means["y"]) / variance.clamp_min(1e-12)
            fitted = variance > 1e-12  # a channel constant over the calibration tokens keeps w
            scale = torch.where(fitted, slope, scale)
            shift = torch.where(fitted, means["y"] - slope * means["z"], shift)
    compensation = 1.0 if running is None else torch.sqrt(running.double() + norm.eps)
    norm.weight.copy_((scale * compensation).to(norm.weight.dtype))
    norm.bias.copy_(shift.to(norm.bias.dtype))


@torch.no_grad()
def _start_gap(model: nn.Module, calibration: _Calibration) -> float:
    """The largest absolute change of the first output on the first calibration batch (eval mode)."""
    training = model.training
    model.eval()
    try:
        output = _first_output(model(**calibration.first_batch))
    finally:
        model.train(training)
    return float((output - calibration.first_output).abs().max())


def _model_config(model: nn.Module):
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise TypeError(
            f"convert_norms expects a Transformers PreTrainedModel with a config, got {type(model).__name__}"
        )
    return config


def _hidden_size(config) -> int:
    hidden_size = getattr(text_config(config), "hidden_size", None)
    if not isinstance(hidden_size, int):
        raise ValueError(f"cannot read the hidden size from {type(config).__name__}: hidden_size={hidden_size!r}")
    return hidden_size


def _resolve_options(norm_type: str, options: dict, config, preserve_function: bool = False) -> dict:
    """The options as built: those `preserve_function` fixes (`PRESERVING`), `group_num` from the
    config's heads where the norm takes one; JSON-able."""
    options = dict(options)
    if preserve_function:
        options.update(_preserving_options(norm_type, options))
    accepted = inspect.signature(NORM_CLASSES[norm_type].__init__).parameters
    heads = getattr(text_config(config), "num_attention_heads", None)
    if "group_num" in accepted and "group_num" not in options and isinstance(heads, int):
        options["group_num"] = heads
    try:
        json.dumps(options)
    except TypeError as error:
        raise TypeError(
            f"convert_norms options must be JSON values to be saved in the config, got {options!r}"
        ) from error
    return options


# ----------------------------------------------------------------------------------------------
# The causal-model warning (README: "causal models with BN or PN-V see the future")


def mixes_positions(norm_type: str, options: dict) -> bool:
    """True when the norm built with `options` takes batch statistics over every position of the batch
    in training (its `mixes_positions` trait): BN, PN-V, MABN and BRN always, PN during its warmup and
    ramp (its `mixing_options`)."""
    cls = NORM_CLASSES[normalize_norm_name(norm_type)]
    if not cls.mixes_positions:
        return False
    return not cls.mixing_options or any((options.get(name) or 0) > 0 for name in cls.mixing_options)


def is_causal(model: nn.Module, config) -> bool:
    """True for decoder-only language models (or any model with a decoder): their norms see one
    position's past only, unless batch statistics mix the positions."""
    if getattr(config, "is_encoder_decoder", False) or getattr(config, "is_decoder", False):
        return True
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    model_type = getattr(config, "model_type", None)
    return model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES


def causal_norms() -> str:
    """The norms whose training output of a position sees no other position, with the options that
    keep it so: what a causal model should train with."""
    names = [f"{name} ({', '.join(f'{option}=0' for option in cls.mixing_options)})" if cls.mixing_options else name
             for name, cls in NORM_CLASSES.items() if not cls.mixes_positions or cls.mixing_options]
    return ", ".join(names[:-1]) + " or " + names[-1]


def _warn_position_mixing(model: nn.Module, config, norm_type: str, options: dict) -> None:
    if not (mixes_positions(norm_type, options) and is_causal(model, config)):
        return
    mixing_options = NORM_CLASSES[normalize_norm_name(norm_type)].mixing_options
    when = f"for as long as its {' / '.join(mixing_options)} last" if mixing_options else "at every step"
    stack = "decoder" if getattr(config, "is_encoder_decoder", False) else "causal"
    warnings.warn(
        f"{type(model).__name__}: the {stack} norms converted to {norm_type} leak future tokens in training "
        f"mode {when}: their batch statistics mix every position of the batch, so a later token changes an "
        f"earlier position's training output. Use {causal_norms()} for a causal model, or treat its results "
        "with suspicion.",
        UserWarning,
        stacklevel=3,
    )


__all__ = [
    "ConversionReport",
    "MaskAwareNorm",
    "NormMaskContext",
    "apply_conversion",
    "convert_norms",
    "find_norms",
    "is_norm_candidate",
    "load_converted",
    "load_converted_config",
    "select_norms",
]

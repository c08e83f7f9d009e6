"""The norms of a converted model and the replay of its conversion record, apart from how they are found.

`convert_norms` (`converter.py`) finds, reads and calibrates a model's norms; this file holds what a
converted model needs at run time and at load time, with no probe and no weight read, so that
`modeling_converted.py` (copied next to a saved checkpoint as remote code) rebuilds a converted
model from `config.powernorm_conversion` alone:

- `NormMaskContext` and `MaskAwareNorm`: the padding mask of each forward, pushed by hooks on the top
  model (and the encoder), read by each converted norm (docs/conversion.md says how);
- `mask_roles(model, names)`: a model's mask context, its hooks and the mask each norm reads, for the
  converted norms and for `convert_norms`' calibration of their sources alike;
- `replay_conversion(model, record)`: build the recorded norms in place of the model's own, on the
  `meta` device too, in the module paths of `model`, which may be another head of the model that was
  converted (`LlamaModel` for a converted `LlamaForCausalLM`);
- `kept_ties(model)`: the weight ties that hold in a model whose head centring untied, which
  `tie_word_embeddings=False` alone would drop on reload (BART's shared embeddings, BERT's decoder bias).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import transformers
from torch import nn

from .normalization import build_norm, normalize_norm_name

CONVERSION_CONFIG_KEY = "powernorm_conversion"
UNTIED_HEAD_CONFIG_KEY = "powernorm_untied_head"  # true where centring set `tie_word_embeddings` false
EPS_ATTRIBUTES = ("eps", "variance_epsilon", "epsilon")
ENCODER, DECODER, MAIN = "encoder", "decoder", "main"
UNMASKED = "unmasked"  # a norm outside a composite model's language model: the mask is not of its positions


# ----------------------------------------------------------------------------------------------
# The mask context and the wrapper


class NormMaskContext:
    """The padding masks of the forward in progress, one per stack (`main`, `encoder`, `decoder`).

    Its hooks are bound methods, so `copy.deepcopy(model)` copies the context with the model.
    """

    def __init__(self, encoder_decoder: bool) -> None:
        self.encoder_decoder = encoder_decoder
        self.norms: list[MaskAwareNorm] = []  # the norms it serves, checked for kernel patches
        self._stack: list[dict[str, torch.Tensor | None]] = []
        self._last: dict[str, torch.Tensor | None] = {}

    def current(self) -> dict[str, torch.Tensor | None]:
        """The masks of the forward in progress; during a backward pass, those of the last forward,
        for the layers that activation checkpointing runs again there."""
        if self._stack:
            return self._stack[-1]
        return self._last if _in_backward() else {}

    def mask_for(self, role: str, hidden_states: torch.Tensor, name: str) -> torch.Tensor | None:
        """The `(batch, seq)` mask of `role` for `hidden_states`; its last `seq` columns under a cache."""
        mask = self.current().get(role)
        if mask is None or hidden_states.dim() != 3:
            return None
        batch, seq = hidden_states.shape[:2]
        if mask.dim() != 2 or mask.shape[0] != batch or mask.shape[1] < seq:
            raise ValueError(
                f"{name}: attention mask of shape {tuple(mask.shape)} does not cover hidden states of shape "
                f"{tuple(hidden_states.shape)}; expected a (batch, seq) 0/1 mask with seq >= {seq}"
            )
        return mask[:, mask.shape[1] - seq:]

    def _push(self, masks: dict[str, torch.Tensor | None]) -> None:
        current = self._stack[-1] if self._stack else {}
        self._stack.append({**current, **masks})

    def top_pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Take the call's masks: `attention_mask` (encoder / main) and `decoder_attention_mask`;
        refuse a forward whose converted norms a kernel patch replaced (`check_unpatched`)."""
        check_unpatched(self.norms)
        bound = _bound_arguments(module, args, kwargs)
        if self.encoder_decoder:
            self._push({ENCODER: bound.get("attention_mask"), DECODER: bound.get("decoder_attention_mask")})
        else:
            self._push({MAIN: bound.get("attention_mask")})

    def encoder_pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """The encoder called on its own (as `generate` does) gets its `attention_mask` too."""
        self._push({ENCODER: _bound_arguments(module, args, kwargs).get("attention_mask")})

    def pop_hook(self, module: nn.Module, args: tuple, output) -> None:
        if self._stack:
            self._last = self._stack.pop()


def check_unpatched(norms: list[MaskAwareNorm]) -> None:
    """RuntimeError when a converted norm's `forward` was replaced on the instance, as Liger's
    `apply_liger_kernel_to_*(model=...)` and the `kernels` package's `kernelize` do to the norms they
    patch: the model would run that kernel instead of the converted norm, silently."""
    for wrapper in norms:
        for module in (wrapper, wrapper._modules["norm"]):
            patched = module.__dict__.get("forward")
            if patched is not None:
                function = getattr(patched, "__func__", patched)
                origin = f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', repr(function))}"
                raise RuntimeError(
                    f"converted norm {wrapper._name!r} ({type(wrapper.norm).__name__}) had its forward replaced by "
                    f"{origin}: a kernel patch (Liger's apply_liger_kernel_to_*, kernels' kernelize) applied after "
                    "convert_norms would run that kernel instead of the converted norm. Apply such patches before "
                    "converting, or keep the converted norms out of them."
                )


def _in_backward() -> bool:
    """True while autograd runs a backward pass (where checkpointed layers are recomputed)."""
    return getattr(torch._C, "_current_graph_task_id", lambda: -1)() != -1


def _bound_arguments(module: nn.Module, args: tuple, kwargs: dict) -> dict:
    """The call's arguments by name, positional ones included."""
    try:
        return inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments
    except TypeError:
        return dict(kwargs)


class MaskAwareNorm(nn.Module):
    """A registry norm that receives the padding mask of its stack from a `NormMaskContext`."""

    def __init__(self, norm: nn.Module, context: NormMaskContext, role: str, name: str) -> None:
        super().__init__()
        self.norm = norm
        self.role = role
        self._context = context
        self._name = name
        context.norms.append(self)

    @property
    def weight(self) -> torch.Tensor | None:
        return getattr(self.norm, "weight", None)

    @property
    def bias(self) -> torch.Tensor | None:
        return getattr(self.norm, "bias", None)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.dim() > 3:
            # A per-head norm (a QK-norm selected by `modules=`) on (batch, seq, heads, head_dim), or
            # (batch, heads, seq, head_dim) in some families: which axis holds the positions is the
            # model's own, so every position counts as real for its statistics.
            flat = hidden_states.reshape(-1, hidden_states.shape[-1])
            return self.norm(flat).view(hidden_states.shape)
        mask = self._context.mask_for(self.role, hidden_states, self._name)
        return self.norm(hidden_states, attention_mask=mask)

    def extra_repr(self) -> str:
        return f"role={self.role!r}"


def norm_epsilon(module: nn.Module, weight: torch.Tensor | None) -> float | None:
    """The norm's epsilon; `torch.nn.RMSNorm(eps=None)` uses the machine epsilon of its dtype."""
    eps = next((getattr(module, a) for a in EPS_ATTRIBUTES if isinstance(getattr(module, a, None), float)), None)
    if eps is None and isinstance(module, getattr(nn, "RMSNorm", ())) and module.eps is None:
        eps = torch.finfo(weight.dtype if weight is not None else torch.float32).eps
    return eps


def norm_size(module: nn.Module) -> int | None:
    """The channels a norm normalizes over, read from shapes only (a `meta` module too), or None."""
    for attribute in ("weight", "bias"):
        value = getattr(module, attribute, None)
        if isinstance(value, torch.Tensor) and value.dim() == 1:
            return int(value.shape[0])
    shape = getattr(module, "normalized_shape", None)
    if isinstance(shape, (tuple, list)) and len(shape) == 1 and isinstance(shape[0], int):
        return shape[0]
    return None


# ----------------------------------------------------------------------------------------------
# Replaying a conversion record


def replay_conversion(model: nn.Module, conversion: dict) -> tuple[dict, list[tuple[str, str, str]]]:
    """Replace exactly the norms recorded in `conversion` (a `config.powernorm_conversion`) by new
    norms built from the record, install the mask hooks and set `config.powernorm_conversion`.

    Reads no weight and runs no probe: the new norms hold their initial values, on the device and
    dtype of the norms they replace, so it works on a model built on the `meta` device, and the
    weights and running statistics are loaded afterwards. Each recorded module gets
    `build_norm(norm_type, size, **options)` from its `norms` entry; a record without `norms` (written
    before it existed) takes the size from the module's shapes and the epsilon from its attribute.
    Returns the record as set (in `model`'s module paths) and `(path, old class, new class)` per norm.
    """
    record = _checked_record(conversion, model)
    norm_type = record["norm_type"]
    masks = mask_roles(model, record["modules"])
    replaced = []
    for name in record["modules"]:
        old, entry = model.get_submodule(name), record["norms"][name]
        norm = _placed_like(build_norm(norm_type, entry["size"], **entry["options"]), old)
        _set_submodule(model, name, MaskAwareNorm(norm, masks.context, masks.roles[name], name))
        replaced.append((name, type(old).__name__, type(norm).__name__))
    masks.hook(model)
    model._powernorm_mask_context = masks.context
    setattr(model.config, CONVERSION_CONFIG_KEY, record)
    return record, replaced


def _checked_record(conversion, model: nn.Module) -> dict:
    """A copy of `conversion` with every key, checked against `model`; ValueError naming what is wrong."""
    if not isinstance(conversion, dict) or not {"norm_type", "options", "modules"} <= set(conversion):
        raise ValueError(f"a conversion record is a dict with keys 'norm_type', 'options', 'modules' (and 'norms', "
                         f"'preserve_function'), got {conversion!r}")
    record = json.loads(json.dumps(conversion))
    record["norm_type"] = normalize_norm_name(record["norm_type"])
    record.setdefault("preserve_function", False)
    norms = _in_model_paths(record, model)
    for name in record["modules"]:
        module = model.get_submodule(name)
        if name not in norms:
            norms[name] = _legacy_entry(module, name, record["options"])
        elif not {"size", "options"} <= set(norms[name]):
            raise ValueError(f"the conversion record's norms[{name!r}] needs 'size' and 'options', got {norms[name]!r}")
    return record


def _legacy_entry(module: nn.Module, name: str, options: dict) -> dict:
    """The `norms` entry of a record written before it existed: size and epsilon from the module."""
    size, eps = norm_size(module), norm_epsilon(module, getattr(module, "weight", None))
    if size is None or eps is None:
        raise ValueError(f"cannot read the size and epsilon of {name!r} ({type(module).__name__}) for a conversion "
                         "record without 'norms'")
    return {"size": size, "options": {"eps": eps, **options}}


def _placed_like(norm: nn.Module, old: nn.Module) -> nn.Module:
    """`norm` on the device and dtype of the norm it replaces (running statistics stay float32)."""
    reference = next((t for t in (*old.parameters(), *old.buffers()) if t.is_floating_point()), None)
    return norm if reference is None else norm.to(device=reference.device, dtype=reference.dtype)


def _in_model_paths(record: dict, model: nn.Module) -> dict:
    """Rewrite `record["modules"]` and `record["norms"]` (returned) in the module paths of `model`.

    The record names the modules of the class that was converted (`config.architectures`); another head
    of the same model (Transformers' Auto classes build any) holds them under its own base model's
    prefix, as its weights are (`_model_path`), and lacks those of the converted class's own head,
    which are dropped with their weights. ValueError when the converted class itself lacks a recorded
    module, or when `model` holds none of them: it would be the unconverted model.
    """
    cls = type(model).__name__
    converted = getattr(model.config, "architectures", None) or [cls]
    source = getattr(getattr(transformers, converted[0], None), "base_model_prefix", "")
    paths = {name: _model_path(model, name, source) for name in record["modules"]}
    missing = [name for name, path in paths.items() if path is None]
    if missing and cls in converted:
        raise ValueError(f"the conversion record names module {missing[0]!r}, which {cls} does not have")
    if paths and len(missing) == len(paths):
        raise ValueError(f"{cls} holds none of the {len(paths)} norms that the conversion of {', '.join(converted)} "
                         f"replaced ({missing[0]!r}, ...): it would run as the unconverted model. Load the folder "
                         f"with hf_powernorm.load_converted(path, {converted[0]}) or the Auto class of its auto_map")
    record["modules"] = [path for path in paths.values() if path is not None]
    norms = record.get("norms", {})
    record["norms"] = {paths[name]: entry for name, entry in norms.items() if paths.get(name) is not None}
    return record["norms"]


def _model_path(model: nn.Module, name: str, source_prefix: str) -> str | None:
    """`name`, a module path of a model whose base model sits at `source_prefix`, in `model`: as it is,
    or with the base model's prefix replaced by `model`'s own (none for a base model); None if absent."""
    inner = name.removeprefix(f"{source_prefix}.") if source_prefix else name
    prefix = getattr(model, "base_model_prefix", "") or ""
    for path in (name, inner, f"{prefix}.{inner}" if prefix else inner):
        try:
            model.get_submodule(path)
        except AttributeError:
            continue
        return path
    return None


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, module)


# ----------------------------------------------------------------------------------------------
# Which mask each norm reads


@dataclass
class MaskRoles:
    """The mask context of a model's converted norms and the role of each: `roles` maps a norm's module
    path to the mask it reads (`main`, `encoder`, `decoder`, or `unmasked` outside a composite model's
    language model); `encoder_prefix` is the encoder's path in an encoder-decoder model, else None."""

    context: NormMaskContext
    roles: dict[str, str]
    encoder_prefix: str | None = None

    def hook(self, model: nn.Module) -> list:
        """Register the hooks that push the call's masks on `context` (on the top model, and on the
        encoder, which `generate` calls on its own) and pop them, even on error; their handles."""
        stacks = [(model, self.context.top_pre_hook)]
        if self.encoder_prefix is not None:
            stacks.append((model.get_submodule(self.encoder_prefix), self.context.encoder_pre_hook))
        handles = []
        for module, pre_hook in stacks:
            handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
            handles.append(module.register_forward_hook(self.context.pop_hook, always_call=True))
        return handles


def mask_roles(model: nn.Module, names: Iterable[str]) -> MaskRoles:
    """A fresh `NormMaskContext` for `model` and the role of each norm at the module paths `names`:
    what the converted norms read at run time and the calibration of their sources reads before."""
    encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False))
    encoder_prefix = _encoder_prefix(model) if encoder_decoder else None
    language = language_model_prefixes(model)
    roles = {name: _role(name, encoder_prefix, encoder_decoder, language) for name in names}
    return MaskRoles(NormMaskContext(encoder_decoder), roles, encoder_prefix)


def text_config(config):
    """The config of a model's language model: `config.get_text_config()` where the config has it (a
    composite model's is of another class), else `config` itself."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def kept_ties(model: nn.Module) -> dict[str, str]:
    """The `{target: source}` weight ties of `model` that hold after centring untied its head: its
    `_tied_weights_keys` (expanded, over every submodel) as Transformers reads them with each config
    that `UNTIED_HEAD_CONFIG_KEY` marks tied again, less those of the output embeddings' weight.

    Untying the head sets `tie_word_embeddings=False` (`centring.py`), and Transformers 5 reads a
    model's every tie off that flag, not its head's alone: BART's encoder and decoder embeddings
    stay its shared table and BERT's decoder bias its prediction bias in memory, `save_pretrained`
    writes each shared tensor once, and a load that knew only the flag would miss the others.
    Works on the `meta` device (names only)."""
    marked = {id(c): c for m in model.modules() if isinstance(m, transformers.PreTrainedModel)
              for c in (m.config, text_config(m.config)) if getattr(c, UNTIED_HEAD_CONFIG_KEY, False)}
    if not marked:
        return model.get_expanded_tied_weights_keys(all_submodels=True)
    flags = {key: config.tie_word_embeddings for key, config in marked.items()}
    try:
        for config in marked.values():
            config.tie_word_embeddings = True
        ties = model.get_expanded_tied_weights_keys(all_submodels=True)
    finally:
        for key, config in marked.items():
            config.tie_word_embeddings = flags[key]
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    weight = getattr(head, "weight", None)
    untied = {name for name, parameter in model.named_parameters(remove_duplicate=False) if parameter is weight}
    return {target: source for target, source in ties.items() if target not in untied and source not in untied}


def language_model_prefixes(model: nn.Module) -> tuple[str, ...] | None:
    """The module paths of a composite model's language model: the outermost sub-models built from
    its text config (`text_config`, a config of another class than the model's), such as Gemma 3's
    or LLaVA's `model.language_model`; None for a model that is its own language model (or whose
    language model is not a sub-model of its own)."""
    from transformers import PreTrainedModel

    config = getattr(model, "config", None)
    text = text_config(config)
    if text is config or type(text) is type(config):
        return None
    prefixes: list[str] = []
    for name, module in model.named_modules():
        if (name and isinstance(module, PreTrainedModel) and type(module.config) is type(text)
                and not is_under(name, prefixes)):
            prefixes.append(name)
    return tuple(prefixes) or None


def is_under(name: str, prefixes: Iterable[str]) -> bool:
    """Whether the module path `name` is one of `prefixes` or lies inside one."""
    return any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes)


def _encoder_prefix(model: nn.Module) -> str:
    """The module path of the encoder of an encoder-decoder model."""
    encoder = model.get_encoder() if hasattr(model, "get_encoder") else None
    for name, module in model.named_modules():
        if module is encoder and name:
            return name
    raise ValueError(f"cannot find the encoder of encoder-decoder model {type(model).__name__} (get_encoder())")


def _role(name: str, encoder_prefix: str | None, encoder_decoder: bool,
          language: tuple[str, ...] | None = None) -> str:
    """Which of the call's masks a norm reads: none outside a composite model's language model
    (every position of a vision tower's input is real), else the encoder's or the decoder's, or the
    one mask of a decoder-only model."""
    if language is not None and not is_under(name, language):
        return UNMASKED
    if not encoder_decoder:
        return MAIN
    return ENCODER if is_under(name, (encoder_prefix,)) else DECODER


__all__ = ["CONVERSION_CONFIG_KEY", "UNTIED_HEAD_CONFIG_KEY", "MaskAwareNorm", "MaskRoles", "NormMaskContext",
           "check_unpatched", "is_under", "kept_ties", "language_model_prefixes", "mask_roles", "norm_epsilon", "norm_size", "replay_conversion", "text_config"]

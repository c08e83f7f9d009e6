"""Converted Transformers models as classes of their own, so that a saved converted model loads right anywhere.

`convert_norms` gives the model it converts a class of this module, named as its own
(`LlamaForCausalLM`) and deriving from it, and a config class of this module deriving from the
model's config class. `save_pretrained` then writes, beside the weights and every running buffer:

- this file and the files it imports (`converted_norms.py`, `normalization.py`, ...), as Transformers
  copies remote code;
- an `auto_map` naming these classes, for `AutoConfig` and every Auto class that builds the model's
  type (`auto_map`): `AutoModel` on a converted `LlamaForCausalLM` folder builds the converted
  `LlamaModel`, `replay_conversion` finding the recorded norms under the base model's prefix;
- a `model_type` of its own (`powernorm_converted_llama`): Transformers knows no such type, so
  `AutoModel...from_pretrained(folder)` without `trust_remote_code=True` raises instead of quietly
  building the unconverted model and starting its norms afresh.

With `trust_remote_code=True` the Auto classes build the converted class: its `__init__` builds the
original model and converts it again from `config.powernorm_conversion` (`replay_conversion`: no probe,
no calibration, valid on the meta device that `from_pretrained` builds on), then the weights and
running buffers load into it, through Transformers' own loading (sharding, dtype, tied weights and
the key renamings of `conversion_mapping`, such as GPT-NeoX's `embed_out` -> `lm_head`).

The classes are made on first use and looked up by name through the module's `__getattr__`, which is
how Transformers' remote-code loader and `pickle` find them: `LlamaForCausalLM` here is the converted
`transformers.LlamaForCausalLM`. In memory the config keeps the original `model_type` (code keyed on
it, such as PEFT's default target modules, still finds it); only the saved `config.json` carries the
prefixed type, and loading strips the prefix again.

`load_converted(path, auto_class)` loads such a folder with this package's code instead of the
folder's copy (no `trust_remote_code`); `converter.py` re-exports it.
"""

from __future__ import annotations

import functools
import json
import os
import warnings
from typing import Any

import torch
import transformers
from torch import nn

from .converted_norms import CONVERSION_CONFIG_KEY, UNTIED_HEAD_CONFIG_KEY, kept_ties, replay_conversion, text_config
from .integrations import PeftStatisticsCheck

MODEL_TYPE_PREFIX = "powernorm_converted_"

_CLASSES: dict[str, type] = {}


def converted_class(base: type) -> type:
    """The converted class of a Transformers model or config class (made once, then cached)."""
    made = _CLASSES.get(base.__name__)
    if made is not None and made.__mro__[1] is base:
        return made
    if issubclass(base, transformers.PreTrainedModel):
        made = _model_class(base)
    elif issubclass(base, transformers.PretrainedConfig):
        made = _config_class(base)
    else:
        raise TypeError(f"expected a Transformers model or config class, got {base!r}")
    _CLASSES[base.__name__] = made
    return made


def is_converted_class(cls: type) -> bool:
    """True for the classes this module makes, in the package or in a saved folder's copy of it."""
    return getattr(cls, "_powernorm_converted", False)


def __getattr__(name: str) -> type:
    """`LlamaForCausalLM` / `LlamaConfig`: the converted class of Transformers' class of that name."""
    if name.startswith("__"):
        raise AttributeError(name)
    base = getattr(transformers, name, None)
    if not isinstance(base, type) or not issubclass(base, (transformers.PreTrainedModel, transformers.PretrainedConfig)):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}: no Transformers model or config "
                             "class has that name")
    return converted_class(base)


# ----------------------------------------------------------------------------------------------
# The classes


def _config_class(base: type) -> type:
    """`base` with the saved `model_type` prefixed (so that only remote code loads it) and `auto_map` kept."""
    base_type = base.model_type

    def to_dict(self) -> dict[str, Any]:
        output = base.to_dict(self)
        output["model_type"] = MODEL_TYPE_PREFIX + base_type
        if output.get("auto_map"):  # saving with this file: every Auto class that builds the model type
            output["auto_map"] = {**auto_map(base_type), **output["auto_map"]}
        return output

    def get_config_dict(cls, *args, **kwargs):
        config_dict, unused = base.get_config_dict.__func__(cls, *args, **kwargs)
        if config_dict.get("model_type") == MODEL_TYPE_PREFIX + base_type:
            config_dict = {**config_dict, "model_type": base_type}
        return config_dict, unused

    namespace = {
        "__module__": __name__,
        "__qualname__": base.__name__,
        "__doc__": f"`{base.__name__}` of a model whose norms `convert_norms` replaced.",
        "to_dict": to_dict,
        "get_config_dict": classmethod(get_config_dict),
        "_auto_class": "AutoConfig",
        "_powernorm_converted": True,
    }
    return type(base.__name__, (base,), namespace)


def _model_class(base: type) -> type:
    """`base` whose `__init__` converts the norms as `config.powernorm_conversion` records."""
    config_class = converted_class(base.config_class) if isinstance(base.config_class, type) else None

    def __init__(self, config, *args, **kwargs) -> None:
        if not is_converted_class(type(config)):
            config.__class__ = converted_class(type(config))
        base.__init__(self, config, *args, **kwargs)
        conversion = getattr(self.config, CONVERSION_CONFIG_KEY, None)
        if not isinstance(conversion, dict):
            raise ValueError(f"{base.__name__} (converted) needs config.{CONVERSION_CONFIG_KEY}, the record that "
                             f"convert_norms writes; got {conversion!r}")
        replay_conversion(self, conversion)
        if _head_untied_by_centring(self.config):
            # A head that centring untied: `tie_word_embeddings` is false, but the model's other ties
            # hold (`kept_ties`); `save_pretrained` wrote each of their tensors once.
            self.all_tied_weights_keys = kept_ties(self)
            self.tie_weights(recompute_mapping=False)

    def is_custom_code(cls) -> bool:
        """The base class's answer: a converted class runs Transformers' own modeling code, its norms
        aside. Loading custom code, Transformers skips the `_init_weights` of a module whose own
        tensors all loaded, so a non-persistent buffer that a parent module sets there (Falcon-H1's
        `mup_vector`) would stay uninitialised; it also applies a model type's checkpoint key
        renamings (GPT-NeoX's `embed_out`) to custom code only when they are registered for it."""
        return original_class(cls).is_custom_code()

    namespace = {
        "__module__": __name__,
        "__qualname__": base.__name__,
        "__doc__": f"`{base.__name__}` with its norms replaced by `convert_norms` (`{__name__}`).",
        "__init__": __init__,
        "is_custom_code": classmethod(is_custom_code),
        "_auto_class": auto_class_name(base),
        "_powernorm_converted": True,
        "peft_config": PeftStatisticsCheck(),  # PEFT without the norms' statistics warns
        # Transformers reads these off the defining module's source; the base class's module is the one.
        "_can_set_attn_implementation_cached_value": base._can_set_attn_implementation(),
    }
    if config_class is not None:
        namespace["config_class"] = config_class
    return type(base.__name__, (base,), namespace)


# A class several Auto classes build is named by the first of these that holds it (BART's
# `ForConditionalGeneration`, also a masked LM: `AutoModelForSeq2SeqLM`), then by any other task's,
# and by the generic ones last (`GPT2LMHeadModel`, also a pre-training model: `AutoModelForCausalLM`).
_FIRST_AUTO_CLASSES = ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModelForSequenceClassification",
                       "AutoModelForMaskedLM", "AutoModelForTokenClassification", "AutoModelForQuestionAnswering",
                       "AutoModelForMultipleChoice")
_GENERIC_AUTO_CLASSES = ("AutoModelForPreTraining", "AutoModelForTextEncoding", "AutoModel")


def auto_classes() -> list[str]:
    """Every Auto model class of Transformers (`AutoModelForCausalLM`, `AutoModelForImageClassification`,
    ...), in the order that names a class's Auto class."""
    from transformers.models.auto import modeling_auto

    names = [name for name, value in vars(modeling_auto).items()
             if name.startswith("Auto") and isinstance(value, type) and hasattr(value, "_model_mapping")]
    ordered = [*_FIRST_AUTO_CLASSES, *(name for name in names if name not in _FIRST_AUTO_CLASSES + _GENERIC_AUTO_CLASSES)]
    return [name for name in ordered if name in names] + [name for name in _GENERIC_AUTO_CLASSES if name in names]


def _mapped_names(auto: str, model_type: str | None) -> tuple[str, ...]:
    """The model class names that the Auto class `auto` builds for `model_type`."""
    from transformers.models.auto import modeling_auto

    found = getattr(modeling_auto, auto)._model_mapping._model_mapping.get(model_type)
    return (found,) if isinstance(found, str) else tuple(found or ())


def auto_class_name(base: type) -> str:
    """The Auto class whose mapping holds `base` (`AutoModelForCausalLM`), `AutoModel` where none does."""
    model_type = getattr(base.config_class, "model_type", None)
    return next((auto for auto in auto_classes() if base.__name__ in _mapped_names(auto, model_type)), "AutoModel")


def auto_map(model_type: str) -> dict[str, str]:
    """`config.auto_map` of a converted folder: each Auto class that builds `model_type` -> the converted
    class of this file it builds (`{"AutoModel": "modeling_converted.LlamaModel", ...}`)."""
    module = __name__.rpartition(".")[2]
    entries = {}
    for auto in auto_classes():
        names = [name for name in _mapped_names(auto, model_type) if isinstance(getattr(transformers, name, None), type)]
        if names:
            entries[auto] = f"{module}.{names[0]}"
    return entries


# ----------------------------------------------------------------------------------------------
# Giving a converted model its class


def adopt(model: nn.Module) -> None:
    """Make `model` (converted in place) and its config instances of their converted classes."""
    if not isinstance(model, transformers.PreTrainedModel):
        return
    config = model.config
    if not is_converted_class(type(config)):
        config.__class__ = converted_class(type(config))
    if not is_converted_class(type(model)):
        model.__class__ = converted_class(type(model))


def original_class(cls: type) -> type:
    """The Transformers class a converted class derives from (`cls` itself otherwise), whether the
    converted class is this module's or a saved folder's copy's."""
    return next(base for base in cls.__mro__ if not base.__dict__.get("_powernorm_converted", False))


# ----------------------------------------------------------------------------------------------
# Loading


def load_converted(path: str | os.PathLike, model_class, dtype: torch.dtype | None = None,
                   **config_kwargs) -> nn.Module:
    """Load a model saved after `convert_norms`, with every weight and running buffer.

    Args:
        path (`str` or `os.PathLike`):
            A local folder or a Hub repo id.
        model_class:
            An Auto class (`AutoModelForCausalLM`) or a model class (`LlamaForCausalLM`).
        dtype (`torch.dtype`, *optional*):
            Cast the loaded model to it (running statistics stay float32).
        config_kwargs:
            Passed to the config's `from_pretrained` (attributes to override).

    The model is returned in eval mode, as `from_pretrained` returns it. The model is built
    as `config.powernorm_conversion` records (its converted class, `modeling_converted.py`) and loaded
    by Transformers' own `from_pretrained`, so checkpoint key renamings (GPT-NeoX's `embed_out`),
    shards and tied weights are handled as for the original model; a key the converted model lacks
    or does not fill raises (with another head than the saved one, as `from_pretrained` does, the
    saved head's weights are left out and the new head's start fresh, with a warning; a norm's never).
    Folders saved before converted models had a class of their own load too, and so does a model
    centred but not converted (`converter.centre_stream`: a comparison's baseline whose head it
    untied), as its Transformers class with the ties it kept, which that class alone would leave
    unfilled (BART's embeddings, BERT's decoder bias). Any other folder without a conversion raises.
    `AutoModel...from_pretrained(path, trust_remote_code=True)` loads the same model without this
    package; without `trust_remote_code` it raises rather than load the unconverted model.
    """
    folder = _local_folder(path)
    config = load_converted_config(folder, **config_kwargs)
    conversion = getattr(config, CONVERSION_CONFIG_KEY, None)
    centred_only = not isinstance(conversion, dict) or "norm_type" not in conversion
    if centred_only and not _head_untied_by_centring(config):  # a plain model is not taken for a converted one
        raise ValueError(
            f"{path}: config.json has no {CONVERSION_CONFIG_KEY}; load it with {model_class.__name__}.from_pretrained"
        )
    base = _model_class_for(original_class(model_class), config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the causal warning was given at conversion time
        model, info = (_centred_class(base) if centred_only else converted_class(base)).from_pretrained(
            folder, config=config, output_loading_info=True)
    if centred_only:
        model.__class__ = base
    _check_loaded_keys(model, config, info, path)
    if dtype is not None:
        model.to(dtype)
    return model.eval()


def _check_loaded_keys(model: nn.Module, config, info: dict, path) -> None:
    """`load_converted`'s check of what `from_pretrained` loaded: a key missing or unexpected raises,
    but for another head than the saved one (`AutoModel` on a causal LM's folder), where, as
    `from_pretrained` does, the saved head's weights are left out and the new head's start fresh, with a
    warning naming them; a norm's tensor missing raises whatever the head."""
    missing, unexpected = info.get("missing_keys") or [], info.get("unexpected_keys") or []
    loaded = original_class(type(model)).__name__
    saved = (getattr(config, "architectures", None) or [loaded])[0]
    if saved != loaded and not any(_under_a_norm(model, key) for key in missing):
        if missing or unexpected:
            warnings.warn(f"{path}: {loaded} from a {saved} checkpoint: left out {sorted(unexpected)}, "
                          f"newly initialised {sorted(missing)}", UserWarning, stacklevel=3)
    elif missing or unexpected:
        raise ValueError(f"{path}: checkpoint does not match the converted model: missing {sorted(missing)}, "
                         f"unexpected {sorted(unexpected)}")


def _under_a_norm(model: nn.Module, key: str) -> bool:
    """Whether the tensor `key` of `model` belongs to a norm (a module whose class name holds "Norm":
    the source's LayerNorms and RMSNorms, a converted norm and its wrapper)."""
    module, names = model, key.split(".")[:-1]
    for name in names:
        module = getattr(module, name, None)
        if module is None:
            return False
        if "Norm" in type(module).__name__:
            return True
    return False


def _head_untied_by_centring(config) -> bool:
    """Whether centring untied the head of a model of `config` (`UNTIED_HEAD_CONFIG_KEY`)."""
    return any(getattr(c, UNTIED_HEAD_CONFIG_KEY, False) for c in (config, text_config(config)))


@functools.cache
def _centred_class(base: type) -> type:
    """`base` that keeps, while it loads, the ties of a model whose head centring untied (`kept_ties`):
    a model centred but not converted (a comparison's baseline) saved each shared tensor once, and
    `base` alone, reading its ties off `tie_word_embeddings`, would leave the others' names unfilled.
    Made once per `base`, as `converted_class` makes its classes."""
    def __init__(self, config, *args, **kwargs) -> None:
        base.__init__(self, config, *args, **kwargs)
        self.all_tied_weights_keys = kept_ties(self)
        self.tie_weights(recompute_mapping=False)

    return type(base.__name__, (base,), {
        "__module__": base.__module__, "__qualname__": base.__qualname__, "__init__": __init__,
        "_can_set_attn_implementation_cached_value": base._can_set_attn_implementation()})


def load_converted_config(path: str | os.PathLike, **config_kwargs):
    """The config of a converted folder as an instance of its converted config class, read with this
    package's code (no `trust_remote_code` needed); a folder that was not converted gives its plain config."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    folder = _local_folder(path)
    with open(os.path.join(folder, "config.json")) as handle:
        model_type = json.load(handle).get("model_type", "")
    if not model_type.startswith(MODEL_TYPE_PREFIX):
        return AutoConfig.from_pretrained(folder, **config_kwargs)
    base_type = model_type.removeprefix(MODEL_TYPE_PREFIX)
    if base_type not in CONFIG_MAPPING:
        raise ValueError(f"{path}: converted from model type {base_type!r}, which this Transformers "
                         "version does not know")
    return converted_class(CONFIG_MAPPING[base_type]).from_pretrained(folder, **config_kwargs)


def _model_class_for(model_class, config) -> type:
    """The Transformers model class that `model_class` (an Auto class or a model class) builds for `config`."""
    mapping = getattr(model_class, "_model_mapping", None)
    if mapping is None:
        return model_class
    config_class = original_class(type(config))
    if config_class not in mapping:
        raise ValueError(f"{model_class.__name__} has no model for {config_class.__name__} "
                         f"(model type {config_class.model_type!r})")
    found = mapping[config_class]
    if isinstance(found, (list, tuple)):
        names = set(getattr(config, "architectures", None) or [])
        found = next((cls for cls in found if cls.__name__ in names), found[0])
    return found


def _local_folder(path: str | os.PathLike) -> str:
    if os.path.isdir(path):
        return str(path)
    from huggingface_hub import snapshot_download

    return snapshot_download(str(path), allow_patterns=["*.json", "*.safetensors"])


__all__ = ["MODEL_TYPE_PREFIX", "adopt", "auto_class_name", "auto_classes", "auto_map", "converted_class",
           "is_converted_class", "load_converted", "load_converted_config", "original_class"]

"""Keeping PN's running statistics right under the ecosystem's wrappers (PEFT, DDP).

PN, PN-V, BN, BRN and MABN learn running statistics in buffers (`docs/models.md` lists what a
checkpoint holds): a tool that saves only trained parameters, or that overwrites buffers across
processes, silently changes the model. "Using the models with Trainer, PEFT, DDP and FSDP" in
`docs/models.md` says what to set; this file holds the helpers it names, and `PeftStatisticsCheck`, the
`peft_config` attribute of the models with such norms (PowerNorm Transformers, converted models),
which warns once when PEFT wraps a model without saving its statistics.
"""

from __future__ import annotations

import warnings
from typing import Any

from torch import nn

from .normalization import running_buffers


def peft_modules_to_save(model: nn.Module) -> list[str]:
    """Names of the modules holding running statistics, for a PEFT config's `modules_to_save`.

    A LoRA adapter saves only its own weights; the statistics PN keeps updating while the adapter
    trains are lost unless their norms are saved with it. PEFT trains and saves a copy of each module
    listed (its weight and bias become trainable too):

    ```python
    >>> config = LoraConfig(target_modules=["q_proj", "v_proj"], modules_to_save=peft_modules_to_save(model))
    ```
    """
    names = _statistics_modules(model)
    if not names:
        raise ValueError(f"{type(model).__name__} has no norm with running statistics (PN, PN-V, BN, BRN, MABN)")
    return names


def _statistics_modules(model: nn.Module) -> list[str]:
    """The paths of the modules holding running statistics in buffers of their own."""
    statistics = running_buffers()  # a norm registered after import included
    return [name for name, module in model.named_modules()
            if name and any(buffer in statistics for buffer, _ in module.named_buffers(recurse=False))]


class PeftStatisticsCheck:
    """The `peft_config` attribute of a model whose norms may keep running statistics.

    PEFT's `get_peft_model` (and Transformers' `add_adapter`) set `model.peft_config` once the adapter
    is in place; setting it here warns once when a norm with running statistics is not saved with the
    adapter (`warn_unsaved_statistics`). Reading and deleting it behave as for a plain attribute.
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, model: nn.Module | None, owner: type | None = None) -> Any:
        if model is None:
            return self
        try:
            return model.__dict__[self.name]
        except KeyError:
            raise AttributeError(self.name) from None

    def __set__(self, model: nn.Module, value: Any) -> None:
        model.__dict__[self.name] = value
        warn_unsaved_statistics(model, value)

    def __delete__(self, model: nn.Module) -> None:
        if model.__dict__.pop(self.name, None) is None:
            raise AttributeError(self.name)


def warn_unsaved_statistics(model: nn.Module, peft_config: Any) -> None:
    """One UserWarning when PEFT wraps `model` (its adapters' configs `peft_config`) and a norm with
    running statistics is neither wrapped for saving (PEFT's `ModulesToSaveWrapper`) nor listed in a
    config's `modules_to_save`: the statistics training updates would be lost with the saved adapter."""
    listed = [name for config in (peft_config or {}).values() for name in getattr(config, "modules_to_save", None) or []]
    wrapped = [name for name, module in model.named_modules()
               if hasattr(module, "original_module") and hasattr(module, "modules_to_save")]
    missing = [name for name in _statistics_modules(model)
               if not any(_within(name, saved) for saved in wrapped) and not any(
                   name == entry or name.endswith("." + entry) for entry in listed)]
    if missing:
        warnings.warn(
            f"{type(model).__name__} wrapped by PEFT: {len(missing)} norms keep running statistics that the adapter "
            f"will not save ({missing[0]}, ...), so what training does to them is lost when it is saved and "
            "reloaded. List them in the PEFT config: modules_to_save=hf_powernorm.peft_modules_to_save(model).",
            UserWarning,
            stacklevel=4,  # the line setting `model.peft_config` (PEFT's), through `__set__` and `Module.__setattr__`
        )


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


__all__ = ["PeftStatisticsCheck", "peft_modules_to_save", "warn_unsaved_statistics"]

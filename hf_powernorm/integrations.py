"""Keeping PN's running statistics right under the ecosystem's wrappers (PEFT, DDP).

PN, PN-V, BN, BRN and MABN learn running statistics in buffers (`powernorm-notes.md`, "What a
checkpoint must hold"): a tool that saves only trained parameters, or that overwrites buffers
across processes, silently changes the model. The README's "Using the models with Trainer, PEFT,
DDP and FSDP" says what to set; this file holds the helpers it names.
"""

from __future__ import annotations

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
    statistics = running_buffers()  # a norm registered after import included
    names = [name for name, module in model.named_modules()
             if name and any(buffer in statistics for buffer, _ in module.named_buffers(recurse=False))]
    if not names:
        raise ValueError(f"{type(model).__name__} has no norm with running statistics (PN, PN-V, BN, BRN, MABN)")
    return names


__all__ = ["peft_modules_to_save"]

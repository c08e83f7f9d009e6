"""What `import hf_powernorm` loads: the norms and their registry, the model family, the converter and
the instrumentation, registered with Transformers' Auto classes (the package re-exports `__all__`)."""

from . import normalization
from .normalization import *  # noqa: F403 - the norms, their registry, `build_norm`, `kernel_backend`
from .instrumentation import NormStatisticsRecorder, read_norm_statistics
from .integrations import peft_modules_to_save
from .converter import ConversionReport, apply_conversion, convert_norms, load_converted, load_converted_config
from .configuration_powernorm import PRESETS, PowerNormTransformerConfig
from .modeling_powernorm import (
    AUTO_CLASSES,
    PowerNormTransformerForCausalLM,
    PowerNormTransformerForConditionalGeneration,
    PowerNormTransformerForSequenceClassification,
    PowerNormTransformerModel,
    PowerNormTransformerPreTrainedModel,
    register_for_auto_classes,
)

def _register() -> None:
    """Register the family with the Auto classes here and, through `auto_map`, for remote code."""
    import transformers

    transformers.AutoConfig.register(PowerNormTransformerConfig.model_type, PowerNormTransformerConfig, exist_ok=True)
    for auto_name, model_class in AUTO_CLASSES.items():
        getattr(transformers, auto_name).register(PowerNormTransformerConfig, model_class, exist_ok=True)
    register_for_auto_classes()


_register()

__all__ = [
    *normalization.__all__,
    "PRESETS",
    "PowerNormTransformerConfig",
    "PowerNormTransformerForCausalLM",
    "PowerNormTransformerForConditionalGeneration",
    "PowerNormTransformerForSequenceClassification",
    "PowerNormTransformerModel",
    "PowerNormTransformerPreTrainedModel",
    "ConversionReport",
    "NormStatisticsRecorder",
    "apply_conversion",
    "convert_norms",
    "load_converted",
    "load_converted_config",
    "peft_modules_to_save",
    "read_norm_statistics",
]

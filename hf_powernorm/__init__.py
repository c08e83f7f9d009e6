"""Power Normalization for the Hugging Face ecosystem: norm layers, models and recipes."""

from .normalization import (
    NORM_CLASSES,
    GroupNorm,
    Identity,
    LayerNorm,
    MaskedBatchNorm,
    PowerNorm,
    PowerNormV,
    RMSNorm,
    build_norm,
    group_scale,
    normalize_norm_name,
)

__version__ = "0.1.0"

__all__ = [
    "NORM_CLASSES",
    "GroupNorm",
    "Identity",
    "LayerNorm",
    "MaskedBatchNorm",
    "PowerNorm",
    "PowerNormV",
    "RMSNorm",
    "build_norm",
    "group_scale",
    "normalize_norm_name",
]

"""Configuration of the PowerNorm Transformer family (Shen et al., ICML 2020, Section 5).

One config describes the encoder-decoder translation model, the decoder-only language model and
the encoder-only classifier. The norm at every position is chosen by name from the norm registry
(`encoder_norm_type`, `decoder_norm_type`); the `powernorm_*` fields are PN's options (Algorithm 2)
and also give the group count of group scaling and GroupNorm. `PRESETS` holds the paper's models.
"""

from __future__ import annotations

import math
from typing import Any

from transformers import PreTrainedConfig

from .normalization import BACKWARD_DENOMINATORS, NORM_CLASSES, WARMUP_STATISTICS, normalize_norm_name

POSITION_EMBEDDING_TYPES = ("sinusoidal", "learned")
ACTIVATIONS = ("relu", "gelu", "gelu_new", "silu", "swish", "tanh")
# Marks `powernorm_group_num` as "one group per attention head" until the config resolves it.
GROUP_NUM_HEADS = "num_attention_heads"
# The sites of a norm in a layer stack, as the per-site options of a norm name them
# (`site_options`: `norm_alpha_init` -> `norm_alpha_init_attention`, ...): before self- and
# cross-attention, before the feed-forward block, and the stack's final norm.
NORM_SITES = ("attention", "ffn", "final")

PRESETS: dict[str, dict[str, Any]] = {
    # IWSLT14 De-En (Table 2): pre-norm, PN in the encoder, LN in the decoder, 8000 warmup updates.
    "iwslt14-small": dict(
        hidden_size=512, encoder_layers=6, decoder_layers=6, num_attention_heads=4, intermediate_size=1024,
        dropout=0.3, attention_dropout=0.1, activation_dropout=0.1, encoder_norm_type="powernorm",
        decoder_norm_type="layernorm", powernorm_warmup_steps=8000, vocab_size=10000,
    ),
    # WMT14 En-De big (Table 2).
    "wmt14-big": dict(
        hidden_size=1024, encoder_layers=6, decoder_layers=6, num_attention_heads=16, intermediate_size=4096,
        dropout=0.3, attention_dropout=0.1, activation_dropout=0.1, encoder_norm_type="powernorm",
        decoder_norm_type="layernorm", powernorm_warmup_steps=8000, vocab_size=32768,
    ),
    # Language modelling (Table 3): decoder-only, PN everywhere.
    "lm-small": dict(
        hidden_size=512, encoder_layers=0, decoder_layers=6, num_attention_heads=8, intermediate_size=2048,
        dropout=0.1, attention_dropout=0.1, activation_dropout=0.1, encoder_norm_type="powernorm",
        decoder_norm_type="powernorm", position_embedding_type="learned", is_encoder_decoder=False,
        vocab_size=10000,
    ),
    # Odd sizes that catch shape bugs in tests.
    "tiny": dict(
        vocab_size=99, hidden_size=32, encoder_layers=2, decoder_layers=2, num_attention_heads=4,
        intermediate_size=37, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0,
    ),
}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class PowerNormTransformerConfig(PreTrainedConfig):
    r"""Configuration of [`PowerNormTransformerModel`] and its heads.

    Example:

    ```python
    >>> from hf_powernorm import PowerNormTransformerConfig, PowerNormTransformerForConditionalGeneration
    >>> config = PowerNormTransformerConfig.from_preset("iwslt14-small", vocab_size=8000)
    >>> model = PowerNormTransformerForConditionalGeneration(config)
    ```

    `normalize_before=True` is pre-norm (the paper's setting); `False` is post-norm.
    `powernorm_group_num` defaults to `num_attention_heads`; `None` disables group scaling.
    `powernorm_warmup_statistic` ("reference", the default, or "cumulative") and `powernorm_warmup_ramp_steps`
    choose PN's running statistic during warmup and the length of the blend from the batch to the
    running denominator after it (0: the paper's switch); see `PowerNorm`.

    PN's defaults, `powernorm_alpha_fwd = powernorm_alpha_bkw = 0.9` and
    `powernorm_backward_denominator="running"`, are the authors' and the paper's eqs. 11-13, and
    `PowerNorm`'s own (one default for the model family, the norm and `convert_norms`; STUDIES.md
    compares them with tuned values). `powernorm_alpha_bkw=1.0` keeps `running_nu` at 0, so the
    backward does not correct for the running statistic: not the paper's backward pass.
    `powernorm_warmup_steps=0` means "set it": the paper ties it to the learning-rate warmup, which
    the recipes do by default.
    DyT and Derf (`normalization.DyT`, `Derf`) start their `alpha` at `norm_alpha_init_attention`
    in front of attention, `norm_alpha_init_ffn` in front of the FFN and `norm_alpha_init_final` in
    the final norm: 1.0 each, the defaults of the authors' GPT-2 patches (`zlab-princeton/Derf`,
    `language model/`), a model of our sizes; their LLaMA 2 values, for widths of 4096 and more,
    are smaller and larger before attention (0.8 / 0.2 / 0.2 at 7B; see `DyT`).
    `embed_scale_learnable` makes the token embeddings' scale (sqrt(hidden) with `scale_embedding`,
    else 1) a learnable scalar starting there, as the authors' language models with DyT and Derf do;
    `None` (the default) means: in a stack whose norms are DyT or Derf (their trait
    `learnable_embed_scale`), fixed otherwise.
    """

    model_type = "powernorm_transformer"
    # The generation cache in outputs, under its Transformers >= 5.24 name and the one before.
    keys_to_ignore_at_inference = ["cache", "past_key_values"]
    # The cache is built from the decoder's layer count.
    attribute_map = {"num_hidden_layers": "decoder_layers"}

    vocab_size: int = 32000
    hidden_size: int = 512
    encoder_layers: int = 6
    decoder_layers: int = 6
    num_attention_heads: int = 8
    intermediate_size: int = 2048
    activation_function: str = "relu"
    dropout: float = 0.1
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0
    classifier_dropout: float = 0.0
    max_position_embeddings: int = 1024
    position_embedding_type: str = "sinusoidal"
    normalize_before: bool = True
    encoder_norm_type: str = "powernorm"
    decoder_norm_type: str = "layernorm"
    powernorm_alpha_fwd: float = 0.9
    powernorm_alpha_bkw: float = 0.9
    powernorm_warmup_steps: int = 0
    powernorm_warmup_statistic: str = "reference"
    powernorm_warmup_ramp_steps: int = 0
    powernorm_group_num: int | str | None = GROUP_NUM_HEADS
    powernorm_backward_denominator: str = "running"
    powernorm_sync_stats: bool = False
    norm_eps: float = 1e-5
    norm_alpha_init_attention: float = 1.0
    norm_alpha_init_ffn: float = 1.0
    norm_alpha_init_final: float = 1.0
    embed_scale_learnable: bool | None = None
    norms_folded: bool = False
    pad_token_id: int | None = 1
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 2
    decoder_start_token_id: int | None = 2
    is_encoder_decoder: bool = True
    is_decoder: bool = False
    tie_word_embeddings: bool = True
    scale_embedding: bool = True
    use_cache: bool = True
    init_std: float = 0.02

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if self.powernorm_group_num == GROUP_NUM_HEADS:
            self.powernorm_group_num = self.num_attention_heads
        self.validate_powernorm_transformer()

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> PowerNormTransformerConfig:
        """A config for one of `PRESETS` ("iwslt14-small", "wmt14-big", "lm-small", "tiny")."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; valid presets: {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    def validate_powernorm_transformer(self) -> None:
        """Raise `ValueError` naming the first bad value; canonicalise the norm names."""
        for name in ("vocab_size", "hidden_size", "num_attention_heads", "intermediate_size",
                     "max_position_embeddings"):
            self._check(name, _is_int(getattr(self, name)) and getattr(self, name) >= 1, "a positive integer")
        for name in ("encoder_layers", "decoder_layers", "powernorm_warmup_steps", "powernorm_warmup_ramp_steps"):
            self._check(name, _is_int(getattr(self, name)) and getattr(self, name) >= 0, "a non-negative integer")
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"hidden_size={self.hidden_size} must be divisible by num_attention_heads={self.num_attention_heads}"
            )
        for name in ("dropout", "attention_dropout", "activation_dropout", "classifier_dropout",
                     "powernorm_alpha_fwd", "powernorm_alpha_bkw"):
            value = getattr(self, name)
            self._check(name, _is_number(value) and 0.0 <= value <= 1.0, "a number in [0, 1]")
        for name in ("norm_eps", "init_std"):
            self._check(name, _is_number(getattr(self, name)) and getattr(self, name) > 0, "a positive number")
        for name in (f"norm_alpha_init_{site}" for site in NORM_SITES):
            value = getattr(self, name)
            self._check(name, _is_number(value) and math.isfinite(value) and value > 0, "a finite positive number")
        self._check("embed_scale_learnable", self.embed_scale_learnable is None
                    or isinstance(self.embed_scale_learnable, bool), "None or a bool")
        self._check("activation_function", self.activation_function in ACTIVATIONS, f"one of {ACTIVATIONS}")
        self._check("position_embedding_type", self.position_embedding_type in POSITION_EMBEDDING_TYPES,
                    f"one of {POSITION_EMBEDDING_TYPES}")
        self._check("powernorm_backward_denominator", self.powernorm_backward_denominator in BACKWARD_DENOMINATORS,
                    f"one of {BACKWARD_DENOMINATORS}")
        self._check("powernorm_warmup_statistic", self.powernorm_warmup_statistic in WARMUP_STATISTICS,
                    f"one of {WARMUP_STATISTICS}")
        group_num = self.powernorm_group_num
        self._check("powernorm_group_num", group_num is None or (
            _is_int(group_num) and group_num >= 1 and self.hidden_size % group_num == 0),
            f"None or a positive integer dividing hidden_size={self.hidden_size}")
        for name in ("normalize_before", "powernorm_sync_stats", "tie_word_embeddings", "scale_embedding",
                     "use_cache", "norms_folded"):
            self._check(name, isinstance(getattr(self, name), bool), "a bool")
        for name in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
            value = getattr(self, name, None)
            values = value if isinstance(value, list) else [value]
            self._check(name, all(v is None or (_is_int(v) and 0 <= v < self.vocab_size) for v in values),
                        f"None or a token id in [0, vocab_size={self.vocab_size})")
        for name in ("encoder_norm_type", "decoder_norm_type"):
            try:
                setattr(self, name, normalize_norm_name(getattr(self, name)))
            except ValueError as error:
                raise ValueError(f"{name}: {error}") from None

    def _check(self, name: str, ok: bool, expected: str) -> None:
        if not ok:
            raise ValueError(f"{name} must be {expected}, got {getattr(self, name)!r}")

    def norm_kwargs(self, norm_type: str, site: str | None = None) -> dict[str, Any]:
        """The options `build_norm(norm_type, hidden_size, **options)` takes from this config; at a
        `site` of `NORM_SITES` also the norm's per-site options (DyT's `alpha_init`, ...)."""
        norm_type = normalize_norm_name(norm_type)
        if site is not None and site not in NORM_SITES:
            raise ValueError(f"site must be None or one of {NORM_SITES}, got {site!r}")
        options: dict[str, Any] = {"eps": self.norm_eps}
        fields = NORM_CLASSES[norm_type].config_options
        options.update({option: getattr(self, field) for option, field in fields.items()})
        if site is not None:
            prefixes = NORM_CLASSES[norm_type].site_options
            options.update({option: getattr(self, f"{prefix}_{site}") for option, prefix in prefixes.items()})
        if norm_type == "groupnorm" and options["group_num"] is None:
            options["group_num"] = 1  # no group scaling is one group for GroupNorm, which needs a count
        return options


__all__ = ["NORM_SITES", "PRESETS", "PowerNormTransformerConfig"]

"""The PowerNorm Transformer family (Shen et al., ICML 2020, Section 5 and Appendix B).

A fairseq-style Transformer (Vaswani et al.) whose norm at every position is chosen from the norm
registry: PN in the encoder and LN in the decoder for translation (Table 2), PN everywhere for
language modelling (Table 3), pre-norm or post-norm. Every norm receives the padding mask so that
batch statistics are taken over real tokens only. Heads: encoder-decoder translation, decoder-only
language model, encoder-only sequence classifier.

In eval, PN, PN-V, BN, BRN and MABN are a per-channel affine map after group scaling (Algorithm 2's
inference step, the running statistic in place of the batch's); `fold_norms()` moves that map into the linear layers that read the norm's output.
"""

from __future__ import annotations

import copy
import inspect
import math
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache
from transformers.masking_utils import create_bidirectional_mask, create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutput,
    BaseModelOutputWithPastAndCrossAttentions,
    CausalLMOutputWithCrossAttentions,
    Seq2SeqLMOutput,
    Seq2SeqModelOutput,
    SequenceClassifierOutput,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import can_return_tuple

from .configuration_powernorm import PowerNormTransformerConfig
from .integrations import PeftStatisticsCheck
from .normalization import NORM_CLASSES, build_norm, float32_buffers, group_scale, running_buffers

# The buffers of the registry's norms that keep running statistics, as the registry is at import
# (the model itself reads `running_buffers()` when it needs them, a norm registered later included).
RUNNING_BUFFERS = tuple(running_buffers())
# Norms that are a per-channel affine map after group scaling in eval, hence foldable.
FOLDABLE_NORMS = tuple(name for name, cls in NORM_CLASSES.items() if cls.foldable)

# Transformers 5.24 renamed the generation cache from `past_key_values` to `cache`: the keyword
# `generate` passes to `forward`, the field of the output classes, and the argument of the mask
# helpers. The model takes either keyword and speaks the installed version's name to Transformers.
_CACHE_FIELD = "cache" if "cache" in Seq2SeqLMOutput.__dataclass_fields__ else "past_key_values"
_MASK_CACHE_ARG = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"


# ----------------------------------------------------------------------------------------------
# Building blocks


class GroupScale(nn.Module):
    """Parameter-free group scaling: what is left of a folded PN (`group_num=None`: identity)."""

    def __init__(self, group_num: int | None) -> None:
        super().__init__()
        self.group_num = group_num

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return group_scale(hidden_states, self.group_num).to(hidden_states.dtype)

    def extra_repr(self) -> str:
        return f"group_num={self.group_num}"


def build_position_norm(config: PowerNormTransformerConfig, norm_type: str, foldable_position: bool,
                        site: str) -> nn.Module:
    """The norm of one position at `site` (`NORM_SITES`: its per-site options, such as DyT's initial
    alpha); a `GroupScale` where `fold_norms()` has folded it away."""
    if config.norms_folded and foldable_position and norm_type in FOLDABLE_NORMS:
        # What is left is the group scaling the config gives the norm (none where it sets no group_num).
        option = NORM_CLASSES[norm_type].config_options.get("group_num")
        return GroupScale(getattr(config, option) if option else None)
    return build_norm(norm_type, config.hidden_size, **config.norm_kwargs(norm_type, site))


def sinusoidal_embedding(position_ids: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """fairseq's sinusoidal positions: sines in the first half of the channels, cosines in the second."""
    half = dim // 2
    frequencies = torch.exp(
        torch.arange(half, dtype=torch.float32, device=position_ids.device) * -(math.log(10000.0) / max(half - 1, 1))
    )
    angles = position_ids.float().unsqueeze(-1) * frequencies  # (batch, seq, half)
    embedding = torch.cat([angles.sin(), angles.cos()], dim=-1)
    if dim % 2:
        embedding = F.pad(embedding, (0, 1))
    return embedding.to(dtype)


def position_ids_from_mask(
    attention_mask: torch.Tensor | None, batch_size: int, seq_length: int, past_length: int, device: torch.device
) -> torch.Tensor:
    """Positions count real tokens only, so left padding does not shift them. Shape (batch, seq)."""
    if attention_mask is None:
        return torch.arange(past_length, past_length + seq_length, device=device).expand(batch_size, -1)
    positions = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
    return positions[:, -seq_length:]


def check_padding_mask(name: str, mask: torch.Tensor | None, batch_size: int, length: int) -> None:
    """A padding mask is (batch, length) of 0 (padding) and 1 (real token); anything else is refused
    here, before a norm takes it into its batch statistics."""
    if mask is None:
        return
    if mask.dim() != 2 or tuple(mask.shape) != (batch_size, length):
        raise ValueError(
            f"{name} must have shape ({batch_size}, {length}) (batch, tokens it covers), got {tuple(mask.shape)}"
        )
    if mask.dtype != torch.bool and not torch.compiler.is_compiling():  # the values are read on the host
        bad = mask[(mask != 0) & (mask != 1)]
        if bad.numel():
            raise ValueError(
                f"{name} must hold only 0 (padding) and 1 (real token), got the values "
                f"{sorted(set(bad.flatten().tolist()), key=str)[:5]}"
            )


def _past_length(cache: Cache | None) -> int:
    return cache.get_seq_length() if cache is not None else 0


def _one_cache(cache: Cache | None, past_key_values: Cache | None) -> Cache | None:
    """The cache under its current name (`cache`) or its former one (`past_key_values`)."""
    if cache is not None and past_key_values is not None:
        raise ValueError("pass the cache as `cache` or as `past_key_values`, not both")
    return cache if cache is not None else past_key_values


def _cache_of(outputs: Any) -> Cache | None:
    """The cache an output of this family carries, whatever the installed version calls its field."""
    return getattr(outputs, _CACHE_FIELD, None)


def _with_cache(cache: Cache | None) -> dict[str, Cache | None]:
    """The cache as a keyword of an output class."""
    return {_CACHE_FIELD: cache}


def decoder_padding_mask(decoder_input_ids: torch.Tensor, pad_token_id: int | None) -> torch.Tensor | None:
    """The decoder's padding from its input ids: the pad tokens after the last other token (right
    padding, as collators build it). The first position is always real: it holds the start token,
    which some checkpoints set to the pad id. None when every position is real. Shape (batch, seq)."""
    if pad_token_id is None:
        return None
    real = decoder_input_ids != pad_token_id
    real[:, 0] = True
    real = real.flip(-1).cumsum(-1).flip(-1) > 0  # a pad followed by a real token is a token
    if torch.compiler.is_compiling():  # asking whether all are real would break the graph
        return real.long()
    return None if bool(real.all()) else real.long()


def shift_tokens_right(input_ids: torch.Tensor, pad_token_id: int, decoder_start_token_id: int) -> torch.Tensor:
    """Decoder inputs from labels: prepend the start token, drop the last one, map -100 to padding."""
    shifted = input_ids.new_zeros(input_ids.shape)
    shifted[:, 1:] = input_ids[:, :-1].clone()
    shifted[:, 0] = decoder_start_token_id
    return shifted.masked_fill(shifted == -100, pad_token_id)


def apply_dropout(hidden_states: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """`F.dropout`, with the CPU's mask drawn from uniform numbers (`rand >= p`): the same
    distribution as `F.dropout`'s element-by-element Bernoulli draw, in half its time forward and
    backward together (BENCHMARKS.md: the largest avoidable cost of the studies' training
    step). Elsewhere (CUDA's fused kernel, a graph being compiled) `F.dropout` itself."""
    if not training or p == 0.0:
        return hidden_states
    if hidden_states.device.type != "cpu" or torch.compiler.is_compiling() or not 0.0 < p < 1.0:
        return F.dropout(hidden_states, p=p, training=True)
    # Uniform numbers in float32 whatever the input's dtype: bfloat16's coarse grid near p would shift
    # the kept fraction.
    keep = torch.rand(hidden_states.shape, dtype=torch.float32).ge_(p)
    keep = (keep if hidden_states.dtype == torch.float32 else keep.to(hidden_states.dtype)).mul_(1.0 / (1.0 - p))
    return hidden_states * keep


def embedding_padding_idx(config: PowerNormTransformerConfig) -> int | None:
    """The token embedding's `padding_idx` (a row kept at zero that its lookups do not train): the pad
    id, unless the pad is a real token's too (a tokenizer without a pad token padding with its end or
    start token, as Transformers' `run_clm.py` does), whose row must learn from its use as an input."""
    eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    return None if config.pad_token_id in {config.bos_token_id, *eos} else config.pad_token_id


class PowerNormTransformerEmbeddings(nn.Module):
    """Token embedding (scaled by sqrt(hidden) when `scale_embedding`) plus positions, then dropout.

    The scale is a learnable scalar, starting there, with `config.embed_scale_learnable` (by default
    in a stack of `norm_type`, the stack's norm, when that norm's `learnable_embed_scale` trait says
    so: DyT and Derf, whose output keeps no fixed scale, as their authors' language models do). It
    scales the tokens only: the authors' GPT-2 scales tokens and learned positions together; ours
    keeps the positions (sinusoidal ones included) at their own scale, as the fixed scale does."""

    def __init__(self, config: PowerNormTransformerConfig, norm_type: str) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, embedding_padding_idx(config))
        self.embed_scale_init = math.sqrt(config.hidden_size) if config.scale_embedding else 1.0
        learnable = config.embed_scale_learnable
        if learnable is None:
            learnable = NORM_CLASSES[norm_type].learnable_embed_scale
        self.embed_scale = nn.Parameter(torch.full((1,), self.embed_scale_init)) if learnable \
            else self.embed_scale_init
        self.position_embedding_type = config.position_embedding_type
        self.max_positions = config.max_position_embeddings
        if self.position_embedding_type == "learned":
            self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.dropout = config.dropout

    def forward(
        self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None, position_ids: torch.Tensor
    ) -> torch.Tensor:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids and inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        hidden_states = inputs_embeds * self.embed_scale
        if self.position_embedding_type == "learned":
            if int(position_ids.max()) >= self.max_positions:
                raise ValueError(
                    f"position {int(position_ids.max())} exceeds max_position_embeddings={self.max_positions}"
                )
            hidden_states = hidden_states + self.embed_positions(position_ids)
        else:
            hidden_states = hidden_states + sinusoidal_embedding(position_ids, hidden_states.shape[-1],
                                                                 hidden_states.dtype)
        return apply_dropout(hidden_states, self.dropout, self.training)


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling  # (batch, heads, q, k)
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    # At least float32, not exactly float32: float64's mask value of a padded query's fully masked
    # row would be -inf in float32, and the row's softmax NaN (spreading to the real tokens' values).
    softmax_dtype = torch.promote_types(attn_weights.dtype, torch.float32)
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=softmax_dtype).to(query.dtype)
    attn_weights = apply_dropout(attn_weights, dropout, module.training)
    attn_output = torch.matmul(attn_weights, value).transpose(1, 2).contiguous()
    return attn_output, attn_weights


class PowerNormTransformerAttention(nn.Module):
    """Multi-head attention through Transformers' attention interface (eager, sdpa, ...)."""

    def __init__(self, config: PowerNormTransformerConfig, layer_idx: int, is_causal: bool = False,
                 is_cross_attention: bool = False) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.is_causal = is_causal
        self.is_cross_attention = is_cross_attention
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim**-0.5
        self.dropout = config.attention_dropout
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.out_proj = nn.Linear(config.hidden_size, config.hidden_size)

    def _project(self, proj: nn.Linear, states: torch.Tensor) -> torch.Tensor:
        return proj(states).view(*states.shape[:-1], -1, self.head_dim).transpose(1, 2)  # (batch, heads, seq, dim)

    def _keys_values(self, hidden_states, key_value_states, cache):
        if cache is None:
            source = key_value_states if self.is_cross_attention else hidden_states
            return self._project(self.k_proj, source), self._project(self.v_proj, source)
        if self.is_cross_attention:
            # The encoder output is fixed during generation: project it once, then reuse it.
            layer_cache = cache.cross_attention_cache
            if cache.is_updated.get(self.layer_idx):
                return layer_cache.layers[self.layer_idx].keys, layer_cache.layers[self.layer_idx].values
            cache.is_updated[self.layer_idx] = True
            source = key_value_states
        else:
            layer_cache = cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
            source = hidden_states
        keys, values = self._project(self.k_proj, source), self._project(self.v_proj, source)
        return layer_cache.update(keys, values, self.layer_idx)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        key_value_states: torch.Tensor | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        query = self._project(self.q_proj, hidden_states)
        keys, values = self._keys_values(hidden_states, key_value_states, cache)
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self, query, keys, values, attention_mask,
            dropout=self.dropout if self.training else 0.0, scaling=self.scaling, **kwargs,
        )
        attn_output = attn_output.reshape(*hidden_states.shape[:-1], -1).contiguous()
        return self.out_proj(attn_output), attn_weights


class PowerNormTransformerFeedForward(nn.Module):
    def __init__(self, config: PowerNormTransformerConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.activation_fn = ACT2FN[config.activation_function]
        self.activation_dropout = config.activation_dropout

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = self.activation_fn(self.fc1(hidden_states))
        hidden_states = apply_dropout(hidden_states, self.activation_dropout, self.training)
        return self.fc2(hidden_states)


# ----------------------------------------------------------------------------------------------
# Layers


class PowerNormTransformerLayerBase(GradientCheckpointingLayer):
    """Residual sub-layers with the norm before (pre-norm) or after (post-norm) each of them."""

    def __init__(self, config: PowerNormTransformerConfig) -> None:
        super().__init__()
        self.normalize_before = config.normalize_before
        self.dropout = config.dropout

    def _sublayer(self, norm: nn.Module, block: Callable, hidden_states: torch.Tensor,
                  padding_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        residual = hidden_states
        if self.normalize_before:
            hidden_states = norm(hidden_states, padding_mask)
        hidden_states, weights = block(hidden_states)
        hidden_states = residual + apply_dropout(hidden_states, self.dropout, self.training)
        if not self.normalize_before:
            hidden_states = norm(hidden_states, padding_mask)
        return hidden_states, weights

    def _ffn_block(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.ffn(hidden_states), None


class PowerNormTransformerEncoderLayer(PowerNormTransformerLayerBase):
    def __init__(self, config: PowerNormTransformerConfig, layer_idx: int) -> None:
        super().__init__(config)
        norm = config.encoder_norm_type
        self.self_attn = PowerNormTransformerAttention(config, layer_idx)
        self.self_attn_norm = build_position_norm(config, norm, config.normalize_before, "attention")
        self.ffn = PowerNormTransformerFeedForward(config)
        self.ffn_norm = build_position_norm(config, norm, config.normalize_before, "ffn")

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        def attend(states):
            return self.self_attn(states, attention_mask=attention_mask, **kwargs)

        hidden_states, attn_weights = self._sublayer(self.self_attn_norm, attend, hidden_states, padding_mask)
        hidden_states, _ = self._sublayer(self.ffn_norm, self._ffn_block, hidden_states, padding_mask)
        return hidden_states, attn_weights


class PowerNormTransformerDecoderLayer(PowerNormTransformerLayerBase):
    def __init__(self, config: PowerNormTransformerConfig, layer_idx: int, cross_attention: bool) -> None:
        super().__init__(config)
        norm = config.decoder_norm_type
        self.self_attn = PowerNormTransformerAttention(config, layer_idx, is_causal=True)
        self.self_attn_norm = build_position_norm(config, norm, config.normalize_before, "attention")
        if cross_attention:
            self.encoder_attn = PowerNormTransformerAttention(config, layer_idx, is_cross_attention=True)
            self.cross_attn_norm = build_position_norm(config, norm, config.normalize_before, "attention")
        self.ffn = PowerNormTransformerFeedForward(config)
        self.ffn_norm = build_position_norm(config, norm, config.normalize_before, "ffn")

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        def attend(states):
            return self.self_attn(states, attention_mask=attention_mask, cache=cache, **kwargs)

        def cross_attend(states):
            return self.encoder_attn(states, attention_mask=encoder_attention_mask,
                                     key_value_states=encoder_hidden_states, cache=cache, **kwargs)

        hidden_states, self_weights = self._sublayer(self.self_attn_norm, attend, hidden_states, padding_mask)
        cross_weights = None
        if encoder_hidden_states is not None:
            hidden_states, cross_weights = self._sublayer(self.cross_attn_norm, cross_attend, hidden_states,
                                                          padding_mask)
        hidden_states, _ = self._sublayer(self.ffn_norm, self._ffn_block, hidden_states, padding_mask)
        return hidden_states, self_weights, cross_weights


# ----------------------------------------------------------------------------------------------
# Pretrained base: weights, norm folding


class _Float32Buffers:
    """The float32 buffers of the registry's norms (`float32_buffers()`), read whenever Transformers
    reads the class attribute that holds this."""

    def __get__(self, instance: Any, owner: type) -> list[str]:
        return list(float32_buffers())


class PowerNormTransformerPreTrainedModel(PreTrainedModel):
    config_class = PowerNormTransformerConfig
    config: PowerNormTransformerConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _no_split_modules = ["PowerNormTransformerEncoderLayer", "PowerNormTransformerDecoderLayer"]
    # Running statistics stay float32 when loading with dtype=torch.bfloat16 / float16.
    _keep_in_fp32_modules_strict = _Float32Buffers()
    peft_config = PeftStatisticsCheck()  # PEFT without the norms' statistics warns

    def create_masks_for_generate(self, attention_mask: torch.Tensor | None = None,
                                  **kwargs: Any) -> torch.Tensor | None:
        """`generate` with a static cache keeps the 2-D padding mask: the norms and the positions need
        it, and each stack builds its attention mask from it and the cache."""
        return attention_mask

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.init_std
        if isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.padding_idx is not None and not getattr(module.weight, "_is_hf_initialized", False):
                init.zeros_(module.weight[module.padding_idx])
        elif isinstance(module, tuple(NORM_CLASSES.values())):
            self._init_norm(module)
        elif isinstance(module, PowerNormTransformerEmbeddings) and isinstance(module.embed_scale, nn.Parameter):
            init.constant_(module.embed_scale, module.embed_scale_init)

    @staticmethod
    def _init_norm(module: nn.Module) -> None:
        """weight 1, bias 0, each buffer at its initial value (`buffer_defaults()` of the norm's class);
        the learnable scalars of DyT and Derf at their initial values (`alpha_init`, `shift_init`)."""
        for name, value in (("weight", 1.0), ("bias", 0.0), *module.buffer_defaults().items()):
            tensor = getattr(module, name, None)
            if tensor is not None:
                init.constant_(tensor, value)
        for name in ("alpha", "shift"):
            tensor = getattr(module, name, None)
            if isinstance(tensor, torch.Tensor):
                init.constant_(tensor, getattr(module, f"{name}_init"))

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any) -> PreTrainedModel | tuple[PreTrainedModel, dict]:
        """Load as usual; warn by name about running statistics the checkpoint lacks."""
        output_loading_info = kwargs.pop("output_loading_info", False)
        model, loading_info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        _check_norm_layout(model, loading_info)
        initial = running_buffers()
        missing = sorted(k for k in loading_info["missing_keys"] if k.rsplit(".", 1)[-1] in initial)
        if missing:
            values = ", ".join(f"{name}={initial[name]:g}" for name in dict.fromkeys(k.rsplit(".", 1)[-1]
                                                                                      for k in missing))
            warnings.warn(
                f"The checkpoint has no running statistics {missing}; they start from their initial values "
                f"({values}), so eval outputs are not those of the trained model.",
                UserWarning,
                stacklevel=2,
            )
        return (model, loading_info) if output_loading_info else model

    def save_pretrained(self, save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> None:
        """Save as usual; the `auto_map` names every Auto class so one directory loads through each."""
        if getattr(type(self), "_auto_class", None) is not None:
            self.config.auto_map = {**(getattr(self.config, "auto_map", None) or {}), **_full_auto_map()}
        return super().save_pretrained(save_directory, *args, **kwargs)

    @torch.no_grad()
    def fold_norms(self) -> int:
        """Fold every eval-mode PN / PN-V / BN / BRN / MABN affine map into the linear layers that read it.

        Pre-norm only: the norm in front of self-attention goes into `q_proj`, `k_proj`, `v_proj`,
        the one in front of cross-attention into `q_proj`, the one in front of the feed-forward
        block into `fc1`; each norm becomes its group scaling. Final norms are left alone (their
        output is the encoder output and the input of the tied output projection). The model is
        for inference afterwards; `config.norms_folded` records it so that it saves and reloads.
        Returns the number of norms folded.
        """
        if self.config.norms_folded:
            raise ValueError("the norms of this model are already folded (config.norms_folded=True)")
        if not self.config.normalize_before:
            raise ValueError("fold_norms needs normalize_before=True: a post-norm output also feeds the residual")
        folded = 0
        for layer in self.modules():
            if isinstance(layer, (PowerNormTransformerEncoderLayer, PowerNormTransformerDecoderLayer)):
                folded += _fold_layer(layer)
        if folded == 0:
            raise ValueError(f"no foldable norm ({', '.join(FOLDABLE_NORMS)}) in this model")
        self.config.norms_folded = True
        return folded


def _check_norm_layout(model: nn.Module, loading_info: dict) -> None:
    """Refuse weights whose norm at some position is not the one the config builds (another norm
    type, or folded against `norms_folded`): an unexpected key there, or a missing parameter.
    Missing running statistics alone are a checkpoint saved without them (a warning, not this)."""
    positions = {name: type(module).__name__ for name, module in model.named_modules()
                 if isinstance(module, (GroupScale, *NORM_CLASSES.values()))}
    differing: dict[str, list[str]] = {}
    statistics = running_buffers()
    for kind, keys in (("unexpected", loading_info["unexpected_keys"]), ("missing", loading_info["missing_keys"])):
        for key in keys:
            position, leaf = key.rsplit(".", 1) if "." in key else ("", key)
            if position in positions and (kind == "unexpected" or leaf not in statistics):
                differing.setdefault(position, []).append(f"{kind} {leaf}")
    if differing:
        config = model.config
        details = "; ".join(f"{position}: config builds {positions[position]}, weights: {', '.join(sorted(found))}"
                            for position, found in sorted(differing.items()))
        raise ValueError(
            f"config.json disagrees with the weights at the norm positions {sorted(differing)} "
            f"(config: encoder_norm_type={config.encoder_norm_type!r}, decoder_norm_type="
            f"{config.decoder_norm_type!r}, norms_folded={config.norms_folded}). {details}. Use the config "
            "saved with these weights."
        )


def _fold_into(norm: nn.Module, linears: list[nn.Linear]) -> nn.Module:
    """`W (s * z + b) + c = (W diag(s)) z + (W b + c)` for each linear; returns the GroupScale left."""
    scale, shift = norm.affine_after_group_scale()
    for linear in linears:
        weight = linear.weight.float()
        linear.bias.copy_((linear.bias.float() + weight @ shift).to(linear.bias.dtype))
        linear.weight.copy_((weight * scale).to(linear.weight.dtype))
    return GroupScale(getattr(norm, "group_num", None))


def _fold_layer(layer: nn.Module) -> int:
    targets = {"self_attn_norm": lambda: [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj],
               "ffn_norm": lambda: [layer.ffn.fc1]}
    if hasattr(layer, "encoder_attn"):
        targets["cross_attn_norm"] = lambda: [layer.encoder_attn.q_proj]
    folded = 0
    for name, linears in targets.items():
        norm = getattr(layer, name)
        if hasattr(norm, "affine_after_group_scale"):
            setattr(layer, name, _fold_into(norm, linears()))
            folded += 1
    return folded


# ----------------------------------------------------------------------------------------------
# Encoder and decoder stacks


class PowerNormTransformerEncoder(PowerNormTransformerPreTrainedModel):
    """`encoder_layers` layers with `encoder_norm_type` norms; bidirectional attention."""

    def __init__(self, config: PowerNormTransformerConfig) -> None:
        super().__init__(config)
        self.embeddings = PowerNormTransformerEmbeddings(config, config.encoder_norm_type)
        self.layers = nn.ModuleList(
            [PowerNormTransformerEncoderLayer(config, i) for i in range(config.encoder_layers)]
        )
        self.final_norm = build_position_norm(config, config.encoder_norm_type, False, "final") \
            if config.normalize_before else None
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embeddings.embed_tokens = value

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        **kwargs,
    ) -> BaseModelOutput:
        output_attentions, output_hidden_states = _output_flags(self.config, output_attentions, output_hidden_states)
        reference = input_ids if input_ids is not None else inputs_embeds
        batch_size, seq_length = reference.shape[:2]
        check_padding_mask("attention_mask", attention_mask, batch_size, seq_length)
        position_ids = position_ids_from_mask(attention_mask, batch_size, seq_length, 0, reference.device)
        hidden_states = self.embeddings(input_ids, inputs_embeds, position_ids)
        attn_mask = create_bidirectional_mask(config=self.config, inputs_embeds=hidden_states,
                                              attention_mask=attention_mask)
        all_hidden, all_attn = [], []
        for layer in self.layers:
            all_hidden.append(hidden_states)
            hidden_states, weights = layer(hidden_states, attn_mask, attention_mask, **_attention_kwargs(kwargs))
            all_attn.append(weights)
        if self.final_norm is not None:
            hidden_states = self.final_norm(hidden_states, attention_mask)
        all_hidden.append(hidden_states)
        return BaseModelOutput(
            last_hidden_state=hidden_states,
            hidden_states=tuple(all_hidden) if output_hidden_states else None,
            attentions=tuple(all_attn) if output_attentions else None,
        )


def _attention_kwargs(kwargs: dict) -> dict:
    """Keyword arguments meant for the attention functions; generation bookkeeping is dropped."""
    dropped = ("return_dict", "use_cache", "position_ids", "cache_position", "output_attentions",
               "output_hidden_states")
    return {k: v for k, v in kwargs.items() if k not in dropped}


def _output_flags(config: PowerNormTransformerConfig, output_attentions: bool | None,
                  output_hidden_states: bool | None) -> tuple[bool, bool]:
    """The keyword where given, else the config's flag (as every Transformers model reads them)."""
    return (bool(config.output_attentions if output_attentions is None else output_attentions),
            bool(config.output_hidden_states if output_hidden_states is None else output_hidden_states))


class PowerNormTransformerDecoder(PowerNormTransformerPreTrainedModel):
    """`decoder_layers` causal layers with `decoder_norm_type` norms; cross-attention in seq2seq."""

    def __init__(self, config: PowerNormTransformerConfig) -> None:
        super().__init__(config)
        self.embeddings = PowerNormTransformerEmbeddings(config, config.decoder_norm_type)
        self.layers = nn.ModuleList(
            [PowerNormTransformerDecoderLayer(config, i, config.is_encoder_decoder)
             for i in range(config.decoder_layers)]
        )
        self.final_norm = build_position_norm(config, config.decoder_norm_type, False, "final") \
            if config.normalize_before else None
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embeddings.embed_tokens = value

    def _new_cache(self) -> Cache:
        if self.config.is_encoder_decoder:
            return EncoderDecoderCache(DynamicCache(config=self.config), DynamicCache(config=self.config))
        return DynamicCache(config=self.config)

    # Over 50 lines: Transformers' signature, one argument a line, as BartModel.forward writes it.
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPastAndCrossAttentions:
        cache = _one_cache(cache, past_key_values)
        output_attentions, output_hidden_states = _output_flags(self.config, output_attentions, output_hidden_states)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if self.training and any(getattr(layer, "gradient_checkpointing", False) for layer in self.layers):
            # Recomputation would run each layer's cache update twice: no cache while checkpointing
            # (what Transformers' checkpointing layer does, whatever name the cache goes by).
            use_cache, cache = False, None
        if use_cache and cache is None:
            cache = self._new_cache()
        reference = input_ids if input_ids is not None else inputs_embeds
        batch_size, seq_length = reference.shape[:2]
        past_length = _past_length(cache)
        # The mask covers the cached tokens and the new ones.
        check_padding_mask("attention_mask", attention_mask, batch_size, past_length + seq_length)
        if encoder_hidden_states is not None:
            check_padding_mask("encoder_attention_mask", encoder_attention_mask, batch_size,
                               encoder_hidden_states.shape[1])
        position_ids = position_ids_from_mask(attention_mask, batch_size, seq_length, past_length, reference.device)
        hidden_states = self.embeddings(input_ids, inputs_embeds, position_ids)
        # The norms see the mask of the new tokens only: (batch, seq).
        padding_mask = attention_mask[:, -seq_length:] if attention_mask is not None else None
        self_attn_cache = cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
        causal_mask = create_causal_mask(config=self.config, inputs_embeds=hidden_states,
                                         attention_mask=attention_mask, **{_MASK_CACHE_ARG: self_attn_cache})
        cross_mask = None
        if encoder_hidden_states is not None:
            cross_mask = create_bidirectional_mask(config=self.config, inputs_embeds=hidden_states,
                                                   attention_mask=encoder_attention_mask,
                                                   encoder_hidden_states=encoder_hidden_states)
        all_hidden, all_self, all_cross = [], [], []
        for layer in self.layers:
            all_hidden.append(hidden_states)
            hidden_states, self_weights, cross_weights = layer(
                hidden_states, causal_mask, encoder_hidden_states, cross_mask, padding_mask,
                cache=cache, **_attention_kwargs(kwargs),
            )
            all_self.append(self_weights)
            all_cross.append(cross_weights)
        if self.final_norm is not None:
            hidden_states = self.final_norm(hidden_states, padding_mask)
        all_hidden.append(hidden_states)
        return BaseModelOutputWithPastAndCrossAttentions(
            last_hidden_state=hidden_states,
            **_with_cache(cache if use_cache else None),
            hidden_states=tuple(all_hidden) if output_hidden_states else None,
            attentions=tuple(all_self) if output_attentions else None,
            cross_attentions=tuple(all_cross) if output_attentions and encoder_hidden_states is not None else None,
        )


# ----------------------------------------------------------------------------------------------
# Models and heads


def _stacks_of(config: PowerNormTransformerConfig) -> tuple[bool, bool]:
    """(encoder, decoder) a config describes: both for translation, the decoder for a language model
    (`is_decoder`), the encoder for a classifier."""
    if config.is_encoder_decoder:
        classifier = any(name.endswith("ForSequenceClassification") for name in config.architectures or ())
        return True, not classifier  # a classifier saved before it marked its config encoder-only
    return not config.is_decoder, config.is_decoder


class PowerNormTransformerModel(PowerNormTransformerPreTrainedModel):
    """The base model of each checkpoint kind, with the stacks its config describes: encoder-decoder
    (translation), decoder-only (`is_decoder`, a language model) or encoder-only (a classifier).
    With `tie_word_embeddings`, the decoder shares the encoder's embedding."""

    def __init__(self, config: PowerNormTransformerConfig, add_encoder: bool | None = None,
                 add_decoder: bool | None = None) -> None:
        super().__init__(config)
        encoder, decoder = _stacks_of(config)
        add_encoder = encoder if add_encoder is None else add_encoder
        add_decoder = decoder if add_decoder is None else add_decoder
        # The heads keep one layout (`model.encoder`, `model.decoder`), so a translation checkpoint
        # loads its encoder into the classifier.
        self.encoder = PowerNormTransformerEncoder(config) if add_encoder else None
        self.decoder = PowerNormTransformerDecoder(config) if add_decoder else None
        self._tied_weights_keys = {
            "decoder.embeddings.embed_tokens.weight": "encoder.embeddings.embed_tokens.weight"
        } if add_encoder and add_decoder else None
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return (self.encoder or self.decoder).get_input_embeddings()

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        for stack in (self.encoder, self.decoder):
            if stack is not None:
                stack.set_input_embeddings(value)

    def get_encoder(self) -> PowerNormTransformerEncoder | None:
        return self.encoder

    def get_decoder(self) -> PowerNormTransformerDecoder | None:
        return self.decoder

    # Over 50 lines: Transformers' signature, one argument a line, as BartModel.forward writes it.
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs: BaseModelOutput | tuple | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> Seq2SeqModelOutput | BaseModelOutputWithPastAndCrossAttentions | BaseModelOutput:
        """Encoder-decoder: as the translation head. Decoder-only or encoder-only: that stack on
        `input_ids` / `inputs_embeds` and `attention_mask`."""
        cache = _one_cache(cache, past_key_values)
        if self.encoder is None:
            return self.decoder(input_ids=input_ids, attention_mask=attention_mask, cache=cache,
                                inputs_embeds=inputs_embeds, use_cache=use_cache, output_attentions=output_attentions,
                                output_hidden_states=output_hidden_states, return_dict=True, **kwargs)
        if self.decoder is None:
            return self.encoder(input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds,
                                output_attentions=output_attentions, output_hidden_states=output_hidden_states,
                                return_dict=True, **kwargs)
        past_length = _past_length(cache)
        if decoder_attention_mask is None and decoder_input_ids is not None and past_length == 0:
            decoder_attention_mask = decoder_padding_mask(decoder_input_ids, self.config.pad_token_id)
        decoder_reference = decoder_input_ids if decoder_input_ids is not None else decoder_inputs_embeds
        if decoder_reference is not None:
            # Checked here, before the encoder's norms update their statistics.
            check_padding_mask("decoder_attention_mask", decoder_attention_mask, decoder_reference.shape[0],
                               past_length + decoder_reference.shape[1])
        if encoder_outputs is None:
            encoder_outputs = self.encoder(input_ids=input_ids, attention_mask=attention_mask,
                                           inputs_embeds=inputs_embeds, output_attentions=output_attentions,
                                           output_hidden_states=output_hidden_states, return_dict=True, **kwargs)
        elif not isinstance(encoder_outputs, BaseModelOutput):
            encoder_outputs = BaseModelOutput(*encoder_outputs)
        output_attentions, output_hidden_states = _output_flags(self.config, output_attentions, output_hidden_states)
        decoder_outputs = self.decoder(
            input_ids=decoder_input_ids, attention_mask=decoder_attention_mask,
            encoder_hidden_states=encoder_outputs.last_hidden_state, encoder_attention_mask=attention_mask,
            cache=cache, inputs_embeds=decoder_inputs_embeds, use_cache=use_cache,
            output_attentions=output_attentions, output_hidden_states=output_hidden_states, return_dict=True,
            **kwargs,
        )
        return Seq2SeqModelOutput(
            last_hidden_state=decoder_outputs.last_hidden_state,
            **_with_cache(_cache_of(decoder_outputs)),
            decoder_hidden_states=decoder_outputs.hidden_states,
            decoder_attentions=decoder_outputs.attentions,
            cross_attentions=decoder_outputs.cross_attentions,
            encoder_last_hidden_state=encoder_outputs.last_hidden_state,
            encoder_hidden_states=encoder_outputs.hidden_states,
            encoder_attentions=encoder_outputs.attentions,
        )


class PowerNormTransformerForConditionalGeneration(PowerNormTransformerPreTrainedModel, GenerationMixin):
    """Translation: the encoder-decoder with an output projection (tied to the embeddings by default)."""

    _tied_weights_keys = {"lm_head.weight": "model.encoder.embeddings.embed_tokens.weight"}

    def __init__(self, config: PowerNormTransformerConfig) -> None:
        super().__init__(config)
        self.model = PowerNormTransformerModel(config, add_encoder=True, add_decoder=True)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_encoder(self) -> PowerNormTransformerEncoder:
        return self.model.encoder

    def get_decoder(self) -> PowerNormTransformerDecoder:
        return self.model.decoder

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def prepare_decoder_input_ids_from_labels(self, labels: torch.Tensor) -> torch.Tensor:
        return shift_tokens_right(labels, self.config.pad_token_id, self.config.decoder_start_token_id)

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs: BaseModelOutput | tuple | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> Seq2SeqLMOutput:
        r"""`labels` (batch, target_len): next tokens, -100 ignored; decoder inputs are derived from them."""
        cache = _one_cache(cache, past_key_values)
        if labels is not None:
            use_cache = False
            if decoder_input_ids is None and decoder_inputs_embeds is None:
                decoder_input_ids = self.prepare_decoder_input_ids_from_labels(labels)
            if decoder_attention_mask is None:
                # A position whose label is ignored is padding (as in fairseq's prev_output_tokens):
                # keep it out of the decoder's batch statistics, also when a collator built the
                # decoder inputs from the labels.
                decoder_attention_mask = (labels != -100).long()
        outputs = self.model(
            input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids,
            decoder_attention_mask=decoder_attention_mask, encoder_outputs=encoder_outputs,
            cache=cache, inputs_embeds=inputs_embeds,
            decoder_inputs_embeds=decoder_inputs_embeds, use_cache=use_cache, return_dict=True, **kwargs,
        )
        logits = self.lm_head(outputs.last_hidden_state)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)
        # the base model's output fields but its last hidden state: the cache, the decoder's and the encoder's
        carried = {name: value for name, value in outputs.items() if name != "last_hidden_state"}
        return Seq2SeqLMOutput(loss=loss, logits=logits, **carried)


def _single_stack_config(config: PowerNormTransformerConfig, is_decoder: bool) -> PowerNormTransformerConfig:
    """A copy of `config` for a decoder-only (`is_decoder`) or an encoder-only model."""
    config = copy.deepcopy(config)
    config.is_encoder_decoder = False
    config.is_decoder = is_decoder
    return config


class PowerNormTransformerForCausalLM(PowerNormTransformerPreTrainedModel, GenerationMixin):
    """Decoder-only language model (no cross-attention): `decoder_layers` layers."""

    _tied_weights_keys = {"lm_head.weight": "model.decoder.embeddings.embed_tokens.weight"}

    def __init__(self, config: PowerNormTransformerConfig) -> None:
        config = _single_stack_config(config, is_decoder=True)
        super().__init__(config)
        self.model = PowerNormTransformerModel(config, add_encoder=False, add_decoder=True)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.set_input_embeddings(value)

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def get_decoder(self) -> PowerNormTransformerDecoder:
        return self.model.decoder

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> CausalLMOutputWithCrossAttentions:
        r"""`labels` (batch, seq): the input ids themselves (shifted inside), -100 ignored."""
        outputs = self.model.decoder(input_ids=input_ids, attention_mask=attention_mask,
                                     cache=_one_cache(cache, past_key_values), inputs_embeds=inputs_embeds,
                                     use_cache=use_cache, return_dict=True, **kwargs)
        logits = self.lm_head(outputs.last_hidden_state)
        loss = None
        if labels is not None:
            shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), shifted.reshape(-1),
                                   ignore_index=-100)
        return CausalLMOutputWithCrossAttentions(
            loss=loss,
            logits=logits,
            **_with_cache(_cache_of(outputs)),
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


class PowerNormTransformerForSequenceClassification(PowerNormTransformerPreTrainedModel):
    """Encoder-only classifier: mean over real tokens of the encoder output, dropout, linear."""

    def __init__(self, config: PowerNormTransformerConfig) -> None:
        config = _single_stack_config(config, is_decoder=False)
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = PowerNormTransformerModel(config, add_encoder=True, add_decoder=False)
        self.dropout = nn.Dropout(config.classifier_dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.set_input_embeddings(value)

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        **kwargs,
    ) -> SequenceClassifierOutput:
        r"""`labels` (batch,): class ids (float targets for regression / multi-label, per `problem_type`)."""
        outputs = self.model.encoder(input_ids=input_ids, attention_mask=attention_mask,
                                     inputs_embeds=inputs_embeds, return_dict=True, **kwargs)
        hidden_states = outputs.last_hidden_state  # (batch, seq, hidden)
        if attention_mask is None:
            pooled = hidden_states.mean(1)
        else:
            weights = attention_mask.to(hidden_states.dtype).unsqueeze(-1)
            pooled = (hidden_states * weights).sum(1) / weights.sum(1).clamp_min(1.0)
        logits = self.classifier(self.dropout(pooled))
        loss = self._loss(logits, labels) if labels is not None else None
        return SequenceClassifierOutput(loss=loss, logits=logits, hidden_states=outputs.hidden_states,
                                        attentions=outputs.attentions)

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.config.problem_type is None:
            single = self.num_labels > 1 and labels.dtype in (torch.long, torch.int)
            self.config.problem_type = "regression" if self.num_labels == 1 else (
                "single_label_classification" if single else "multi_label_classification")
        if self.config.problem_type == "regression":
            return F.mse_loss(logits.squeeze(-1).float(), labels.float())
        if self.config.problem_type == "single_label_classification":
            return F.cross_entropy(logits.float().view(-1, self.num_labels), labels.view(-1))
        return F.binary_cross_entropy_with_logits(logits.float(), labels.float())


AUTO_CLASSES = {
    "AutoModel": PowerNormTransformerModel,
    "AutoModelForSeq2SeqLM": PowerNormTransformerForConditionalGeneration,
    "AutoModelForCausalLM": PowerNormTransformerForCausalLM,
    "AutoModelForSequenceClassification": PowerNormTransformerForSequenceClassification,
}


def _full_auto_map() -> dict[str, str]:
    module = __name__.rsplit(".", 1)[-1]
    auto_map = {"AutoConfig": f"configuration_powernorm.{PowerNormTransformerConfig.__name__}"}
    auto_map.update({auto: f"{module}.{cls.__name__}" for auto, cls in AUTO_CLASSES.items()})
    return auto_map


def register_for_auto_classes() -> None:
    """Make `save_pretrained` copy the code files and write a full `auto_map` into `config.json`."""
    PowerNormTransformerConfig.register_for_auto_class()
    for auto, cls in AUTO_CLASSES.items():
        cls.register_for_auto_class(auto)


__all__ = [
    "AUTO_CLASSES",
    "GroupScale",
    "PowerNormTransformerDecoder",
    "PowerNormTransformerEncoder",
    "PowerNormTransformerForCausalLM",
    "PowerNormTransformerForConditionalGeneration",
    "PowerNormTransformerForSequenceClassification",
    "PowerNormTransformerModel",
    "PowerNormTransformerPreTrainedModel",
    "register_for_auto_classes",
]

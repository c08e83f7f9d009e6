"""Tiny PowerNorm Transformer models and their inputs, for the tests of any folder (models, norms)."""

import torch

from hf_powernorm import (
    PowerNormTransformerConfig,
    PowerNormTransformerForCausalLM,
    PowerNormTransformerForConditionalGeneration,
    PowerNormTransformerForSequenceClassification,
)

BATCH, SEQ, VOCAB = 3, 7, 99
HEAD_CLASSES = {
    "seq2seq": PowerNormTransformerForConditionalGeneration,
    "causal": PowerNormTransformerForCausalLM,
    "classifier": PowerNormTransformerForSequenceClassification,
}


def make_config(norm: str = "powernorm", **overrides) -> PowerNormTransformerConfig:
    options = dict(encoder_norm_type=norm, decoder_norm_type=norm, num_labels=3)
    options.update(overrides)
    return PowerNormTransformerConfig.from_preset("tiny", **options)


def make_model(head: str, norm: str = "powernorm", seed: int = 0, **overrides):
    torch.manual_seed(seed)
    return HEAD_CLASSES[head](make_config(norm, **overrides))


def ids(seed: int = 1, batch: int = BATCH, seq: int = SEQ) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, seq), generator=generator)


def inputs_for(head: str, input_ids: torch.Tensor, attention_mask=None, with_labels: bool = False) -> dict:
    batch = {"input_ids": input_ids, "attention_mask": attention_mask}
    if head == "seq2seq":
        decoder_input_ids = torch.cat([torch.full_like(input_ids[:, :1], 2), input_ids[:, :-1]], dim=1)
        batch.update(decoder_input_ids=decoder_input_ids, decoder_attention_mask=attention_mask)
    if with_labels:
        batch["labels"] = torch.arange(input_ids.shape[0]) % 3 if head == "classifier" else input_ids
    return batch

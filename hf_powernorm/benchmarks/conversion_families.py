"""How closely `convert_norms(..., preserve_function=True)` keeps the function of LayerNorm families.

    python -m hf_powernorm.benchmarks.conversion_families [--seeds 3]

For tiny random models of each family (Transformers' own config classes, odd sizes, norm weights
and biases moved off 1 and 0 by a seeded generator, as a trained model's are), this prints one
Markdown table (docs/conversion_families.md): whether every norm converted exactly (the residual
stream centred, `centring.py`) or some were fitted ("approximate", with the largest mean / RMS of a
fitted norm's input), and the largest logit change over real tokens of held-out batches relative to
the logits' RMS: PN fitted on the uncentred stream (`centre_stream=False`, what the conversion did
before centring), then PN and RMSNorm on the centred stream. The families and their inputs are the
ones `tests/conversion/test_centring.py` checks.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

VOCAB, HIDDEN, HEADS, SEQ, IMAGE, MELS, FRAMES = 99, 32, 4, 7, 28, 8, 32
TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
TEXT = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=HEADS,
            max_position_embeddings=64, **TOKENS)


@dataclass(frozen=True)
class Family:
    """A tiny model of a family: `build()` makes it, `inputs` says what it reads (`text`, `seq2seq`,
    `image`, `audio`), `exact` whether every norm's input can be centred (pre-LN, linear writers)."""

    build: Callable
    inputs: str
    exact: bool
    note: str = ""


def _tf():
    import transformers

    return transformers


FAMILIES: dict[str, Family] = {
    "gpt2": Family(lambda tf: tf.GPT2LMHeadModel(tf.GPT2Config(
        vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=HEADS, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, **TOKENS)), "text", True, "tied head untied"),
    "gpt_neox": Family(lambda tf: tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(
        **TEXT, intermediate_size=37, hidden_dropout=0.0, attention_dropout=0.0)), "text", True, "parallel block"),
    "opt": Family(lambda tf: tf.OPTForCausalLM(tf.OPTConfig(
        **TEXT, ffn_dim=37, word_embed_proj_dim=HIDDEN, do_layer_norm_before=True, dropout=0.0)), "text", True,
        "pre-LN (do_layer_norm_before)"),
    "phi": Family(lambda tf: tf.PhiForCausalLM(tf.PhiConfig(
        **TEXT, intermediate_size=37, resid_pdrop=0.0, embd_pdrop=0.0)), "text", True, "parallel block"),
    "falcon": Family(lambda tf: tf.FalconForCausalLM(tf.FalconConfig(
        **TEXT, parallel_attn=True, hidden_dropout=0.0, attention_dropout=0.0)), "text", True,
        "parallel attention, tied head"),
    "falcon_new_decoder": Family(lambda tf: tf.FalconForCausalLM(tf.FalconConfig(
        **TEXT, new_decoder_architecture=True, num_kv_heads=2, num_ln_in_parallel_attn=2, hidden_dropout=0.0,
        attention_dropout=0.0)), "text", True, "two norms per block"),
    "starcoder2": Family(lambda tf: tf.Starcoder2ForCausalLM(tf.Starcoder2Config(
        **TEXT, num_key_value_heads=2, intermediate_size=37, residual_dropout=0.0, embedding_dropout=0.0)),
        "text", True),
    "cohere": Family(lambda tf: tf.CohereForCausalLM(tf.CohereConfig(
        **TEXT, num_key_value_heads=2, intermediate_size=37)), "text", True, "LayerNorm without bias"),
    "vit": Family(lambda tf: tf.ViTForImageClassification(tf.ViTConfig(
        hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=HEADS, intermediate_size=37,
        image_size=IMAGE, patch_size=7, num_labels=5, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0)), "image", True, "patch convolution, CLS token, position table"),
    "modernbert": Family(lambda tf: tf.ModernBertForMaskedLM(tf.ModernBertConfig(
        **{**TEXT, "max_position_embeddings": 64}, intermediate_size=38, cls_token_id=3, sep_token_id=4,
        embedding_dropout=0.0, mlp_dropout=0.0, attention_dropout=0.0)), "text", False, "norm after the embeddings"),
    "bert": Family(lambda tf: tf.BertForMaskedLM(tf.BertConfig(
        **{k: v for k, v in TEXT.items() if k not in ("bos_token_id", "eos_token_id")}, intermediate_size=37,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)), "text", False, "post-LN"),
    "bart": Family(lambda tf: tf.BartForConditionalGeneration(tf.BartConfig(
        vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=2, decoder_layers=2, encoder_attention_heads=HEADS,
        decoder_attention_heads=HEADS, encoder_ffn_dim=37, decoder_ffn_dim=37, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, max_position_embeddings=64, decoder_start_token_id=2, forced_eos_token_id=None,
        **TOKENS)), "seq2seq", False, "post-LN"),
    "whisper": Family(lambda tf: tf.WhisperForConditionalGeneration(tf.WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=MELS, encoder_layers=2, decoder_layers=2, encoder_attention_heads=HEADS,
        decoder_attention_heads=HEADS, d_model=HIDDEN, encoder_ffn_dim=37, decoder_ffn_dim=37,
        max_source_positions=FRAMES // 2, max_target_positions=16, dropout=0.0, decoder_start_token_id=1,
        suppress_tokens=None, begin_suppress_tokens=None, **TOKENS)), "audio", False,
        "encoder: a GELU between its convolutions and the stream; decoder exact"),
}


def build(name: str, seed: int = 0) -> torch.nn.Module:
    """The family's tiny model with its norms' weights moved off 1 and every bias (the norms', and each
    writer's into the residual stream) off 0, as a trained model's are, in eval mode: a centring that
    skips a writer's bias then shows."""
    from hf_powernorm.converter import is_norm_candidate

    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = FAMILIES[name].build(_tf())
    generator = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for _, module in model.named_modules():
            weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
            if is_norm_candidate(module) and isinstance(weight, torch.Tensor):
                weight.mul_(torch.empty(weight.shape).uniform_(0.5, 1.5, generator=generator).to(weight))
            if isinstance(bias, torch.nn.Parameter):
                bias.copy_(torch.randn(bias.shape, generator=generator).mul(0.3).to(bias))
    return model.eval()


def batch(name: str, seed: int = 1, labels: bool = False) -> dict:
    """Inputs of the family's kind: right-padded tokens (3, 7) with their mask (and a decoder side for
    an encoder-decoder model), or images, or mel features; `labels` for a training step."""
    generator = torch.Generator().manual_seed(seed)
    kind = FAMILIES[name].inputs
    if kind == "image":
        inputs = {"pixel_values": torch.randn(3, 3, IMAGE, IMAGE, generator=generator)}
        return {**inputs, "labels": torch.randint(0, 5, (3,), generator=generator)} if labels else inputs
    ids = torch.randint(5, VOCAB, (3, SEQ), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 5:], mask[2, 3:] = 0, 0
    ids = ids.masked_fill(mask == 0, 0)
    if kind == "audio":
        inputs = {"input_features": torch.randn(3, MELS, FRAMES, generator=generator), "decoder_input_ids": ids,
                  "decoder_attention_mask": mask}
    else:
        inputs = {"input_ids": ids, "attention_mask": mask}
        if kind == "seq2seq":
            inputs["decoder_input_ids"] = torch.randint(5, VOCAB, (3, SEQ - 2), generator=generator)
    if labels:
        inputs["labels"] = ids.masked_fill(mask == 0, -100) if kind in ("text", "audio") else inputs.pop(
            "decoder_input_ids")
    return inputs


def real_logits(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    """The logits of the real positions, `(positions, classes)`: every position of an image or of a
    sequence-to-sequence decoder side, the unpadded ones of a token sequence."""
    logits = model(**inputs).logits.detach().double()
    mask = inputs.get("decoder_attention_mask", inputs.get("attention_mask") if "decoder_input_ids" not in inputs
                      else None)
    if mask is None or logits.dim() != 3:
        return logits.reshape(-1, logits.shape[-1])
    return logits[mask.bool()]


def relative_change(model: torch.nn.Module, expected: list[torch.Tensor], held_out: list[dict]) -> float:
    """The largest change of the real logits over `held_out` from `expected`, relative to their RMS."""
    with torch.no_grad():
        outputs = [real_logits(model, inputs) for inputs in held_out]
    change = max(float((out - ref).abs().max()) for out, ref in zip(outputs, expected))
    return change / float(torch.cat(expected).square().mean().sqrt())


def convert(name: str, norm_type: str, centre_stream: bool = True, seed: int = 0):
    """The family's tiny model converted with `preserve_function` on two calibration batches, and its report."""
    from hf_powernorm import convert_norms
    from transformers.utils import logging as hf_logging

    model = build(name, seed)
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            report = convert_norms(model, norm_type, preserve_function=True, centre_stream=centre_stream,
                                   calibration_batches=[batch(name, seed + 2), batch(name, seed + 3)])
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    return model.eval(), report


def measure(name: str, seeds: int = 1) -> dict:
    """The table's row of one family: worst figures over `seeds` models."""
    held_out = [batch(name, seed) for seed in (100, 101, 102)]
    row = {"before": 0.0, "powernorm": 0.0, "rmsnorm": 0.0, "offcentre": 0.0, "exact": True}
    for seed in range(seeds):
        source = build(name, seed)
        with torch.no_grad():
            expected = [real_logits(source, inputs) for inputs in held_out]
        for column, norm_type, centre in (("before", "powernorm", False), ("powernorm", "powernorm", True),
                                          ("rmsnorm", "rmsnorm", True)):
            model, report = convert(name, norm_type, centre, seed)
            row[column] = max(row[column], relative_change(model, expected, held_out))
            if centre:
                row["exact"] = row["exact"] and report.preserves_function
                row["offcentre"] = max([row["offcentre"], *(ratio or 0.0 for _, ratio in report.approximate)])
    return row


def table(seeds: int = 1) -> str:
    header = ["family", "model class", "result", "largest fitted mean / RMS", "PN, fitted (before)",
              "PN, centred", "RMSNorm, centred", "notes"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, family in FAMILIES.items():
        row = measure(name, seeds)
        cells = [name, type(build(name)).__name__, "exact" if row["exact"] else "approximate",
                 "-" if row["exact"] else f"{row['offcentre']:.2g}", f"{row['before']:.2g}", f"{row['powernorm']:.2g}",
                 f"{row['rmsnorm']:.2g}", family.note]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="models per family; the table shows the worst")
    args = parser.parse_args(argv)
    command = "python -m hf_powernorm.benchmarks.conversion_families " + " ".join(
        argv if argv is not None else sys.argv[1:])
    text = (f"`{command.strip()}` (torch {torch.__version__}, transformers {_tf().__version__}): largest logit "
            f"change over real tokens / logits' RMS, worst of {args.seeds} seeds\n\n{table(args.seeds)}")
    print(text)
    return text


if __name__ == "__main__":
    main()

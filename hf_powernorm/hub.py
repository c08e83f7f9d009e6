"""Model cards and Hub uploads for the PowerNorm Transformer family.

`render_model_card` fills `model_cards/powernorm_transformer.md` (YAML metadata: license, language,
tags, datasets, metrics; a body with the norm configuration, how to load the model with
`trust_remote_code=True`, the training command and results when known); `render_conversion_card`
the card of a Transformers model whose norms `convert_norms` replaced. `push_to_hub` uploads in one
commit what `save_pretrained` writes (weights with every running statistic, config, code files), the
tokenizer files when given, and the card of either kind, after every check (the card renders, the
model saves with its weights) and only then creating the repository; `upload_saved_model` uploads a
folder where they were written already (a training recipe's export).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from huggingface_hub import CommitInfo, CommitOperationAdd, EvalResult, HfApi, ModelCard, ModelCardData

from .configuration_powernorm import NORM_SITES, PowerNormTransformerConfig
from .converter import CONVERSION_CONFIG_KEY, causal_norms, mixes_positions
from .modeling_converted import auto_class_name as transformers_auto_class_name
from .modeling_converted import original_class
from .modeling_powernorm import AUTO_CLASSES
from .normalization import NORM_CLASSES

# Installed from a wheel the templates sit inside the package; in a source tree, at its top.
_TEMPLATE_DIRS = (Path(__file__).resolve().parent / "model_cards", Path(__file__).resolve().parents[1] / "model_cards")
TEMPLATE_PATH = next((d for d in _TEMPLATE_DIRS if d.is_dir()), _TEMPLATE_DIRS[-1]) / "powernorm_transformer.md"

# class name -> (task, pipeline tag, usage snippet); the Auto class is `auto_class_name`'s
_HEADS: dict[str, tuple[str, str | None, str]] = {
    "PowerNormTransformerForConditionalGeneration": (
        "translation", "translation",
        "```python\ngenerated = model.generate(input_ids, attention_mask=attention_mask, num_beams=5, "
        "length_penalty=1.0)\n```",
    ),
    "PowerNormTransformerForCausalLM": (
        "text-generation", "text-generation",
        "```python\nfrom transformers import pipeline\n\ngenerator = pipeline(\"text-generation\", model=model, "
        "tokenizer=tokenizer)\ngenerator(\"The old teacher\", max_new_tokens=50)[0][\"generated_text\"]  "
        "# the prompt, continued\n```",
    ),
    "PowerNormTransformerForSequenceClassification": (
        "text-classification", "text-classification",
        "```python\nlabels = model(input_ids, attention_mask=attention_mask).logits.argmax(-1)\n```",
    ),
    "PowerNormTransformerModel": (
        "feature-extraction", "feature-extraction",
        "```python\nhidden = model(input_ids, decoder_input_ids=decoder_input_ids).last_hidden_state\n```",
    ),
}

_NORM_OPTIONS = ("normalize_before", "powernorm_alpha_fwd", "powernorm_alpha_bkw", "powernorm_warmup_steps",
                 "powernorm_group_num", "powernorm_backward_denominator", "powernorm_sync_stats", "norm_eps")


def auto_class_name(model: Any) -> str:
    """The Auto class that builds `model`: a PowerNorm Transformer head's from `AUTO_CLASSES`, another
    Transformers model's (converted or not) from Transformers' own mappings (`AutoModel` where none
    holds it)."""
    ours = {cls.__name__: auto for auto, cls in AUTO_CLASSES.items()}
    if type(model).__name__ in ours:
        return ours[type(model).__name__]
    return transformers_auto_class_name(original_class(type(model)))


def _norm_positions(config: PowerNormTransformerConfig, head: str) -> list[tuple[str, str]]:
    positions = []
    if head != "PowerNormTransformerForCausalLM" and config.encoder_layers:
        positions.append(("encoder (self-attention, feed-forward, final)", config.encoder_norm_type))
    if head not in ("PowerNormTransformerForSequenceClassification",) and config.decoder_layers:
        where = "self-attention, feed-forward, final" if head == "PowerNormTransformerForCausalLM" \
            else "self-attention, cross-attention, feed-forward, final"
        positions.append((f"decoder ({where})", config.decoder_norm_type))
    return positions


def _norm_options(config: PowerNormTransformerConfig, positions: list[tuple[str, str]]) -> list[tuple[str, Any]]:
    """`_NORM_OPTIONS`, and the per-site options (DyT's and Derf's initial alpha) and the embedding
    scale's where a norm of the model takes them."""
    norms = [NORM_CLASSES[norm] for _, norm in positions]
    prefixes = sorted({prefix for cls in norms for prefix in cls.site_options.values()})
    names = [*_NORM_OPTIONS, *(f"{prefix}_{site}" for prefix in prefixes for site in NORM_SITES)]
    options = [(name, getattr(config, name)) for name in names]
    learnable = sorted({norm for _, norm in positions if NORM_CLASSES[norm].learnable_embed_scale})
    if config.embed_scale_learnable is not None:
        options.append(("embed_scale_learnable", config.embed_scale_learnable))
    elif learnable:
        options.append(("embed_scale_learnable", f"None (learnable in the {' and '.join(learnable)} stacks)"))
    return options


def _elementwise_norms(positions: list[tuple[str, str]]) -> list[str]:
    """The model's norms with per-site options: the element-wise ones (DyT, Derf), without statistics."""
    return sorted({norm for _, norm in positions if NORM_CLASSES[norm].site_options})


def _running_statistics(model: Any) -> tuple[list[str], bool]:
    """The float32 buffers the model's norms keep for eval (`float32_buffers` of each), in the
    order met, and whether those norms count their steps (`num_batches_tracked`)."""
    norms = [m for m in model.modules() if isinstance(m, tuple(NORM_CLASSES.values())) and m.float32_buffers()]
    names = dict.fromkeys(name for norm in norms for name in norm.float32_buffers())
    return list(names), any(hasattr(norm, "num_batches_tracked") for norm in norms)


def _causal_leak(config: PowerNormTransformerConfig) -> list[str]:
    """The decoder's norm, named for the card, when its training statistics mix the positions of a
    batch (`mixes_positions`, with the config's options): a causal model trained with it saw the future."""
    norm = config.decoder_norm_type
    if not mixes_positions(norm, config.norm_kwargs(norm)):
        return []
    mixing_options = NORM_CLASSES[norm].mixing_options
    return [f"`{norm}`" + (f" while its {' / '.join(mixing_options)} last" if mixing_options else "")]


def _architecture(model: Any, config: PowerNormTransformerConfig, head: str) -> list[tuple[str, Any]]:
    rows = []
    if head != "PowerNormTransformerForCausalLM":
        rows.append(("encoder layers", config.encoder_layers))
    if head != "PowerNormTransformerForSequenceClassification":
        rows.append(("decoder layers", config.decoder_layers))
    rows += [("hidden size", config.hidden_size), ("feed-forward size", config.intermediate_size),
             ("attention heads", config.num_attention_heads), ("vocabulary", config.vocab_size),
             ("positions", config.position_embedding_type), ("activation", config.activation_function),
             ("tied embeddings", config.tie_word_embeddings)]
    if hasattr(model, "num_parameters"):
        rows.append(("parameters", f"{model.num_parameters():,}"))
    return rows


def _as_list(value: str | list[str] | None) -> list[str] | None:
    return [value] if isinstance(value, str) else value


def _card_data(
    repo_id: str,
    task: str,
    pipeline_tag: str | None,
    license: str,
    language: str | list[str] | None,
    datasets: str | list[str] | None,
    results: dict[str, float] | None,
    tags: list[str] | None,
) -> ModelCardData:
    """The YAML metadata; results on a named dataset also go into a `model-index` entry."""
    dataset_list = _as_list(datasets)
    eval_results = None
    if results and dataset_list:
        eval_results = [EvalResult(task_type=task, dataset_type=dataset_list[0], dataset_name=dataset_list[0],
                                   metric_type=name, metric_value=value) for name, value in results.items()]
    extra_tags = [tag for tag in (tags or []) if tag not in ("powernorm", "custom_code")]
    return ModelCardData(
        license=license, language=_as_list(language), datasets=dataset_list,
        metrics=sorted(results) if results else None, library_name="transformers", pipeline_tag=pipeline_tag,
        tags=["powernorm", "custom_code", *extra_tags], model_name=repo_id.split("/")[-1],
        eval_results=eval_results,
    )


# Over 50 lines: its signature and docstring name eleven arguments; the code is 22 lines.
def render_model_card(
    model: Any,
    *,
    repo_id: str,
    license: str = "apache-2.0",
    language: str | list[str] | None = None,
    datasets: str | list[str] | None = None,
    results: dict[str, float] | None = None,
    training_command: str | None = None,
    description: str | None = None,
    tags: list[str] | None = None,
    with_tokenizer: bool = False,
    template_path: str | Path | None = None,
) -> ModelCard:
    """The card of `model` (a PowerNorm Transformer head) for the Hub repository `repo_id`.

    Args:
        model (`PowerNormTransformerPreTrainedModel`):
            The head the card describes (its task, norms, running statistics and architecture).
        repo_id (`str`):
            The Hub repository, `owner/name`; its last part names the model.
        license (`str`, *optional*, defaults to `"apache-2.0"`), language, datasets, tags:
            The card's metadata.
        results (`dict[str, float]`, *optional*):
            Metric names to values (e.g. `{"bleu": 35.4}`): the card's `metrics`, a results table and,
            with `datasets`, a `model-index` entry.
        training_command (`str`, *optional*):
            The command that trained the model, shown in the card.
        description (`str`, *optional*):
            The card's opening text; by default one line naming the task.
        with_tokenizer (`bool`, *optional*, defaults to `False`):
            The repository holds tokenizer files, and the card shows how to load them.
        template_path (`str` or `Path`, *optional*):
            A card template in place of `TEMPLATE_PATH`.
    """
    head = type(model).__name__
    if head not in _HEADS:
        raise ValueError(f"render_model_card expects a PowerNorm Transformer model, got {head}")
    task, pipeline_tag, usage = _HEADS[head]
    card_data = _card_data(repo_id, task, pipeline_tag, license, language, datasets, results, tags)
    facts = _model_facts(model, head)
    template = Path(template_path) if template_path is not None else TEMPLATE_PATH
    if not template.is_file():
        raise FileNotFoundError(f"model card template {template} not found; pass template_path=")
    return ModelCard.from_template(
        card_data,
        template_str=template.read_text(encoding="utf-8"),
        model_name=repo_id.split("/")[-1],
        repo_id=repo_id,
        description=description or f"A PowerNorm Transformer for {task}.",
        task=task,
        usage=usage,
        with_tokenizer=with_tokenizer,
        training_command=training_command,
        results=sorted(results.items()) if results else None,
        **facts,
    )


def _model_facts(model: Any, head: str) -> dict[str, Any]:
    """The card template's variables that describe `model` itself: its auto class, norms and their
    options, running statistics, architecture and what leaks across positions."""
    config = model.config
    positions = _norm_positions(config, head)
    causal_leak = _causal_leak(config) if head == "PowerNormTransformerForCausalLM" else []
    statistics, counted = _running_statistics(model)
    return {
        "auto_class": auto_class_name(model),
        "norm_positions": positions,
        "norm_options": _norm_options(config, positions),
        "elementwise_norms": ", ".join(f"`{norm}`" for norm in _elementwise_norms(positions)),
        "norms_folded": config.norms_folded,
        "running_statistics": ", ".join(f"`{name}`" for name in statistics),
        "step_counters": counted,
        "architecture": _architecture(model, config, head),
        "causal_leak": ", ".join(causal_leak),
        "causal_norms": causal_norms(),
    }


def render_conversion_card(
    model: Any,
    *,
    repo_id: str = "PATH",
    results: dict[str, float] | None = None,
    description: str | None = None,
    training_command: str | None = None,
) -> str:
    """The card of a Transformers model whose norms `convert_norms` replaced: what was converted, how
    to load it with its statistics (`load_converted`), the training command and the scores.

    Args:
        model (`PreTrainedModel`):
            A model converted by `convert_norms` (its `config.powernorm_conversion`).
        repo_id (`str`, *optional*, defaults to `"PATH"`):
            The repository or folder the card's loading code names.
        results (`dict[str, float]`, *optional*):
            Metric names to values, the card's results table.
        description (`str`, *optional*):
            The card's opening text.
        training_command (`str`, *optional*):
            The command that trained the model.
    """
    conversion, name = getattr(model.config, CONVERSION_CONFIG_KEY), type(model).__name__
    auto = auto_class_name(model)
    lines = ["---", "license: apache-2.0", "library_name: transformers", "tags:", "- powernorm", "- normalization",
             "---", "", f"# {repo_id}", "", description or "",
             "", f"`{name}` ({model.config.model_type}) whose {len(conversion['modules'])} per-token norms "
             f"`hf_powernorm.convert_norms` replaced by `{conversion['norm_type']}` (options "
             f"`{conversion['options']}`); `model.safetensors` holds their running statistics.", "",
             "## How to load it", "", "```python", f"from transformers import {auto}", "",
             f'model = {auto}.from_pretrained("{repo_id}", trust_remote_code=True)', "```", "",
             "The folder carries the code that rebuilds the converted norms (`modeling_converted.py` and the "
             "files it imports) and a model type of its own, so loading without `trust_remote_code=True` "
             "raises instead of building the original norms. With `hf_powernorm` installed, "
             f'`hf_powernorm.load_converted("{repo_id}", {auto})` loads it with the installed code.', "",
             "## Training", "", "```bash", training_command or "(not recorded)", "```", "",
             "## Results", "", "| Metric | Value |", "|---|---|",
             *(f"| {k} | {v} |" for k, v in sorted((results or {}).items()))]
    return "\n".join(lines) + "\n"


def push_to_hub(
    model: Any,
    repo_id: str,
    *,
    tokenizer: Any | None = None,
    card: ModelCard | None = None,
    commit_message: str = "Upload PowerNorm Transformer",
    private: bool | None = None,
    token: str | None = None,
    revision: str | None = None,
    create_pr: bool = False,
    **card_options: Any,
) -> CommitInfo:
    """Upload model, code files, tokenizer and card to `repo_id` in one commit, creating the repository
    if needed, after every check: the card renders, the model and tokenizer save, the folder holds
    weights. A failed check leaves no repository behind.

    Args:
        model (`PreTrainedModel`):
            A PowerNorm Transformer head (its card: `render_model_card`) or a Transformers model whose
            norms `convert_norms` replaced (`render_conversion_card`).
        repo_id (`str`):
            The Hub repository, created if it does not exist.
        tokenizer (*optional*):
            A tokenizer saved beside the model.
        card (`ModelCard`, *optional*):
            A ready card, in place of the rendered one.
        commit_message, private, token, revision, create_pr:
            As `huggingface_hub.HfApi.create_repo` and `create_commit` take them.
        card_options:
            Passed to the card's function (license, language, datasets, results, training_command,
            ...) unless `card` is given.
    """
    render = _card_renderer(model, tokenizer, card, card_options)
    rendered = render(repo_id)
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
        _files_to_upload(Path(folder), repo_id)
        created = HfApi(token=token).create_repo(repo_id, private=private, exist_ok=True).repo_id
        (rendered if created == repo_id else render(created)).save(os.path.join(folder, "README.md"))
        return upload_saved_model(folder, created, commit_message=commit_message, token=token, revision=revision,
                                  create_pr=create_pr)


def _card_renderer(model: Any, tokenizer: Any | None, card: ModelCard | None,
                   options: dict[str, Any]) -> Callable[[str], ModelCard]:
    """`repo_id -> card` for `push_to_hub`; ValueError for a model neither card describes."""
    if card is not None:
        return lambda repo_id: card
    if type(model).__name__ in _HEADS:
        return lambda repo_id: render_model_card(model, repo_id=repo_id, with_tokenizer=tokenizer is not None,
                                                 **options)
    if isinstance(getattr(getattr(model, "config", None), CONVERSION_CONFIG_KEY, None), dict):
        return lambda repo_id: ModelCard(render_conversion_card(model, repo_id=repo_id, **options))
    raise ValueError(f"push_to_hub expects a PowerNorm Transformer model or a Transformers model converted by "
                     f"convert_norms (config.{CONVERSION_CONFIG_KEY}), got {type(model).__name__}")


def _files_to_upload(folder: Path, repo_id: str) -> list[Path]:
    """The files at the top of `folder` but hidden ones; FileNotFoundError when no `.safetensors` weights
    are among them, ValueError when a symbolic link is (what it points to, a token file say, is never sent)."""
    entries = sorted(path for path in folder.iterdir() if not path.name.startswith("."))
    links = [path.name for path in entries if path.is_symlink()]
    if links:
        raise ValueError(f"{folder} holds symbolic links ({', '.join(links)}): an upload sends regular files only; "
                         f"put the files themselves there, or remove the links")
    files = [path for path in entries if path.is_file()]
    if not any(path.name.endswith(".safetensors") for path in files):
        raise FileNotFoundError(f"{folder} holds no .safetensors weights: nothing to upload to {repo_id}")
    return files


def upload_saved_model(
    folder: str | Path,
    repo_id: str,
    *,
    commit_message: str = "Upload PowerNorm Transformer",
    token: str | None = None,
    revision: str | None = None,
    create_pr: bool = False,
) -> CommitInfo:
    """Upload in one commit the files at the top of `folder` (what `save_pretrained`, a tokenizer's
    `save_pretrained` and the card wrote there), leaving its sub-folders (checkpoints, logs) and
    hidden files (the lock of the run writing it) out; a symbolic link there is refused, not followed.

    Args:
        folder (`str` or `Path`):
            The saved model's folder.
        repo_id (`str`):
            The Hub repository, which must exist.
        commit_message, token, revision, create_pr:
            As `huggingface_hub.HfApi.create_commit` takes them.
    """
    files = _files_to_upload(Path(folder), repo_id)
    operations = [CommitOperationAdd(path_in_repo=path.name, path_or_fileobj=str(path)) for path in files]
    return HfApi(token=token).create_commit(repo_id, operations, commit_message=commit_message, revision=revision,
                                            create_pr=create_pr)


__all__ = ["TEMPLATE_PATH", "auto_class_name", "push_to_hub", "render_conversion_card", "render_model_card",
           "upload_saved_model"]

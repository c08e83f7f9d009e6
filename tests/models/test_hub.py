"""Model cards and what `push_to_hub` sends, without a network: the Hub API calls are patched.

No Hub server is reachable from the tests: `HfApi.create_repo` and `HfApi.create_commit` are
replaced by the `hub` recorder of `conftest.py`, and the recorded files are checked (and loaded back from a Hub cache
layout with `HF_HUB_OFFLINE=1`).
"""

import copy
import io
import json
import pathlib
import shutil
from unittest import mock

import pytest
import torch
import yaml
from huggingface_hub import ModelCard
from safetensors.torch import load as load_safetensors
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForSeq2SeqLM, PreTrainedTokenizerFast

from hf_powernorm import (
    NORM_CLASSES,
    PowerNormTransformerConfig,
    PowerNormTransformerForCausalLM,
    PowerNormTransformerForConditionalGeneration,
    PowerNormTransformerForSequenceClassification,
)
from hf_powernorm.hub import TEMPLATE_PATH, push_to_hub, render_model_card
from hf_powernorm.modeling_powernorm import RUNNING_BUFFERS

REPO_ID = "powernorm-test/tiny-iwslt"
COMMAND = "accelerate launch recipes/translation.py --preset iwslt14-small --max_steps 50000"


pytestmark = pytest.mark.usefixtures("one_thread")


def trained_seq2seq() -> PowerNormTransformerForConditionalGeneration:
    torch.manual_seed(0)
    model = PowerNormTransformerForConditionalGeneration(
        PowerNormTransformerConfig.from_preset("tiny", powernorm_warmup_steps=2))
    for step in range(3):
        input_ids = torch.randint(3, 99, (3, 7), generator=torch.Generator().manual_seed(step))
        model(input_ids=input_ids, labels=input_ids).loss.backward()
    return model.eval()


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": i + 4 for i in range(95)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>")


def front_matter(card: ModelCard) -> dict:
    return yaml.safe_load(str(card).split("---")[1])


# ---------------------------------------------------------------------------------------------
# Cards


def test_card_metadata_and_body_for_translation():
    card = render_model_card(trained_seq2seq(), repo_id=REPO_ID, language=["de", "en"], datasets="iwslt14",
                             results={"bleu": 35.4}, training_command=COMMAND, tags=["translation"])
    meta = front_matter(card)
    assert meta["license"] == "apache-2.0"
    assert meta["language"] == ["de", "en"]
    assert meta["datasets"] == ["iwslt14"] and meta["metrics"] == ["bleu"]
    assert "powernorm" in meta["tags"] and "translation" in meta["tags"]
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "translation"
    assert meta["model-index"][0]["results"][0]["metrics"][0] == {"type": "bleu", "value": 35.4}
    body = card.text
    assert "| encoder (self-attention, feed-forward, final) | `powernorm` |" in body
    assert "cross-attention, feed-forward, final) | `layernorm` |" in body
    assert "| `powernorm_warmup_steps` | `2` |" in body and "| `powernorm_group_num` | `4` |" in body
    assert f'AutoModelForSeq2SeqLM.from_pretrained("{REPO_ID}", trust_remote_code=True)' in body
    assert COMMAND in body and "| bleu | 35.4 |" in body
    assert "running_phi" in body


def test_card_without_results_or_command_says_so():
    model = PowerNormTransformerForSequenceClassification(
        PowerNormTransformerConfig.from_preset("tiny", num_labels=3))
    card = render_model_card(model, repo_id="org/sentiment", language="en", datasets="financial_phrasebank")
    meta = front_matter(card)
    assert meta["pipeline_tag"] == "text-classification" and "metrics" not in meta
    assert "The training command was not recorded." in card.text
    assert "No results were recorded" in card.text
    assert "AutoModelForSequenceClassification" in card.text and "decoder (" not in card.text
    assert "AutoTokenizer" not in card.text  # no tokenizer files to load


def training_sees_the_future(model) -> bool:
    """Change the last token of a batch: do the training-mode logits of earlier positions change?"""
    input_ids = torch.randint(3, 99, (3, 7), generator=torch.Generator().manual_seed(0))
    changed = input_ids.clone()
    changed[:, -1] = (changed[:, -1] + 7) % 99
    before = copy.deepcopy(model).train()(input_ids=input_ids).logits[:, :-1]
    after = copy.deepcopy(model).train()(input_ids=changed).logits[:, :-1]
    return not torch.allclose(before, after, atol=1e-6, rtol=0)


@pytest.mark.parametrize("norm, overrides", [(norm, {}) for norm in sorted(NORM_CLASSES)]
                         + [("powernorm", {"powernorm_warmup_steps": 2})])
def test_causal_card_warns_when_training_sees_the_future(norm, overrides):
    torch.manual_seed(0)
    model = PowerNormTransformerForCausalLM(PowerNormTransformerConfig.from_preset(
        "tiny", decoder_norm_type=norm, is_encoder_decoder=False, **overrides))
    card = render_model_card(model, repo_id="org/lm")
    warns = "mix\nfuture tokens" in card.text
    assert warns is training_sees_the_future(model)
    statistics = NORM_CLASSES[norm].float32_buffers()
    if statistics:
        listed = ", ".join(f"`{name}`" for name in statistics)
        assert f"the running statistics of the norms ({listed};\nfloat32) and their step counters" in card.text
    else:
        assert "The norms keep no running statistic: the checkpoint holds weights only." in card.text
    assert "encoder (" not in card.text and front_matter(card)["pipeline_tag"] == "text-generation"


def test_auto_class_name_of_every_head_and_of_a_converted_model():
    from transformers import BartConfig, BartForConditionalGeneration, GPT2Config, GPT2LMHeadModel

    from hf_powernorm.hub import auto_class_name
    from hf_powernorm.modeling_powernorm import AUTO_CLASSES

    config = PowerNormTransformerConfig.from_preset("tiny")
    with torch.device("meta"):
        for auto, cls in AUTO_CLASSES.items():
            assert auto_class_name(cls(config)) == auto
        assert auto_class_name(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2))) == "AutoModelForCausalLM"
        bart = BartForConditionalGeneration(BartConfig(encoder_layers=1, decoder_layers=1, d_model=8,
                                                       encoder_attention_heads=2, decoder_attention_heads=2))
        assert auto_class_name(bart) == "AutoModelForSeq2SeqLM"


def test_card_of_a_folded_model_says_it_is_for_inference_only():
    model = trained_seq2seq()
    model.fold_norms()
    assert "inference only" in render_model_card(model, repo_id=REPO_ID).text


def test_card_comes_from_the_model_cards_template(tmp_path):
    assert TEMPLATE_PATH.parent.name == "model_cards" and TEMPLATE_PATH.is_file()
    custom = tmp_path / "card.md"
    custom.write_text("---\n{{ card_data }}\n---\n# {{ model_name }} ({{ task }})\n")
    card = render_model_card(trained_seq2seq(), repo_id=REPO_ID, template_path=custom)
    assert card.text.strip() == "# tiny-iwslt (translation)"
    with pytest.raises(FileNotFoundError, match="missing.md"):
        render_model_card(trained_seq2seq(), repo_id=REPO_ID, template_path=tmp_path / "missing.md")
    with pytest.raises(ValueError, match="PowerNorm Transformer"):
        render_model_card(torch.nn.Linear(2, 2), repo_id=REPO_ID)


# ---------------------------------------------------------------------------------------------
# Uploads


def test_push_to_hub_sends_weights_buffers_config_code_tokenizer_and_card(hub, tmp_path):
    model = trained_seq2seq()
    push_to_hub(model, REPO_ID, tokenizer=tiny_tokenizer(), private=True, language=["de", "en"],
                datasets="iwslt14", results={"bleu": 35.4}, training_command=COMMAND)
    assert hub.repos == [(REPO_ID, {"private": True, "exist_ok": True})]
    assert len(hub.commits) == 1
    commit = hub.commits[0]
    files = commit["files"]
    assert commit["repo_id"] == REPO_ID and commit["commit_message"] == "Upload PowerNorm Transformer"
    assert {"model.safetensors", "config.json", "generation_config.json", "configuration_powernorm.py",
            "modeling_powernorm.py", "normalization.py", "README.md", "tokenizer.json",
            "tokenizer_config.json"} <= set(files)
    weights = load_safetensors(files["model.safetensors"])
    buffers = {k: v for k, v in model.named_buffers() if k.rsplit(".", 1)[-1] in RUNNING_BUFFERS}
    assert buffers
    for name, buffer in buffers.items():
        assert torch.equal(weights[name], buffer), name
    config = json.loads(files["config.json"])
    assert config["model_type"] == "powernorm_transformer" and len(config["auto_map"]) == 5
    card = ModelCard(files["README.md"].decode())
    assert "powernorm" in card.data.tags and card.data.license == "apache-2.0"
    assert COMMAND in card.text
    assert f'AutoTokenizer.from_pretrained("{REPO_ID}", trust_remote_code=False)' in card.text
    assert "compiles PowerNorm's C kernels" in card.text and "`HF_POWERNORM_KERNELS=0`" in card.text

    # What was sent loads back from a Hub cache layout, offline, by repository id.
    snapshot = tmp_path / "hub" / "models--powernorm-test--tiny-iwslt" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (tmp_path / "hub" / "models--powernorm-test--tiny-iwslt" / "refs").mkdir()
    (tmp_path / "hub" / "models--powernorm-test--tiny-iwslt" / "refs" / "main").write_text("0" * 40)
    for name, content in files.items():
        (snapshot / name).write_bytes(content)
    loaded = AutoModelForSeq2SeqLM.from_pretrained(REPO_ID, cache_dir=tmp_path / "hub", trust_remote_code=True)
    input_ids = torch.randint(3, 99, (2, 5), generator=torch.Generator().manual_seed(7))
    assert torch.equal(loaded(input_ids=input_ids, decoder_input_ids=input_ids).logits,
                       model(input_ids=input_ids, decoder_input_ids=input_ids).logits)
    shutil.rmtree(tmp_path / "hub")


def test_a_given_card_is_sent_as_is(hub):
    card = ModelCard("---\nlicense: mit\ntags:\n- powernorm\n---\n# Custom\n")
    push_to_hub(trained_seq2seq(), REPO_ID, card=card, commit_message="v2", revision="dev")
    commit = hub.commits[0]
    assert commit["files"]["README.md"].decode().endswith("# Custom\n")
    assert commit["commit_message"] == "v2" and commit["revision"] == "dev"
    assert "tokenizer.json" not in commit["files"]


def test_transformers_push_to_hub_also_sends_buffers_and_code_files(hub):
    """`model.push_to_hub` (Transformers' own) uploads the same checkpoint, with a generic card."""
    model = trained_seq2seq()
    generic = ModelCard("---\nlibrary_name: transformers\n---\n")
    with mock.patch("transformers.utils.hub.create_and_tag_model_card", return_value=generic):
        model.push_to_hub(REPO_ID)
    files = hub.commits[0]["files"]
    assert {"modeling_powernorm.py", "configuration_powernorm.py", "normalization.py"} <= set(files)
    weights = load_safetensors(files["model.safetensors"])
    assert torch.equal(weights["model.encoder.layers.0.ffn_norm.running_phi"],
                       model.model.encoder.layers[0].ffn_norm.running_phi)
    assert io.BytesIO(files["config.json"]).read().count(b"auto_map") == 1


# ---------------------------------------------------------------------------------------------
# Converted models, and checks before the repository exists


def converted_llama():
    import warnings

    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_powernorm import convert_norms

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=37, pad_token_id=0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        convert_norms(model, "powernorm")
    model.train()(input_ids=torch.randint(3, 99, (3, 7), generator=torch.Generator().manual_seed(1)))
    return model.eval()


def test_push_to_hub_sends_a_converted_model_with_its_conversion_card(hub):
    model = converted_llama()
    push_to_hub(model, REPO_ID, results={"perplexity": 12.5}, training_command=COMMAND)
    assert hub.repos == [(REPO_ID, {"private": None, "exist_ok": True})]
    files = hub.commits[0]["files"]
    assert {"model.safetensors", "config.json", "modeling_converted.py", "converted_norms.py", "normalization.py",
            "README.md"} <= set(files)
    card = files["README.md"].decode()
    assert "`hf_powernorm.convert_norms` replaced by `powernorm`" in card and "LlamaForCausalLM" in card
    assert f'AutoModelForCausalLM.from_pretrained("{REPO_ID}", trust_remote_code=True)' in card
    assert COMMAND in card and "| perplexity | 12.5 |" in card
    weights = load_safetensors(files["model.safetensors"])
    phi = {k: v for k, v in model.named_buffers() if k.endswith("running_phi")}
    assert phi and all(torch.equal(weights[k], v) for k, v in phi.items())


def test_a_repository_id_completed_by_the_hub_is_the_one_the_card_names(hub):
    with mock.patch.object(hub, "create_repo", side_effect=lambda api, repo_id, **kw: hub.__class__.create_repo(
            hub, api, f"someone/{repo_id}", **kw)):
        push_to_hub(converted_llama(), "tiny-llama")
    assert hub.commits[0]["repo_id"] == "someone/tiny-llama"
    assert 'from_pretrained("someone/tiny-llama", trust_remote_code=True)' in hub.commits[0]["files"]["README.md"].decode()


def test_an_upload_refuses_a_symbolic_link_rather_than_send_its_target(hub, tmp_path):
    from hf_powernorm.hub import upload_saved_model

    trained_seq2seq().save_pretrained(tmp_path / "export")
    (tmp_path / "token").write_text("a secret")
    (tmp_path / "export" / "x.txt").symlink_to(tmp_path / "token")
    with pytest.raises(ValueError, match=r"export holds symbolic links \(x.txt\): an upload sends regular files"):
        upload_saved_model(tmp_path / "export", REPO_ID)
    assert hub.commits == []


@pytest.mark.parametrize("case", ["not ours", "unknown option", "option of the other card", "no weights"])
def test_every_check_runs_before_the_repository_is_created(hub, case):
    model, options, error = converted_llama(), {}, TypeError
    if case == "not ours":
        model, error = torch.nn.Linear(2, 2), ValueError
    elif case == "unknown option":
        model, options = trained_seq2seq(), {"licence": "mit"}
    elif case == "option of the other card":
        options = {"language": ["en"]}  # render_model_card's, not render_conversion_card's
    else:
        error = FileNotFoundError
        model.save_pretrained = lambda folder, **kwargs: (pathlib.Path(folder) / "config.json").write_text("{}")
    with pytest.raises(error):
        push_to_hub(model, REPO_ID, **options)
    assert hub.repos == [] and hub.commits == []

"""Saved models load with `trust_remote_code=True` in a fresh process where `hf_powernorm` is absent.

One child process checks every case (a process start and the Transformers import dominate the
cost): a saved directory through every fitting Auto class, the Hugging Face cache layout of
`ORG/NAME` with `HF_HUB_OFFLINE=1`, bfloat16 loading, a folded model, and re-saving.
"""

import json
import os
import shutil
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers

from hf_powernorm import (
    PowerNormTransformerConfig,
    PowerNormTransformerForCausalLM,
    PowerNormTransformerForConditionalGeneration,
    PowerNormTransformerForSequenceClassification,
)

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO_ID = "powernorm-test/tiny-iwslt"

# Runs through conftest's `run_without_the_package`: no hf_powernorm, its own HF_HOME.
CHILD = textwrap.dedent(
    r"""
    import json
    import torch
    import transformers
    from transformers import (AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSeq2SeqLM,
                              AutoModelForSequenceClassification)

    expected = torch.load(EXPECTED, weights_only=True)
    results = {"transformers": transformers.__version__}

    def check_buffers(model, key):
        buffers = dict(model.named_buffers())
        for name, tensor in expected[key + "/buffers"].items():
            got = buffers[name]
            assert got.dtype == tensor.dtype, (key, name, got.dtype)
            assert torch.equal(got, tensor), (key, name)
        return len(expected[key + "/buffers"])

    def remote(model):
        module = type(model).__module__
        assert module.startswith("transformers_modules."), module
        return module

    # A translation directory through AutoConfig, AutoModel, AutoModelForSeq2SeqLM.
    config = AutoConfig.from_pretrained(DIRS["seq2seq"], trust_remote_code=True)
    assert type(config).__name__ == "PowerNormTransformerConfig" and config.encoder_norm_type == "powernorm"
    assert (config.powernorm_warmup_statistic, config.powernorm_warmup_ramp_steps) == ("reference", 3)
    base = AutoModel.from_pretrained(DIRS["seq2seq"], trust_remote_code=True)
    assert type(base).__name__ == "PowerNormTransformerModel"
    seq2seq = AutoModelForSeq2SeqLM.from_pretrained(DIRS["seq2seq"], trust_remote_code=True)
    results["seq2seq_module"] = remote(seq2seq)
    assert seq2seq.model.encoder.layers[0].self_attn_norm.warmup_statistic == "reference"
    results["seq2seq_buffers"] = check_buffers(seq2seq, "seq2seq")
    inputs = expected["inputs"]
    logits = seq2seq(input_ids=inputs, decoder_input_ids=inputs).logits
    assert torch.equal(logits, expected["seq2seq/logits"])
    hidden = base(input_ids=inputs, decoder_input_ids=inputs).last_hidden_state
    assert torch.equal(hidden, expected["seq2seq/hidden"])
    generated = seq2seq.generate(inputs, num_beams=3, max_new_tokens=5, do_sample=False)
    assert torch.equal(generated, expected["seq2seq/generated"])
    # The copied code reuses the cache that the installed Transformers hands it.
    assert torch.equal(seq2seq.generate(inputs, num_beams=3, max_new_tokens=5, do_sample=False, use_cache=False),
                       generated)
    # ... and its encoder into the classifier.
    classifier_from_s2s = AutoModelForSequenceClassification.from_pretrained(DIRS["seq2seq"], trust_remote_code=True)
    assert type(classifier_from_s2s).__name__ == "PowerNormTransformerForSequenceClassification"

    # bfloat16: weights cast, running statistics float32 and bit-identical.
    bf16 = AutoModelForSeq2SeqLM.from_pretrained(DIRS["seq2seq"], trust_remote_code=True, dtype=torch.bfloat16)
    assert bf16.lm_head.weight.dtype == torch.bfloat16
    check_buffers(bf16, "seq2seq")

    causal = AutoModelForCausalLM.from_pretrained(DIRS["causal"], trust_remote_code=True)
    results["causal_module"] = remote(causal)
    check_buffers(causal, "causal")
    assert torch.equal(causal(input_ids=inputs).logits, expected["causal/logits"])
    for use_cache in (True, False):
        assert torch.equal(causal.generate(inputs[:, :3], max_new_tokens=4, do_sample=False, eos_token_id=None,
                                           use_cache=use_cache), expected["causal/generated"])

    classifier = AutoModelForSequenceClassification.from_pretrained(DIRS["classifier"], trust_remote_code=True)
    check_buffers(classifier, "classifier")
    assert torch.equal(classifier(input_ids=inputs).logits, expected["classifier/logits"])

    folded = AutoModelForSeq2SeqLM.from_pretrained(DIRS["folded"], trust_remote_code=True)
    assert folded.config.norms_folded
    assert torch.allclose(folded(input_ids=inputs, decoder_input_ids=inputs).logits, expected["seq2seq/logits"],
                          atol=1e-5, rtol=1e-5)

    # From the Hub cache layout, offline, by repository id.
    hub = AutoModelForSeq2SeqLM.from_pretrained(REPO_ID, trust_remote_code=True)
    results["hub_module"] = remote(hub)
    check_buffers(hub, "seq2seq")
    assert torch.equal(hub(input_ids=inputs, decoder_input_ids=inputs).logits, expected["seq2seq/logits"])
    hub_config = AutoConfig.from_pretrained(REPO_ID, trust_remote_code=True)
    assert hub_config.model_type == "powernorm_transformer"
    hub_base = AutoModel.from_pretrained(REPO_ID, trust_remote_code=True)
    assert torch.equal(hub_base(input_ids=inputs, decoder_input_ids=inputs).last_hidden_state,
                       expected["seq2seq/hidden"])

    # A remote-code model saves again with its code files.
    seq2seq.save_pretrained(RESAVE)
    import os
    results["resaved"] = sorted(os.listdir(RESAVE))
    print("RESULTS " + json.dumps(results))
    """
)


pytestmark = pytest.mark.usefixtures("one_thread")


def _trained(model, steps: int = 3):
    torch.manual_seed(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model.train()
    for step in range(steps):
        input_ids = torch.randint(3, 99, (3, 7), generator=torch.Generator().manual_seed(step))
        labels = torch.tensor([0, 1, 0]) if isinstance(model, PowerNormTransformerForSequenceClassification) \
            else input_ids
        model(input_ids=input_ids, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval()


def _buffers(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.named_buffers()}


def _hub_cache(hf_home, saved_dir) -> None:
    """`hub/models--ORG--NAME/refs/main` holds the commit, `snapshots/<commit>/` the files."""
    repo = hf_home / "hub" / ("models--" + REPO_ID.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    shutil.copytree(saved_dir, repo / "snapshots" / COMMIT)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote")
    inputs = torch.randint(3, 99, (3, 7), generator=torch.Generator().manual_seed(42))
    expected = {"inputs": inputs}
    dirs = {}
    seq2seq_config = PowerNormTransformerConfig.from_preset("tiny", powernorm_warmup_steps=2,
                                                            powernorm_warmup_statistic="reference",
                                                            powernorm_warmup_ramp_steps=3)
    models = {
        "seq2seq": PowerNormTransformerForConditionalGeneration(seq2seq_config),
        "causal": PowerNormTransformerForCausalLM(
            PowerNormTransformerConfig.from_preset("tiny", decoder_norm_type="powernorm", is_encoder_decoder=False)),
        "classifier": PowerNormTransformerForSequenceClassification(
            PowerNormTransformerConfig.from_preset("tiny", encoder_norm_type="batchnorm", num_labels=2)),
    }
    for key, model in models.items():
        _trained(model)
    with torch.no_grad():
        for key, model in models.items():
            dirs[key] = str(root / key)
            model.save_pretrained(dirs[key])
            expected[key + "/buffers"] = _buffers(model)
        seq2seq = models["seq2seq"]
        expected["seq2seq/logits"] = seq2seq(input_ids=inputs, decoder_input_ids=inputs).logits
        expected["seq2seq/hidden"] = seq2seq.model(input_ids=inputs, decoder_input_ids=inputs).last_hidden_state
        expected["seq2seq/generated"] = seq2seq.generate(inputs, num_beams=3, max_new_tokens=5, do_sample=False)
        expected["causal/logits"] = models["causal"](input_ids=inputs).logits
        expected["causal/generated"] = models["causal"].generate(inputs[:, :3], max_new_tokens=4, do_sample=False,
                                                                  eos_token_id=None)
        expected["classifier/logits"] = models["classifier"](input_ids=inputs).logits
        folded = PowerNormTransformerForConditionalGeneration(seq2seq_config)
        folded.load_state_dict(seq2seq.state_dict())
        folded.eval().fold_norms()
        dirs["folded"] = str(root / "folded")
        folded.save_pretrained(dirs["folded"])
    torch.save(expected, root / "expected.pt")
    return root, dirs, models


def test_copied_code_requires_no_optional_package(saved):
    """Transformers refuses remote code whose files import a package that is not installed (unless the
    import sits in a `try` block): the copied files may require torch and transformers only, so a
    machine without Triton loads a saved model."""
    from transformers.dynamic_module_utils import get_imports

    root, dirs, _ = saved
    files = sorted({path for folder in dirs.values() for path in Path(folder).glob("*.py")})
    assert any(path.name == "kernels_triton.py" for path in files)
    for path in files:
        packages = set(get_imports(path)) - set(sys.stdlib_module_names)
        assert packages <= {"torch", "transformers", "safetensors", "huggingface_hub"}, (path.name, packages)


def test_save_pretrained_copies_how_the_norms_run_beside_what_they_compute(saved):
    """`normalization.py` imports `norm_dispatch.py`, the only importer of the kernel files: all four
    travel with every checkpoint, and the C and C++ sources that `kernels_cpu.py` imports with them."""
    _, dirs, _ = saved
    for key in ("seq2seq", "causal", "classifier", "folded"):
        files = set(os.listdir(dirs[key]))
        assert {"normalization.py", "norm_dispatch.py", "kernels_cpu.py", "kernels_triton.py", "kernels_cpu_source.py",
                "kernels_cpu_operator_source.py"} <= files, key

def test_save_pretrained_writes_code_files_and_full_auto_map(saved):
    _, dirs, _ = saved
    for key in ("seq2seq", "causal", "classifier", "folded"):
        files = set(os.listdir(dirs[key]))
        assert {"config.json", "model.safetensors", "configuration_powernorm.py", "modeling_powernorm.py",
                "normalization.py"} <= files, key
        auto_map = json.loads(open(os.path.join(dirs[key], "config.json")).read())["auto_map"]
        assert auto_map == {
            "AutoConfig": "configuration_powernorm.PowerNormTransformerConfig",
            "AutoModel": "modeling_powernorm.PowerNormTransformerModel",
            "AutoModelForSeq2SeqLM": "modeling_powernorm.PowerNormTransformerForConditionalGeneration",
            "AutoModelForCausalLM": "modeling_powernorm.PowerNormTransformerForCausalLM",
            "AutoModelForSequenceClassification": "modeling_powernorm.PowerNormTransformerForSequenceClassification",
        }
    modeling = open(os.path.join(dirs["seq2seq"], "modeling_powernorm.py")).read()
    assert "hf_powernorm" not in modeling.replace("hf_powernorm.", "")  # only relative imports


def test_fresh_process_without_the_package_loads_directory_and_hub_cache(saved, tmp_path, monkeypatch,
                                                                        run_without_the_package):
    root, dirs, _ = saved
    # What evaluate, datasets and transformers leave on this process's path once they have loaded a
    # module: a dynamic-module cache, here holding an unrelated `transformers_modules` package. It
    # must not reach the child, whose own `transformers_modules` it would shadow.
    stale_cache = tmp_path / "stale_modules_cache"
    (stale_cache / "transformers_modules" / "other").mkdir(parents=True)
    (stale_cache / "__init__.py").touch()
    (stale_cache / "transformers_modules" / "__init__.py").touch()
    monkeypatch.syspath_prepend(str(stale_cache))
    hf_home = tmp_path / "hf_home"
    _hub_cache(hf_home, dirs["seq2seq"])
    header = (f"EXPECTED = {str(root / 'expected.pt')!r}\nDIRS = {dirs!r}\nREPO_ID = {REPO_ID!r}\n"
              f"RESAVE = {str(tmp_path / 'resaved')!r}\n")
    completed = run_without_the_package(header + CHILD, hf_home)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-6000:]
    line = next(line for line in completed.stdout.splitlines() if line.startswith("RESULTS "))
    results = json.loads(line[len("RESULTS "):])
    assert results["transformers"] == transformers.__version__
    assert results["seq2seq_buffers"] > 0
    assert results["hub_module"].startswith("transformers_modules.")
    assert {"configuration_powernorm.py", "modeling_powernorm.py", "normalization.py"} <= set(results["resaved"])
    # The downloaded code came from the cache snapshot.
    assert (hf_home / "modules" / "transformers_modules").is_dir()

"""PN's statistics where they meet the ecosystem: double backward, FSDP's buffer dtype, PEFT, DDP."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from launching import free_port
from hf_powernorm import NORM_CLASSES, build_norm

HIDDEN = 12

pytestmark = pytest.mark.usefixtures("one_thread")

# Norms whose backward is a custom autograd Function (an approximation, not a derivative).
APPROXIMATE_BACKWARD = {"powernorm": "PowerNorm", "mabn": "MovingAverageBatchNorm"}


def _batch(seed: int = 0, dtype: torch.dtype = torch.float32):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 5, HIDDEN, generator=generator, dtype=dtype) * 2 + 0.3
    mask = torch.ones(3, 5, dtype=torch.long)
    mask[1, 3:] = 0
    return x, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # fused kernels and torch ops
@pytest.mark.parametrize("name", sorted(NORM_CLASSES))
def test_double_backward_is_exact_or_refused_never_silent(name, dtype):
    norm = build_norm(name, HIDDEN).to(dtype).train()
    x, mask = _batch(dtype=dtype)
    x.requires_grad_(True)
    out = norm(x, mask)
    if name in APPROXIMATE_BACKWARD:
        buffers = {k: v.clone() for k, v in norm.named_buffers()}
        with pytest.raises(RuntimeError, match=f"{APPROXIMATE_BACKWARD[name]}'s approximate backward is not "
                                               "twice differentiable"):
            torch.autograd.grad(out.square().sum(), x, create_graph=True)
        for key, value in norm.named_buffers():
            if key != "num_batches_tracked":
                torch.testing.assert_close(value, buffers[key], msg=key)
        # The ordinary backward is unaffected.
        (grad,) = torch.autograd.grad(norm(x, mask).square().sum(), x)
        assert torch.isfinite(grad).all()
        return
    (grad,) = torch.autograd.grad(out.square().sum(), x, create_graph=True)
    assert grad.requires_grad
    grad.square().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


# ---------------------------------------------------------------------------------------------
# FSDP v1 with MixedPrecision(buffer_dtype=torch.bfloat16) casts the running buffers


def _cast_float_buffers(model: torch.nn.Module, dtype: torch.dtype) -> list[str]:
    """What FSDP v1's buffer_dtype does: replace every floating buffer by a cast copy."""
    cast = []
    for module_name, module in model.named_modules():
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer.is_floating_point():
                setattr(module, name, buffer.to(dtype))
                cast.append(f"{module_name}.{name}".lstrip("."))
    return cast


@pytest.mark.parametrize("name", sorted(n for n, cls in NORM_CLASSES.items() if hasattr(cls, "reset_running_stats")))
def test_running_statistics_update_in_buffers_cast_to_bfloat16(name):
    norm = build_norm(name, HIDDEN, **({"warmup_steps": 1} if name == "powernorm" else {})).train()
    cast = _cast_float_buffers(norm, torch.bfloat16)
    before = {k: v.clone() for k, v in norm.named_buffers()}
    for step in range(3):
        x, mask = _batch(seed=step)
        x.requires_grad_(True)
        norm(x, mask).square().sum().backward()
    assert int(norm.num_batches_tracked) == 3
    moved = [k for k in cast
             if getattr(norm, k).dtype == torch.bfloat16 and not torch.equal(getattr(norm, k), before[k])]
    assert "running_phi" in moved or "running_var" in moved, moved


def test_a_training_step_with_bfloat16_buffers_updates_the_statistics():
    from hf_powernorm import PowerNormTransformerConfig, PowerNormTransformerForConditionalGeneration

    torch.manual_seed(0)
    config = PowerNormTransformerConfig.from_preset("tiny", decoder_norm_type="powernorm", powernorm_warmup_steps=1)
    model = PowerNormTransformerForConditionalGeneration(config).train()
    assert _cast_float_buffers(model, torch.bfloat16)
    before = {k: v.clone() for k, v in model.named_buffers()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(2):
        generator = torch.Generator().manual_seed(step)
        batch = {"input_ids": torch.randint(3, 99, (3, 7), generator=generator),
                 "labels": torch.randint(3, 99, (3, 5), generator=generator)}
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    phi = {k: v for k, v in model.named_buffers() if k.endswith(("running_phi", "running_nu"))}
    assert phi and all(v.dtype == torch.bfloat16 for v in phi.values())
    assert all(not torch.equal(v, before[k]) for k, v in phi.items())


# ---------------------------------------------------------------------------------------------
# PEFT: the statistics a LoRA adapter trained come back with it


def _tiny(head: str, seed: int = 0):
    from hf_powernorm import (PowerNormTransformerConfig, PowerNormTransformerForCausalLM,
                              PowerNormTransformerForConditionalGeneration)

    torch.manual_seed(seed)
    config = PowerNormTransformerConfig.from_preset("tiny", decoder_norm_type="powernorm", powernorm_warmup_steps=1)
    cls = PowerNormTransformerForCausalLM if head == "causal" else PowerNormTransformerForConditionalGeneration
    return cls(config)


def _lm_batch(head: str, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    batch = {"input_ids": torch.randint(3, 99, (3, 7), generator=generator)}
    batch["labels"] = batch["input_ids"] if head == "causal" else torch.randint(3, 99, (3, 5), generator=generator)
    return batch


def test_peft_modules_to_save_names_every_norm_with_running_statistics():
    from hf_powernorm import peft_modules_to_save

    model = _tiny("seq2seq")
    names = peft_modules_to_save(model)
    assert len(names) == 2 * 2 + 1 + 2 * 3 + 1  # encoder: 2 per layer + final; decoder: 3 per layer + final
    assert "model.encoder.layers.0.self_attn_norm" in names and "model.decoder.final_norm" in names
    with pytest.raises(ValueError, match="has no norm with running statistics"):
        peft_modules_to_save(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("head", ["causal", "seq2seq"])
def test_a_reloaded_lora_adapter_with_the_norms_to_save_equals_the_trained_model(head, tmp_path):
    peft = pytest.importorskip("peft", reason="peft is not installed (pip install -e .[dev])")
    from hf_powernorm import peft_modules_to_save

    base = _tiny(head)
    base.save_pretrained(tmp_path / "base")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                             modules_to_save=peft_modules_to_save(base))
    model = peft.get_peft_model(base, config).train()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for step in range(3):
        model(**_lm_batch(head, step)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(tmp_path / "adapter")
    eval_batch = {"input_ids": _lm_batch(head, 9)["input_ids"]}
    if head == "seq2seq":
        eval_batch["decoder_input_ids"] = _lm_batch(head, 10)["input_ids"][:, :4]
    with torch.no_grad():
        expected = model.eval()(**eval_batch).logits
        cls = type(_tiny(head))
        reloaded = peft.PeftModel.from_pretrained(cls.from_pretrained(tmp_path / "base"), tmp_path / "adapter")
        got = reloaded.eval()(**eval_batch).logits
        without = peft.PeftModel.from_pretrained(
            cls.from_pretrained(tmp_path / "base"),
            _adapter_without_norms(tmp_path, peft)).eval()(**eval_batch).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert not torch.allclose(without, expected, atol=1e-4)  # the norms' statistics matter


def _converted_llama(norm_type: str = "powernorm"):
    import warnings

    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_powernorm import convert_norms

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=37))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        convert_norms(model, norm_type)
    return model


def _peft_warnings(peft, model, **config) -> list[str]:
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], **config))
    assert wrapped.base_model.model is model
    return [str(w.message) for w in caught if "wrapped by PEFT" in str(w.message)]


@pytest.mark.parametrize("source", ["powernorm_transformer", "converted"])
def test_get_peft_model_without_the_statistics_in_modules_to_save_warns_once(source):
    peft = pytest.importorskip("peft", reason="peft is not installed (pip install -e .[dev])")
    from hf_powernorm import peft_modules_to_save

    build = (lambda: _tiny("causal")) if source == "powernorm_transformer" else _converted_llama
    model = build()
    names = peft_modules_to_save(model)
    found = _peft_warnings(peft, model)
    assert len(found) == 1 and "modules_to_save=hf_powernorm.peft_modules_to_save(model)" in found[0]
    assert f"{len(names)} norms keep running statistics" in found[0] and names[0] in found[0]
    assert isinstance(model.peft_config, dict)  # PEFT's attribute reads back as PEFT set it

    model = build()
    assert _peft_warnings(peft, model, modules_to_save=peft_modules_to_save(model)) == []
    assert _peft_warnings(peft, build(), modules_to_save=names[:1]) != []  # one norm saved, the others not


def test_peft_on_a_model_without_running_statistics_does_not_warn_and_unloads():
    """`unload` leaves the converted model's `peft_config` as it leaves a plain Llama's: removed since
    PEFT 0.21, kept by the floor's 0.18."""
    peft = pytest.importorskip("peft", reason="peft is not installed (pip install -e .[dev])")
    from transformers import LlamaForCausalLM

    model = _converted_llama("rmsnorm")
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert _peft_warnings(peft, _converted_llama("rmsnorm")) == []
    wrapped.unload()
    plain = LlamaForCausalLM(model.config)
    peft.get_peft_model(plain, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).unload()
    assert type(model) is not LlamaForCausalLM and hasattr(model, "peft_config") == hasattr(plain, "peft_config")


def _adapter_without_norms(tmp_path, peft):
    """The same LoRA weights saved without `modules_to_save`: what a plain LoRA config keeps."""
    import json

    from safetensors.torch import load_file, save_file

    source, target = tmp_path / "adapter", tmp_path / "adapter_without_norms"
    target.mkdir()
    config = json.loads((source / "adapter_config.json").read_text())
    config["modules_to_save"] = None
    (target / "adapter_config.json").write_text(json.dumps(config))
    weights = load_file(source / "adapter_model.safetensors")
    save_file({k: v for k, v in weights.items() if "lora_" in k}, target / "adapter_model.safetensors")
    return target


# ---------------------------------------------------------------------------------------------
# DDP's buffer broadcast overwrites the statistics: warned once


def _train_under_ddp(norm_name: str, broadcast: bool, steps: int = 3) -> list[str]:
    """The messages of our warning while a Linear and two norms train (then evaluate) under DDP."""
    import warnings

    from hf_powernorm import norm_dispatch

    norm_dispatch._BROADCAST_WARNED.clear()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), build_norm(norm_name, HIDDEN),
                                build_norm(norm_name, HIDDEN))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddp = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=broadcast)
        for _ in range(steps):
            ddp(torch.randn(4, HIDDEN)).sum().backward()
        ddp.eval()
        with torch.no_grad():
            ddp(torch.randn(4, HIDDEN))
    return [str(w.message) for w in caught if "broadcast_buffers=True" in str(w.message)]


@pytest.mark.parametrize("norm_name, broadcast, expected", [
    ("powernorm", True, 1), ("powernorm", False, 0), ("batchnorm", True, 1), ("mabn", True, 1),
    ("layernorm", True, 0),
])
def test_ddp_broadcasting_buffers_is_warned_once(norm_name, broadcast, expected, tmp_path):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        found = _train_under_ddp(norm_name, broadcast)
    finally:
        dist.destroy_process_group()
    assert len(found) == expected, found
    if expected:
        assert "broadcast_buffers=False (Trainer: ddp_broadcast_buffers=False)" in found[0]


_DDP_WORKER = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    sys.path[:0] = sys.argv[3:]  # this file's folder and the tests' (its helpers)
    from test_integrations import _train_under_ddp
    rank, port = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    print("WARNINGS", len(_train_under_ddp("powernorm", True)), len(_train_under_ddp("powernorm", False)))
    dist.destroy_process_group()
    """
)


def test_ddp_broadcasting_buffers_is_warned_once_in_each_of_two_processes(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(_DDP_WORKER)
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(script), str(rank), port, os.path.dirname(__file__),
                               os.path.dirname(os.path.dirname(__file__))],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for rank in range(2)]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    for stdout, _ in outputs:
        assert "WARNINGS 1 0" in stdout, stdout

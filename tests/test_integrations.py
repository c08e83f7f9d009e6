"""PN's statistics where they meet the ecosystem: double backward, FSDP's buffer dtype, PEFT, DDP."""

import pytest
import torch

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

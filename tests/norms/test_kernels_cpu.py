"""The CPU kernels' binding: each entry of `kernels_cpu._SIGNATURES` is the C source's definition of that
function (return type and parameter types, in order), and the loaded library is bound from it."""

from __future__ import annotations

import ctypes
import re

import pytest
import torch

from hf_powernorm import kernels_cpu
from hf_powernorm.kernels_cpu_source import C_SOURCE

DEFINITION = r"^(?:SQUASH_CODE )?(?P<restype>void|int) {name}\((?P<parameters>[^)]*)\)\s*\{{"
SCALARS = {"long long": ctypes.c_longlong, "long": ctypes.c_long, "int": ctypes.c_int, "float": ctypes.c_float}


def _ctype(parameter: str):
    """The ctypes type a C parameter (`const float *x`, `long T`) is passed as."""
    if "*" in parameter:
        return ctypes.c_void_p
    declared = " ".join(parameter.split()[:-1]).removeprefix("const ")
    return SCALARS[declared]


@pytest.mark.parametrize("name", sorted(kernels_cpu._SIGNATURES))
def test_each_signature_is_the_c_definition(name):
    (match,) = re.finditer(DEFINITION.format(name=name), C_SOURCE, re.M)
    restype, argtypes = kernels_cpu._SIGNATURES[name]
    assert restype is (None if match["restype"] == "void" else ctypes.c_int)
    assert argtypes == [_ctype(parameter) for parameter in match["parameters"].split(",")]


def test_the_library_is_bound_from_the_table():
    library = kernels_cpu.load()
    assert library is not None, "a C compiler is expected on this machine"
    for name, (restype, argtypes) in kernels_cpu._SIGNATURES.items():
        function = getattr(library, name)
        assert (function.restype, function.argtypes) == (restype, argtypes), name


C = 8
# Each kernels_cpu function that takes a step counter, called with `counter` on a (tokens, C) batch.
COUNTER_CALLS = {
    "pn_statistics": lambda x, mask, counter: kernels_cpu.pn_statistics(
        x.square().sum(0), float(x.shape[0]), torch.ones(C), counter, 1e-5, 2, 0, 0.1, False, False),
    "pn_step_forward": lambda x, mask, counter: kernels_cpu.pn_step_forward(
        x, mask, None, torch.ones(C), torch.zeros(C), torch.ones(C), counter, 1e-5, 2, 0, 0.1, False, False),
    "pnv_step_forward": lambda x, mask, counter: kernels_cpu.pnv_step_forward(
        x, mask, None, torch.ones(C), torch.zeros(C), torch.ones(C), counter, 1e-5, 0.1, True),
    "bn_step_forward": lambda x, mask, counter: kernels_cpu.bn_step_forward(
        x, mask, torch.ones(C), torch.zeros(C), torch.zeros(C), torch.ones(C), counter, 1e-5, 0.1, False, 1.0, 0.0),
    "mabn_step_forward": lambda x, mask, counter: kernels_cpu.mabn_step_forward(
        x, mask, torch.ones(C), torch.zeros(C), torch.ones(C), torch.zeros(2, C), counter, 1e-5, 0.1, 2, 2.0, 2),
}


@pytest.mark.parametrize("name", sorted(COUNTER_CALLS))
def test_kernels_refuse_a_counter_they_would_read_past(name):
    """The C kernels read and write the step counter as one `long long`: an int32 counter (its
    neighbour a sentinel that a read or write past it would take in or change), a two-element one,
    an int64 mask that is strided or short, each refused with a TypeError naming it, nothing written;
    an int64 counter is taken."""
    assert kernels_cpu.load() is not None, "a C compiler is expected on this machine"
    x = torch.randn(6, C, generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([1, 1, 0, 1, 0, 1])
    storage = torch.tensor([0, -1], dtype=torch.int32)
    with pytest.raises(TypeError, match=r"counter .*int64.*got dtype torch\.int32"):
        COUNTER_CALLS[name](x, mask, storage[0])
    assert storage.tolist() == [0, -1]
    with pytest.raises(TypeError, match=r"counter .*one-element.*shape \(2,\)"):
        COUNTER_CALLS[name](x, mask, torch.zeros(2, dtype=torch.int64))
    if name != "pn_statistics":  # which takes no mask
        for bad in (torch.ones(12, dtype=torch.int64)[::2], mask[:5]):
            with pytest.raises(TypeError, match=r"mask must be a contiguous CPU tensor of 6 elements"):
                COUNTER_CALLS[name](x, bad, torch.tensor(0))
    counter = torch.tensor(0)
    COUNTER_CALLS[name](x, mask, counter)
    assert counter.dtype == torch.int64 and int(counter) == 1

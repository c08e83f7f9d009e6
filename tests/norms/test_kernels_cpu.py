"""The CPU kernels' binding: each entry of `kernels_cpu._SIGNATURES` is the C source's definition of that
function (return type and parameter types, in order), and the loaded library is bound from it."""

from __future__ import annotations

import ctypes
import re

import pytest

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

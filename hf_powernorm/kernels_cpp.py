"""PowerNorm's CPU training step as a C++ autograd node around the C kernels of `kernels_cpu`.

`kernels_cpu` runs a PN training step in two C calls; wrapped in a Python `torch.autograd.Function`
the step also pays the Python function's own forward and backward calls, about 0.1 ms a step on the
benchmark machine (BENCHMARKS.md: an autograd function doing no arithmetic costs 0.15-0.25 of
`F.layer_norm`'s whole step at (1024, 512)), which is what LayerNorm's C++ autograd node does not
pay. This module registers `torch.ops.hf_powernorm.pn_step`, the same two C calls inside a C++
`torch::autograd::Function`: the same bits (tested), without the Python around them.

Built on first use with the system C++ compiler against the installed torch's headers (about 15 s,
once per torch version and CPU: the library's name carries the digest of the source, the flags, the
torch version and the C kernels' library it links against), in the C kernels' private cache
directory and under the same rule: loaded only when the record next to it names that digest and
the library's own hash. Without a C++ compiler or torch's headers, with `HF_POWERNORM_KERNELS=0`
or `HF_POWERNORM_CPP=0`, `load()` returns None and PN's step runs its C calls from Python
(`normalization._PowerNormStepFunction`), the same arithmetic.

A non-finite gradient statistic is reported as the Python path does, a `RuntimeWarning` (through
the interpreter's `warnings`, so filters apply); a double backward is refused with its message.
Checkpointing recomputations do not come here (they reuse the step's statistics in Python).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import shutil
import subprocess
import sysconfig
import tempfile
from types import SimpleNamespace

import torch

from . import kernels_cpu

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <Python.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

extern "C" {
int pn_step_forward(const float *x, const void *m, int kind, long T, long C, long groups, float gs_eps,
                    int threads, const float *weight, const float *bias, float *phi, long long *counter, float eps,
                    long warmup, long ramp, float ema, int reference, int batch_backward, int stream, float *y,
                    float *stats, float *count);
int pn_step_backward(const float *dy, const float *x, const void *m, int kind, long T, long C, long groups,
                     float gs_eps, int threads, const float *weight, float *nu, const float *stats, float count,
                     int usable, float rate, int stream, float *dx, float *grads);
int mabn_step_forward(const float *x, const void *m, int kind, long T, long C, int threads, const float *weight,
                      const float *bias, float *phi, float *window_phi, long window, long long *counter, float eps,
                      float momentum, long warmup, float rmax, long renorm_warmup, int reuse, int stream, float *y,
                      float *out, float *count);
int mabn_step_backward(const float *dy, const float *x, const void *m, int kind, long T, long C, int threads,
                       const float *weight, const float *out, float *window_gz, long window, long long step,
                       long warmup, float count, int usable, int stream, float *dx, float *grads);
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;


/* warnings.warn(message, RuntimeWarning), as the Python path warns; a filter that turns the warning
   into an error raises it here as a RuntimeError with the warning's text. */
void warn_runtime(const char *message) {
  PyGILState_STATE state = PyGILState_Ensure();
  int failed = PyErr_WarnEx(PyExc_RuntimeWarning, message, 1);
  std::string error;
  if (failed) {
    PyObject *type, *value, *trace;
    PyErr_Fetch(&type, &value, &trace);
    PyObject *text = value ? PyObject_Str(value) : nullptr;
    error = text && PyUnicode_Check(text) ? PyUnicode_AsUTF8(text) : message;
    Py_XDECREF(text);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(trace);
  }
  PyGILState_Release(state);
  TORCH_CHECK(!failed, error);
}

/* The double-backward refusal and the non-finite gradient-statistic warning of the Python steps. */
void refuse_double_backward(const char *name) {
  TORCH_CHECK(!at::GradMode::is_enabled(), name,
              "'s approximate backward is not twice differentiable: create_graph=True (a gradient penalty, double "
              "backward) is not supported through it");
}

void warn_gradient_statistic(const char *name) {
  std::string message = std::string(name) + ": non-finite gradient statistic (NaN or inf in the input or gradient); "
                        "the running statistics were not updated for this batch";
  warn_runtime(message.c_str());
}

/* The mask argument of the C calls: none for mask_kind 0 (no mask; the tensor is an empty stand-in). */
const void *mask_pointer(const at::Tensor &mask, int64_t kind) { return kind ? mask.data_ptr() : nullptr; }

at::Tensor mask_or_empty(const c10::optional<at::Tensor> &mask, const at::Tensor &x) {
  // autograd's inputs must be defined: no mask is an empty tensor, never read with mask_kind 0
  return mask.has_value() ? *mask : at::empty({0}, x.options());
}

struct PowerNormStep : public torch::autograd::Function<PowerNormStep> {
  static variable_list forward(AutogradContext *ctx, at::Tensor x, at::Tensor weight, at::Tensor bias,
                               at::Tensor mask, int64_t mask_kind, at::Tensor running_phi, at::Tensor running_nu,
                               at::Tensor counter, int64_t groups, double gs_eps, double eps, int64_t warmup,
                               int64_t ramp, double ema, double rate, bool reference, bool batch_backward,
                               int64_t stream_bytes) {
    const int64_t T = x.size(0), C = x.size(1);
    const bool stream = T * C * 4 >= stream_bytes;
    at::Tensor y = at::empty_like(x), stats = at::empty({3, C}, x.options()), info = at::empty({2}, x.options());
    float count = 0.0f;
    int status = pn_step_forward(
        x.data_ptr<float>(), mask_pointer(mask, mask_kind), (int)mask_kind, T, C, groups, (float)gs_eps,
        at::get_num_threads(),
        weight.data_ptr<float>(), bias.data_ptr<float>(), running_phi.data_ptr<float>(),
        reinterpret_cast<long long *>(counter.data_ptr<int64_t>()), (float)eps, warmup, ramp, (float)ema, reference,
        batch_backward, stream, y.data_ptr<float>(), stats.data_ptr<float>(), &count);
    float *out = info.data_ptr<float>();
    out[0] = count;
    out[1] = (float)status;
    // saved tensors: x and weight, as _PowerNormStepFunction saves them (a checkpointing recomputation
    // runs that function and must save as many); the rest as plain data
    ctx->save_for_backward({x, weight});
    ctx->saved_data["mask"] = mask;
    ctx->saved_data["running_nu"] = running_nu;
    ctx->saved_data["stats"] = stats;
    ctx->saved_data["count"] = (double)count;
    ctx->saved_data["usable"] = status == 1;
    ctx->saved_data["mask_kind"] = mask_kind;
    ctx->saved_data["groups"] = groups;
    ctx->saved_data["gs_eps"] = gs_eps;
    ctx->saved_data["rate"] = rate;
    ctx->saved_data["stream"] = stream;
    ctx->mark_non_differentiable({stats, info});
    return {y, stats, info};
  }

  static variable_list backward(AutogradContext *ctx, variable_list grad_outputs) {
    refuse_double_backward("PowerNorm");
    variable_list saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1];
    at::Tensor mask = ctx->saved_data["mask"].toTensor(), nu = ctx->saved_data["running_nu"].toTensor(),
               stats = ctx->saved_data["stats"].toTensor();
    const int64_t T = x.size(0), C = x.size(1), mask_kind = ctx->saved_data["mask_kind"].toInt();
    at::Tensor dy = grad_outputs[0].defined() ? grad_outputs[0].to(at::kFloat).contiguous() : at::zeros_like(x);
    at::Tensor dx = at::empty_like(x), grads = at::empty({2, C}, x.options());
    int status = pn_step_backward(
        dy.data_ptr<float>(), x.data_ptr<float>(), mask_pointer(mask, mask_kind), (int)mask_kind, T, C,
        ctx->saved_data["groups"].toInt(), (float)ctx->saved_data["gs_eps"].toDouble(), at::get_num_threads(),
        weight.data_ptr<float>(), nu.data_ptr<float>(), stats.data_ptr<float>(),
        (float)ctx->saved_data["count"].toDouble(), ctx->saved_data["usable"].toBool(),
        (float)ctx->saved_data["rate"].toDouble(), ctx->saved_data["stream"].toBool(), dx.data_ptr<float>(),
        grads.data_ptr<float>());
    if (status < 0) warn_gradient_statistic("PowerNorm");
    variable_list result(18);
    result[0] = dx;
    result[1] = grads[0];
    result[2] = grads[1];
    return result;
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> pn_step(
    const at::Tensor &x, const at::Tensor &weight, const at::Tensor &bias, const c10::optional<at::Tensor> &mask,
    int64_t mask_kind, const at::Tensor &running_phi, const at::Tensor &running_nu, const at::Tensor &counter,
    int64_t groups, double gs_eps, double eps, int64_t warmup, int64_t ramp, double ema, double rate, bool reference,
    bool batch_backward, int64_t stream_bytes) {
  variable_list out = PowerNormStep::apply(x, weight, bias, mask_or_empty(mask, x), mask_kind,
                                           running_phi, running_nu, counter, groups, gs_eps, eps, warmup, ramp, ema,
                                           rate, reference, batch_backward, stream_bytes);
  return {out[0], out[1], out[2]};
}

struct MovingAverageBatchNormStep : public torch::autograd::Function<MovingAverageBatchNormStep> {
  static variable_list forward(AutogradContext *ctx, at::Tensor x, at::Tensor weight, at::Tensor bias,
                               at::Tensor mask, int64_t mask_kind, at::Tensor running_phi, at::Tensor window_phi,
                               at::Tensor window_gz, at::Tensor counter, double eps, double momentum, int64_t warmup,
                               double rmax, int64_t renorm_warmup, int64_t stream_bytes) {
    const int64_t T = x.size(0), C = x.size(1), step = counter.item<int64_t>() + 1;
    const bool stream = T * C * 4 >= stream_bytes;
    at::Tensor y = at::empty_like(x), out = at::empty({2, C}, x.options()), info = at::empty({2}, x.options());
    float count = 0.0f;
    int status = mabn_step_forward(
        x.data_ptr<float>(), mask_pointer(mask, mask_kind), (int)mask_kind, T, C, at::get_num_threads(),
        weight.data_ptr<float>(), bias.data_ptr<float>(), running_phi.data_ptr<float>(), window_phi.data_ptr<float>(),
        window_phi.size(0), reinterpret_cast<long long *>(counter.data_ptr<int64_t>()), (float)eps, (float)momentum,
        warmup, (float)rmax, renorm_warmup, 0, stream, y.data_ptr<float>(), out.data_ptr<float>(), &count);
    float *written = info.data_ptr<float>();
    written[0] = count;
    written[1] = (float)status;
    ctx->save_for_backward({x, weight});  // as _MovingAverageBatchNormStepFunction saves (checkpointing)
    ctx->saved_data["mask"] = mask;
    ctx->saved_data["mask_kind"] = mask_kind;
    ctx->saved_data["out"] = out;
    ctx->saved_data["window_gz"] = window_gz;
    ctx->saved_data["step"] = step;
    ctx->saved_data["warmup"] = warmup;
    ctx->saved_data["count"] = (double)count;
    ctx->saved_data["usable"] = status == 1;
    ctx->saved_data["stream"] = stream;
    ctx->mark_non_differentiable({out, info});
    return {y, out, info};
  }

  static variable_list backward(AutogradContext *ctx, variable_list grad_outputs) {
    refuse_double_backward("MovingAverageBatchNorm");
    variable_list saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1];
    auto &data = ctx->saved_data;
    at::Tensor mask = data["mask"].toTensor(), out = data["out"].toTensor(), window_gz = data["window_gz"].toTensor();
    const int64_t T = x.size(0), C = x.size(1), mask_kind = data["mask_kind"].toInt();
    at::Tensor dy = grad_outputs[0].defined() ? grad_outputs[0].to(at::kFloat).contiguous() : at::zeros_like(x);
    at::Tensor dx = at::empty_like(x), grads = at::empty({2, C}, x.options());
    int status = mabn_step_backward(
        dy.data_ptr<float>(), x.data_ptr<float>(), mask_pointer(mask, mask_kind), (int)mask_kind, T, C,
        at::get_num_threads(), weight.data_ptr<float>(), out.data_ptr<float>(), window_gz.data_ptr<float>(),
        window_gz.size(0), data["step"].toInt(), data["warmup"].toInt(), (float)data["count"].toDouble(),
        data["usable"].toBool(), data["stream"].toBool(), dx.data_ptr<float>(), grads.data_ptr<float>());
    if (status < 0) warn_gradient_statistic("MovingAverageBatchNorm");
    variable_list result(15);
    result[0] = dx;
    result[1] = grads[0];
    result[2] = grads[1];
    return result;
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> mabn_step(
    const at::Tensor &x, const at::Tensor &weight, const at::Tensor &bias, const c10::optional<at::Tensor> &mask,
    int64_t mask_kind, const at::Tensor &running_phi, const at::Tensor &window_phi, const at::Tensor &window_gz,
    const at::Tensor &counter, double eps, double momentum, int64_t warmup, double rmax, int64_t renorm_warmup,
    int64_t stream_bytes) {
  variable_list out = MovingAverageBatchNormStep::apply(x, weight, bias, mask_or_empty(mask, x), mask_kind,
                                                        running_phi, window_phi, window_gz, counter, eps, momentum,
                                                        warmup, rmax, renorm_warmup, stream_bytes);
  return {out[0], out[1], out[2]};
}

}  // namespace

TORCH_LIBRARY(hf_powernorm, m) {
  m.def("pn_step(Tensor x, Tensor weight, Tensor bias, Tensor? mask, int mask_kind, Tensor running_phi, "
        "Tensor running_nu, Tensor counter, int groups, float gs_eps, float eps, int warmup, int ramp, float ema, "
        "float rate, bool reference, bool batch_backward, int stream_bytes) -> (Tensor, Tensor, Tensor)");
  m.def("mabn_step(Tensor x, Tensor weight, Tensor bias, Tensor? mask, int mask_kind, Tensor running_phi, "
        "Tensor window_phi, Tensor window_gz, Tensor counter, float eps, float momentum, int warmup, float rmax, "
        "int renorm_warmup, int stream_bytes) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(hf_powernorm, CompositeImplicitAutograd, m) {
  m.impl("pn_step", &pn_step);
  m.impl("mabn_step", &mabn_step);
}
"""

_FLAGS = ["-O2", "-std=c++17", "-fPIC", "-shared", "-w"]
_ops = None
_tried = False


def _torch_paths() -> tuple[list[str], str]:
    root = pathlib.Path(torch.__file__).parent
    includes = [root / "include", root / "include" / "torch" / "csrc" / "api" / "include"]
    return [str(path) for path in includes] + [sysconfig.get_paths()["include"]], str(root / "lib")


def _digest(c_library: pathlib.Path) -> str:
    includes, lib = _torch_paths()
    parts = [_SOURCE, *_FLAGS, torch.__version__, str(torch._C._GLIBCXX_USE_CXX11_ABI), lib, *includes,
             c_library.name, kernels_cpu._cpu_identity()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _compile(target: pathlib.Path, c_library: pathlib.Path, digest: str) -> None:
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (c++/g++) on PATH")
    includes, lib = _torch_paths()
    if not (pathlib.Path(includes[0]) / "torch" / "library.h").exists():
        raise RuntimeError(f"torch's C++ headers are not installed ({includes[0]})")
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        source = pathlib.Path(tmp) / "powernorm_ops.cpp"
        source.write_text(_SOURCE)
        built = pathlib.Path(tmp) / target.name
        command = [compiler, *_FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
                   *(f"-I{path}" for path in includes), str(source), str(c_library), "-o", str(built),
                   f"-L{lib}", "-ltorch", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{lib}"]
        subprocess.run(command, check=True, capture_output=True)
        record = {"source_and_flags": digest, "library": kernels_cpu._file_digest(built), "flags": _FLAGS}
        os.replace(built, target)  # atomic: concurrent processes never load a half-written file
        kernels_cpu._write_atomically(kernels_cpu._record_path(target), json.dumps(record).encode())


def load() -> SimpleNamespace | None:
    """The C++ steps, `pn_step` and `mabn_step` (`torch.ops.hf_powernorm.*.default`), building them on
    first use; None when disabled or unavailable (the steps then run their C calls from Python)."""
    global _ops, _tried
    if _tried:
        return _ops
    _tried = True
    if os.environ.get("HF_POWERNORM_CPP", "1") == "0" or kernels_cpu.load() is None:
        return None
    try:
        c_library = kernels_cpu._library_path
        digest = _digest(c_library)
        target = c_library.parent / f"powernorm_ops_{digest[:16]}.so"
        if not kernels_cpu._trusted(target, digest):
            logger.info("Building PowerNorm's C++ training steps (once per torch version, about 15 s)")
            _compile(target, c_library, digest)
            if not kernels_cpu._trusted(target, digest):
                raise RuntimeError(f"{target} changed while it was being built")
        if not hasattr(torch.ops.hf_powernorm, "pn_step"):
            torch.ops.load_library(str(target))
        _ops = SimpleNamespace(pn_step=torch.ops.hf_powernorm.pn_step.default,
                               mabn_step=torch.ops.hf_powernorm.mabn_step.default)
    except (OSError, RuntimeError, subprocess.CalledProcessError) as err:
        detail = getattr(err, "stderr", b"") or b""
        logger.info("PowerNorm's C++ training steps unavailable (%s %s); their C calls run from Python",
                    err, detail.decode(errors="replace")[-500:])
        _ops = None
    return _ops

"""The C++ source of DyT's and Derf's torch operator (`kernels_cpu.load_operator` builds it on first use).

One autograd node in C++ around the C library's `elementwise_forward` and `elementwise_backward`,
whose addresses `bind` receives; `NAMESPACE` is replaced by the build's own. A string for the same
reason as `kernels_cpu_source.py`'s; the design: docs/cpu_kernels.md.
"""

OPERATOR_SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>
#include <cmath>
#include <optional>

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

/* The C kernels (`elementwise_forward`, `elementwise_backward` of the C library), bound once. */
typedef void (*ForwardKernel)(const float *, long, long, int, float, float, const float *, const float *, int,
                              float *);
typedef void (*BackwardKernel)(const float *, const float *, long, long, int, float, float, const float *, int,
                               float *, float *);
static ForwardKernel forward_kernel = nullptr;
static BackwardKernel backward_kernel = nullptr;

static void bind(int64_t forward, int64_t backward) {
    forward_kernel = reinterpret_cast<ForwardKernel>(forward);
    backward_kernel = reinterpret_cast<BackwardKernel>(backward);
}

/* dx, dalpha, dshift, dweight, dbias by the formula in ATen ops: the create_graph=True backward. */
static variable_list formula_backward(const at::Tensor &dy, const at::Tensor &x, const at::Tensor &alpha,
                                      const at::Tensor &shift, const at::Tensor &weight, int64_t function) {
    at::Tensor z = shift.defined() ? at::addcmul(shift, x, alpha) : x * alpha;
    at::Tensor value = function == 0 ? at::tanh(z) : at::erf(z);
    at::Tensor slope = function == 0 ? 1 - value * value : at::exp(-z * z) * (2.0 / std::sqrt(M_PI));
    at::Tensor g = dy * weight * slope, rows = dy.reshape({-1, x.size(-1)});
    return {g * alpha, (g * x).sum().reshape(alpha.sizes()),
            shift.defined() ? g.sum().reshape(shift.sizes()) : at::Tensor(),
            (rows * value.reshape({-1, x.size(-1)})).sum(0), rows.sum(0), at::Tensor()};
}

struct ElementwiseNorm : public torch::autograd::Function<ElementwiseNorm> {
    static at::Tensor forward(AutogradContext *ctx, const at::Tensor &input, const at::Tensor &alpha,
                              const std::optional<at::Tensor> &shift, const at::Tensor &weight,
                              const at::Tensor &bias, int64_t function) {
        at::Tensor x = input.contiguous(), w = weight.contiguous(), b = bias.contiguous();
        at::Tensor s = shift.has_value() ? *shift : at::Tensor();
        float a = *alpha.data_ptr<float>(), t = s.defined() ? *s.data_ptr<float>() : 0.0f;  /* one CPU float each */
        long channels = x.size(-1), tokens = channels ? x.numel() / channels : 0;
        at::Tensor y = at::empty_like(x);
        forward_kernel(x.data_ptr<float>(), tokens, channels, (int)function, a, t, w.data_ptr<float>(),
                       b.data_ptr<float>(), at::get_num_threads(), y.data_ptr<float>());
        ctx->save_for_backward({x, alpha, s, w});
        ctx->saved_data["function"] = function;
        ctx->saved_data["alpha"] = (double)a;
        ctx->saved_data["shift"] = (double)t;
        return y;
    }

    static variable_list backward(AutogradContext *ctx, variable_list grads) {
        variable_list saved = ctx->get_saved_variables();
        const at::Tensor &x = saved[0], &alpha = saved[1], &shift = saved[2], &weight = saved[3];
        int64_t function = ctx->saved_data["function"].toInt();
        if (at::GradMode::is_enabled()) return formula_backward(grads[0], x, alpha, shift, weight, function);
        at::Tensor dy = grads[0].contiguous();
        long channels = x.size(-1), tokens = channels ? x.numel() / channels : 0;
        bool input_gradient = ctx->needs_input_grad(0);
        at::Tensor dx = input_gradient ? at::empty_like(x) : at::Tensor();
        at::Tensor sums = at::empty({2 * channels + 2}, x.options());
        backward_kernel(dy.data_ptr<float>(), x.data_ptr<float>(), tokens, channels, (int)function,
                        (float)ctx->saved_data["alpha"].toDouble(), (float)ctx->saved_data["shift"].toDouble(),
                        weight.data_ptr<float>(), at::get_num_threads(),
                        input_gradient ? dx.data_ptr<float>() : nullptr, sums.data_ptr<float>());
        std::vector<at::Tensor> parts = sums.split_with_sizes({channels, channels, 1, 1});
        return {dx, parts[2].view(alpha.sizes()), shift.defined() ? parts[3].view(shift.sizes()) : at::Tensor(),
                parts[0], parts[1], at::Tensor()};
    }
};

static at::Tensor elementwise_norm(const at::Tensor &x, const at::Tensor &alpha, const std::optional<at::Tensor> &shift,
                                   const at::Tensor &weight, const at::Tensor &bias, int64_t function) {
    TORCH_CHECK(forward_kernel != nullptr && backward_kernel != nullptr, "elementwise_norm: kernels not bound");
    TORCH_CHECK(function == 0 || function == 1, "elementwise_norm: function must be 0 (tanh) or 1 (erf), got ",
                function);
    int64_t channels = x.dim() ? x.size(-1) : 0;
    for (const at::Tensor &t : {x, alpha, weight, bias, shift.value_or(alpha)})
        TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat,
                    "elementwise_norm: CPU float32 tensors expected, got ", t.device(), " ", t.scalar_type());
    TORCH_CHECK(x.dim() >= 1 && weight.numel() == channels && bias.numel() == channels && alpha.numel() == 1
                && (!shift.has_value() || shift->numel() == 1),
                "elementwise_norm: weight and bias of x's last size and one alpha (and shift) expected, got x ",
                x.sizes(), ", weight ", weight.sizes(), ", bias ", bias.sizes(), ", alpha ", alpha.sizes());
    return ElementwiseNorm::apply(x, alpha, shift, weight, bias, function);
}

TORCH_LIBRARY(NAMESPACE, m) {
    m.def("bind(int forward, int backward) -> ()", bind);
    m.def("elementwise_norm(Tensor x, Tensor alpha, Tensor? shift, Tensor weight, Tensor bias, int function) "
          "-> Tensor");
}
TORCH_LIBRARY_IMPL(NAMESPACE, CPU, m) { m.impl("elementwise_norm", elementwise_norm); }
TORCH_LIBRARY_IMPL(NAMESPACE, Autograd, m) { m.impl("elementwise_norm", elementwise_norm); }
"""

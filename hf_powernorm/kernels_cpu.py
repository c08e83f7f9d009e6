"""Fused CPU kernels for PowerNorm, its relatives, DyT and Derf (float32, contiguous `(tokens, C)` inputs).

A composition of torch ops takes about ten passes over memory per training step; on a CPU, where
each elementwise pass costs about as much as a whole `layer_norm`, that is several times LayerNorm.
These kernels do the arithmetic in two passes per training step once the denominator is the running
statistic (statistics and output together; the backward sums and input gradient together), three
during warmup (the output needs the batch statistic first), one in eval, parallel over tokens with
OpenMP. They save nothing but `x`: the group scales and `z0 = x * r` are recomputed per token.
`pn_step_forward`/`pn_step_backward` take a whole PN step in one call each (statistics, buffer
updates and parameter gradients included, the attention mask read as it is); `pnv_step_forward`/`pnv_step_backward` take
PN-V's step likewise (two passes each way: its exact gradient needs a batch sum first);
`bn_step_*` (masked BN and BRN) and `mabn_step_*` (MABN, its moving averages included) the same
way, two passes each way (`bn_moments`, then `affine_backward_rows`); `norm_eval` is
every eval-mode norm in one pass, with streaming stores for outputs of `STREAM_BYTES` and more;
`elementwise_forward`/`elementwise_backward` DyT and Derf, one pass each way (their tanh and erf in
arithmetic the compiler vectorises: libm's are scalar calls; built with multiply-adds and the widest
vectors), saving `x` alone.
`torch.compile` of the same arithmetic (`norm_dispatch.py`'s pure tensor functions, inductor's C++)
measured several times slower here: its reductions over tokens are not vectorised (BENCHMARKS.md).

The C source below is compiled on first use with the system C compiler into a cache directory
(`$HF_POWERNORM_CACHE`, else `$XDG_CACHE_HOME/hf_powernorm`, else `~/.cache/hf_powernorm`) and loaded
with `ctypes`: no build step at install time and no torch headers, so it builds in about a second.
The directory is private (mode 0700, owned by the user; another owner's is refused), and a library
is loaded only when the record written next to it names the hash of this source and these flags
and the library's own hash; any other file of that name is rebuilt, never loaded.
Without a compiler, or with `HF_POWERNORM_KERNELS=0`, `load()` returns None and PowerNorm runs
its torch ops; the results agree to float32 rounding (tested).

DyT's and Derf's training step also runs as one torch operator with a C++ autograd node around the
same two kernels (`load_operator()`, the end of this file): built on first use with the C++ compiler
and torch's own headers into the same cache (about 15 s, once per torch build and source, recorded
and checked the same way), because the Python around a small step cost as much as its arithmetic.
Without it (no C++ compiler, `HF_POWERNORM_OPERATOR=0`) the step runs a Python autograd function
around the same kernels, to the same bits (tested).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import logging
import os
import pathlib
import platform
import shutil
import stat
import subprocess
import tempfile

import torch

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX__)
#include <immintrin.h>
#endif

#define FLUSH 64  /* rows summed in float before adding to the double accumulators */

static void add_to(double *dst, float *src, long n) {
    for (long i = 0; i < n; i++) { dst[i] += src[i]; src[i] = 0.0f; }
}

/* The threads worth starting for n floats: one per TEAM_FLOATS at most (waking a thread costs
   microseconds, the whole pass over a decoding step's few tokens less than that). */
#define TEAM_FLOATS 32768L
static int team(int threads, long n) {
    long useful = n / TEAM_FLOATS;
    return useful < 1 ? 1 : (useful < threads ? (int)useful : threads);
}

/* sum_j x[j]^2 over k floats in four independent vector sums: one sum's chain of dependent additions
   waits out the adder's latency at every vector (0.67x of the eval pass at (1024, 512), one thread). */
#if defined(__AVX512F__)
static float sum_squares(const float *x, long k) {
    long j = 0;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (; j + 64 <= k; j += 64) {
        __m512 v0 = _mm512_loadu_ps(x + j), v1 = _mm512_loadu_ps(x + j + 16);
        __m512 v2 = _mm512_loadu_ps(x + j + 32), v3 = _mm512_loadu_ps(x + j + 48);
        a0 = _mm512_fmadd_ps(v0, v0, a0); a1 = _mm512_fmadd_ps(v1, v1, a1);
        a2 = _mm512_fmadd_ps(v2, v2, a2); a3 = _mm512_fmadd_ps(v3, v3, a3);
    }
    for (; j + 16 <= k; j += 16) { __m512 v = _mm512_loadu_ps(x + j); a0 = _mm512_fmadd_ps(v, v, a0); }
    float s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
    for (; j < k; j++) s += x[j] * x[j];
    return s;
}
#elif defined(__AVX__)
static inline __m256 square_add(__m256 v, __m256 a) {
#if defined(__FMA__)
    return _mm256_fmadd_ps(v, v, a);
#else
    return _mm256_add_ps(_mm256_mul_ps(v, v), a);
#endif
}
static float sum_squares(const float *x, long k) {
    long j = 0;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (; j + 32 <= k; j += 32) {
        a0 = square_add(_mm256_loadu_ps(x + j), a0); a1 = square_add(_mm256_loadu_ps(x + j + 8), a1);
        a2 = square_add(_mm256_loadu_ps(x + j + 16), a2); a3 = square_add(_mm256_loadu_ps(x + j + 24), a3);
    }
    for (; j + 8 <= k; j += 8) a0 = square_add(_mm256_loadu_ps(x + j), a0);
    __m256 a = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    float s = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
    for (; j < k; j++) s += x[j] * x[j];
    return s;
}
#else
static float sum_squares(const float *x, long k) {
    float s = 0.0f;
    #pragma omp simd reduction(+:s)
    for (long j = 0; j < k; j++) s += x[j] * x[j];
    return s;
}
#endif

/* r[g] = 1 / sqrt(mean_group(x^2) + eps) of one token, or 1 when groups == 0 (no group scaling). */
static void group_scales(const float *x, long C, long groups, float eps, float *r) {
    if (groups == 0) { r[0] = 1.0f; return; }
    long k = C / groups;
    for (long g = 0; g < groups; g++) r[g] = 1.0f / sqrtf(sum_squares(x + g * k, k) / (float)k + eps);
}

/* Streaming (non-temporal) stores of y = x r s + h over n floats: the output goes to memory
   without first being read into the cache, a third less traffic than an ordinary store. For outputs
   of STREAM_BYTES and more only (the caller decides); y and n must suit the vector width (see below). */
#if defined(__AVX512F__)
#define STREAM_FLOATS 16
static void stream_affine(const float *x, float r, const float *s, const float *h, float *y, long n) {
    __m512 vr = _mm512_set1_ps(r);
    for (long j = 0; j < n; j += 16)
        _mm512_stream_ps(y + j, _mm512_fmadd_ps(_mm512_mul_ps(_mm512_loadu_ps(x + j), vr),
                                                _mm512_loadu_ps(s + j), _mm512_loadu_ps(h + j)));
}
#elif defined(__AVX__)
#define STREAM_FLOATS 8
static void stream_affine(const float *x, float r, const float *s, const float *h, float *y, long n) {
    __m256 vr = _mm256_set1_ps(r);
    for (long j = 0; j < n; j += 8)
        _mm256_stream_ps(y + j, _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + j), vr),
                                                            _mm256_loadu_ps(s + j)), _mm256_loadu_ps(h + j)));
}
#else
#define STREAM_FLOATS 0
#endif

/* Whether rows of k floats (and of C, a multiple of k) starting at y can be streamed. */
static int streamable(int stream, const float *y, long k) {
    return stream && y && STREAM_FLOATS && k % (STREAM_FLOATS ? STREAM_FLOATS : 1) == 0
           && (uintptr_t)y % (4 * (STREAM_FLOATS ? STREAM_FLOATS : 1)) == 0;
}

/* The streamed gradients below have one body for both vector widths: `vfloat` is a vector of
   STREAM_FLOATS floats and VEC(op) names the intrinsic `op` at that width. */
#if STREAM_FLOATS
#if defined(__AVX512F__)
typedef __m512 vfloat;
#define VEC(op) _mm512_##op
#else
typedef __m256 vfloat;
#define VEC(op) _mm256_##op
#endif
#endif

/* The input gradient of one token's group of k channels, streamed: z0 = x r,
   dz0 = dy a - w c z0, dx = r (dz0 - z0 proj) (grouped) or dz0 (no group scaling). */
#if STREAM_FLOATS
static void stream_backward(const float *x, const float *dy, const float *a, const float *c, float r, float w,
                            float proj, int grouped, float *dx, long k) {
    vfloat vr = VEC(set1_ps)(r), vw = VEC(set1_ps)(w), vp = VEC(set1_ps)(proj);
    for (long j = 0; j < k; j += STREAM_FLOATS) {
        vfloat z0 = VEC(mul_ps)(VEC(loadu_ps)(x + j), vr);
        vfloat dz0 = VEC(sub_ps)(VEC(mul_ps)(VEC(loadu_ps)(dy + j), VEC(loadu_ps)(a + j)),
                                 VEC(mul_ps)(VEC(mul_ps)(vw, VEC(loadu_ps)(c + j)), z0));
        if (grouped) dz0 = VEC(mul_ps)(vr, VEC(sub_ps)(dz0, VEC(mul_ps)(z0, vp)));
        VEC(stream_ps)(dx + j, dz0);
    }
}
#endif


/* A token's weight from the mask as given: kind 0 none (1), 1 float32 weights, 2 int64 and
   3 bool/uint8 attention masks (1 where nonzero). Reading the mask in place spares its conversion. */
static inline float mask_weight(const void *m, int kind, long t) {
    if (kind == 1) return ((const float *)m)[t];
    if (kind == 2) return ((const long long *)m)[t] != 0 ? 1.0f : 0.0f;
    if (kind == 3) return ((const unsigned char *)m)[t] != 0 ? 1.0f : 0.0f;
    return 1.0f;
}

/* One pass over the rows of x (T x C), with z0 = x r (r: the token's group scales):
   sum_sq[c] = sum_t w_t z0[t,c]^2 (and sum_sq[C] = sum_t w_t) when sum_sq is given,
   y = z0 scale + shift when y is given (no shift: y = z0 scale; no scale either: y = z0).
   The group scales' eps is `eps` (1e-5 for PN's group scaling). */
static void rows_masked(const float *x, const void *m, int kind, long T, long C, long groups, float eps,
                        int threads, const float *scale, const float *shift, float *y, double *sum_sq, int stream) {
    long G = groups ? groups : 1, k = C / G;
    int streamed = streamable(stream, y, k) && scale && shift;
    if (sum_sq) {  /* sum_sq[C] receives the real-token count */
        memset(sum_sq, 0, sizeof(double) * (C + 1));
        if (kind) { for (long t = 0; t < T; t++) sum_sq[C] += mask_weight(m, kind, t); } else sum_sq[C] = (double)T;
    }
    #pragma omp parallel num_threads(team(threads, T * C))
    {
        float *acc = sum_sq ? calloc(C, sizeof(float)) : NULL;
        double *dacc = sum_sq ? calloc(C, sizeof(double)) : NULL;
        float *r = malloc(sizeof(float) * G);
        long rows = 0;
        #pragma omp for schedule(static)
        for (long t = 0; t < T; t++) {
            const float *xt = x + t * C;
            group_scales(xt, C, groups, eps, r);
            float wt = mask_weight(m, kind, t);
            for (long g = 0; g < G; g++) {
                const float *xg = xt + g * k;
                float rg = r[g], c2 = wt * rg * rg;
#if STREAM_FLOATS
                if (streamed) {  /* the statistics, then the output streamed */
                    if (acc && wt != 0.0f) {
                        float *ag = acc + g * k;
                        #pragma omp simd
                        for (long j = 0; j < k; j++) ag[j] += c2 * xg[j] * xg[j];
                    }
                    stream_affine(xg, rg, scale + g * k, shift + g * k, y + t * C + g * k, k);
                    continue;
                }
#endif
                if (acc && wt != 0.0f && y && scale && shift) {  /* statistics and output in one loop */
                    float *restrict ag = acc + g * k, *restrict yg = y + t * C + g * k;
                    const float *sg = scale + g * k, *hg = shift + g * k;
                    #pragma omp simd
                    for (long j = 0; j < k; j++) {
                        float xv = xg[j];
                        ag[j] += c2 * xv * xv;
                        yg[j] = xv * rg * sg[j] + hg[j];
                    }
                    continue;
                }
                if (acc && wt != 0.0f) {
                    float *ag = acc + g * k;
                    #pragma omp simd
                    for (long j = 0; j < k; j++) ag[j] += c2 * xg[j] * xg[j];
                }
                if (y && scale && shift) {
                    float *yg = y + t * C + g * k;
                    const float *sg = scale + g * k, *hg = shift + g * k;
                    #pragma omp simd
                    for (long j = 0; j < k; j++) yg[j] = xg[j] * rg * sg[j] + hg[j];
                } else if (y && scale) {
                    float *yg = y + t * C + g * k;
                    const float *sg = scale + g * k;
                    #pragma omp simd
                    for (long j = 0; j < k; j++) yg[j] = xg[j] * rg * sg[j];
                } else if (y) {
                    float *yg = y + t * C + g * k;
                    #pragma omp simd
                    for (long j = 0; j < k; j++) yg[j] = xg[j] * rg;
                }
            }
            if (acc && ++rows % FLUSH == 0) add_to(dacc, acc, C);
        }
        if (acc) {
            add_to(dacc, acc, C);
            #pragma omp critical
            for (long c = 0; c < C; c++) sum_sq[c] += dacc[c];
        }
        free(acc);
        free(dacc);
        free(r);
    }
#if STREAM_FLOATS
    if (streamed) _mm_sfence();
#endif
}

void pn_rows(const float *x, const float *w, long T, long C, long groups, float eps, int threads,
             const float *scale, const float *shift, float *y, double *sum_sq) {
    rows_masked(x, w, w ? 1 : 0, T, C, groups, eps, threads, scale, shift, y, sum_sq, 0);
}

/* The backward in one pass over (dy, x): z0 = x r recomputed per token;
   s_all[c] = sum_t dy z0, s_real[c] = sum_t w_t dy z0, s_dy[c] = sum_t dy;
   dz0 = dy a - w_t c z0 with a = weight / s_b and c = nu / (s s_b) (eqs. 11-12);
   dx = r (dz0 - z0 mean_group(dz0 z0)), or dx = dz0 without group scaling. No sums (s_all NULL,
   dx given): the input gradient alone. */
static void backward_masked(const float *dy, const float *x, const void *m, int kind, long T, long C, long groups,
                            float eps, int threads, const float *weight, const float *nu, const float *inv_s,
                            const float *inv_s_b, float *dx, double *s_all, double *s_real, double *s_dy,
                            int stream) {
    long G = groups ? groups : 1, k = C / G;
    int streamed = streamable(stream, dx, k);
    float *a = malloc(sizeof(float) * 2 * C), *cc = a + C;
    for (long c = 0; c < C; c++) { a[c] = weight[c] * inv_s_b[c]; cc[c] = nu[c] * inv_s[c] * inv_s_b[c]; }
    int want_sums = s_all != NULL;
    if (want_sums) {
        memset(s_all, 0, sizeof(double) * C);
        memset(s_real, 0, sizeof(double) * C);
        memset(s_dy, 0, sizeof(double) * C);
    }
    #pragma omp parallel num_threads(team(threads, T * C))
    {
        float *acc = want_sums ? calloc(3 * C, sizeof(float)) : NULL;
        double *dacc = want_sums ? calloc(3 * C, sizeof(double)) : NULL;
        /* per token one of two sums of dy z0: real tokens' (s_real) or padding's; s_all is both
           (token weights are 0 or 1 wherever this runs: _flatten's and _kernel_mask's) */
        float *a_pad = acc, *a_real = acc ? acc + C : NULL, *a_dy = acc ? acc + 2 * C : NULL;
        float *r = malloc(sizeof(float) * G);
        long rows = 0;
        #pragma omp for schedule(static)
        for (long t = 0; t < T; t++) {
            const float *dyt = dy + t * C, *xt = x + t * C;
            float *dxt = dx ? dx + t * C : NULL;  /* no dx: the sums only */
            float wt = mask_weight(m, kind, t);
            float *a_tok = wt != 0.0f ? a_real : a_pad;
            group_scales(xt, C, groups, eps, r);
            for (long g = 0; g < G; g++) {
                long o = g * k;
                float rg = r[g], proj = 0.0f;
                if (!dx) {  /* a loop of its own: a conditional store would keep it from vectorising */
                    #pragma omp simd
                    for (long j = 0; j < k; j++) {
                        float z0 = xt[o + j] * rg, d = dyt[o + j], p = d * z0;
                        a_tok[o + j] += p;
                        a_dy[o + j] += d;
                    }
                    continue;
                }
#if STREAM_FLOATS
                if (streamed) {  /* the sums and the projection, then dx recomputed and streamed */
                    if (want_sums) {
                        #pragma omp simd reduction(+:proj)
                        for (long j = 0; j < k; j++) {
                            float z0 = xt[o + j] * rg, d = dyt[o + j], p = d * z0;
                            a_tok[o + j] += p;
                            a_dy[o + j] += d;
                            proj += (d * a[o + j] - wt * cc[o + j] * z0) * z0;
                        }
                    } else {
                        #pragma omp simd reduction(+:proj)
                        for (long j = 0; j < k; j++) {
                            float z0 = xt[o + j] * rg;
                            proj += (dyt[o + j] * a[o + j] - wt * cc[o + j] * z0) * z0;
                        }
                    }
                    stream_backward(xt + o, dyt + o, a + o, cc + o, rg, wt, proj / (float)k, groups != 0, dxt + o, k);
                    continue;
                }
#endif
                if (!want_sums) {
                    #pragma omp simd reduction(+:proj)
                    for (long j = 0; j < k; j++) {
                        float z0 = xt[o + j] * rg, dz0 = dyt[o + j] * a[o + j] - wt * cc[o + j] * z0;
                        dxt[o + j] = dz0;
                        proj += dz0 * z0;
                    }
                } else {
                    #pragma omp simd reduction(+:proj)
                    for (long j = 0; j < k; j++) {
                        float z0 = xt[o + j] * rg, d = dyt[o + j], p = d * z0;
                        a_tok[o + j] += p;
                        a_dy[o + j] += d;
                        float dz0 = d * a[o + j] - wt * cc[o + j] * z0;
                        dxt[o + j] = dz0;
                        proj += dz0 * z0;
                    }
                }
                if (groups == 0) continue;
                proj /= (float)k;
                #pragma omp simd
                for (long j = 0; j < k; j++) dxt[o + j] = rg * (dxt[o + j] - xt[o + j] * rg * proj);
            }
            if (want_sums && ++rows % FLUSH == 0) add_to(dacc, acc, 3 * C);
        }
        if (want_sums) add_to(dacc, acc, 3 * C);
        #pragma omp critical
        for (long c = 0; want_sums && c < C; c++) {
            s_all[c] += dacc[c] + dacc[C + c];
            s_real[c] += dacc[C + c];
            s_dy[c] += dacc[2 * C + c];
        }
        free(acc);
        free(dacc);
        free(r);
    }
#if STREAM_FLOATS
    if (streamed) _mm_sfence();
#endif
    free(a);
}

void pn_backward(const float *dy, const float *x, const void *m, int kind, long T, long C, long groups, float eps,
                 int threads, const float *weight, const float *nu, const float *inv_s, const float *inv_s_b,
                 float *dx, double *s_all, double *s_real, double *s_dy) {
    backward_masked(dy, x, m, kind, T, C, groups, eps, threads, weight, nu, inv_s, inv_s_b, dx, s_all, s_real, s_dy, 0);
}

/* Rows t0 <= t < t1 of norm_eval's output. */
static void eval_rows(const float *x, long t0, long t1, long C, long groups, float gs_eps, const float *scale,
                      const float *shift, int streamed, float *y) {
    long G = groups ? groups : 1, k = C / G;
    float r[G];
    for (long t = t0; t < t1; t++) {
        const float *xt = x + t * C;
        float *yt = y + t * C;
        group_scales(xt, C, groups, gs_eps, r);
        for (long g = 0; g < G; g++) {
            long o = g * k;
            float rg = r[g];
#if STREAM_FLOATS
            if (streamed) { stream_affine(xt + o, rg, scale + o, shift + o, yt + o, k); continue; }
#endif
            #pragma omp simd
            for (long j = 0; j < k; j++) yt[o + j] = xt[o + j] * rg * scale[o + j] + shift[o + j];
        }
    }
}

/* An eval-mode norm in one pass over the rows of x (T x C): y = GS(x) scale + shift with
   scale = weight / sqrt(var + eps) and shift = bias - mean scale per channel (a missing vector
   counts as 1 for weight, 0 for bias and mean, and no var means scale = weight): PN, PN-V and MABN
   (var = the running quadratic mean), BN and BRN (mean and variance), RMSNorm (groups 1, gs_eps
   its eps, weight only) and the group scaling left by folding (no vectors). groups = 0: no group
   scaling. stream != 0: streaming stores where the layout allows. */
void norm_eval(const float *x, long T, long C, long groups, float gs_eps, int threads,
               const float *weight, const float *bias, const float *mean, const float *var, float eps,
               int stream, float *y) {
    long G = groups ? groups : 1, k = C / G;
    float *scale = malloc(sizeof(float) * 2 * C), *shift = scale + C;
    for (long c = 0; c < C; c++) {
        float s = weight ? weight[c] : 1.0f;
        if (var) s = s / sqrtf(var[c] + eps);
        scale[c] = s;
        shift[c] = (bias ? bias[c] : 0.0f) - (mean ? mean[c] * s : 0.0f);
    }
    int streamed = streamable(stream, y, k), nthr = team(threads, T * C);
    if (nthr == 1) {  /* a decoding step's few tokens: no OpenMP team to set up */
        eval_rows(x, 0, T, C, groups, gs_eps, scale, shift, streamed, y);
    } else {
        #pragma omp parallel num_threads(nthr)
        {  /* the static schedule's contiguous chunks */
            long i = omp_get_thread_num(), n = omp_get_num_threads();
            eval_rows(x, T * i / n, T * (i + 1) / n, C, groups, gs_eps, scale, shift, streamed, y);
        }
    }
#if STREAM_FLOATS
    if (streamed) _mm_sfence();
#endif
    free(scale);
}

/* Batch moments over real tokens in one pass over x (T x C), about a shift K (the running mean:
   near the batch mean, so the float partial sums of squares lose little to cancellation):
   sums[c] = sum_t w_t (x - K), sums[C + c] = sum_t w_t (x - K)^2, sums[2C] = sum_t w_t. */
void bn_moments(const float *x, const void *m, int kind, long T, long C, const float *shift, int threads,
                double *sums) {
    memset(sums, 0, sizeof(double) * (2 * C + 1));
    if (kind) { for (long t = 0; t < T; t++) sums[2 * C] += mask_weight(m, kind, t); } else sums[2 * C] = (double)T;
    #pragma omp parallel num_threads(team(threads, T * C))
    {
        float *acc = calloc(2 * C, sizeof(float)), *acc2 = acc + C;
        double *dacc = calloc(2 * C, sizeof(double));
        long rows = 0;
        #pragma omp for schedule(static)
        for (long t = 0; t < T; t++) {
            float wt = mask_weight(m, kind, t);
            if (wt == 0.0f) continue;
            const float *xt = x + t * C;
            #pragma omp simd
            for (long c = 0; c < C; c++) {
                float d = xt[c] - shift[c];
                acc[c] += wt * d;
                acc2[c] += wt * d * d;
            }
            if (++rows % FLUSH == 0) add_to(dacc, acc, 2 * C);
        }
        add_to(dacc, acc, 2 * C);
        #pragma omp critical
        for (long c = 0; c < 2 * C; c++) sums[c] += dacc[c];
        free(acc);
        free(dacc);
    }
}

/* The input gradient of a per-channel affine map with batch-statistic terms, one pass:
   dx = dy a - w_t (c x + e) (real tokens carry the statistics' terms, padding gets dy a). */
static void affine_backward_rows(const float *dy, const float *x, const void *m, int kind, long T, long C,
                                 int threads, const float *a, const float *cc, const float *e, float *dx, int stream) {
    int streamed = streamable(stream, dx, C);
    #pragma omp parallel for num_threads(team(threads, T * C)) schedule(static)
    for (long t = 0; t < T; t++) {
        const float *dyt = dy + t * C, *xt = x + t * C;
        float *dxt = dx + t * C;
        float wt = mask_weight(m, kind, t);
#if STREAM_FLOATS
        if (streamed) {
            vfloat vw = VEC(set1_ps)(wt);
            for (long c = 0; c < C; c += STREAM_FLOATS)
                VEC(stream_ps)(dxt + c, VEC(sub_ps)(
                    VEC(mul_ps)(VEC(loadu_ps)(dyt + c), VEC(loadu_ps)(a + c)),
                    VEC(mul_ps)(vw, VEC(add_ps)(VEC(mul_ps)(VEC(loadu_ps)(cc + c), VEC(loadu_ps)(xt + c)),
                                                VEC(loadu_ps)(e + c)))));
            continue;
        }
#endif
        #pragma omp simd
        for (long c = 0; c < C; c++) dxt[c] = dyt[c] * a[c] - wt * (cc[c] * xt[c] + e[c]);
    }
#if STREAM_FLOATS
    if (streamed) _mm_sfence();
#endif
}

/* torch.lerp's formula, so that the buffers match the torch ops' bit for bit where they can. */
static float lerp(float start, float end, float weight) {
    return weight < 0.5f ? start + weight * (end - start) : end - (end - start) * (1.0f - weight);
}

static float clampf(float v, float lo, float hi) { return v < lo ? lo : (v > hi ? hi : v); }

/* Masked BN's and BRN's training forward in one call (MaskedBatchNorm / BatchRenorm): the moments
   pass (about the running mean), the step's statistics, the output pass y = x a + b with
   a = weight r / sigma, b = bias + weight d - mean a. mean = K + S1/n, var = max(S2/n - (S1/n)^2, 0)
   (biased), usable = count > 0 and both finite; BRN (renorm): r = clip(sqrt(var + eps) / sigma_run,
   1/rmax, rmax), d = clip((mean - mu_run) / sigma_run, -dmax, dmax) from the running statistics before
   the update; BN: r = 1, d = 0. An unusable batch takes the running mean and variance, r = 1, d = 0,
   and updates nothing. A usable one updates running_mean and running_var (lerp by momentum, the
   unbiased variance var n / max(n - 1, 1)) and the counter. out (4 x C): mean, 1/sigma, r, d of the
   step; reuse != 0 (a checkpointing recomputation): out holds them already, the output pass alone.
   Returns 1 usable, 0 no real token, -1 non-finite statistics (as pn_statistics). */
int bn_step_forward(const float *x, const void *m, int kind, long T, long C, int threads, const float *weight,
                    const float *bias, float *running_mean, float *running_var, long long *counter, float eps,
                    float momentum, int renorm, float rmax, float dmax, int reuse, int stream, float *y, float *out,
                    float *count) {
    float *mean = out, *inv = out + C, *r = out + 2 * C, *d = out + 3 * C;
    int status = 1;
    if (!reuse) {
        double *sums = malloc(sizeof(double) * (2 * C + 1));
        bn_moments(x, m, kind, T, C, running_mean, threads, sums);
        *count = (float)sums[2 * C];
        double n = sums[2 * C] > 1.0 ? sums[2 * C] : 1.0;
        int finite = 1;
        for (long c = 0; c < C; c++) {  /* the batch's mean and variance, kept in r and d for now */
            double centred = sums[c] / n, var = sums[C + c] / n - centred * centred;
            r[c] = (float)((double)running_mean[c] + centred);
            d[c] = (float)(var > 0.0 ? var : 0.0);
            finite &= isfinite(r[c]) && isfinite(d[c]);
        }
        free(sums);
        status = *count > 0.0f && finite ? 1 : (*count > 0.0f ? -1 : 0);
        float unbias = *count / (*count - 1.0f > 1.0f ? *count - 1.0f : 1.0f);
        for (long c = 0; c < C; c++) {
            float batch_mean = r[c], batch_var = d[c];
            float inv_run = 1.0f / sqrtf(running_var[c] + eps);
            if (status != 1) {
                mean[c] = running_mean[c]; inv[c] = inv_run; r[c] = 1.0f; d[c] = 0.0f;
                continue;
            }
            mean[c] = batch_mean;
            inv[c] = 1.0f / sqrtf(batch_var + eps);
            r[c] = renorm ? clampf(sqrtf(batch_var + eps) * inv_run, 1.0f / rmax, rmax) : 1.0f;
            d[c] = renorm ? clampf((batch_mean - running_mean[c]) * inv_run, -dmax, dmax) : 0.0f;
            running_mean[c] = lerp(running_mean[c], batch_mean, momentum);
            running_var[c] = lerp(running_var[c], batch_var * unbias, momentum);
        }
        if (status == 1) *counter += 1;
    }
    float *a = malloc(sizeof(float) * 2 * C), *b = a + C;
    for (long c = 0; c < C; c++) {
        a[c] = weight[c] * r[c] * inv[c];
        b[c] = bias[c] + weight[c] * d[c] - mean[c] * a[c];
    }
    norm_eval(x, T, C, 0, 0.0f, threads, a, b, NULL, NULL, 0.0f, stream, y);
    free(a);
    return status;
}

/* PN-V's training forward in one call (PowerNormV): the statistics pass, v = sum_V z0^2 / max(n, 1),
   usable = n > 0 and v finite, 1/s = 1/sqrt(v + eps) for a usable batch, else 1/sqrt(phi + eps);
   phi <- lerp(phi, v, ema) and the counter for a usable batch unless `update` is 0 (a checkpointing
   recomputation); the output pass y = z0 weight / s + bias. inv_s (C) receives 1/s; *count the real
   tokens; returns 1 usable, 0 no real token, -1 non-finite v. */
int pnv_step_forward(const float *x, const void *m, int kind, long T, long C, long groups, float gs_eps, int threads,
                     const float *weight, const float *bias, float *phi, long long *counter, float eps, float ema,
                     int update, int stream, float *y, float *inv_s, float *count) {
    double *sums = malloc(sizeof(double) * (C + 1));
    float *v = malloc(sizeof(float) * 2 * C), *scale = v + C;
    rows_masked(x, m, kind, T, C, groups, gs_eps, threads, NULL, NULL, NULL, sums, 0);
    *count = (float)sums[C];
    float n = *count > 1.0f ? *count : 1.0f;
    int finite = 1;
    for (long c = 0; c < C; c++) { v[c] = (float)sums[c] / n; finite &= isfinite(v[c]) != 0; }
    int usable = *count > 0.0f && finite;
    for (long c = 0; c < C; c++) {
        inv_s[c] = 1.0f / sqrtf((usable ? v[c] : phi[c]) + eps);
        scale[c] = weight[c] * inv_s[c];
        if (usable && update) phi[c] = lerp(phi[c], v[c], ema);
    }
    if (usable && update) *counter += 1;
    rows_masked(x, NULL, 0, T, C, groups, gs_eps, threads, scale, bias, y, NULL, stream);
    free(sums);
    free(v);
    return usable ? 1 : (*count > 0.0f ? -1 : 0);
}

/* The backward of bn_step_forward: a sums pass (S1 = sum_all dy, S2 = sum_all dy (x - mean)) and the
   input-gradient pass dx = a dy - (real) (a S1 / n + a S2 (x - mean) / (n sigma^2)), the batch terms
   only for a usable step; grads (2 x C): dweight = r S2 / sigma + d S1, dbias = S1. */
void bn_step_backward(const float *dy, const float *x, const void *m, int kind, long T, long C, int threads,
                      const float *weight, const float *out, float count, int usable, int stream, float *dx,
                      float *grads) {
    const float *mean = out, *inv = out + C, *r = out + 2 * C, *d = out + 3 * C;
    double *sums = malloc(sizeof(double) * 3 * C);
    float *v = malloc(sizeof(float) * 5 * C), *ones = v, *zeros = v + C, *a = v + 2 * C, *cc = v + 3 * C, *e = v + 4 * C;
    for (long c = 0; c < C; c++) { ones[c] = 1.0f; zeros[c] = 0.0f; }
    backward_masked(dy, x, NULL, 0, T, C, 0, 0.0f, threads, ones, zeros, ones, ones, NULL, sums, sums + C, sums + 2 * C,
                    0);
    float n = count > 1.0f ? count : 1.0f;
    for (long c = 0; c < C; c++) {
        float s1 = (float)sums[2 * C + c], s2 = (float)(sums[c] - (double)mean[c] * sums[2 * C + c]);
        a[c] = weight[c] * r[c] * inv[c];
        cc[c] = usable ? a[c] * inv[c] * inv[c] * s2 / n : 0.0f;
        e[c] = (usable ? a[c] * s1 / n : 0.0f) - cc[c] * mean[c];
        grads[c] = r[c] * inv[c] * s2 + d[c] * s1;
        grads[C + c] = s1;
    }
    affine_backward_rows(dy, x, m, kind, T, C, threads, a, cc, e, dx, stream);
    free(sums);
    free(v);
}

/* One training step's statistics from the (reduced) sums, on C channels
   (norm_dispatch._pn_step_denominators):
   v = sum_sq / max(count, 1); usable = count > 0 and v finite; 1/s from the warmup weight
   r = clamp((t - W) / (K + 1), 0, 1) (the batch, the running or the blended denominator);
   1/s_b = 1/s (backward "running") or the batch one; phi (float32 buffer) and the counter (int64)
   updated in place for a usable batch (ema = 1 - alpha_fwd). Returns 1 usable, 0 skipped, -1 skipped for non-finite v. */
int pn_statistics(const float *sum_sq, float count, long C, float *phi, long long *counter, float eps,
                  long warmup, long ramp, float ema, int reference, int batch_backward,
                  float *v, float *inv_s, float *inv_s_b) {
    long long t = *counter + 1;
    float n = count > 1.0f ? count : 1.0f;
    int finite = 1;
    for (long c = 0; c < C; c++) { v[c] = sum_sq[c] / n; finite &= isfinite(v[c]) != 0; }
    int usable = count > 0.0f && finite;
    float r = (float)(t - warmup) / (float)(ramp + 1);
    r = r < 0.0f ? 0.0f : (r > 1.0f ? 1.0f : r);
    float cumulative = 1.0f / (float)t;
    for (long c = 0; c < C; c++) {
        float running = 1.0f / sqrtf(phi[c] + eps), batch = 1.0f / sqrtf(v[c] + eps);
        float s = r == 0.0f ? batch : (r == 1.0f ? running : 1.0f / sqrtf((1.0f - r) * v[c] + r * phi[c] + eps));
        inv_s[c] = usable ? s : running;
        inv_s_b[c] = usable ? (batch_backward ? batch : s) : running;
        if (!usable) continue;
        if (!reference) {
            phi[c] = lerp(phi[c], v[c], t <= warmup ? cumulative : ema);
        } else {
            if (t < warmup) phi[c] = lerp(phi[c], v[c], cumulative);
            phi[c] = lerp(phi[c], v[c], ema);
        }
    }
    if (usable) *counter += 1;
    return usable ? 1 : (count > 0.0f ? -1 : 0);
}

/* The backward's statistics (PowerNorm._update_nu and the parameter gradients), on C channels:
   Lambda = weight inv_s s_real / max(count, 1), Gamma = v inv_s^2;
   nu <- nu (1 - rate Gamma) + rate Lambda (rate = 1 - alpha_bkw) where the forward was usable and
   Lambda is finite; dweight = inv_s s_all. Returns 1 updated, 0 not, -1 not for non-finite Lambda. */
int pn_gradient_statistics(const double *s_all, const double *s_real, const float *weight, const float *v,
                           const float *inv_s, float count, long C, int usable, float rate, float *nu,
                           float *grad_weight) {
    float n = count > 1.0f ? count : 1.0f;
    int finite = 1;
    for (long c = 0; c < C; c++) {
        float lam = weight[c] * inv_s[c] * (float)s_real[c] / n;
        finite &= isfinite(lam) != 0;
        grad_weight[c] = inv_s[c] * (float)s_all[c];
    }
    if (!usable || count <= 0.0f) return 0;
    if (!finite) return -1;
    for (long c = 0; c < C; c++) {
        float lam = weight[c] * inv_s[c] * (float)s_real[c] / n, gamma = v[c] * (inv_s[c] * inv_s[c]);
        nu[c] = nu[c] * (1.0f - rate * gamma) + rate * lam;
    }
    return 1;
}

/* PowerNorm's whole training forward in one call (norm_dispatch._pn_step_denominators with the passes):
   once the denominator is the running statistic whatever the batch (t > W + K), statistics and
   output in one pass with scale = weight / sqrt(phi + eps), phi before this step's update; else a
   statistics pass, the step's statistics, then the output pass with scale = weight / s.
   stats (3 x C) receives v, 1/s, 1/s_b; *count the real tokens; returns pn_statistics's status. */
int pn_step_forward(const float *x, const void *m, int kind, long T, long C, long groups, float gs_eps,
                    int threads, const float *weight, const float *bias, float *phi, long long *counter, float eps,
                    long warmup, long ramp, float ema, int reference, int batch_backward, int stream, float *y,
                    float *stats, float *count) {
    double *sums = malloc(sizeof(double) * (C + 1));
    float *scale = malloc(sizeof(float) * 2 * C), *sum_sq = scale + C;
    long long t = *counter + 1;
    int running = t - warmup >= ramp + 1;  /* the weight of the running statistic r = 1 */
    if (running) {
        /* weight times pn_statistics's 1/s: a recomputation's weight * (1/s) gives the same bits */
        for (long c = 0; c < C; c++) scale[c] = weight[c] * (1.0f / sqrtf(phi[c] + eps));
        rows_masked(x, m, kind, T, C, groups, gs_eps, threads, scale, bias, y, sums, stream);
    } else {
        rows_masked(x, m, kind, T, C, groups, gs_eps, threads, NULL, NULL, NULL, sums, 0);
    }
    for (long c = 0; c < C; c++) sum_sq[c] = (float)sums[c];
    *count = (float)sums[C];
    int status = pn_statistics(sum_sq, *count, C, phi, counter, eps, warmup, ramp, ema, reference, batch_backward,
                               stats, stats + C, stats + 2 * C);
    if (!running) {
        for (long c = 0; c < C; c++) scale[c] = weight[c] * stats[C + c];
        rows_masked(x, NULL, 0, T, C, groups, gs_eps, threads, scale, bias, y, NULL, stream);
    }
    free(sums);
    free(scale);
    return status;
}

/* PN-V's exact backward in one call: a sums pass (S = sum_all dY z0, sum_all dY), then the
   input-gradient pass of pn_backward with nu = usable ? weight S inv_s / max(count, 1) : 0 (its
   c = nu inv_s^2); grads (2 x C) receives dweight = inv_s S and dbias = sum_all dY. */
void pnv_step_backward(const float *dy, const float *x, const void *m, int kind, long T, long C, long groups,
                       float gs_eps, int threads, const float *weight, const float *inv_s, float count, int usable,
                       int stream, float *dx, float *grads) {
    double *sums = malloc(sizeof(double) * 3 * C);
    float *nu = calloc(C, sizeof(float));
    backward_masked(dy, x, m, kind, T, C, groups, gs_eps, threads, weight, nu, inv_s, inv_s, NULL, sums, sums + C,
                    sums + 2 * C, 0);
    float n = count > 1.0f ? count : 1.0f;
    for (long c = 0; c < C; c++) {
        float total = (float)sums[c];
        nu[c] = usable ? weight[c] * total * inv_s[c] / n : 0.0f;
        grads[c] = inv_s[c] * total;
        grads[C + c] = (float)sums[2 * C + c];
    }
    backward_masked(dy, x, m, kind, T, C, groups, gs_eps, threads, weight, nu, inv_s, inv_s, dx, NULL, NULL, NULL,
                    stream);
    free(sums);
    free(nu);
}

/* MABN's training forward in one call (MovingAverageBatchNorm._forward_statistics with the passes):
   the moments pass (S = sum_V x^2), chi2_B = S / max(n, 1), usable = n > 0 and chi2_B finite; step
   t = counter + 1; a usable batch is stored in window_phi[t % m]; chi2 = chi2_B while t <= m or t < W,
   else the mean of window_phi's m rows; r = clip(sqrt((chi2 + eps) / (phi + eps)), 1/rmax, rmax) for
   a usable step after max(renorm_warmup, W), else 1; 1/chi = 1/sqrt(chi2 + eps), or 1/sqrt(phi + eps)
   for an unusable batch; a usable batch moves phi towards chi2 (lerp by momentum) and counts. Then
   the output pass y = x weight r / chi + bias. out (2 x C) receives 1/chi and r; reuse != 0 (a
   checkpointing recomputation): out holds them already, the output pass alone. Returns 1 usable,
   0 no real token, -1 non-finite chi2_B (as bn_step_forward). */
int mabn_step_forward(const float *x, const void *m, int kind, long T, long C, int threads, const float *weight,
                      const float *bias, float *phi, float *window_phi, long window, long long *counter, float eps,
                      float momentum, long warmup, float rmax, long renorm_warmup, int reuse, int stream, float *y,
                      float *out, float *count) {
    float *inv = out, *r = out + C;
    int status = 1;
    if (!reuse) {
        double *sums = malloc(sizeof(double) * (2 * C + 1));
        float *chi2 = malloc(sizeof(float) * 2 * C), *batch = chi2 + C;
        float *zeros = calloc(C, sizeof(float));
        bn_moments(x, m, kind, T, C, zeros, threads, sums);
        *count = (float)sums[2 * C];
        double n = *count > 1.0f ? (double)*count : 1.0;
        int finite = 1;
        for (long c = 0; c < C; c++) { batch[c] = (float)(sums[C + c] / n); finite &= isfinite(batch[c]) != 0; }
        status = *count > 0.0f && finite ? 1 : (*count > 0.0f ? -1 : 0);
        long long t = *counter + 1;
        if (status == 1) memcpy(window_phi + (t % window) * C, batch, sizeof(float) * C);
        int batch_phase = t <= window || t < warmup;
        int renormalize = status == 1 && t > (renorm_warmup > warmup ? renorm_warmup : warmup);
        for (long c = 0; c < C; c++) {
            if (batch_phase) {
                chi2[c] = batch[c];
            } else {
                float total = 0.0f;
                for (long k = 0; k < window; k++) total += window_phi[k * C + c];
                chi2[c] = total / (float)window;
            }
            r[c] = renormalize ? clampf(sqrtf((chi2[c] + eps) / (phi[c] + eps)), 1.0f / rmax, rmax) : 1.0f;
            inv[c] = 1.0f / sqrtf((status == 1 ? chi2[c] : phi[c]) + eps);
            if (status == 1) phi[c] = lerp(phi[c], chi2[c], momentum);
        }
        if (status == 1) *counter += 1;
        free(sums);
        free(chi2);
        free(zeros);
    }
    float *a = malloc(sizeof(float) * C);
    for (long c = 0; c < C; c++) a[c] = weight[c] * r[c] * inv[c];
    norm_eval(x, T, C, 0, 0.0f, threads, a, bias, NULL, NULL, 0.0f, stream, y);
    free(a);
    return status;
}

/* The backward of mabn_step_forward (MovingAverageBatchNorm._backward_statistic with the passes): a
   sums pass (sum_all dY x, sum_V dY x, sum_all dY); Psi_B = a sum_V(dY x) / max(n, 1), a = weight r / chi;
   a usable step with finite Psi_B stores it in window_gz[t % m]; Psi = Psi_B while t <= m or t < W, else
   the mean of window_gz's m rows; Psi_B itself where it is not finite; 0 after an unusable forward. The
   input-gradient pass dx = dY a - (real) Psi x / chi^2; grads (2 x C): dweight = r / chi sum_all(dY x),
   dbias = sum_all dY. Returns -1 where a usable step's Psi_B is not finite (nothing stored), else 0. */
int mabn_step_backward(const float *dy, const float *x, const void *m, int kind, long T, long C, int threads,
                       const float *weight, const float *out, float *window_gz, long window, long long step,
                       long warmup, float count, int usable, int stream, float *dx, float *grads) {
    const float *inv = out, *r = out + C;
    double *sums = malloc(sizeof(double) * 3 * C);
    float *v = malloc(sizeof(float) * 6 * C), *ones = v, *zeros = v + C, *a = v + 2 * C, *psi = v + 3 * C;
    float *cc = v + 4 * C, *batch = v + 5 * C;
    for (long c = 0; c < C; c++) { ones[c] = 1.0f; zeros[c] = 0.0f; }
    backward_masked(dy, x, m, kind, T, C, 0, 0.0f, threads, ones, zeros, ones, ones, NULL, sums, sums + C, sums + 2 * C,
                    0);
    float n = count > 1.0f ? count : 1.0f;
    int finite = 1;
    for (long c = 0; c < C; c++) {
        a[c] = weight[c] * r[c] * inv[c];
        batch[c] = a[c] * (float)sums[C + c] / n;
        finite &= isfinite(batch[c]) != 0;
    }
    if (usable && finite) memcpy(window_gz + (step % window) * C, batch, sizeof(float) * C);
    int batch_phase = step <= window || step < warmup;
    for (long c = 0; c < C; c++) {
        if (!usable) {
            psi[c] = 0.0f;
        } else if (batch_phase || !finite) {
            psi[c] = batch[c];
        } else {
            float total = 0.0f;
            for (long k = 0; k < window; k++) total += window_gz[k * C + c];
            psi[c] = total / (float)window;
        }
        cc[c] = psi[c] * (inv[c] * inv[c]);
        grads[c] = r[c] * inv[c] * (float)sums[c];
        grads[C + c] = (float)sums[2 * C + c];
    }
    affine_backward_rows(dy, x, m, kind, T, C, threads, a, cc, zeros, dx, stream);
    free(sums);
    free(v);
    return usable && !finite ? -1 : 0;
}

/* PowerNorm's whole backward in one call: the pass of pn_backward, then pn_gradient_statistics
   (nu read by the pass before it is updated); grads (2 x C) receives dweight and dbias. */
int pn_step_backward(const float *dy, const float *x, const void *m, int kind, long T, long C, long groups,
                     float gs_eps, int threads, const float *weight, float *nu, const float *stats, float count,
                     int usable, float rate, int stream, float *dx, float *grads) {
    double *sums = malloc(sizeof(double) * 3 * C);
    const float *v = stats, *inv_s = stats + C, *inv_s_b = stats + 2 * C;
    backward_masked(dy, x, m, kind, T, C, groups, gs_eps, threads, weight, nu, inv_s, inv_s_b, dx, sums, sums + C,
                    sums + 2 * C, stream);
    int status = pn_gradient_statistics(sums, sums + C, weight, v, inv_s, count, C, usable, rate, nu, grads);
    for (long c = 0; c < C; c++) grads[C + c] = (float)sums[2 * C + c];
    free(sums);
    return status;
}

/* DyT's and Derf's code, and theirs alone, is built with contracted multiply-adds (one rounding
   where ISO C's default, off, rounds twice) and, on x86-64, the CPU's widest vectors (GCC's default
   for AVX-512 is 256 bits): it is arithmetic-bound where LayerNorm's passes are memory-bound (about
   0.6x the time of the default build, 2026-12-03). The other kernels keep their bits. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define SQUASH_CODE __attribute__((optimize("fp-contract=fast"), target("prefer-vector-width=512")))
#elif defined(__GNUC__) && !defined(__clang__)
#define SQUASH_CODE __attribute__((optimize("fp-contract=fast")))
#else
#define SQUASH_CODE
#endif

/* DyT's and Derf's squashing functions in arithmetic the compiler vectorises (libm's tanhf, erff
   and expf are scalar calls here): f(z) and f'(z) from one shared value k = CORE(z), without branches
   (selects only), so that the loops below vectorise. tanh (k = tanh z, tanh' = 1 - k^2) as Eigen's
   rational approximation (`generic_fast_tanh_float`: an odd polynomial of degree 13 over an even one
   of degree 6, the argument clamped to +-7.905, where tanh rounds to +-1 in float32): at most 2.8e-7
   from float64 tanh, about half the arithmetic of 2 sigmoid(2z) - 1 through exp (no range
   reduction). erf: its value as 16 polynomials of degree 5 in t = a - i/4 on a = |z| in [i/4, (i+1)/4)
   (`ERF_TABLE`, i = 0..15; the first without a constant term, fitted in relative error, so that the
   erf of a tiny z keeps its relative accuracy), 1 from a = 4 on (where erf rounds to 1 in float32),
   the sign put back last: least-squares fits at 200 Chebyshev nodes of each interval, rounded to
   float32, at most 6.4e-8 from float64 erf on every float32 in [1/16, 8) and 1.6e-7 relative below
   0.3. The AVX-512 build reads each coefficient with one vector permute (16 floats: one register),
   other builds index the table; the two give the same bits (tested). Its slope k = erf'(z) =
   2 / sqrt(pi) exp(-z^2), on a clamped to 9.25 (exp(-a^2) and its 2^n stay normal floats), with no
   division: exp's n = round(-a^2 log2 e) by the 1.5 2^23 shifter, whose low bits go to the exponent
   field, and 2 / sqrt(pi) 2^f a minimax polynomial (relative error 2e-7). The table took about 0.6x
   the forward's time of the odd series below 475/512 and 1 - k P(a) above it, which needed k and
   both branches in every lane (2026-12-03). */
SQUASH_CODE static inline float tanh_core(float z) {
    float x = z < -7.90531110763549805f ? -7.90531110763549805f : z;  /* NaN stays NaN */
    x = x > 7.90531110763549805f ? 7.90531110763549805f : x;
    float q = x * x;
    float p = x * (4.89352455891786e-03f + q * (6.37261928875436e-04f + q * (1.48572235717979e-05f
              + q * (5.12229709037114e-08f + q * (-8.60467152213735e-11f + q * (2.00018790482477e-13f
              + q * -2.76076847742355e-16f))))));
    float d = 4.89352518554385e-03f + q * (2.26843463243900e-03f + q * (1.18534705686654e-04f
              + q * 1.19825839466702e-06f));
    return p / d;
}
SQUASH_CODE static inline float tanh_value(float z, float k) { (void)z; return k; }
SQUASH_CODE static inline float tanh_slope(float k) { return 1.0f - k * k; }
SQUASH_CODE static inline float erf_abs(float z) {  /* |z| clamped to 9.25: exp(-z^2) and 2^n stay normal */
    float a = fabsf(z);
    return a > 9.25f ? 9.25f : a;  /* NaN stays NaN */
}
SQUASH_CODE static inline float erf_core(float z) {  /* 2 / sqrt(pi) exp(-a^2) = 2^n (2 / sqrt(pi)) 2^f, |f| <= 1/2 */
    float a = erf_abs(z), q = a * a;
    float s = fmaf(q, -1.44269504088896341f, 12582912.0f);  /* 1.5 2^23 + n: n = round(-q log2 e) in the low bits */
    float n = s - 12582912.0f;
    float f = fmaf(q, -1.44269504088896341f, -n);  /* one rounding each, written out: the compiler may
                                                     otherwise share q log2 e rounded between the two */
    float p = f * 1.498089056e-03f + 1.091767941e-02f;  /* 2 / sqrt(pi) 2^f: minimax, relative error 2e-7 */
    p = p * f + 6.263308972e-02f;
    p = p * f + 2.710605860e-01f;
    p = p * f + 7.821326256e-01f;
    p = p * f + 1.128379226e+00f;
    union { float f; uint32_t i; } k = {p}, shifted = {s};
    k.i += shifted.i << 23;  /* n into the exponent field (s's bits above n's shift out): no multiply */
    return k.f;
}
SQUASH_CODE static inline float erf_slope(float k) { return k; }
static const float ERF_TABLE[6][16] = {
    {0.000000000e+00f, 2.763263881e-01f, 5.204998851e-01f, 7.111556530e-01f,
     8.427007794e-01f, 9.229001403e-01f, 9.661051631e-01f, 9.866716862e-01f,
     9.953222871e-01f, 9.985373020e-01f, 9.995930195e-01f, 9.998993874e-01f,
     9.999778867e-01f, 9.999957085e-01f, 9.999992847e-01f, 9.999998808e-01f},
    {1.128379107e+00f, 1.060012460e+00f, 8.787811399e-01f, 6.429306865e-01f,
     4.151079953e-01f, 2.365218848e-01f, 1.189308017e-01f, 5.277515203e-02f,
     2.066693082e-02f, 7.142212708e-03f, 2.178205177e-03f, 5.862363614e-04f,
     1.392365957e-04f, 2.918362588e-05f, 5.397949735e-06f, 8.810908412e-07f},
    {6.564881460e-06f, -2.649250627e-01f, -4.393229485e-01f, -4.821781218e-01f,
     -4.151301682e-01f, -2.956868708e-01f, -1.784196347e-01f, -9.236383438e-02f,
     -4.133149981e-02f, -1.606524922e-02f, -5.441987421e-03f, -1.610327745e-03f,
     -4.169766617e-04f, -9.460662113e-05f, -1.882726792e-05f, -3.288972493e-06f},
    {-3.763237298e-01f, -3.104997277e-01f, -1.476458609e-01f, 2.641994506e-02f,
     1.387420297e-01f, 1.681413949e-01f, 1.391726881e-01f, 9.029367566e-02f,
     4.818367958e-02f, 2.163982205e-02f, 8.285691030e-03f, 2.726646606e-03f,
     7.753649261e-04f, 1.912605658e-04f, 4.104059917e-05f, 7.677234862e-06f},
    {1.970166340e-03f, 1.370849609e-01f, 1.923905909e-01f, 1.538460255e-01f,
     6.649812311e-02f, -1.083057746e-02f, -4.794173315e-02f, -4.924307019e-02f,
     -3.418055922e-02f, -1.843130775e-02f, -8.114697412e-03f, -2.988355467e-03f,
     -9.333863272e-04f, -2.494553046e-04f, -5.739091284e-05f, -1.141547182e-05f},
    {1.060546041e-01f, 4.532615095e-02f, -2.703504823e-02f, -6.670918316e-02f,
     -6.106119603e-02f, -3.064391576e-02f, -2.303251997e-03f, 1.132802200e-02f,
     1.244421210e-02f, 8.360578679e-03f, 4.236414097e-03f, 1.727707335e-03f,
     5.842620158e-04f, 1.665797754e-04f, 4.045959940e-05f, 8.430430171e-06f}};

SQUASH_CODE static inline int erf_interval(float a) {  /* a in [0, 4] or NaN: i = floor(4a), at most 15 */
    float a4 = a * 4.0f;
    return a4 < 15.0f ? (int)a4 : 15;
}
SQUASH_CODE static inline float erf_value(float z, float k) {
    (void)k;
    float a = fabsf(z);
    a = a > 4.0f ? 4.0f : a;  /* NaN stays NaN */
    int i = erf_interval(a);
    float t = a - (float)i * 0.25f;  /* exact */
    float p = ERF_TABLE[5][i];
    p = p * t + ERF_TABLE[4][i];
    p = p * t + ERF_TABLE[3][i];
    p = p * t + ERF_TABLE[2][i];
    p = p * t + ERF_TABLE[1][i];
    p = p * t + ERF_TABLE[0][i];
    return copysignf(a >= 4.0f ? 1.0f : p, z);
}

#if defined(__AVX512F__)
/* erf_core and erf_value on 16 lanes, the same operations in the same order (so the same bits),
   the table's coefficients read with permutes where the compiler would gather. */
static inline __m512 erf_core16(__m512 z) {
    __m512 a = _mm512_min_ps(_mm512_set1_ps(9.25f), _mm512_abs_ps(z));  /* NaN (second operand) stays */
    __m512 q = _mm512_mul_ps(a, a), log2e = _mm512_set1_ps(-1.44269504088896341f);
    __m512 shifter = _mm512_set1_ps(12582912.0f);
    __m512 s = _mm512_fmadd_ps(q, log2e, shifter);
    __m512 n = _mm512_sub_ps(s, shifter);
    __m512 f = _mm512_fmsub_ps(q, log2e, n);
    __m512 p = _mm512_fmadd_ps(f, _mm512_set1_ps(1.498089056e-03f), _mm512_set1_ps(1.091767941e-02f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.263308972e-02f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.710605860e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(7.821326256e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.128379226e+00f));
    return _mm512_scalef_ps(p, n);  /* p 2^n, exact: n >= -123 keeps it normal, as the exponent add */
}
static inline __m512 erf_value16(__m512 z) {
    __m512 four = _mm512_set1_ps(4.0f);
    __m512 a = _mm512_min_ps(four, _mm512_abs_ps(z));
    __m512i i = _mm512_cvttps_epi32(_mm512_mul_ps(a, four));  /* 16 at a = 4 (permutes read i mod 16: a value
                                                                    then replaced by 1), NaN: 0x80000000 */
    __m512 t = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(i), _mm512_set1_ps(0.25f), a);
    __m512 p = _mm512_permutexvar_ps(i, _mm512_loadu_ps(ERF_TABLE[5]));
    p = _mm512_fmadd_ps(p, t, _mm512_permutexvar_ps(i, _mm512_loadu_ps(ERF_TABLE[4])));
    p = _mm512_fmadd_ps(p, t, _mm512_permutexvar_ps(i, _mm512_loadu_ps(ERF_TABLE[3])));
    p = _mm512_fmadd_ps(p, t, _mm512_permutexvar_ps(i, _mm512_loadu_ps(ERF_TABLE[2])));
    p = _mm512_fmadd_ps(p, t, _mm512_permutexvar_ps(i, _mm512_loadu_ps(ERF_TABLE[1])));
    p = _mm512_fmadd_ps(p, t, _mm512_permutexvar_ps(i, _mm512_loadu_ps(ERF_TABLE[0])));
    p = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, four, _CMP_GE_OQ), p, _mm512_set1_ps(1.0f));
    __m512i sign = _mm512_set1_epi32((int)0x80000000u);  /* copysign: z's sign bit, p's others */
    return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(sign, _mm512_castps_si512(z), _mm512_castps_si512(p), 0xCA));
}
/* One vector of Derf's forward (lanes outside m: nothing stored). */
static inline void erf_forward16(const float *xt, float *yt, long c, __mmask16 m, __m512 va, __m512 vs,
                                 const float *weight, const float *bias) {
    __m512 z = _mm512_fmadd_ps(va, _mm512_maskz_loadu_ps(m, xt + c), vs);
    __m512 y = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, weight + c), erf_value16(z),
                               _mm512_maskz_loadu_ps(m, bias + c));
    _mm512_mask_storeu_ps(yt + c, m, y);
}
/* Derf's forward row: y = weight erf(alpha x + shift) + bias; whole vectors, then the rest masked. */
static void erf_forward_row16(const float *xt, float *yt, long C, float alpha, float shift, const float *weight,
                              const float *bias) {
    __m512 va = _mm512_set1_ps(alpha), vs = _mm512_set1_ps(shift);
    long c = 0;
    for (; c + 16 <= C; c += 16) erf_forward16(xt, yt, c, (__mmask16)0xFFFF, va, vs, weight, bias);
    if (c < C) erf_forward16(xt, yt, c, (__mmask16)((1u << (C - c)) - 1u), va, vs, weight, bias);
}
/* One vector of Derf's backward (BACKWARD_ROW(erf, ...)'s arithmetic; lanes outside m add 0). */
static inline void erf_backward16(const float *dyt, const float *xt, float *dxt, long c, __mmask16 m, __m512 va,
                                  __m512 vs, const float *weight, float *acc, float *acc_b, __m512 *sum_a,
                                  __m512 *sum_s) {
    __m512 x = _mm512_maskz_loadu_ps(m, xt + c), dy = _mm512_maskz_loadu_ps(m, dyt + c);
    __m512 z = _mm512_fmadd_ps(va, x, vs);
    __m512 g = _mm512_mul_ps(_mm512_mul_ps(dy, _mm512_maskz_loadu_ps(m, weight + c)), erf_core16(z));
    _mm512_mask_storeu_ps(acc + c, m, _mm512_fmadd_ps(dy, erf_value16(z), _mm512_maskz_loadu_ps(m, acc + c)));
    _mm512_mask_storeu_ps(acc_b + c, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, acc_b + c), dy));
    *sum_a = _mm512_fmadd_ps(g, x, *sum_a);
    *sum_s = _mm512_add_ps(*sum_s, g);
    if (dxt) _mm512_mask_storeu_ps(dxt + c, m, _mm512_mul_ps(g, va));
}
/* Derf's backward row: the per-channel sums in acc and acc_b, the row's sums of g x and g added to
   *row_a and *row_s, dx where dxt is not NULL; whole vectors, then the rest masked. */
static void erf_backward_row16(const float *dyt, const float *xt, float *dxt, long C, float alpha, float shift,
                               const float *weight, float *acc, float *acc_b, float *row_a, float *row_s) {
    __m512 va = _mm512_set1_ps(alpha), vs = _mm512_set1_ps(shift);
    __m512 sum_a = _mm512_setzero_ps(), sum_s = _mm512_setzero_ps();
    long c = 0;
    for (; c + 16 <= C; c += 16)
        erf_backward16(dyt, xt, dxt, c, (__mmask16)0xFFFF, va, vs, weight, acc, acc_b, &sum_a, &sum_s);
    if (c < C)
        erf_backward16(dyt, xt, dxt, c, (__mmask16)((1u << (C - c)) - 1u), va, vs, weight, acc, acc_b, &sum_a,
                       &sum_s);
    *row_a += _mm512_reduce_add_ps(sum_a);
    *row_s += _mm512_reduce_add_ps(sum_s);
}
#endif

/* One row of the forward (F: tanh or erf), and of the backward with or without dx. */
#define FORWARD_ROW(F) \
    _Pragma("omp simd") \
    for (long c = 0; c < C; c++) { \
        float z = alpha * xt[c] + shift; \
        yt[c] = weight[c] * F##_value(z, F##_core(z)) + bias[c]; \
    }
#define BACKWARD_ROW(F, STORE) \
    _Pragma("omp simd reduction(+:row_a, row_s)") \
    for (long c = 0; c < C; c++) { \
        float z = alpha * xt[c] + shift, k = F##_core(z), g = dyt[c] * weight[c] * F##_slope(k); \
        acc[c] += dyt[c] * F##_value(z, k); \
        acc_b[c] += dyt[c]; \
        row_a += g * xt[c]; \
        row_s += g; \
        STORE; \
    }

/* DyT (fn 0) and Derf (fn 1) forward in one pass over x (T x C): y = weight f(alpha x + shift) + bias. */
SQUASH_CODE void elementwise_forward(const float *x, long T, long C, int fn, float alpha, float shift,
                                     const float *weight, const float *bias, int threads, float *y) {
    #pragma omp parallel for num_threads(team(threads, T * C)) schedule(static)
    for (long t = 0; t < T; t++) {
        const float *xt = x + t * C;
        float *yt = y + t * C;
        if (fn == 0) { FORWARD_ROW(tanh) }
#if defined(__AVX512F__)
        else erf_forward_row16(xt, yt, C, alpha, shift, weight, bias);
#else
        else { FORWARD_ROW(erf) }
#endif
    }
}

/* Their backward in one pass over dy and x (f(z) recomputed from x): with g = dy weight f'(z),
   dx = g alpha (dx may be NULL: the sums only); grads (2C + 2, float, summed in double): dweight =
   sum_t dy f(z), dbias = sum_t dy, then dalpha = sum g x and dshift = sum g over every element. */
SQUASH_CODE void elementwise_backward(const float *dy, const float *x, long T, long C, int fn, float alpha,
                                      float shift, const float *weight, int threads, float *dx, float *grads) {
    double *sums = calloc(2 * C + 2, sizeof(double));
    #pragma omp parallel num_threads(team(threads, T * C))
    {
        /* per channel: dweight and dbias; dalpha and dshift are sums over every element, per row in
           float (a vector reduction), over the rows in double */
        float *acc = calloc(2 * C, sizeof(float)), *acc_b = acc + C;
        double *dacc = calloc(2 * C, sizeof(double)), a = 0.0, b = 0.0;
        long rows = 0;
        #pragma omp for schedule(static)
        for (long t = 0; t < T; t++) {
            const float *dyt = dy + t * C, *xt = x + t * C;
            float *dxt = dx ? dx + t * C : NULL, row_a = 0.0f, row_s = 0.0f;
            if (fn == 0 && dxt) { BACKWARD_ROW(tanh, dxt[c] = g * alpha) }
            else if (fn == 0) { BACKWARD_ROW(tanh, (void)0) }
#if defined(__AVX512F__)
            else erf_backward_row16(dyt, xt, dxt, C, alpha, shift, weight, acc, acc_b, &row_a, &row_s);
#else
            else if (dxt) { BACKWARD_ROW(erf, dxt[c] = g * alpha) }
            else { BACKWARD_ROW(erf, (void)0) }
#endif
            a += row_a;
            b += row_s;
            if (++rows % FLUSH == 0) add_to(dacc, acc, 2 * C);
        }
        add_to(dacc, acc, 2 * C);
        #pragma omp critical
        {
            for (long c = 0; c < 2 * C; c++) sums[c] += dacc[c];
            sums[2 * C] += a;
            sums[2 * C + 1] += b;
        }
        free(acc);
        free(dacc);
    }
    for (long c = 0; c < 2 * C + 2; c++) grads[c] = (float)sums[c];
    free(sums);
}
"""

# -march=native: the vector width of this CPU (AVX2/AVX-512), as torch's own kernels dispatch to it.
# The library is then specific to the CPU, whose identity is part of the digest that names it.
# -fno-math-errno: nothing here reads errno, and with it sqrtf vectorises (the same correctly
# rounded results); a small eval call's per-channel scale took 0.6 us of its 3.1 without it.
# -fno-trapping-math: nothing here reads the floating-point exception flags either, and with it
# floorf and the selects of DyT's and Derf's functions vectorise (the same results).
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-fPIC", "-shared", "-std=c99"]
_library = None
_tried = False
from .norm_functional import GROUP_SCALE_EPS  # noqa: E402 - the constant lives with the maths


def _cache_dir() -> pathlib.Path:
    if os.environ.get("HF_POWERNORM_CACHE"):
        return pathlib.Path(os.environ["HF_POWERNORM_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "hf_powernorm"


def _check_parents(path: pathlib.Path) -> None:
    """Refuse `path` when a folder above it (as written or resolved) can be written by others and is not
    sticky: another user could rename the cache away and put their own in its place."""
    path = path.absolute()
    for parent in {*path.parents, *path.resolve().parents}:
        mode = parent.stat().st_mode
        if mode & (stat.S_IWGRP | stat.S_IWOTH) and not mode & stat.S_ISVTX:
            raise RuntimeError(f"kernel cache {path} lies in {parent}, which others can write "
                               f"(mode {stat.S_IMODE(mode):o}, not sticky); set HF_POWERNORM_CACHE to a private folder")


def _private_dir(path: pathlib.Path) -> pathlib.Path:
    """`path`, created with mode 0700, or made 0700 when it is ours; another user's is refused, as is a
    folder under one others can write. Tightened, it loses the files named as the cache names its own
    (`powernorm_*`), which others could have planted; other files are left alone."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_parents(path)
    info = path.stat()
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        raise RuntimeError(f"kernel cache {path} belongs to another user (uid {info.st_uid})")
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(path, 0o700)
        for planted in path.glob("powernorm_*"):
            if planted.is_dir() and not planted.is_symlink():
                shutil.rmtree(planted)
            else:
                planted.unlink()
    return path


def _cpu_identity() -> str:
    """The CPU's model and instruction-set flags (what `-march=native` compiles for)."""
    try:
        with open("/proc/cpuinfo") as handle:
            lines = [line for line in handle if line.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


def _source_digest() -> str:
    return hashlib.sha256("\0".join([_SOURCE, *_FLAGS, _cpu_identity()]).encode()).hexdigest()


def _file_digest(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _record_path(target: pathlib.Path) -> pathlib.Path:
    return target.with_suffix(".json")


def _open_own_file(path: pathlib.Path) -> int:
    """A read-only descriptor of `path` after `lstat` found a regular file (not a link) this user owns,
    opened without following a link and checked by `fstat` to be that same file."""
    info = os.lstat(path)
    if not stat.S_ISREG(info.st_mode) or (hasattr(os, "getuid") and info.st_uid != os.getuid()):
        raise OSError(f"{path} is not a regular file of this user's")
    descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    opened = os.fstat(descriptor)
    if (opened.st_dev, opened.st_ino) != (info.st_dev, info.st_ino):
        os.close(descriptor)
        raise OSError(f"{path} changed while it was opened")
    return descriptor


def _descriptor_digest(descriptor: int) -> str:
    with os.fdopen(os.dup(descriptor), "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _trusted_descriptor(target: pathlib.Path, digest: str | None = None) -> int | None:
    """An open descriptor of `target` when the record next to it names this source and flags (`digest`,
    the C library's by default) and the hash of the bytes read through that descriptor; else None."""
    try:
        with os.fdopen(_open_own_file(_record_path(target)), "rb") as handle:
            record = json.loads(handle.read())
        if record.get("source_and_flags") != (_source_digest() if digest is None else digest):
            return None
        descriptor = _open_own_file(target)
    except (OSError, ValueError, AttributeError):
        return None
    try:
        if _descriptor_digest(descriptor) == record.get("library"):
            return descriptor
    except OSError:
        pass
    os.close(descriptor)
    return None


def _trusted(target: pathlib.Path, digest: str | None = None) -> bool:
    """Whether a record of `digest` (the C library's by default) trusts `target` (`_trusted_descriptor`)."""
    descriptor = _trusted_descriptor(target, digest)
    if descriptor is not None:
        os.close(descriptor)
    return descriptor is not None


def _descriptor_path(descriptor: int) -> str | None:
    path = f"/proc/self/fd/{descriptor}"
    return path if os.path.exists(path) else None


def _load_opened(descriptor: int, target: pathlib.Path, loader):
    """`loader(path)` on the file open as `descriptor`, whose bytes were hashed: through `/proc/self/fd/N`
    where that exists; elsewhere by `target`, refused when it names another file before or after loading.
    The descriptor stays open: the dynamic loader knows a library by its path, and a number reused by a
    later file would name the library already loaded."""
    opened = os.fstat(descriptor)

    def unchanged() -> bool:
        info = os.lstat(target)
        return (info.st_dev, info.st_ino) == (opened.st_dev, opened.st_ino)

    try:
        by_descriptor = _descriptor_path(descriptor)
        if by_descriptor is not None:
            return loader(by_descriptor)
        if not unchanged():
            raise RuntimeError(f"{target} was replaced after its hash was checked")
        loaded = loader(str(target))
        if not unchanged():
            raise RuntimeError(f"{target} was replaced while it was loaded")
        return loaded
    except BaseException:
        os.close(descriptor)
        raise


def _write_atomically(target: pathlib.Path, data: bytes) -> None:
    with tempfile.NamedTemporaryFile(dir=target.parent, delete=False) as handle:
        handle.write(data)
    os.replace(handle.name, target)


def _compiler(variable: str, names: tuple[str, ...], what: str) -> str:
    """The compiler `$variable` names, else the first of `names` on PATH."""
    compiler = os.environ.get(variable) or next(filter(None, map(shutil.which, names)), None)
    if compiler is None:
        raise RuntimeError(f"no {what} ({'/'.join(names)}) on PATH")
    return compiler


def _compile_source(target: pathlib.Path, compiler: str, text: str, source_name: str, flags: list[str],
                    libraries: list[str], record: dict) -> None:
    """`compiler flags <source> -o <library> libraries` in a temporary folder beside `target` (`text`
    written there as `source_name`); the library renamed to `target`, then its record (`record` with
    the library's hash) written next to it."""
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        source = pathlib.Path(tmp) / source_name
        source.write_text(text)
        built = pathlib.Path(tmp) / target.name
        subprocess.run([compiler, *flags, str(source), "-o", str(built), *libraries], check=True, capture_output=True)
        record = {**record, "library": _file_digest(built)}
        os.replace(built, target)  # atomic: concurrent processes never load a half-written file
        _write_atomically(_record_path(target), json.dumps(record).encode())


def _compile(target: pathlib.Path) -> None:
    _compile_source(target, _compiler("CC", ("cc", "gcc"), "C compiler"), _SOURCE, "powernorm_cpu.c", _FLAGS,
                    ["-lm"], {"source_and_flags": _source_digest(), "flags": _FLAGS})


@contextlib.contextmanager
def _build_lock(target: pathlib.Path):
    """One build at a time of `target` across processes (two test workers, two ranks): the second
    waits and then finds the first's library. Without `fcntl` (not POSIX), no lock: the atomic
    replace still keeps a half-written file from being loaded."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    lock = target.with_suffix(".lock")
    try:  # never through a link: a planted one would have the lock created or opened at its target
        descriptor = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as err:
        if os.path.islink(lock):
            raise RuntimeError(f"kernel cache lock {lock} is a symbolic link; remove it") from err
        raise
    with os.fdopen(descriptor, "r+b") as handle:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            raise RuntimeError(f"kernel cache lock {lock} is not a regular file")
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _built(target: pathlib.Path, digest: str, build, announce: str | None = None) -> int:
    """An open descriptor of `target` once a record of `digest` trusts it: built by `build(target)` where
    none does, one process at a time (another's build waited for, then used); `announce` logged before a
    build."""
    descriptor = _trusted_descriptor(target, digest)
    if descriptor is None:
        with _build_lock(target):
            descriptor = _trusted_descriptor(target, digest)
            if descriptor is None:  # else built by another process while this one waited
                if announce:
                    logger.warning(announce)
                build(target)
                descriptor = _trusted_descriptor(target, digest)
                if descriptor is None:
                    raise RuntimeError(f"{target} changed while it was being built")
    return descriptor


def _warn_unavailable(what: str, err: BaseException, instead: str) -> None:
    detail = getattr(err, "stderr", b"") or b""
    logger.warning("%s unavailable (%s %s); %s", what, err, detail.decode(errors="replace")[-500:], instead)


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, n, i = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    f = ctypes.c_float
    lib.pn_rows.argtypes = [p, p, n, n, n, f, i, p, p, p, p]
    lib.pn_backward.argtypes = [p, p, p, i, n, n, n, f, i, p, p, p, p, p, p, p, p]
    lib.pn_statistics.argtypes = [p, f, n, p, p, f, n, n, f, i, i, p, p, p]
    lib.pn_gradient_statistics.argtypes = [p, p, p, p, p, f, n, i, f, p, p]
    lib.norm_eval.argtypes = [p, n, n, n, f, i, p, p, p, p, f, i, p]
    lib.norm_eval.restype = None
    lib.pn_step_forward.argtypes = [p, p, i, n, n, n, f, i, p, p, p, p, f, n, n, f, i, i, i, p, p, p]
    lib.pn_step_backward.argtypes = [p, p, p, i, n, n, n, f, i, p, p, p, f, i, f, i, p, p]
    lib.pn_step_forward.restype = lib.pn_step_backward.restype = i
    lib.bn_step_forward.argtypes = [p, p, i, n, n, i, p, p, p, p, p, f, f, i, f, f, i, i, p, p, p]
    lib.bn_step_backward.argtypes = [p, p, p, i, n, n, i, p, p, f, i, i, p, p]
    lib.bn_step_forward.restype, lib.bn_step_backward.restype = i, None
    lib.pnv_step_forward.argtypes = [p, p, i, n, n, n, f, i, p, p, p, p, f, f, i, i, p, p, p]
    lib.pnv_step_forward.restype = i
    lib.pnv_step_backward.argtypes = [p, p, p, i, n, n, n, f, i, p, p, f, i, i, p, p]
    lib.pnv_step_backward.restype = None
    lib.mabn_step_forward.argtypes = [p, p, i, n, n, i, p, p, p, p, n, p, f, f, n, f, n, i, i, p, p, p]
    lib.mabn_step_backward.argtypes = [p, p, p, i, n, n, i, p, p, p, n, ctypes.c_longlong, n, f, i, i, p, p]
    lib.mabn_step_forward.restype = lib.mabn_step_backward.restype = i
    for fn in (lib.pn_rows, lib.pn_backward):
        fn.restype = None
    lib.pn_statistics.restype = lib.pn_gradient_statistics.restype = i
    lib.elementwise_forward.argtypes = [p, n, n, i, f, f, p, p, i, p]
    lib.elementwise_backward.argtypes = [p, p, n, n, i, f, f, p, i, p, p]
    lib.elementwise_forward.restype = lib.elementwise_backward.restype = None
    return lib


def load() -> ctypes.CDLL | None:
    """The compiled kernels, building them on first use; None when disabled or unavailable."""
    global _library, _tried
    if _tried:
        return _library
    _tried = True
    if os.environ.get("HF_POWERNORM_KERNELS", "1") == "0":
        return None
    try:
        digest = _source_digest()
        target = _private_dir(_cache_dir()) / f"powernorm_cpu_{digest[:16]}.so"
        _library = _bind(_load_opened(_built(target, digest, _compile), target, ctypes.CDLL))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as err:
        _warn_unavailable("PowerNorm CPU kernels", err, "using the eager implementation")
        _library = None
    return _library


def kernels_usable(x: torch.Tensor) -> bool:
    """Whether the fused kernels apply to this input (CPU float32, kernels built)."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and load() is not None


def _ptr(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def _float_vector(values: torch.Tensor) -> torch.Tensor:
    return values.detach().float().contiguous()


def pn_rows(x: torch.Tensor, token_weights: torch.Tensor | None, group_num: int | None,
            scale: torch.Tensor | None = None, shift: torch.Tensor | None = None, statistics: bool = True,
            eps: float = GROUP_SCALE_EPS):
    """One pass over contiguous float32 `x` (tokens, C) with `z0 = GS(x)`: `(y, sum_V z0^2)`, where
    `y = z0 * scale + shift` when `scale` is given (else None); when `statistics`, the float32 sums
    (C,) and the real-token count as a float (else None, None): `(y, sum_sq, count)`."""
    tokens, channels = x.shape
    y = None if scale is None else torch.empty_like(x)
    sums = torch.empty(channels + 1, dtype=torch.float64) if statistics else None
    scale, shift = (None if vector is None else _float_vector(vector) for vector in (scale, shift))
    _library.pn_rows(_ptr(x), _ptr(token_weights), tokens, channels, group_num or 0, eps, torch.get_num_threads(),
                     _ptr(scale), _ptr(shift), _ptr(y), _ptr(sums))
    if sums is None:
        return y, None, None
    sums = sums.float()
    return y, sums[:-1], float(sums[-1])


# Outputs (y, dx) from this size on are written with streaming stores, past the core's caches: an
# ordinary store first reads each output line it misses, a third of the traffic. Measured on the
# benchmark machine (2 MiB of L2 per core; study stopped, interleaved against ordinary stores):
# PN's, masked BN's and MABN's training steps took 0.75-0.83x at 4-8 MiB, PN's eval map 0.74-0.85x
# at 6-8 MiB and 0.95-1.02x at 4 MiB, but 1.22x on two threads at 2 MiB; a whole model's train
# step and eval forward with 8 MiB norm tensors did not change (1.00x: its norms are 1-2% of it).
STREAM_BYTES = 4 << 20


def norm_eval(x: torch.Tensor, group_num: int | None, weight: torch.Tensor | None = None,
              bias: torch.Tensor | None = None, mean: torch.Tensor | None = None, var: torch.Tensor | None = None,
              eps: float = 0.0, group_eps: float = GROUP_SCALE_EPS) -> torch.Tensor:
    """An eval-mode norm of contiguous float32 `x` (..., C) in one pass (no autograd), shaped as `x`:
    `GS(x) * scale + shift`, `scale = weight / sqrt(var + eps)`, `shift = bias - mean * scale`, each
    vector float32 and contiguous or None (weight 1, bias and mean 0, no var: scale = weight)."""
    channels = x.shape[-1]
    tokens = x.numel() // channels if channels else 0
    y = torch.empty_like(x)
    _library.norm_eval(x.data_ptr(), tokens, channels, group_num or 0, group_eps, torch.get_num_threads(),
                       weight if weight is None else weight.data_ptr(), bias if bias is None else bias.data_ptr(),
                       mean if mean is None else mean.data_ptr(), var if var is None else var.data_ptr(), eps,
                       tokens * channels * 4 >= STREAM_BYTES, y.data_ptr())
    return y


def group_scale(x: torch.Tensor, group_num: int) -> torch.Tensor:
    """`GS(x)` of contiguous float32 `x` (..., C) in one pass (no autograd)."""
    return norm_eval(x, group_num)


def pn_backward(dy: torch.Tensor, x: torch.Tensor, token_weights: torch.Tensor | None, group_num: int | None,
                weight: torch.Tensor, nu: torch.Tensor, inv_s: torch.Tensor, inv_s_b: torch.Tensor,
                eps: float = GROUP_SCALE_EPS, input_gradient: bool = True):
    """One pass over contiguous float32 `dy` and `x`: `dx` from `dz0 = dy * a - (real) * c * z0`,
    `a = weight * inv_s_b`, `c = nu * inv_s * inv_s_b`, through the group-scaling backward, and the
    float64 sums `(sum_all dy*z0, sum_V dy*z0, sum_all dy)` (3, C); `dx` is None without
    `input_gradient` (the sums only). `token_weights`: float 0/1 weights or a mask of `MASK_KINDS`."""
    tokens, channels = x.shape
    dx = torch.empty_like(x) if input_gradient else None
    sums = torch.empty(3, channels, dtype=torch.float64)
    vectors = [_float_vector(t) for t in (weight, nu, inv_s, inv_s_b)]  # kept alive across the call
    _library.pn_backward(_ptr(dy), _ptr(x), *_mask_args(token_weights), tokens, channels, group_num or 0, eps,
                         torch.get_num_threads(), *map(_ptr, vectors), _ptr(dx), _ptr(sums[0]), _ptr(sums[1]),
                         _ptr(sums[2]))
    return dx, sums


SQUASH = {"tanh": 0, "erf": 1}  # DyT's and Derf's functions, as `elementwise_*` name them


def elementwise_forward(x: torch.Tensor, function: str, alpha: float, shift: float, weight: torch.Tensor,
                        bias: torch.Tensor) -> torch.Tensor:
    """DyT (`function="tanh"`) or Derf (`"erf"`) of contiguous float32 `x` (tokens, C) in one pass:
    `weight * f(alpha * x + shift) + bias`, `weight` and `bias` float32 and contiguous."""
    tokens, channels = x.shape
    y = torch.empty_like(x)
    _library.elementwise_forward(x.data_ptr(), tokens, channels, SQUASH[function], alpha, shift, weight.data_ptr(),
                                 bias.data_ptr(), torch.get_num_threads(), y.data_ptr())
    return y


def elementwise_backward(dy: torch.Tensor, x: torch.Tensor, function: str, alpha: float, shift: float,
                         weight: torch.Tensor, input_gradient: bool = True):
    """Their backward in one pass over contiguous float32 `dy` and `x` (tokens, C): `(dx, grads)`, `dx`
    None without `input_gradient`; `grads` float32 (2C + 2, summed in float64): dweight, dbias,
    dalpha, dshift."""
    tokens, channels = x.shape
    dx = torch.empty_like(x) if input_gradient else None
    grads = torch.empty(2 * channels + 2)
    _library.elementwise_backward(dy.data_ptr(), x.data_ptr(), tokens, channels, SQUASH[function], alpha, shift,
                                  weight.data_ptr(), torch.get_num_threads(), _ptr(dx), grads.data_ptr())
    return dx, grads


MASK_KINDS = {torch.float32: 1, torch.int64: 2, torch.bool: 3, torch.uint8: 3}


def pn_step_forward(x: torch.Tensor, mask: torch.Tensor | None, group_num: int | None, weight: torch.Tensor,
                    bias: torch.Tensor, running_phi: torch.Tensor, counter: torch.Tensor, eps: float,
                    warmup_steps: int, ramp_steps: int, ema_rate: float, reference: bool, batch_backward: bool,
                    group_eps: float = GROUP_SCALE_EPS):
    """PowerNorm's training forward in one C call (`pn_rows` and `pn_statistics` together):
    `(status, y, stats, count)` with `stats` (3, C) = `(v, 1/s, 1/s_backward)`, updating
    `running_phi` and `counter` in place; `mask` is a contiguous `(tokens,)` tensor of a
    `MASK_KINDS` dtype, read as it is; every vector float32 and contiguous."""
    tokens, channels = x.shape
    y, stats, count = torch.empty_like(x), torch.empty(3, channels), ctypes.c_float()
    status = _library.pn_step_forward(
        x.data_ptr(), None if mask is None else mask.data_ptr(), 0 if mask is None else MASK_KINDS[mask.dtype],
        tokens, channels, group_num or 0, group_eps, torch.get_num_threads(), weight.data_ptr(),
        bias.data_ptr(), running_phi.data_ptr(), counter.data_ptr(), eps, warmup_steps, ramp_steps, ema_rate,
        reference, batch_backward, tokens * channels * 4 >= STREAM_BYTES, y.data_ptr(), stats.data_ptr(),
        ctypes.byref(count))
    return status, y, stats, count.value


def pn_step_backward(dy: torch.Tensor, x: torch.Tensor, mask: torch.Tensor | None, group_num: int | None,
                     weight: torch.Tensor, running_nu: torch.Tensor, stats: torch.Tensor, count: float, usable: bool,
                     rate: float, group_eps: float = GROUP_SCALE_EPS):
    """PowerNorm's backward in one C call (`pn_backward` and `pn_gradient_statistics` together):
    `(status, dx, grads)` with `grads` (2, C) = `(dweight, dbias)`, updating `running_nu` in place."""
    tokens, channels = x.shape
    dx, grads = torch.empty_like(x), torch.empty(2, channels)
    status = _library.pn_step_backward(
        dy.data_ptr(), x.data_ptr(), None if mask is None else mask.data_ptr(),
        0 if mask is None else MASK_KINDS[mask.dtype], tokens, channels, group_num or 0, group_eps,
        torch.get_num_threads(), weight.data_ptr(), running_nu.data_ptr(), stats.data_ptr(), count, usable, rate,
        tokens * channels * 4 >= STREAM_BYTES, dx.data_ptr(), grads.data_ptr())
    return status, dx, grads


def _mask_args(mask: torch.Tensor | None) -> tuple:
    return (None, 0) if mask is None else (mask.data_ptr(), MASK_KINDS[mask.dtype])


def bn_step_forward(x: torch.Tensor, mask: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor,
                    running_mean: torch.Tensor, running_var: torch.Tensor, counter: torch.Tensor, eps: float,
                    momentum: float, renorm: bool, rmax: float, dmax: float, reused: torch.Tensor | None = None):
    """Masked BN's or BRN's training forward in one C call: `(status, y, out, count)`, `out` (4, C) =
    `(mean, 1/sigma, r, d)` of the step, updating the running statistics and `counter` in place;
    with `reused` (a recomputation: the step's `out`) the output pass alone. Contiguous float32 vectors."""
    tokens, channels = x.shape
    y, count = torch.empty_like(x), ctypes.c_float(0.0)
    out = torch.empty(4, channels) if reused is None else reused
    status = _library.bn_step_forward(
        x.data_ptr(), *_mask_args(mask), tokens, channels, torch.get_num_threads(), weight.data_ptr(),
        bias.data_ptr(), running_mean.data_ptr(), running_var.data_ptr(), counter.data_ptr(), eps, momentum, renorm,
        rmax, dmax, reused is not None, tokens * channels * 4 >= STREAM_BYTES, y.data_ptr(), out.data_ptr(),
        ctypes.byref(count))
    return status, y, out, count.value


def pnv_step_forward(x: torch.Tensor, mask: torch.Tensor | None, group_num: int | None, weight: torch.Tensor,
                     bias: torch.Tensor, running_phi: torch.Tensor, counter: torch.Tensor, eps: float, ema_rate: float,
                     update: bool):
    """PN-V's training forward in one C call: `(status, y, inv_s, count)`, updating `running_phi` and
    `counter` in place for a usable batch when `update`. Contiguous float32 vectors."""
    tokens, channels = x.shape
    y, inv_s, count = torch.empty_like(x), torch.empty(channels), ctypes.c_float(0.0)
    status = _library.pnv_step_forward(
        x.data_ptr(), *_mask_args(mask), tokens, channels, group_num or 0, GROUP_SCALE_EPS, torch.get_num_threads(),
        weight.data_ptr(), bias.data_ptr(), running_phi.data_ptr(), counter.data_ptr(), eps, ema_rate, update,
        tokens * channels * 4 >= STREAM_BYTES, y.data_ptr(), inv_s.data_ptr(), ctypes.byref(count))
    return status, y, inv_s, count.value


def pnv_step_backward(dy: torch.Tensor, x: torch.Tensor, mask: torch.Tensor | None, group_num: int | None,
                      weight: torch.Tensor, inv_s: torch.Tensor, count: float, usable: bool):
    """The backward of `pnv_step_forward` in one C call (a sums pass, then the input gradient):
    `(dx, grads)`, `grads` (2, C) = `(dweight, dbias)`."""
    tokens, channels = x.shape
    dx, grads = torch.empty_like(x), torch.empty(2, channels)
    weight = _float_vector(weight)
    _library.pnv_step_backward(dy.data_ptr(), x.data_ptr(), *_mask_args(mask), tokens, channels, group_num or 0,
                               GROUP_SCALE_EPS, torch.get_num_threads(), weight.data_ptr(), inv_s.data_ptr(), count,
                               usable, tokens * channels * 4 >= STREAM_BYTES, dx.data_ptr(), grads.data_ptr())
    return dx, grads


def mabn_step_forward(x: torch.Tensor, mask: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor,
                      running_phi: torch.Tensor, window_phi: torch.Tensor, counter: torch.Tensor, eps: float,
                      momentum: float, warmup_steps: int, rmax: float, renorm_warmup_steps: int,
                      reused: torch.Tensor | None = None):
    """MABN's training forward in one C call: `(status, y, out, count)`, `out` (2, C) = `(1/chi, r)` of
    the step, updating `running_phi`, `window_phi` and `counter` in place; with `reused` (a
    recomputation: the step's `out`) the output pass alone. Contiguous float32 vectors."""
    tokens, channels = x.shape
    y, count = torch.empty_like(x), ctypes.c_float(0.0)
    out = torch.empty(2, channels) if reused is None else reused
    status = _library.mabn_step_forward(
        x.data_ptr(), *_mask_args(mask), tokens, channels, torch.get_num_threads(), weight.data_ptr(),
        bias.data_ptr(), running_phi.data_ptr(), window_phi.data_ptr(), window_phi.shape[0], counter.data_ptr(), eps,
        momentum, warmup_steps, rmax, renorm_warmup_steps, reused is not None, tokens * channels * 4 >= STREAM_BYTES,
        y.data_ptr(), out.data_ptr(), ctypes.byref(count))
    return status, y, out, count.value


def mabn_step_backward(dy: torch.Tensor, x: torch.Tensor, mask: torch.Tensor | None, weight: torch.Tensor,
                       out: torch.Tensor, window_gz: torch.Tensor, step: int, warmup_steps: int, count: float,
                       usable: bool):
    """The backward of `mabn_step_forward` in one C call: `(status, dx, grads)`, `grads` (2, C) =
    `(dweight, dbias)`, updating `window_gz` in place; status -1: a non-finite gradient statistic."""
    tokens, channels = x.shape
    dx, grads = torch.empty_like(x), torch.empty(2, channels)
    weight = _float_vector(weight)
    status = _library.mabn_step_backward(
        dy.data_ptr(), x.data_ptr(), *_mask_args(mask), tokens, channels, torch.get_num_threads(), weight.data_ptr(),
        out.data_ptr(), window_gz.data_ptr(), window_gz.shape[0], step, warmup_steps, count, usable,
        tokens * channels * 4 >= STREAM_BYTES, dx.data_ptr(), grads.data_ptr())
    return status, dx, grads


def bn_step_backward(dy: torch.Tensor, x: torch.Tensor, mask: torch.Tensor | None, weight: torch.Tensor,
                     out: torch.Tensor, count: float, usable: bool):
    """The backward of `bn_step_forward` in one C call: `(dx, grads)`, `grads` (2, C) = `(dweight, dbias)`."""
    tokens, channels = x.shape
    dx, grads = torch.empty_like(x), torch.empty(2, channels)
    _library.bn_step_backward(dy.data_ptr(), x.data_ptr(), *_mask_args(mask), tokens, channels, torch.get_num_threads(),
                              weight.data_ptr(), out.data_ptr(), count, usable, tokens * channels * 4 >= STREAM_BYTES,
                              dx.data_ptr(), grads.data_ptr())
    return dx, grads


def pn_statistics(sum_sq: torch.Tensor, count: float, running_phi: torch.Tensor, counter: torch.Tensor,
                  eps: float, warmup_steps: int, ramp_steps: int, ema_rate: float, reference: bool,
                  batch_backward: bool):
    """PowerNorm's step statistics on the CPU (what `norm_dispatch._pn_denominators` computes):
    `(status, v, 1/s, 1/s_backward)`, updating float32 `running_phi` and the int64 `counter` in
    place for a usable batch; status 1 usable, 0 no real token, -1 non-finite statistics."""
    channels = sum_sq.shape[0]
    sum_sq = _float_vector(sum_sq)
    v, inv_s, inv_s_b = torch.empty(3, channels).unbind(0)
    status = _library.pn_statistics(_ptr(sum_sq), count, channels, _ptr(running_phi), _ptr(counter), eps,
                                    warmup_steps, ramp_steps, ema_rate, int(reference), int(batch_backward),
                                    _ptr(v), _ptr(inv_s), _ptr(inv_s_b))
    return status, v, inv_s, inv_s_b


def pn_gradient_statistics(sums: torch.Tensor, weight: torch.Tensor, v: torch.Tensor, inv_s: torch.Tensor,
                           count: float, usable: bool, rate: float, running_nu: torch.Tensor):
    """The backward's statistics on the CPU from `pn_backward`'s sums: updates float32 `running_nu`
    (eq. 13) where the step is usable and Lambda finite; `(status, grad_weight)`, status as in
    `pn_statistics`."""
    weight = _float_vector(weight)
    grad_weight = torch.empty(sums.shape[1])
    status = _library.pn_gradient_statistics(_ptr(sums[0]), _ptr(sums[1]), _ptr(weight), _ptr(v), _ptr(inv_s),
                                             count, sums.shape[1], int(usable), rate, _ptr(running_nu),
                                             _ptr(grad_weight))
    return status, grad_weight


# ----------------------------------------------------------------------------------------------
# DyT's and Derf's training step as one torch operator with a C++ autograd node
#
# A Python autograd function and its tensor bookkeeping cost DyT's step at (1024, 512) on one thread
# about 0.3x of `F.layer_norm`'s whole step, most of it Python run with caches the kernels have just
# flushed; a C++ node pays what LayerNorm's own node pays. So the same two C kernels also run behind
# one operator, `elementwise_norm`, built with torch's headers into a second library of the cache
# (about 15 s, once per torch version and source), its namespace named by the build's digest so that
# two sources never clash in one process. Without a C++ compiler or torch's headers the step runs as
# before (`norm_dispatch._ElementwiseNormFunction`), to the same bits. Its backward under
# `create_graph=True` is the formula in ATen ops (differentiable in turn), not the kernels.

_OPERATOR_SOURCE = r"""
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
_OPERATOR_FLAGS = ["-O2", "-std=c++20", "-fPIC", "-shared"]
_operator = None
_operator_tried = False


def _torch_build_arguments() -> list[str]:
    """Where torch's headers and libraries are, and its C++ ABI."""
    root = pathlib.Path(torch.__file__).parent
    return [f"-I{root / 'include'}", f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", f"-L{root / 'lib'}", "-lc10",
            "-ltorch_cpu"]


def _operator_digest() -> str:
    """Names the operator's source and flags, torch's build, and the C library's (whose kernels it binds)."""
    parts = [_OPERATOR_SOURCE, *_OPERATOR_FLAGS, *_torch_build_arguments(), torch.__version__, _source_digest()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _compile_operator(target: pathlib.Path, namespace: str) -> None:
    _compile_source(target, _compiler("CXX", ("c++", "g++"), "C++ compiler"),
                    _OPERATOR_SOURCE.replace("NAMESPACE", namespace), "powernorm_operator.cpp", _OPERATOR_FLAGS,
                    _torch_build_arguments(), {"source_and_flags": _operator_digest()})


def load_operator():
    """`elementwise_norm(x, alpha, shift, weight, bias, function)` (the torch operator, `function` as
    `SQUASH` numbers it), building it on first use; None where the C kernels or the operator are
    unavailable (the caller then runs its Python autograd function)."""
    global _operator, _operator_tried
    if _operator_tried:
        return _operator
    _operator_tried = True
    library = load()
    if library is None or os.environ.get("HF_POWERNORM_OPERATOR", "1") == "0":
        return None
    digest = _operator_digest()
    namespace = f"hf_powernorm_{digest[:16]}"
    try:
        folder = _private_dir(_cache_dir())
        # a pause of seconds in a first training step: said, once per torch version and source
        announce = f"Building the C++ operator of DyT and Derf in {folder} (once per torch version, about 15 s)"
        target = folder / f"powernorm_operator_{digest[:16]}.so"
        descriptor = _built(target, digest, lambda target: _compile_operator(target, namespace), announce)
        _load_opened(descriptor, target, torch.ops.load_library)
        operators = getattr(torch.ops, namespace)
        operators.bind(ctypes.cast(library.elementwise_forward, ctypes.c_void_p).value,
                       ctypes.cast(library.elementwise_backward, ctypes.c_void_p).value)
        _operator = operators.elementwise_norm.default
    except (OSError, RuntimeError, subprocess.CalledProcessError) as err:
        _warn_unavailable("DyT/Derf C++ operator", err,
                          "their CPU step runs a Python autograd function around the same kernels")
        _operator = None
    return _operator

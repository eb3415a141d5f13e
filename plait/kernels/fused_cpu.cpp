// The small per-layer operators of a Llama decoder layer, fused, for the CPU (fp32).
//
// Between its four matmuls and attention, a layer of torch code runs some 25 small operators
// (RMSNorm as pow/mean/add/rsqrt/mul/mul, the residual adds, rotary as chunk/mul/mul/sub/cat,
// SiLU and the product, the two KV stores) plus their views: each a dispatch through torch of a
// few microseconds on a few hundred floats, several milliseconds per decode step over 30
// layers. Here each group is one pass over its rows:
//   rms_norm           out = x * rsqrt(mean(x^2) + eps) * w
//   add_rms_norm_      residual += delta (in place); out = rms_norm(residual)
//   rope_store_kv      q and k of the fused qkv projection rotated (neox, rotate-half); q
//                      returned, k and v written into the KV pool rows of the new tokens (an
//                      fp32 pool, or a bf16 one: `--kv-cache-dtype bfloat16`, rounded as torch
//                      rounds)
//   silu_mul           silu(gate) * up of the fused gate_up projection
// Each result is bit-identical to the torch operators it replaces (the references in
// fused_ops.py), so the fused model's greedy output is the unfused one's: the arithmetic is
// torch's operation for operation, in the same order, and this file is compiled with
// -ffp-contract=off so that no multiply and add are merged into one FMA. Two places follow
// torch's internals: RMSNorm's sum of squares is summed in the order of ATen's cascade sum, and
// SiLU's exp is Sleef's expf, both at `lanes`, the width of torch's own vectors (8 or 16; the
// loader finds it by comparing with torch). One known exception: SiLU over more than 32768
// floats whose rows are no multiple of 32 wide, where torch's threads may split a row and move
// its scalar tail (an element or so within 1 ulp; real models' MLP widths are multiples of 32).
//
// Measured (one thread, medians, A/B on the same busy machine): at 1 token add_rms_norm_
// 1.5 us vs torch's 11.8 us, silu_mul 1.5 vs 4.7 us, rope_store_kv 1.6 vs 24.8 us; at 1024
// tokens 93 vs 245 us, 450-535 vs 850-1000 us (memory-bound: it reads gate_up once), 80 vs
// 584 us.
//
// Built with -mavx512f where the CPU has AVX-512 (16-wide), else AVX2 + FMA (8-wide): AVX-512
// made silu_mul 1.6-1.9x faster at 32-1024 tokens (its exp), add_rms_norm_ 1.2x.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kMaxHeadDim = 512;  // the attention kernels' limit too

#if defined(__AVX512F__)
constexpr int64_t W = 16;
using vec = __m512;
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
inline vec vset(float x) { return _mm512_set1_ps(x); }
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec vdiv(vec a, vec b) { return _mm512_div_ps(a, b); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }
using veci = __m512i;
inline veci vcvt_nearest(vec x) { return _mm512_cvtps_epi32(x); }  // ties to even
inline vec vcvt_float(veci x) { return _mm512_cvtepi32_ps(x); }
inline veci vsra1(veci x) { return _mm512_srai_epi32(x, 1); }
inline veci vsubi(veci a, veci b) { return _mm512_sub_epi32(a, b); }
inline vec vpow2i(veci q) {  // 2^q for integral q in [-126, 127]
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(q, _mm512_set1_epi32(127)), 23));
}
inline vec vselect_lt(vec a, vec b, vec if_lt, vec otherwise) {  // a < b ? if_lt : otherwise
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_LT_OQ), otherwise, if_lt);
}
#else
constexpr int64_t W = 8;
using vec = __m256;
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v); }
inline vec vset(float x) { return _mm256_set1_ps(x); }
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec vdiv(vec a, vec b) { return _mm256_div_ps(a, b); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(vec v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_hadd_ps(lo, lo);
  lo = _mm_hadd_ps(lo, lo);
  return _mm_cvtss_f32(lo);
}
using veci = __m256i;
inline veci vcvt_nearest(vec x) { return _mm256_cvtps_epi32(x); }  // ties to even
inline vec vcvt_float(veci x) { return _mm256_cvtepi32_ps(x); }
inline veci vsra1(veci x) { return _mm256_srai_epi32(x, 1); }
inline veci vsubi(veci a, veci b) { return _mm256_sub_epi32(a, b); }
inline vec vpow2i(veci q) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(q, _mm256_set1_epi32(127)), 23));
}
inline vec vselect_lt(vec a, vec b, vec if_lt, vec otherwise) {
  return _mm256_blendv_ps(otherwise, if_lt, _mm256_cmp_ps(a, b, _CMP_LT_OQ));
}
#endif

// Sleef's expf (u10), operation for operation: what torch's Vectorized<float>::exp calls, so
// that SiLU rounds as torch's does. exp(d) = 2^q * e^s, d = q ln2 + s (ln2 in two parts), a
// degree-6 polynomial for e^s, 2^q applied in two halves (q reaches 145 at d = 100).
inline vec vexp(vec d) {
  const veci q = vcvt_nearest(vmul(d, vset(1.442695040888963407359924681001892137f)));
  const vec qf = vcvt_float(q);
  vec s = vfma(qf, vset(-0.693145751953125f), d);
  s = vfma(qf, vset(-1.428606765330187045e-06f), s);
  vec u = vset(0.000198527617612853646278381f);
  u = vfma(u, s, vset(0.00139304355252534151077271f));
  u = vfma(u, s, vset(0.00833336077630519866943359f));
  u = vfma(u, s, vset(0.0416664853692054748535156f));
  u = vfma(u, s, vset(0.166666671633720397949219f));
  u = vfma(u, s, vset(0.5f));
  u = vadd(vset(1.0f), vfma(vmul(s, s), u, s));
  const veci half = vsra1(q);
  u = vmul(vmul(u, vpow2i(half)), vpow2i(vsubi(q, half)));
  u = vselect_lt(d, vset(-104.0f), vzero(), u);  // underflow: 0
  return vselect_lt(vset(100.0f), d, vset(INFINITY), u);  // overflow: inf
}

// rows of `work` floats each: below this many floats in all, one thread (a parallel region
// costs more than a decode step's few thousand floats); larger inputs are split. 2^14, not
// 2^16: SmolLM2's residual add + norm from 15 rows and rotary + KV store from 18 run on both
// cores, whose caches each hold half of the linear's output they read (SmolLM2 decode step,
// engines interleaved: batch 32 0.978x and 0.983x, batch 8-16 0.98-1.0x)
inline int64_t grain_rows(int64_t work_per_row) {
  constexpr int64_t kMinWork = 1 << 14;
  return std::max<int64_t>(1, kMinWork / std::max<int64_t>(1, work_per_row));
}

// torch's RMSNorm: mean(x^2) as sum / n, + eps, rsqrt as 1 / sqrt, then (x * r) * w
inline void scale_row(const float* x, const float* w, float* out, int64_t n, float sumsq,
                      float eps) {
  const float r = 1.0f / std::sqrt(sumsq / static_cast<float>(n) + eps);
  const vec vr = vset(r);
  int64_t i = 0;
  for (; i + W <= n; i += W) vstore(out + i, vmul(vmul(vload(x + i), vr), vload(w + i)));
  for (; i < n; ++i) out[i] = (x[i] * r) * w[i];
}

// torch's order of summation for x.pow(2).sum(-1) over a contiguous row (ATen's cascade_sum:
// vectorized_inner_sum, row_sum and multi_row_sum in native/cpu/SumKernel.cpp), so that
// RMSNorm matches torch's bit for bit: the squares rounded before summing; vectors of L lanes
// (L: the width of torch's own sum kernel, 8 or 16) summed in 4 interleaved cascades whose
// levels hold 16 (or more) partial sums each; the 4 added in order, then the scalar tail and
// the L lanes left to right. Rows shorter than L: the same cascades over single floats.
template <int64_t L>
void cascade_rows(const float* data, int64_t rows, float out[4][L]) {
  constexpr int kLevels = 4;
  const int64_t ceil_log2 =
      rows <= 2 ? 1 : 64 - __builtin_clzll(static_cast<uint64_t>(rows - 1));
  const int64_t power = std::max<int64_t>(4, ceil_log2 / kLevels);
  const int64_t step = int64_t(1) << power, mask = step - 1;
  float acc[kLevels][4][L] = {};
  auto add_row = [&](int64_t i) {
    for (int k = 0; k < 4; ++k)
      for (int64_t l = 0; l < L; ++l) acc[0][k][l] += data[(i * 4 + k) * L + l];
  };
  int64_t i = 0;
  while (i + step <= rows) {
    for (int64_t j = 0; j < step; ++j, ++i) add_row(i);
    for (int j = 1; j < kLevels; ++j) {
      for (int k = 0; k < 4; ++k)
        for (int64_t l = 0; l < L; ++l) {
          acc[j][k][l] += acc[j - 1][k][l];
          acc[j - 1][k][l] = 0.0f;
        }
      if ((i & (mask << (j * power))) != 0) break;
    }
  }
  for (; i < rows; ++i) add_row(i);
  for (int j = 1; j < kLevels; ++j)
    for (int k = 0; k < 4; ++k)
      for (int64_t l = 0; l < L; ++l) acc[0][k][l] += acc[j][k][l];
  std::memcpy(out, acc[0], sizeof(acc[0]));
}

// ATen's row_sum over `n` items of L floats each (L = 1: scalars)
template <int64_t L>
void row_sum(const float* data, int64_t n, float out[L]) {
  float part[4][L];
  cascade_rows<L>(data, n / 4, part);
  for (int64_t i = n / 4 * 4; i < n; ++i)
    for (int64_t l = 0; l < L; ++l) part[0][l] += data[i * L + l];
  for (int k = 1; k < 4; ++k)
    for (int64_t l = 0; l < L; ++l) part[0][l] += part[k][l];
  std::memcpy(out, part[0], sizeof(part[0]));
}

template <int64_t L>
float torch_sum(const float* sq, int64_t n) {
  if (n < L) {
    float total;
    row_sum<1>(sq, n, &total);
    return total;
  }
  const int64_t vectors = n / L;
  float lanes[L];
  row_sum<L>(sq, vectors, lanes);
  float total = 0.0f;
  for (int64_t k = vectors * L; k < n; ++k) total += sq[k];
  for (int64_t k = 0; k < L; ++k) total += lanes[k];
  return total;
}

// sum of x^2 in torch's order; sq: scratch of n floats; lanes: torch's width (8 or 16)
inline float sum_squares(const float* x, int64_t n, float* sq, int64_t lanes) {
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    vec v = vload(x + i);
    vstore(sq + i, vmul(v, v));
  }
  for (; i < n; ++i) sq[i] = x[i] * x[i];
  return lanes == 16 ? torch_sum<16>(sq, n) : torch_sum<8>(sq, n);
}

// residual += delta
inline void add_row(float* residual, const float* delta, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W) vstore(residual + i, vadd(vload(residual + i), vload(delta + i)));
  for (; i < n; ++i) residual[i] = residual[i] + delta[i];
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32,
              name, ": a float32 CPU tensor is expected");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, ": [rows, n] with unit column stride");
}

void check_lanes(int64_t lanes) { TORCH_CHECK(lanes == 8 || lanes == 16, "lanes: 8 or 16"); }

void check_weight(const torch::Tensor& w, int64_t n) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kFloat32 && w.dim() == 1 &&
                  w.size(0) == n && w.is_contiguous(),
              "weight: a contiguous float32 [n] tensor is expected");
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps,
                       int64_t lanes) {
  check_rows(x, "x");
  check_lanes(lanes);
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  check_weight(weight, n);
  auto out = torch::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    std::vector<float> sq(n);
    for (int64_t t = begin; t < end; ++t) {
      const float* row = xp + t * stride;
      scale_row(row, wp, op + t * n, n, sum_squares(row, n, sq.data(), lanes), e);
    }
  });
  return out;
}

torch::Tensor add_rms_norm_(torch::Tensor& residual, const torch::Tensor& delta,
                            const torch::Tensor& weight, double eps, int64_t lanes) {
  check_rows(residual, "residual");
  check_rows(delta, "delta");
  check_lanes(lanes);
  const int64_t rows = residual.size(0), n = residual.size(1);
  TORCH_CHECK(delta.size(0) == rows && delta.size(1) == n, "delta: the residual's shape");
  check_weight(weight, n);
  auto out = torch::empty({rows, n}, residual.options());
  float* rp = residual.data_ptr<float>();
  const float* dp = delta.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t rs = residual.stride(0), ds = delta.stride(0);
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, grain_rows(2 * n), [&](int64_t begin, int64_t end) {
    std::vector<float> sq(n);
    for (int64_t t = begin; t < end; ++t) {
      float* row = rp + t * rs;
      add_row(row, dp + t * ds, n);
      scale_row(row, wp, op + t * n, n, sum_squares(row, n, sq.data(), lanes), e);
    }
  });
  return out;
}

// one head: out = cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin), x = cat(x1, x2)
inline void rotate_head(const float* x, const float* cos, const float* sin, float* out,
                        int64_t half) {
  int64_t j = 0;
  for (; j + W <= half; j += W) {
    vec x1 = vload(x + j), x2 = vload(x + half + j), c = vload(cos + j), s = vload(sin + j);
    vstore(out + j, vsub(vmul(x1, c), vmul(x2, s)));
    vstore(out + half + j, vadd(vmul(x2, c), vmul(x1, s)));
  }
  for (; j < half; ++j) {
    const float x1 = x[j], x2 = x[half + j];
    out[j] = x1 * cos[j] - x2 * sin[j];
    out[half + j] = x2 * cos[j] + x1 * sin[j];
  }
}

template <typename index_t>
void check_slots(const index_t* loc, int64_t n, int64_t num_slots) {
  for (int64_t t = 0; t < n; ++t) {
    TORCH_CHECK(loc[t] >= 0 && loc[t] < num_slots, "rope_store_kv: slot out of range");
  }
}

// a pool row's K and V as the pool stores them: fp32 as computed, or bf16 rounded to nearest
// even (c10::BFloat16's conversion, the same bits as torch's .to(torch.bfloat16))
inline void store_head(const float* x, const float* c, const float* s, float* out, int64_t half) {
  rotate_head(x, c, s, out, half);
}
inline void store_head(const float* x, const float* c, const float* s, at::BFloat16* out,
                       int64_t half) {
  alignas(64) float rotated[kMaxHeadDim];
  rotate_head(x, c, s, rotated, half);
  for (int64_t j = 0; j < 2 * half; ++j) out[j] = at::BFloat16(rotated[j]);
}
inline void store_row(const float* x, float* out, int64_t n) {
  std::memcpy(out, x, n * sizeof(float));
}
inline void store_row(const float* x, at::BFloat16* out, int64_t n) {
  for (int64_t j = 0; j < n; ++j) out[j] = at::BFloat16(x[j]);
}

template <typename index_t, typename kv_t>
void rope_store_rows(const float* qkv, int64_t qkv_stride, const float* cos, const float* sin,
                     const index_t* loc, float* q, kv_t* kbuf, kv_t* vbuf, int64_t tokens,
                     int64_t heads, int64_t kv_heads, int64_t dim) {
  const int64_t half = dim / 2, kv_row = kv_heads * dim;
  at::parallel_for(0, tokens, grain_rows((heads + 2 * kv_heads) * dim), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* row = qkv + t * qkv_stride;
      const float* c = cos + t * half;
      const float* s = sin + t * half;
      for (int64_t h = 0; h < heads; ++h) {
        rotate_head(row + h * dim, c, s, q + (t * heads + h) * dim, half);
      }
      const int64_t slot = static_cast<int64_t>(loc[t]);
      for (int64_t h = 0; h < kv_heads; ++h) {
        store_head(row + (heads + h) * dim, c, s, kbuf + slot * kv_row + h * dim, half);
      }
      store_row(row + (heads + kv_heads) * dim, vbuf + slot * kv_row, kv_row);
    }
  });
}

template <typename kv_t>
void rope_store_typed(const torch::Tensor& qkv, const float* cp, const float* sp,
                      torch::Tensor& k_buffer, torch::Tensor& v_buffer, const torch::Tensor& loc,
                      float* q, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t dim) {
  kv_t* kp = k_buffer.data_ptr<kv_t>();
  kv_t* vp = v_buffer.data_ptr<kv_t>();
  const int64_t slots = k_buffer.size(0);
  if (loc.scalar_type() == torch::kInt64) {
    const int64_t* lp = loc.data_ptr<int64_t>();
    check_slots(lp, tokens, slots);
    rope_store_rows(qkv.data_ptr<float>(), qkv.stride(0), cp, sp, lp, q, kp, vp, tokens, heads,
                    kv_heads, dim);
  } else {
    const int32_t* lp = loc.data_ptr<int32_t>();
    check_slots(lp, tokens, slots);
    rope_store_rows(qkv.data_ptr<float>(), qkv.stride(0), cp, sp, lp, q, kp, vp, tokens, heads,
                    kv_heads, dim);
  }
}

torch::Tensor rope_store_kv(const torch::Tensor& qkv, const torch::Tensor& cos,
                            const torch::Tensor& sin, torch::Tensor& k_buffer,
                            torch::Tensor& v_buffer, const torch::Tensor& loc, int64_t heads,
                            int64_t kv_heads) {
  check_rows(qkv, "qkv");
  const int64_t tokens = qkv.size(0);
  TORCH_CHECK(k_buffer.dim() == 3 && k_buffer.size(1) == kv_heads,
              "k_buffer: [slots, kv_heads, head_dim] is expected");
  const int64_t dim = k_buffer.size(2);
  TORCH_CHECK(dim % 2 == 0 && dim <= kMaxHeadDim, "head_dim must be even, at most ", kMaxHeadDim);
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * dim, "qkv: [T, (heads + 2 kv_heads) D]");
  const auto kv_type = k_buffer.scalar_type();
  for (const auto* b : {&k_buffer, &v_buffer}) {
    TORCH_CHECK((kv_type == torch::kFloat32 || kv_type == torch::kBFloat16) &&
                    b->scalar_type() == kv_type && b->is_contiguous() &&
                    b->sizes() == k_buffer.sizes() && b->device().is_cpu(),
                "k_buffer, v_buffer: contiguous CPU pools of one shape, both float32 or both "
                "bfloat16");
  }
  for (const auto* t : {&cos, &sin}) {
    TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_contiguous() &&
                    t->numel() == tokens * (dim / 2),
                "cos, sin: contiguous float32 [T, head_dim / 2]");
  }
  TORCH_CHECK(loc.dim() == 1 && loc.size(0) == tokens && loc.is_contiguous() &&
                  (loc.scalar_type() == torch::kInt64 || loc.scalar_type() == torch::kInt32),
              "loc: contiguous int32 or int64 [T]");
  auto q = torch::empty({tokens, heads, dim}, qkv.options());
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  if (kv_type == torch::kFloat32)
    rope_store_typed<float>(qkv, cp, sp, k_buffer, v_buffer, loc, q.data_ptr<float>(), tokens,
                            heads, kv_heads, dim);
  else
    rope_store_typed<at::BFloat16>(qkv, cp, sp, k_buffer, v_buffer, loc, q.data_ptr<float>(),
                                   tokens, heads, kv_heads, dim);
  return q;
}

// torch's silu, x / (1 + exp(-x)), then * up
inline vec silu_mul_vec(vec g, vec u) {
  const vec one = vset(1.0f);
  return vmul(vdiv(g, vadd(one, vexp(vsub(vzero(), g)))), u);
}

torch::Tensor silu_mul(const torch::Tensor& gate_up, int64_t lanes) {
  check_rows(gate_up, "gate_up");
  check_lanes(lanes);
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up: [T, 2 * intermediate]");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2, stride = gate_up.stride(0);
  auto out = torch::empty({rows, n}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, grain_rows(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* g = gp + t * stride;
      const float* u = g + n;
      float* o = op + t * n;
      int64_t j = 0;
      // torch vectorizes rows in blocks of 2 vectors of its width (8 or 16 here) and
      // runs the rest through its scalar code (std::exp)
      const int64_t blocked = n / (2 * lanes) * (2 * lanes);
      for (; j + W <= blocked; j += W) vstore(o + j, silu_mul_vec(vload(g + j), vload(u + j)));
      for (; j < n; ++j) o[j] = (g[j] / (1.0f + std::exp(-g[j]))) * u[j];  // torch's tail
    }
  });
  return out;
}

// The first index of a row's maximum and the maximum, as torch's argmax and amax: a NaN
// anywhere is the row's maximum (its first index); -inf everywhere gives index 0. Pass 1 takes
// the vector maximum and looks for NaNs, pass 2 finds the first lane equal to it.
void row_max_argmax(const float* x, int64_t n, float* max_out, int64_t* idx_out) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
  bool nan = false;
  float best = neg_inf;
#if defined(__AVX512F__)
  __m512 m = _mm512_set1_ps(neg_inf);
  for (; j + 16 <= n; j += 16) {
    const __m512 v = _mm512_loadu_ps(x + j);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0;
    m = _mm512_max_ps(m, v);
  }
  best = _mm512_reduce_max_ps(m);
#else
  __m256 m = _mm256_set1_ps(neg_inf);
  for (; j + 8 <= n; j += 8) {
    const __m256 v = _mm256_loadu_ps(x + j);
    nan |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) != 0;
    m = _mm256_max_ps(m, v);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  for (int k = 0; k < 8; k++) best = std::max(best, lanes[k]);
#endif
  for (int64_t k = j; k < n; k++) {
    nan |= std::isnan(x[k]);
    best = std::max(best, x[k]);
  }
  if (nan) {
    for (int64_t k = 0; k < n; k++) {
      if (std::isnan(x[k])) {
        *max_out = x[k];
        *idx_out = k;
        return;
      }
    }
  }
  *max_out = best;
  *idx_out = 0;
  int64_t k = 0;
#if defined(__AVX512F__)
  const __m512 b = _mm512_set1_ps(best);
  for (; k + 16 <= n; k += 16) {
    const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + k), b, _CMP_EQ_OQ);
    if (eq) {
      *idx_out = k + __builtin_ctz(static_cast<unsigned>(eq));
      return;
    }
  }
#else
  const __m256 b = _mm256_set1_ps(best);
  for (; k + 8 <= n; k += 8) {
    const int eq = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + k), b, _CMP_EQ_OQ));
    if (eq) {
      *idx_out = k + __builtin_ctz(static_cast<unsigned>(eq));
      return;
    }
  }
#endif
  for (; k < n; k++) {
    if (x[k] == best) {
      *idx_out = k;
      return;
    }
  }
}

// rows of logits [B, V] -> (amax [B] float32, argmax [B] int64) in one call: the sampler's
// finite check and greedy pick. torch's two reductions on the freshly written logits took
// 120-270 us each a step here (a batch of 1 to 32 rows of 49,152).
std::vector<torch::Tensor> max_argmax(const torch::Tensor& logits) {
  check_rows(logits, "logits");
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  TORCH_CHECK(n > 0, "logits: empty rows");
  auto mx = torch::empty({rows}, logits.options());
  auto idx = torch::empty({rows}, logits.options().dtype(torch::kLong));
  const float* lp = logits.data_ptr<float>();
  float* mp = mx.data_ptr<float>();
  int64_t* ip = idx.data_ptr<int64_t>();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) row_max_argmax(lp + r * stride, n, mp + r, ip + r);
  });
  return {mx, idx};
}

// Grammar masks in place: logits [B, V] float32, bitmask [B, W] int32 (token t allowed iff bit
// t % 32 of word t / 32 is set, xgrammar's layout); a banned token's logit becomes -inf, and
// so does every token past 32 W. A word of all ones (a free string's letters) is skipped; the
// others are two masked stores of -inf (AVX-512) or a loop over their zero bits. xgrammar's
// CPU kernel took ~1.1 ms a step for 32 rows of SmolLM2's 49,152 tokens here.
void apply_bitmask_(torch::Tensor logits, const torch::Tensor& bitmask) {
  check_rows(logits, "logits");
  TORCH_CHECK(bitmask.device().is_cpu() && bitmask.scalar_type() == torch::kInt32 &&
                  bitmask.dim() == 2 && bitmask.stride(1) == 1,
              "bitmask: [rows, words] int32 CPU with unit column stride");
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  TORCH_CHECK(bitmask.size(0) == rows, "bitmask: one row per logits row");
  const int64_t words = bitmask.size(1), bstride = bitmask.stride(0);
  const int64_t covered = std::min(n, 32 * words), full = covered / 32;
  float* lp = logits.data_ptr<float>();
  const uint32_t* bp = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
#if defined(__AVX512F__)
    const __m512 ninf = _mm512_set1_ps(neg_inf);
#endif
    for (int64_t r = begin; r < end; ++r) {
      float* x = lp + r * stride;
      const uint32_t* b = bp + r * bstride;
      for (int64_t w = 0; w < full; ++w) {
        const uint32_t bits = b[w];
        if (bits == 0xFFFFFFFFu) continue;
#if defined(__AVX512F__)
        _mm512_mask_storeu_ps(x + 32 * w, static_cast<__mmask16>(~bits & 0xFFFFu), ninf);
        _mm512_mask_storeu_ps(x + 32 * w + 16, static_cast<__mmask16>(~bits >> 16), ninf);
#else
        for (uint32_t z = ~bits; z != 0; z &= z - 1) x[32 * w + __builtin_ctz(z)] = neg_inf;
#endif
      }
      for (int64_t t = 32 * full; t < covered; ++t)
        if (!((b[t / 32] >> (t % 32)) & 1u)) x[t] = neg_inf;
      for (int64_t t = covered; t < n; ++t) x[t] = neg_inf;
    }
  });
}


// ------------------------------------------------------------------ the logits screen
// Exact greedy picks through a bf16 screen of the logits GEMM (plait/runtime/logit_screen.py
// derives the bound). approx [B, V] bf16 is bf16(h) x bf16(W)^T accumulated in fp32 and
// rounded to bf16; each exact logit lies within
//   e_j = a w_norm[j] + b w_rest[j] + c |approx_j|,
//   a = ||h - bf16(h)|| + g (||bf16(h)|| + ||h||),  b = ||h||,
// of approx_j. A token whose upper bound approx_j + e_j is below the best lower bound
// max_k (approx_k - e_k) cannot be the argmax; the others (one to a few on a real model) get
// their exact fp32 dot product h . W_j, and the largest wins (the first on ties, as argmax).
// A row with a NaN or an infinite bound takes every token's exact dot product (torch's rules:
// a NaN is the maximum). With a grammar bitmask only its allowed tokens count, as after
// apply_bitmask_ (none allowed: -inf, index 0).
inline float bf16_bits_to_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

float dot_exact(const float* x, const float* w, int64_t n) {
  int64_t i = 0;
  vec acc0 = vzero(), acc1 = vzero();
  for (; i + 2 * W <= n; i += 2 * W) {
    acc0 = vfma(vload(x + i), vload(w + i), acc0);
    acc1 = vfma(vload(x + i + W), vload(w + i + W), acc1);
  }
  for (; i + W <= n; i += W) acc0 = vfma(vload(x + i), vload(w + i), acc0);
  float s = vsum(vadd(acc0, acc1));
  for (; i < n; ++i) s += x[i] * w[i];
  return s;
}

// 16 (8) bf16 values from p as floats
#if defined(__AVX512F__)
inline __m512 load_bf16(const uint16_t* p) {
  const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}
#else
inline __m256 load_bf16(const uint16_t* p) {
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}
#endif

// whether token t is allowed by a grammar bitmask row (xgrammar's layout; none: all are)
inline bool allowed(const uint32_t* bits, int64_t words, int64_t t) {
  return bits == nullptr || (t < 32 * words && ((bits[t / 32] >> (t % 32)) & 1u));
}

void screen_row(const uint16_t* x, const float* h, const uint16_t* hb, const float* weight,
                const float* wn, const float* wr, int64_t hidden, int64_t n, double g, float c,
                const uint32_t* bits, int64_t words, std::vector<int64_t>& cand,
                float* max_out, int64_t* idx_out) {
  double hn2 = 0, hbn2 = 0, hln2 = 0;
  for (int64_t i = 0; i < hidden; ++i) {
    const double v = h[i], vb = bf16_bits_to_float(hb[i]);
    hn2 += v * v;
    hbn2 += vb * vb;
    hln2 += (v - vb) * (v - vb);
  }
  const double slack = 1.0 + 1e-6;  // the norms' own rounding
  const float a = static_cast<float>(slack * (std::sqrt(hln2) + g * (std::sqrt(hbn2) + std::sqrt(hn2))));
  const float b = static_cast<float>(slack * std::sqrt(hn2));
  const float tiny = 1e-30f;  // flushed subnormal products
  const float neg_inf = -std::numeric_limits<float>::infinity();
  // with a bitmask, whole 16-token blocks run vectorized up to the last fully covered one
  const int64_t vec_end = bits == nullptr ? n : std::min(n, 32 * words);
  // each token's error bound (the scalar tails compute the same in scalars)
  auto bound = [&](float v, int64_t t) { return a * wn[t] + tiny + b * wr[t] + c * std::fabs(v); };
#if defined(__AVX512F__)
  const __m512 va = _mm512_set1_ps(a), vb = _mm512_set1_ps(b), vc = _mm512_set1_ps(c),
               vt = _mm512_set1_ps(tiny);
  auto bound16 = [&](__m512 v, int64_t t) {  // the 16 tokens from t
    __m512 e = _mm512_fmadd_ps(va, _mm512_loadu_ps(wn + t), vt);
    e = _mm512_fmadd_ps(vb, _mm512_loadu_ps(wr + t), e);
    return _mm512_fmadd_ps(vc, _mm512_abs_ps(v), e);
  };
  auto block_mask = [&](int64_t t) {  // the allowed ones of the 16 tokens from t (t % 16 == 0)
    return bits == nullptr ? static_cast<__mmask16>(0xFFFF)
                           : static_cast<__mmask16>(bits[t / 32] >> (t % 32));
  };
#endif
  // pass 1: the best lower bound among the allowed tokens (and whether one is not finite)
  float thr = neg_inf;
  bool bad = false, any = false;
  int64_t j = 0;
#if defined(__AVX512F__)
  {
    __m512 m = _mm512_set1_ps(neg_inf);
    __mmask16 nonfinite = 0, seen = 0;
    for (; j + 16 <= vec_end; j += 16) {
      const __mmask16 ok = block_mask(j);
      if (!ok) continue;
      const __m512 v = load_bf16(x + j);
      const __m512 lo = _mm512_sub_ps(v, bound16(v, j));
      nonfinite |= ok & _mm512_cmp_ps_mask(_mm512_sub_ps(lo, lo), _mm512_setzero_ps(), _CMP_NEQ_UQ);
      m = _mm512_mask_max_ps(m, ok, m, lo);
      seen |= ok;
    }
    thr = _mm512_reduce_max_ps(m);
    bad = nonfinite != 0;
    any = seen != 0;
  }
#endif
  const int64_t tail = j;
  for (; j < n; ++j) {
    if (!allowed(bits, words, j)) continue;
    const float v = bf16_bits_to_float(x[j]);
    const float lo = v - bound(v, j);
    bad |= !std::isfinite(lo);
    thr = std::max(thr, lo);
    any = true;
  }
  if (!any) {  // nothing allowed: as the masked logits, all -inf (argmax 0)
    *max_out = neg_inf;
    *idx_out = 0;
    return;
  }
  // pass 2: the candidates (every allowed token where a bound is not finite)
  cand.clear();
  if (bad || !std::isfinite(thr)) {
    for (int64_t k = 0; k < n; ++k)
      if (allowed(bits, words, k)) cand.push_back(k);
  } else {
    j = 0;
#if defined(__AVX512F__)
    const __m512 vthr = _mm512_set1_ps(thr);
    for (; j < tail; j += 16) {
      const __mmask16 ok = block_mask(j);
      if (!ok) continue;
      const __m512 v = load_bf16(x + j);
      for (uint32_t hit = ok & _mm512_cmp_ps_mask(_mm512_add_ps(v, bound16(v, j)), vthr, _CMP_GE_OQ);
           hit != 0; hit &= hit - 1)
        cand.push_back(j + __builtin_ctz(hit));
    }
#endif
    for (; j < n; ++j) {
      if (!allowed(bits, words, j)) continue;
      const float v = bf16_bits_to_float(x[j]);
      if (v + bound(v, j) >= thr) cand.push_back(j);
    }
  }
  // the exact dot products of the candidates: the first maximum, a NaN first of all
  float best = neg_inf;
  int64_t best_idx = cand.front();
  for (const int64_t k : cand) {
    const float d = dot_exact(h, weight + k * hidden, hidden);
    if (std::isnan(d)) {
      best = d;
      best_idx = k;
      break;
    }
    if (d > best) {
      best = d;
      best_idx = k;
    }
  }
  *max_out = best;
  *idx_out = best_idx;
}

std::vector<torch::Tensor> screen_argmax(const torch::Tensor& approx, const torch::Tensor& hidden,
                                         const torch::Tensor& hidden_bf16,
                                         const torch::Tensor& weight, const torch::Tensor& w_norm,
                                         const torch::Tensor& w_rest, double g, double c,
                                         int64_t valid, const std::optional<torch::Tensor>& bitmask) {
  TORCH_CHECK(approx.device().is_cpu() && approx.scalar_type() == torch::kBFloat16 &&
                  approx.dim() == 2 && approx.stride(1) == 1,
              "approx: [B, V] bfloat16 CPU rows with unit column stride");
  TORCH_CHECK(hidden.device().is_cpu() && hidden.scalar_type() == torch::kFloat32 &&
                  hidden.dim() == 2 && hidden.is_contiguous(),
              "hidden: [B, H] float32 CPU, contiguous");
  TORCH_CHECK(hidden_bf16.scalar_type() == torch::kBFloat16 && hidden_bf16.is_contiguous() &&
                  hidden_bf16.sizes() == hidden.sizes(),
              "hidden_bf16: hidden as contiguous bfloat16");
  const int64_t rows = approx.size(0), hid = hidden.size(1);
  TORCH_CHECK(hidden.size(0) == rows, "hidden: one row per approx row");
  TORCH_CHECK(weight.scalar_type() == torch::kFloat32 && weight.is_contiguous() &&
                  weight.dim() == 2 && weight.size(1) == hid,
              "weight: [V, H] float32, contiguous");
  const int64_t n = std::min({valid, approx.size(1), weight.size(0)});
  TORCH_CHECK(n > 0, "screen_argmax: no valid token");
  TORCH_CHECK(w_norm.scalar_type() == torch::kFloat32 && w_norm.is_contiguous() &&
                  w_rest.scalar_type() == torch::kFloat32 && w_rest.is_contiguous() &&
                  w_norm.numel() >= n && w_rest.numel() >= n,
              "w_norm, w_rest: [V] float32");
  const uint32_t* bp = nullptr;
  int64_t words = 0, bstride = 0;
  if (bitmask.has_value()) {
    const torch::Tensor& bm = *bitmask;
    TORCH_CHECK(bm.device().is_cpu() && bm.scalar_type() == torch::kInt32 && bm.dim() == 2 &&
                    bm.stride(1) == 1 && bm.size(0) == rows,
                "bitmask: [B, W] int32 CPU, one row per approx row, unit column stride");
    bp = reinterpret_cast<const uint32_t*>(bm.data_ptr<int32_t>());
    words = bm.size(1);
    bstride = bm.stride(0);
  }
  auto mx = torch::empty({rows}, hidden.options());
  auto idx = torch::empty({rows}, hidden.options().dtype(torch::kLong));
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(approx.data_ptr<at::BFloat16>());
  const uint16_t* hbp = reinterpret_cast<const uint16_t*>(hidden_bf16.data_ptr<at::BFloat16>());
  const float* hp = hidden.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float* wnp = w_norm.data_ptr<float>();
  const float* wrp = w_rest.data_ptr<float>();
  float* mp = mx.data_ptr<float>();
  int64_t* ip = idx.data_ptr<int64_t>();
  const int64_t stride = approx.stride(0);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> cand;
    for (int64_t r = begin; r < end; ++r)
      screen_row(xp + r * stride, hp + r * hid, hbp + r * hid, wp, wnp, wrp, hid, n, g,
                 static_cast<float>(c), bp == nullptr ? nullptr : bp + r * bstride, words, cand,
                 mp + r, ip + r);
  });
  return {mx, idx};
}

}  // namespace

// ----------------------------------------------------------------------------- decode layers
// The model's lean layer loop (LlamaForCausalLM._forward_lean) in C++: per layer the fused qkv
// linear, rope_store_kv, decode attention, o linear, add_rms_norm_, gate_up linear, silu_mul,
// down linear, add_rms_norm_ -- the same kernels on the same operands in the same order, so
// the same results, without the ~270 Python calls a step (each a few microseconds, more with
// the interpreter's state evicted by the weight stream: SmolLM2's 30 layers at batch 1 on the
// AVX2 VM, see llama.py). The linears and the attention live in the other kernel modules
// (woq_cpu.cpp, attn_cpu.cpp); each exports its entry points' addresses with their signatures
// (entry_points()), and this module calls them through typed pointers, so each source keeps
// its own build flags (this one's -ffp-contract=off) and the three are not one translation
// unit. The GIL is released for the whole loop.
namespace {

using Tensor = torch::Tensor;
using Fp32LinearFn = Tensor (*)(Tensor, Tensor, int64_t);
using Int8LinearFn = Tensor (*)(Tensor, Tensor, Tensor, int64_t);
using Int4LinearFn = Tensor (*)(Tensor, Tensor, Tensor, Tensor, int64_t);
using AttentionFn = std::vector<Tensor> (*)(Tensor, Tensor, Tensor, Tensor, Tensor, double);
using MergeFn = void (*)(Tensor, Tensor, Tensor, Tensor, Tensor);

// the signature each entry point is exported with (woq_cpu.cpp, attn_cpu.cpp)
constexpr const char* kFp32Signature = "Tensor(Tensor x, Tensor w, int64 N)";
constexpr const char* kInt8Signature = "Tensor(Tensor x, Tensor w, Tensor scale, int64 N)";
constexpr const char* kInt4Signature =
    "Tensor(Tensor x, Tensor w, Tensor scale, Tensor mins, int64 N)";
constexpr const char* kAttentionSignature =
    "Tensor[](Tensor q, Tensor k_buffer, Tensor v_buffer, Tensor slots, Tensor lens, float scale)";
constexpr const char* kMergeSignature =
    "(Tensor out, Tensor lse, Tensor members, Tensor p_out, Tensor p_lse)";

// an exported (address, signature) pair, its signature checked
void* entry_point(const py::handle& entry, const std::string& name, const char* signature) {
  const auto e = entry.cast<std::pair<int64_t, std::string>>();
  TORCH_CHECK(e.second == signature, "entry point ", name, ": signature ", e.second,
              ", expected ", signature);
  return reinterpret_cast<void*>(e.first);
}

struct Linear {
  int kind = 0;  // 0 fp32, 1 int8, 2 int4
  bool silu = false;  // fp32_linear_silu: the output is silu(gate) * up already
  void* fn = nullptr;
  std::vector<Tensor> w;  // the kernel's operands after x, N last
  int64_t n = 0;

  Tensor operator()(const Tensor& x) const {
    switch (kind) {
      case 0: return reinterpret_cast<Fp32LinearFn>(fn)(x, w[0], n);
      case 1: return reinterpret_cast<Int8LinearFn>(fn)(x, w[0], w[1], n);
      default: return reinterpret_cast<Int4LinearFn>(fn)(x, w[0], w[1], w[2], n);
    }
  }
};

struct Layer {
  Linear qkv, o, gate_up, down;
  Tensor post_w, next_w, k_buffer, v_buffer;
  double post_eps = 0, next_eps = 0;
  int64_t heads = 0, kv_heads = 0;
};

// (name, (address, signature), operands) of one linear (woq.py's kernel_entry): the kind
// from its name, the address checked against the kind's signature
Linear make_linear(const py::tuple& spec) {
  TORCH_CHECK(spec.size() == 3, "decode layers: a linear is (name, entry point, operands)");
  const std::string name = spec[0].cast<std::string>();
  const py::tuple args = spec[2].cast<py::tuple>();
  Linear lin;
  if (name == "fp32_linear" || name == "fp32_linear_silu") {
    lin.kind = 0, lin.fn = entry_point(spec[1], name, kFp32Signature);
    lin.silu = name == "fp32_linear_silu";
  } else if (name == "int8_linear") {
    lin.kind = 1, lin.fn = entry_point(spec[1], name, kInt8Signature);
  } else if (name == "int4_linear") {
    lin.kind = 2, lin.fn = entry_point(spec[1], name, kInt4Signature);
  } else {
    TORCH_CHECK(false, "decode layers: unknown linear kernel ", name);
  }
  TORCH_CHECK(args.size() == size_t(lin.kind + 2), "decode layers: ", name, " operands");
  for (size_t i = 0; i + 1 < args.size(); i++) lin.w.push_back(args[i].cast<Tensor>());
  lin.n = args[args.size() - 1].cast<int64_t>();
  return lin;
}

enum Kernel { kQkv, kRope, kAttention, kO, kNorm, kGateUp, kSilu, kDown, kKernels };
constexpr const char* kKernelNames[kKernels] = {
    "qkv_proj", "rope_store_kv", "attention", "o_proj", "add_rms_norm", "gate_up_proj",
    "silu_mul", "down_proj"};

// Adds the time since its last tick to seconds[kernel] (nothing when seconds is null).
class Clock {
 public:
  explicit Clock(double* seconds) : seconds_(seconds) {
    if (seconds_) last_ = std::chrono::steady_clock::now();
  }
  void tick(Kernel kernel) {
    if (!seconds_) return;
    const auto now = std::chrono::steady_clock::now();
    seconds_[kernel] += std::chrono::duration<double>(now - last_).count();
    last_ = now;
  }

 private:
  double* seconds_;
  std::chrono::steady_clock::time_point last_;
};

class DecodeLayers {
 public:
  // layers: the Python loop's tuples (i, heads, kv_heads, qkv, o, gate_up, down, post_w,
  // post_eps, next_w, next_eps), each linear (name, (address, signature), operands) of a
  // woq_cpu.cpp function (woq.py's kernel_entry); k_buffers, v_buffers: the pool's per-layer
  // tensors; attention: attn_cpu.cpp's entry_points() (decode_attention, merge_prefix);
  // lanes: FusedOps' sum and SiLU widths
  DecodeLayers(const py::list& layers, const std::vector<Tensor>& k_buffers,
               const std::vector<Tensor>& v_buffers, const py::dict& attention,
               int64_t sum_lanes, int64_t silu_lanes)
      : attention_(reinterpret_cast<AttentionFn>(entry_point(
            attention["decode_attention"], "decode_attention", kAttentionSignature))),
        merge_(reinterpret_cast<MergeFn>(
            entry_point(attention["merge_prefix"], "merge_prefix", kMergeSignature))),
        sum_lanes_(sum_lanes),
        silu_lanes_(silu_lanes) {
    check_lanes(sum_lanes);
    check_lanes(silu_lanes);
    for (const auto& item : layers) {
      const py::tuple t = item.cast<py::tuple>();
      TORCH_CHECK(t.size() == 11, "decode layers: a layer is an 11-tuple");
      Layer l;
      const int64_t i = t[0].cast<int64_t>();
      TORCH_CHECK(i >= 0 && i < int64_t(k_buffers.size()) && i < int64_t(v_buffers.size()),
                  "decode layers: layer index out of the pool");
      l.heads = t[1].cast<int64_t>(), l.kv_heads = t[2].cast<int64_t>();
      TORCH_CHECK(l.kv_heads > 0 && l.heads % l.kv_heads == 0, "decode layers: heads");
      l.qkv = make_linear(t[3].cast<py::tuple>());
      l.o = make_linear(t[4].cast<py::tuple>());
      l.gate_up = make_linear(t[5].cast<py::tuple>());
      l.down = make_linear(t[6].cast<py::tuple>());
      TORCH_CHECK(!l.qkv.silu && !l.o.silu && !l.down.silu,
                  "decode layers: fp32_linear_silu only as the gate_up linear");
      l.post_w = t[7].cast<Tensor>(), l.post_eps = t[8].cast<double>();
      l.next_w = t[9].cast<Tensor>(), l.next_eps = t[10].cast<double>();
      l.k_buffer = k_buffers[i], l.v_buffer = v_buffers[i];
      layers_.push_back(std::move(l));
    }
  }

  // x: the residual stream [T, hidden] (updated in place), h: the first layer's normed input;
  // returns the last layer's normed output (the final norm's). slots, lens, scale: the decode
  // attention's (attn_cpu.cpp decode_attention) for this batch, each request's KV after its
  // shared prefix if it has one; groups: the shared prefixes (cpu_attention.py's
  // PrefixGroup), each (members [n], slots [1, P], lens [1]): the members' query rows attend
  // the prefix in one call and merge into their rows, as decode_attention_cpu does.
  Tensor run(Tensor x, Tensor h, const Tensor& cos, const Tensor& sin, const Tensor& loc,
             const Tensor& slots, const Tensor& lens, double scale,
             const std::vector<std::tuple<Tensor, Tensor, Tensor>>& groups) {
    Clock clock(timing_ ? seconds_ : nullptr);
    for (const Layer& l : layers_) {
      Tensor kb = l.k_buffer, vb = l.v_buffer;
      const Tensor qkv = l.qkv(h);
      clock.tick(kQkv);
      const Tensor q = rope_store_kv(qkv, cos, sin, kb, vb, loc, l.heads, l.kv_heads);
      clock.tick(kRope);
      const int64_t T = q.size(0), D = q.size(2);
      const Tensor qg = q.view({T, l.kv_heads, l.heads / l.kv_heads, D});
      const std::vector<Tensor> attended = attention_(qg, kb, vb, slots, lens, scale);
      for (const auto& [members, prefix_slots, prefix_lens] : groups) {
        // the members' query rows per kv head, member-major: [1, Hkv, n * G, D]
        const Tensor qs = qg.index_select(0, members).transpose(0, 1).reshape(
            {1, l.kv_heads, members.size(0) * (l.heads / l.kv_heads), D});
        const std::vector<Tensor> p = attention_(qs, kb, vb, prefix_slots, prefix_lens, scale);
        merge_(attended[0], attended[1], members, p[0], p[1]);
      }
      const Tensor a = attended[0].view({T, -1});
      clock.tick(kAttention);
      const Tensor o = l.o(a);
      clock.tick(kO);
      h = add_rms_norm_(x, o, l.post_w, l.post_eps, sum_lanes_);
      clock.tick(kNorm);
      const Tensor gate_up = l.gate_up(h);
      clock.tick(kGateUp);
      const Tensor act = l.gate_up.silu ? gate_up : silu_mul(gate_up, silu_lanes_);
      clock.tick(kSilu);
      const Tensor m = l.down(act);
      clock.tick(kDown);
      h = add_rms_norm_(x, m, l.next_w, l.next_eps, sum_lanes_);
      clock.tick(kNorm);
    }
    return h;
  }

  // Per-kernel wall time, summed over the runs since the last reset while timing is on
  // (benchmarks/layer_split.py): {kernel: seconds}. Off by default (a clock read between
  // kernels, ~20 ns each, when on).
  void set_timing(bool on) { timing_ = on; }
  py::dict timings() const {
    py::dict d;
    for (int i = 0; i < kKernels; i++) d[kKernelNames[i]] = seconds_[i];
    return d;
  }
  void reset_timings() { std::fill(seconds_, seconds_ + kKernels, 0.0); }

  int64_t size() const { return layers_.size(); }

 private:
  std::vector<Layer> layers_;
  AttentionFn attention_;
  MergeFn merge_;
  int64_t sum_lanes_, silu_lanes_;
  bool timing_ = false;
  double seconds_[kKernels] = {};
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "x * rsqrt(mean(x^2) + eps) * weight over the rows of x");
  m.def("add_rms_norm_", &add_rms_norm_,
        "residual += delta (in place); returns rms_norm(residual, weight, eps)");
  m.def("rope_store_kv", &rope_store_kv,
        "rotate q and k of a fused qkv row block, store k and v at the pool slots; returns q");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused [T, 2 I] gate_up block");
  m.def("max_argmax", &max_argmax, "(amax, argmax) of each row of [B, V] float32 logits");
  m.def("apply_bitmask_", &apply_bitmask_,
        "logits [B, V] in place: -inf where the token's bit in bitmask [B, W] int32 is 0");
  m.def("screen_argmax", &screen_argmax,
        "exact (amax, argmax) of hidden @ weight^T rows through a bf16 screen of the logits");
  m.attr("vector_width") = W;
  py::class_<DecodeLayers>(m, "DecodeLayers")
      .def(py::init<const py::list&, const std::vector<torch::Tensor>&,
                    const std::vector<torch::Tensor>&, const py::dict&, int64_t, int64_t>())
      .def("run", &DecodeLayers::run, py::call_guard<py::gil_scoped_release>(),
           "the decoder layers of one decode forward; returns the final normed hidden rows")
      .def("set_timing", &DecodeLayers::set_timing, "time each kernel (off by default)")
      .def("timings", &DecodeLayers::timings, "{kernel: seconds} since the last reset")
      .def("reset_timings", &DecodeLayers::reset_timings)
      .def("__len__", &DecodeLayers::size);
}

// Decode attention over the KV pool for the CPU (AVX2 + FMA), reading K/V rows in place.
//
// The torch path gathers every request's K and V rows into a padded batch (index_select:
// one read and one write of the KV it attends) and then runs torch's flash kernel over the
// copy (a second read), shaped for long query blocks, not for one query row per request.
// Here each (request, kv head) pair is one task: its G query heads (grouped-query heads of
// that kv head) score every key row found through the request's slot list, a softmax, and
// the weighted sum of the value rows. Output: out [B, Hkv, G, D] and the log-sum-exp of the
// scaled scores [B, Hkv, G] (for merging with a shared prefix's partial result).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

inline float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_hadd_ps(lo, lo);
  lo = _mm_hadd_ps(lo, lo);
  return _mm_cvtss_f32(lo);
}

inline float hmax(__m256 v) {
  __m128 lo = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_max_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_max_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}

// exp(x) for x <= 0 (softmax arguments): 2^n * p(r) with x = n ln2 + r, |r| <= ln2 / 2, a
// degree-6 polynomial for e^r (relative error ~2e-7, below fp32 attention's own rounding).
inline __m256 exp_ps(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  x = _mm256_max_ps(x, lo);
  const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
  const __m256 ln2_hi = _mm256_set1_ps(0.693359375f);
  const __m256 ln2_lo = _mm256_set1_ps(-2.12194440e-4f);
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, ln2_hi, x);
  r = _mm256_fnmadd_ps(n, ln2_lo, r);
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// one (request, kv head): q [G, D] -> out [G, D], lse [G]; scores [G, L] scratch
void attend_one(const float* q, int64_t G, int64_t D, const float* kbuf, const float* vbuf,
                int64_t row_stride, const int64_t* slots, int64_t L, float scale, float* out,
                float* lse, std::vector<float>& scores) {
  const int64_t Lp = (L + 7) & ~int64_t(7);
  scores.resize(G * Lp);
  // scores[g, l] = scale * q_g . k_l
  for (int64_t l = 0; l < L; l++) {
    const float* k = kbuf + slots[l] * row_stride;
    for (int64_t g = 0; g < G; g++) {
      const float* qg = q + g * D;
      __m256 acc = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d), _mm256_loadu_ps(k + d), acc);
      scores[g * Lp + l] = hsum(acc) * scale;
    }
  }
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t g = 0; g < G; g++) {
    float* s = scores.data() + g * Lp;
    for (int64_t l = L; l < Lp; l++) s[l] = neg_inf;
    __m256 mv = _mm256_set1_ps(neg_inf);
    for (int64_t l = 0; l < Lp; l += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + l));
    const float m = hmax(mv);
    const __m256 mb = _mm256_set1_ps(m);
    __m256 sv = _mm256_setzero_ps();
    for (int64_t l = 0; l < Lp; l += 8) {
      __m256 p = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(s + l), mb));
      // padding lanes: exp(-inf - m) is clamped above, so zero them explicitly
      if (l + 8 > L) {
        alignas(32) float tmp[8];
        _mm256_store_ps(tmp, p);
        for (int64_t j = L - l; j < 8; j++) tmp[j] = 0.0f;
        p = _mm256_load_ps(tmp);
      }
      _mm256_storeu_ps(s + l, p);
      sv = _mm256_add_ps(sv, p);
    }
    const float sum = hsum(sv);
    lse[g] = m + std::log(sum);
    const float inv = 1.0f / sum;
    // out_g = sum_l p_l v_l / sum, D / 8 accumulators (D <= 128: 16 registers)
    float* o = out + g * D;
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
      const int64_t nd = std::min<int64_t>(64, D - d0) / 8;
      __m256 acc[8];
      for (int64_t j = 0; j < nd; j++) acc[j] = _mm256_setzero_ps();
      for (int64_t l = 0; l < L; l++) {
        const float* v = vbuf + slots[l] * row_stride + d0;
        const __m256 p = _mm256_set1_ps(s[l]);
        for (int64_t j = 0; j < nd; j++)
          acc[j] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * j), acc[j]);
      }
      const __m256 iv = _mm256_set1_ps(inv);
      for (int64_t j = 0; j < nd; j++) _mm256_storeu_ps(o + d0 + 8 * j, _mm256_mul_ps(acc[j], iv));
    }
  }
}

}  // namespace

// q [B, Hkv, G, D] float32; k_buffer, v_buffer [S, Hkv, D] float32 (one layer of the pool);
// slots [B, W] int64 (row b's first lens[b] entries are its KV slots); lens [B] int64.
std::vector<at::Tensor> decode_attention(at::Tensor q, at::Tensor k_buffer, at::Tensor v_buffer,
                                         at::Tensor slots, at::Tensor lens, double scale) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kFloat, "q: [B, Hkv, G, D] float32");
  TORCH_CHECK(k_buffer.scalar_type() == at::kFloat && v_buffer.scalar_type() == at::kFloat,
              "K/V buffers: float32");
  TORCH_CHECK(k_buffer.is_contiguous() && v_buffer.is_contiguous(), "K/V buffers: contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && lens.scalar_type() == at::kLong,
              "slots, lens: int64");
  q = q.contiguous();
  slots = slots.contiguous();
  lens = lens.contiguous();
  const int64_t B = q.size(0), H = q.size(1), G = q.size(2), D = q.size(3);
  TORCH_CHECK(D % 8 == 0 && D <= 512, "head_dim must be a multiple of 8");
  TORCH_CHECK(k_buffer.size(1) == H && k_buffer.size(2) == D, "K buffer shape");
  TORCH_CHECK(slots.size(0) == B && lens.size(0) == B, "slots/lens batch");
  const int64_t W = slots.size(1);
  const int64_t S = k_buffer.size(0);
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; b++) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= W, "lens out of range");
    for (int64_t l = 0; l < lp[b]; l++)
      TORCH_CHECK(sp[b * W + l] >= 0 && sp[b * W + l] < S, "slot out of range");
  }
  auto out = at::empty_like(q);
  auto lse = at::empty({B, H, G}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k_buffer.data_ptr<float>();
  const float* vp = v_buffer.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* lsep = lse.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t t = begin; t < end; t++) {
      const int64_t b = t / H, h = t % H;
      attend_one(qp + t * G * D, G, D, kp + h * D, vp + h * D, H * D, sp + b * W, lp[b], sc,
                 op + t * G * D, lsep + t * G, scores);
    }
  });
  return {out, lse};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention,
        "q [B, Hkv, G, D] over the pool rows slots[b, :lens[b]] -> (out, lse)");
}

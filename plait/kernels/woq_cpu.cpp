// Weight-only quantized linears for the CPU (AVX2 + FMA): y = x @ dequant(W).T, x fp32.
// Decode at small batches reads every weight once per step, so fewer weight bytes are fewer
// bytes of memory traffic; the weights are converted to fp32 in registers, never in memory.
//   int8: W[n, k] = q[n, k] * scale[n]                    (q: int8 [N, K], per output row)
//   int4: W[n, k] = q[n, k] * scale[n, g] + min[n, g]     (g = k / 32; q: 0..15, two per
//         byte in GGUF Q4_1's order: byte j of a group holds element j (low nibble) and
//         element j + 16 (high nibble); packed [N, K / 2] uint8)
// Activation rows are taken in chunks of kRowChunk so a chunk stays in cache while each
// thread streams its share of the weight rows.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

constexpr int64_t kRowChunk = 32;
constexpr int64_t kGroup = 32;

inline float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_hadd_ps(lo, lo);
  lo = _mm_hadd_ps(lo, lo);
  return _mm_cvtss_f32(lo);
}

inline __m256 load_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}

inline __m256 u8_to_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }

// int8: NB weight rows x BB activation rows of out
template <int NB, int BB>
void tile_int8(const float* x, const int8_t* w, const float* scale, float* out, int64_t K,
               int64_t N, int64_t n0, int64_t b0) {
  __m256 acc[NB][BB];
  for (int i = 0; i < NB; i++)
    for (int j = 0; j < BB; j++) acc[i][j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 wv[NB];
    for (int i = 0; i < NB; i++) wv[i] = load_i8(w + (n0 + i) * K + k);
    for (int j = 0; j < BB; j++) {
      __m256 xv = _mm256_loadu_ps(x + (b0 + j) * K + k);
      for (int i = 0; i < NB; i++) acc[i][j] = _mm256_fmadd_ps(wv[i], xv, acc[i][j]);
    }
  }
  for (int i = 0; i < NB; i++)
    for (int j = 0; j < BB; j++) {
      float s = hsum(acc[i][j]);
      for (int64_t kk = k; kk < K; kk++) s += x[(b0 + j) * K + kk] * w[(n0 + i) * K + kk];
      out[(b0 + j) * N + n0 + i] = s * scale[n0 + i];
    }
}

// int4: one weight row x BB activation rows; xsum[b, g] = sum of x over group g (for the mins)
template <int BB>
void tile_int4(const float* x, const float* xsum, const uint8_t* w, const float* scale,
               const float* mins, float* out, int64_t K, int64_t N, int64_t n, int64_t b0) {
  const int64_t G = K / kGroup;
  const uint8_t* row = w + n * (K / 2);
  const __m128i mask = _mm_set1_epi8(0x0F);
  __m256 acc[BB];
  for (int j = 0; j < BB; j++) acc[j] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; g++) {
    __m128i v = _mm_loadu_si128((const __m128i*)(row + g * 16));
    __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
    __m256 w0 = u8_to_ps(lo), w1 = u8_to_ps(_mm_srli_si128(lo, 8));
    __m256 w2 = u8_to_ps(hi), w3 = u8_to_ps(_mm_srli_si128(hi, 8));
    __m256 d = _mm256_set1_ps(scale[n * G + g]);
    for (int j = 0; j < BB; j++) {
      const float* xg = x + (b0 + j) * K + g * kGroup;
      __m256 s0 = _mm256_mul_ps(w0, _mm256_loadu_ps(xg));
      __m256 s1 = _mm256_mul_ps(w1, _mm256_loadu_ps(xg + 8));
      s0 = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xg + 16), s0);
      s1 = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xg + 24), s1);
      acc[j] = _mm256_fmadd_ps(d, _mm256_add_ps(s0, s1), acc[j]);
    }
  }
  for (int j = 0; j < BB; j++) {
    float m = 0.f;
    for (int64_t g = 0; g < G; g++) m += mins[n * G + g] * xsum[(b0 + j) * G + g];
    out[(b0 + j) * N + n] = hsum(acc[j]) + m;
  }
}

void check_x(const torch::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [B, K] tensor");
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " features, the weight ", K);
}

}  // namespace

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scale) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kChar && w.is_contiguous());
  const int64_t K = w.size(1), N = w.size(0);
  check_x(x, K);
  TORCH_CHECK(scale.numel() == N && scale.scalar_type() == torch::kFloat && scale.is_contiguous());
  const int64_t B = x.size(0);
  auto out = torch::empty({B, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  constexpr int NB = 4;
  const int64_t blocks = (N + NB - 1) / NB;
  for (int64_t c0 = 0; c0 < B; c0 += kRowChunk) {
    const int64_t c1 = std::min(B, c0 + kRowChunk);
    at::parallel_for(0, blocks, 16, [&](int64_t lo, int64_t hi) {
      for (int64_t blk = lo; blk < hi; blk++) {
        const int64_t n0 = blk * NB;
        if (n0 + NB > N) {  // the last rows, one at a time
          for (int64_t n = n0; n < N; n++)
            for (int64_t b = c0; b < c1; b++) tile_int8<1, 1>(xp, wp, sp, op, K, N, n, b);
          continue;
        }
        int64_t b = c0;
        for (; b + 2 <= c1; b += 2) tile_int8<NB, 2>(xp, wp, sp, op, K, N, n0, b);
        for (; b < c1; b++) tile_int8<NB, 1>(xp, wp, sp, op, K, N, n0, b);
      }
    });
  }
  return out;
}

torch::Tensor int4_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scale,
                          torch::Tensor mins) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kByte && w.is_contiguous());
  const int64_t N = w.size(0), K = w.size(1) * 2;
  TORCH_CHECK(K % kGroup == 0, "int4: in_features must be a multiple of ", kGroup);
  check_x(x, K);
  const int64_t G = K / kGroup;
  for (const auto& t : {scale, mins})
    TORCH_CHECK(t.numel() == N * G && t.scalar_type() == torch::kFloat && t.is_contiguous());
  const int64_t B = x.size(0);
  auto xsum = x.view({B, G, kGroup}).sum(-1).contiguous();  // [B, G]
  auto out = torch::empty({B, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* xs = xsum.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* mp = mins.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t c0 = 0; c0 < B; c0 += kRowChunk) {
    const int64_t c1 = std::min(B, c0 + kRowChunk);
    at::parallel_for(0, N, 64, [&](int64_t lo, int64_t hi) {
      for (int64_t n = lo; n < hi; n++) {
        int64_t b = c0;
        for (; b + 4 <= c1; b += 4) tile_int4<4>(xp, xs, wp, sp, mp, op, K, N, n, b);
        for (; b < c1; b++) tile_int4<1>(xp, xs, wp, sp, mp, op, K, N, n, b);
      }
    });
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_linear", &int8_linear, "y = x @ (q * scale[:, None]).T");
  m.def("int4_linear", &int4_linear, "y = x @ (q * scale + min, group 32).T");
}

// plait's linears for the CPU: y = x @ W.T with x and y fp32 and W fp32 (the default fp32
// path) or weight-only quantized (y = x @ dequant(W).T). One source, compiled twice
// (plait/kernels/woq.py picks the build at run time): with -mavx512f (16-float vectors) and
// with -mavx2 -mfma (8-float vectors).
//
// Weights are stored in panels of 32 output features (woq.py's to_panels_* writes them; the
// last panel is zero-padded):
//   fp32: w[p, k, j]  = W[32 p + j, k]                       float [P, K, 32]
//   int8: w[p, k, j]  = q[32 p + j, k]                       int8  [P, K, 32]
//         scale[32 p + j]                                    float [P * 32]
//   int4: w[p, k, j]  = q[32 p + j, k] | q[32 p + j + 16, k] << 4   (j < 16)  uint8 [P, K, 16]
//         (the AVX2 build: the same bytes, each run of 4 inputs transposed so that a
//         feature's 4 inputs are adjacent, w[p, k/4, 4 j + k%4]            uint8 [P, K/4, 64];
//         see tile_int4_q8)
//         scale[p, g, j], mins[p, g, j] for features 32 p + j, inputs 32 g .. 32 g + 31
//         W[n, k] = q * scale + min (GGUF Q4_1's form)          float16 [P, K / 32, 32]
// so the 32 features of one input k are one 16- or 32-byte load, expanded in registers into
// two vectors (features j and j + 16; AVX2 takes each panel as two halves of 2 x 8 features,
// or, for fp32 tiles of one or two rows, as four vectors in one pass).
//
// The GEMM is a register-tiled outer product: a tile of MR activation rows x one panel keeps
// MR x 2 vector accumulators; per input k it broadcasts x[m, k] and multiplies it into the two
// weight vectors. Each thread claims runs of panels (parallel_panels). For each block of up to
// kRowBlock rows, the first MR rows run straight from the quantized weights ("direct":
// dequantized in registers) and, when more rows follow, also write the dequantized panel
// (K x 32 floats, <= 200 KB for K = 1536: L2) to a per-thread scratch that the remaining row
// tiles read. So the weights are dequantized once per panel and row block, not once per row,
// and never for the whole matrix: the old kernel dequantized per (weight row, 4 activation
// rows) and reread all activation rows from L2 per weight row, 3x slower than fp32 at batch 32.
// fp32 panels need no scratch: every row tile reads the panel (the first from memory, the
// rest from L2), and the weight stream is prefetched in software (panel_rows_fp32). One thread
// streaming fp32 weights with the hardware prefetcher alone got ~40 GB/s of this machine's
// ~70; prefetching 16 KB ahead took SmolLM2's batch-1 linears 8.7 -> 6.9 ms, and spreading
// the next panel's prefetch over the first two row tiles (instead of all of it from the
// first) took batch 32 from 24 to 20 ms; over all of them, evenly (a core fetches ~12 GB/s
// from memory on the Intel Xeon VM, and two tiles' worth of compute was too short to take a
// panel at that rate: the third tile computed with the memory idle), 37.1 -> 32.1 ms for
// SmolLM2's 30 layers of linears at batch 32 and 59.1 -> 50.7 at 64 on that VM. From 24 rows
// on, the AVX-512 build takes fp32 panels in pairs (tile_pair: 6 rows x 64 features), closer to
// the FMA peak in prefills; from 4 rows to 127 the pairs run their inputs in blocks that every
// row tile takes in turn (panel_pair_blocks: the weight stream then overlaps all the compute,
// not only the first tile's: SmolLM2's linears 1.14-1.27x faster at 8-32 rows).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kPanel = 32;  // output features per panel
constexpr int64_t kGroup = 32;  // int4 inputs per scale/min pair
constexpr int64_t kRowBlock = 64;  // activation rows per block: x block <= 384 KB at K = 1536
constexpr int64_t kPrefetchFloats = 4096;  // 16 KB ahead in a single tile's stream

// body(p0, p1) over panels [0, panels), claimed from a shared counter in guided chunks (each
// claim a 1/threads share of what is left, so the first claims are each thread's contiguous
// stream and the last ones a panel or two) instead of split evenly up front: a thread the OS
// preempts (another process, this VM's neighbours) or that runs slower leaves the tail to the
// others rather than holding the whole linear up at the end. Each item (a panel, or a panel
// pair's row block) is computed by one thread, every output in one chain over the inputs, so
// results do not depend on which.
template <class Body>
void parallel_panels(int64_t panels, const Body& body) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), panels);
  if (threads <= 1 || at::in_parallel_region()) return body(0, panels);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    int64_t p0 = next.load(std::memory_order_relaxed);
    while (p0 < panels) {
      const int64_t chunk = std::max<int64_t>(1, (panels - p0) / threads);
      if (next.compare_exchange_weak(p0, p0 + chunk, std::memory_order_relaxed)) {
        body(p0, std::min(panels, p0 + chunk));
        p0 = next.load(std::memory_order_relaxed);
      }
    }
  });
}

#if defined(__AVX512F__)
constexpr const char* kIsa = "avx512";
constexpr int W = 16;  // floats per vector: one vector pair covers a whole panel
constexpr int kDirectRows = 8;  // 16 accumulators + dequantization temporaries in 32 registers
constexpr int kScratchRows = 12;  // 24 accumulators + 2 weight vectors
using vf = __m512;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline vf vbcast(const float* p) { return _mm512_set1_ps(*p); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline void vstore_n(float* p, vf v, int64_t n) {  // the first n (< W) floats
  _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), v);
}

// 16 bytes -> their low nibbles (features j) and high nibbles (features j + 16) as floats
inline void q4_pair(const uint8_t* p, vf& lo, vf& hi) {
  __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
  lo = _mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(0x0F)));
  hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4));
}
inline vf q8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
inline vf vload_half(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
}
inline vf vset1_sum(vf v) { return _mm512_set1_ps(_mm512_reduce_add_ps(v)); }
#else
constexpr const char* kIsa = "avx2";
constexpr int W = 8;  // a panel is two halves, each a vector pair (features h*8.., 16+h*8..)
constexpr int kDirectRows = 4;  // 16 ymm registers
constexpr int kScratchRows = 6;  // 12 accumulators + 2 weight vectors + the broadcast
using vf = __m256;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline vf vbcast(const float* p) { return _mm256_broadcast_ss(p); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline void vstore_n(float* p, vf v, int64_t n) {
  const __m256i first_n =
      _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  _mm256_maskstore_ps(p, first_n, v);
}
inline void q4_pair(const uint8_t* p, vf& lo, vf& hi) {  // 8 bytes
  __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
  lo = _mm256_cvtepi32_ps(_mm256_and_si256(q, _mm256_set1_epi32(0x0F)));
  hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4));
}
inline vf q8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
inline vf vload_half(const uint16_t* p) {  // F16C
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
}
inline vf vset1_sum(vf v) {  // every lane = the sum of v's lanes
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm256_broadcastss_ps(s);
}
#endif
constexpr int kHalves = 16 / W;  // vector pairs per panel

// Where one tile writes: rows of out (leading dimension ldo) at the panel's first column,
// `cols` of its 32 columns valid (the last panel may be partial), an optional per-column
// scale (int8's per-feature scale, applied once at the end).
struct Dest {
  float* out;
  int64_t ldo;
  int64_t cols;
  const float* col_scale;
  // the panel holds gate features j and up features j (its vector pairs' two halves; woq.py's
  // interleave_gate_up): write silu(gate) * up, 16 columns a panel, at out (fp32_linear_silu)
  bool silu = false;
};

#if defined(__AVX512F__)
// silu(gate) * up bit for bit as fused_cpu.cpp's silu_mul (torch's Vectorized<float> silu:
// g / (1 + exp(-g)), exp Sleef's expf u10), operation for operation. No product here feeds
// an addition (the compiler could fuse the two: fused_cpu.cpp is built with
// -ffp-contract=off, this file is not), so the written FMAs are the only ones.
inline vf silu_mul_exact(vf g, vf u) {
  const vf d = _mm512_sub_ps(_mm512_setzero_ps(), g);  // exp(-g)
  const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(d, _mm512_set1_ps(1.442695040888963407359924681001892137f)));
  const vf qf = _mm512_cvtepi32_ps(q);
  vf s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-0.693145751953125f), d);
  s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-1.428606765330187045e-06f), s);
  vf e = _mm512_set1_ps(0.000198527617612853646278381f);
  e = _mm512_fmadd_ps(e, s, _mm512_set1_ps(0.00139304355252534151077271f));
  e = _mm512_fmadd_ps(e, s, _mm512_set1_ps(0.00833336077630519866943359f));
  e = _mm512_fmadd_ps(e, s, _mm512_set1_ps(0.0416664853692054748535156f));
  e = _mm512_fmadd_ps(e, s, _mm512_set1_ps(0.166666671633720397949219f));
  e = _mm512_fmadd_ps(e, s, _mm512_set1_ps(0.5f));
  e = _mm512_add_ps(_mm512_set1_ps(1.0f), _mm512_fmadd_ps(_mm512_mul_ps(s, s), e, s));
  auto pow2i = [](__m512i k) {  // 2^k for integral k in [-126, 127]
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_add_epi32(k, _mm512_set1_epi32(127)), 23));
  };
  const __m512i half = _mm512_srai_epi32(q, 1);
  e = _mm512_mul_ps(_mm512_mul_ps(e, pow2i(half)), pow2i(_mm512_sub_epi32(q, half)));
  e = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(d, _mm512_set1_ps(-104.0f), _CMP_LT_OQ), e,
                           _mm512_setzero_ps());  // underflow: 0
  e = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(_mm512_set1_ps(100.0f), d, _CMP_LT_OQ), e,
                           _mm512_set1_ps(INFINITY));  // overflow: inf
  return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), u);
}
#endif

inline void store_vec(const Dest& d, float* p, int64_t c, vf a) {
  if (d.col_scale) a = vmul(a, vload(d.col_scale + c));
  if (d.cols >= c + W) vstore(p + c, a);
  else if (d.cols > c) vstore_n(p + c, a, d.cols - c);
}

inline void store_pair(const Dest& d, int64_t m, int h, vf a0, vf a1) {
  float* row = d.out + m * d.ldo;
#if defined(__AVX512F__)
  if (d.silu) {
    const vf v = silu_mul_exact(a0, a1);
    if (d.cols >= W) vstore(row, v);
    else if (d.cols > 0) vstore_n(row, v, d.cols);
    return;
  }
#endif
  store_vec(d, row, h * W, a0);
  store_vec(d, row, 16 + h * W, a1);
}

struct Q8Inputs;  // the inputs rounded to int8 for the AVX2 integer tiles (below)

// Weight sources, read one group of kGroup inputs at a time (int4's scale and min are
// per group: kept in registers across it): group(k0, h).pair(k) gives the vector pair
// (features h*W.., 16+h*W..) of input k0 + k as floats.
struct Int4Weights {
  const uint8_t* w;  // [K, 16] of this panel (AVX2: [K / 4, 64])
  const uint16_t* scale;  // float16 [G, 32]
  const uint16_t* mins;
  const Q8Inputs* act = nullptr;  // the inputs rounded to int8 (AVX2, tile_int4_q8)
#if defined(__AVX512F__)  // (AVX2: tile_int4_q8 reads the panels)
  struct Group {
    const uint8_t* w;
    vf s0, s1, m0, m1;
    inline void pair(int64_t k, vf& w0, vf& w1) const {
      q4_pair(w + k * 16, w0, w1);
      w0 = vfma(w0, s0, m0);
      w1 = vfma(w1, s1, m1);
    }
  };
#endif
  static constexpr int64_t kAhead = 4096;  // bytes of the weight stream prefetched ahead
  // called by the first half's pass, which streams the panel: the group kAhead bytes on (its
  // 8 lines) and the scales and mins 8 groups on
  inline void prefetch_ahead(int64_t k0) const {
    const char* ahead = reinterpret_cast<const char*>(w + k0 * 16) + kAhead;
    for (int64_t b = 0; b < kGroup * 16; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(scale + (k0 / kGroup + 8) * kPanel), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(mins + (k0 / kGroup + 8) * kPanel), _MM_HINT_T0);
  }
#if defined(__AVX512F__)
  inline Group group(int64_t k0, int h) const {
    const uint16_t* s = scale + (k0 / kGroup) * kPanel + h * W;
    const uint16_t* mn = mins + (k0 / kGroup) * kPanel + h * W;
    if (h == 0) prefetch_ahead(k0);
    return {w + k0 * 16 + h * W, vload_half(s), vload_half(s + 16), vload_half(mn),
            vload_half(mn + 16)};
  }
#endif
};

struct Int8Weights {  // q as floats; the per-feature scale is applied at the store
  static constexpr int64_t kInt8Ahead = 4096;  // bytes of the weight stream prefetched ahead
  const int8_t* w;  // [K, 32] of this panel (AVX2: [Kp / 4, 128], Kp = K rounded up to 32)
  const Q8Inputs* act = nullptr;  // the inputs rounded to int8 (AVX2, tile_int8_q8)
#if defined(__AVX512F__)  // (AVX2: tile_int8_q8 reads the panels)
  struct Group {
    const int8_t* w;
    const int8_t* pf;  // the first half's pass streams the panel: prefetch kInt8Ahead on
    inline void pair(int64_t k, vf& w0, vf& w1) const {
      if (pf && !(k & 1)) _mm_prefetch(reinterpret_cast<const char*>(pf + k * kPanel), _MM_HINT_T0);
      w0 = q8(w + k * kPanel);
      w1 = q8(w + k * kPanel + 16);
    }
  };
  inline Group group(int64_t k0, int h) const {
    return {w + k0 * kPanel + h * W, h == 0 ? w + k0 * kPanel + kInt8Ahead : nullptr};
  }
#endif
};

// where the fp32 panels' software prefetches go. On the Intel Xeon VM L2 everywhere
// (cpp_build.prefetch_flags: -DPLAIT_PREFETCH_L2): SmolLM2's 30 layers of linears + logits with L2
// instead of L1 for the single tile's stream: 4 rows 1.12-1.13x, 8 and 12 rows 1.09x, 1 row even
// (15 alternated repeats, twice); for the spread prefetches of the next panel ~1.03x at 32 rows.
// On AMD with AVX-512 (Zen 4) L2 below kL1FromRows rows (the pair blocks, below), L1 from there
// on: on the Zen 4 EPYC VM (SmolLM2's 30 layers of linears, the two builds alternated, 15 repeats,
// twice) L2 was 1.05-1.10x faster at 1 row, 1.11-1.15x at 4, 1.29-1.35x at 8, 1.10-1.12x at 16,
// and 0.97x at 24-32 rows, where a tile's prefetched share of the next block is read from L1 by
// the tiles that follow it (64 and 200 rows alike). The AVX2 build on AMD keeps L1 (into L2
// measured slower on the AVX2 EPYC VM).
#if defined(PLAIT_PREFETCH_L2)
constexpr auto kStreamHint = _MM_HINT_T1;
constexpr auto kSmallStreamHint = _MM_HINT_T1;  // the few-row tiles' stream (Fp32Weights)
#elif defined(__AVX512F__)
constexpr auto kStreamHint = _MM_HINT_T0;
constexpr auto kSmallStreamHint = _MM_HINT_T1;
#else
constexpr auto kStreamHint = _MM_HINT_T0;
constexpr auto kSmallStreamHint = _MM_HINT_T0;
#endif

// Whether a single row tile (panel_rows_fp32: 1-3 rows with AVX-512, the pair blocks from 4;
// 1-6 with AVX2) prefetches its own weight stream kPrefetchFloats ahead in software
// (set_fp32_stream_prefetch changes it).
// On the Intel VMs it did (batch-1 linears 8.7 -> 6.9 ms, above). On the Zen 4 EPYC VM, with
// the weights on 2 MB pages as the model runner puts them, the hardware prefetchers alone
// stream faster: SmolLM2's 30 layers of linears, the two builds alternated in one process (a
// script by hand, session 46), 1 row 1.17x on one thread and 1.01-1.12x on two, 2 rows 1.27x /
// 1.09x, 3 rows 1.33x / 1.07x (on 4 KB pages 1.02x at 1 row, 1.12x / 1.06x at 3); on two
// threads without it the linears read 96% of a streaming sum's rate, with it 85-90%. SmolLM2's
// decode steps (benchmarks/profile_steps.py --stream-prefetch-ab, in-process, alternated):
// batch 1 about even (0.99-1.09x), 2 1.04-1.17x, 3 1.04-1.20x. So it is off on AMD's AVX-512 build
// (no PLAIT_PREFETCH_L2: cpp_build.prefetch_flags) and on everywhere else (AVX2 AMD unmeasured).
// The pair blocks' prefetches (4+ rows) stay: without them 4 rows measured even, 8 rows 0.74x.
#if defined(PLAIT_PREFETCH_L2) || !defined(__AVX512F__)
std::atomic<bool> g_single_tile_stream{true};
#else
std::atomic<bool> g_single_tile_stream{false};
#endif

struct Fp32Weights {  // fp32 panels [K, 32]: the dequantized scratch, or fp32 weights
  const float* w;
  // software prefetch while reading input k: with `stream`, both cache lines of input k at pf
  // (pf + k * 32: a single tile reading ahead in its own panel); or, with `rate` > 0, line
  // (k * rate) >> 16 of pf (rate / 65536 lines per input: a tile's share of the next panel
  // spread evenly over its inputs); else none
  const float* pf = nullptr;
  bool stream = false;
  int64_t rate = 0;
  struct Group {
    const float* w;
    const float* pf;  // null: no prefetch
    int64_t rate, k0;
    inline void pair(int64_t k, vf& w0, vf& w1) const {
      if (rate > 0) {
        _mm_prefetch((const char*)(pf + (((k0 + k) * rate) >> 16) * 16), kSmallStreamHint);
      } else if (pf) {
        _mm_prefetch((const char*)(pf + k * 32), kSmallStreamHint);
        _mm_prefetch((const char*)(pf + k * 32 + 16), kSmallStreamHint);
      }
      w0 = vload(w + k * kPanel);
      w1 = vload(w + k * kPanel + 16);
    }
  };
  // the prefetches ride on the first vector pair's pass (AVX2 reads a panel in two)
  inline Group group(int64_t k0, int h) const {
    const float* wk = w + k0 * kPanel + h * W;
    if (h != 0) return {wk, nullptr, 0, k0};
    if (rate > 0) return {wk, pf, rate, k0};
    return {wk, stream ? pf + k0 * 32 : nullptr, 0, k0};
  }
};

// MR rows of x (from row m0) x vector pair h of one panel. SPLIT independent accumulator sets
// over alternate k: one row alone has only two accumulation chains, too few to cover the FMA
// latency. With `scratch`, also writes the pair's weights there (for the next row tiles).
template <int MR, int SPLIT, bool STORE, class Weights>
void tile(const float* x, int64_t ldx, int64_t K, const Weights& wt, int h, const Dest& d,
          int64_t m0, float* __restrict scratch) {
  vf acc[SPLIT][MR][2];
#pragma GCC unroll 2
  for (int s = 0; s < SPLIT; s++)
#pragma GCC unroll 16
    for (int m = 0; m < MR; m++) acc[s][m][0] = acc[s][m][1] = vzero();
  for (int64_t k0 = 0; k0 < K; k0 += kGroup) {
    const auto grp = wt.group(k0, h);
    const float* xk = x + m0 * ldx + k0;
    float* __restrict sk = STORE ? scratch + k0 * kPanel + h * W : nullptr;
    const int64_t kn = std::min(kGroup, K - k0);  // < kGroup: int8's last, partial group
    for (int64_t k = 0; k < kn; k += SPLIT) {
#pragma GCC unroll 2
      for (int s = 0; s < SPLIT; s++) {
        if (k + s >= kn) break;  // only in a partial group (SPLIT 2, odd K)
        vf w0, w1;
        grp.pair(k + s, w0, w1);
        if constexpr (STORE) {
          vstore(sk + (k + s) * kPanel, w0);
          vstore(sk + (k + s) * kPanel + 16, w1);
        }
#pragma GCC unroll 16
        for (int m = 0; m < MR; m++) {
          const vf xb = vbcast(xk + m * ldx + k + s);
          acc[s][m][0] = vfma(w0, xb, acc[s][m][0]);
          acc[s][m][1] = vfma(w1, xb, acc[s][m][1]);
        }
      }
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < MR; m++) {
    vf a0 = acc[0][m][0], a1 = acc[0][m][1];
#pragma GCC unroll 2
    for (int s = 1; s < SPLIT; s++) {
      a0 = vadd(a0, acc[s][m][0]);
      a1 = vadd(a1, acc[s][m][1]);
    }
    store_pair(d, m0 + m, h, a0, a1);
  }
}

#if defined(__AVX512F__)
// int4, one or two rows without a scratch to write (batch-1 and 2-row decode): the scale and
// min folded out of the inner loop. W[n, k] = q s + min over a group of 32 inputs, so
// sum_k x_k W[n, k] = s * sum_k x_k q + min * sum_k x_k: the inner loop multiplies the raw
// codes (no per-weight scale and min FMA: 8 instead of 10 instructions per 16 weights), and
// each group ends with two FMAs per accumulator; the first half's pass prefetches the weight
// stream 4 KB ahead (and the scales and mins 8 groups ahead), as the fp32 path does. SmolLM2's
// 120 layer linears at one row, old vs new build alternated in one process on the AVX2 EPYC:
// 1.11-1.13x (two rows even, so three rows keep the old tiles). AVX-512 builds only: the AVX2
// build's one- and two-row tiles are integer dot products (tile_int4_q8). Rounds differently from
// dequantizing first (a float sum in another order), within fp32 accuracy of the reference.
template <int MR, int SPLIT>
void tile_int4_folded(const float* x, int64_t ldx, int64_t K, const Int4Weights& wt, int h,
                      const Dest& d, int64_t m0) {
  vf acc[MR][2];
#pragma GCC unroll 4
  for (int m = 0; m < MR; m++) acc[m][0] = acc[m][1] = vzero();
  for (int64_t k0 = 0; k0 < K; k0 += kGroup) {  // K is a whole number of groups (int4_linear)
    const uint8_t* wg = wt.w + k0 * 16 + h * W;
    vf aq[SPLIT][MR][2];
#pragma GCC unroll 2
    for (int s = 0; s < SPLIT; s++)
#pragma GCC unroll 4
      for (int m = 0; m < MR; m++) aq[s][m][0] = aq[s][m][1] = vzero();
    const float* xk = x + m0 * ldx + k0;
    if (h == 0) wt.prefetch_ahead(k0);
    for (int64_t k = 0; k < kGroup; k += SPLIT) {
#pragma GCC unroll 2
      for (int s = 0; s < SPLIT; s++) {
        vf q0, q1;
        q4_pair(wg + (k + s) * 16, q0, q1);
#pragma GCC unroll 4
        for (int m = 0; m < MR; m++) {
          const vf xb = vbcast(xk + m * ldx + k + s);
          aq[s][m][0] = vfma(q0, xb, aq[s][m][0]);
          aq[s][m][1] = vfma(q1, xb, aq[s][m][1]);
        }
      }
    }
    const uint16_t* sc = wt.scale + (k0 / kGroup) * kPanel + h * W;
    const uint16_t* mn = wt.mins + (k0 / kGroup) * kPanel + h * W;
    const vf s0 = vload_half(sc), s1 = vload_half(sc + 16);
    const vf n0 = vload_half(mn), n1 = vload_half(mn + 16);
#pragma GCC unroll 4
    for (int m = 0; m < MR; m++) {
      vf q0 = aq[0][m][0], q1 = aq[0][m][1];
      if constexpr (SPLIT == 2) q0 = vadd(q0, aq[1][m][0]), q1 = vadd(q1, aq[1][m][1]);
      vf xs = vload(xk + m * ldx);  // the group's 32 inputs of row m, summed
#pragma GCC unroll 4
      for (int j = 1; j < kGroup / W; j++) xs = vadd(xs, vload(xk + m * ldx + j * W));
      const vf xsum = vset1_sum(xs);
      acc[m][0] = vfma(n0, xsum, vfma(s0, q0, acc[m][0]));
      acc[m][1] = vfma(n1, xsum, vfma(s1, q1, acc[m][1]));
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < MR; m++) store_pair(d, m0 + m, h, acc[m][0], acc[m][1]);
}

#endif

#if !defined(__AVX512F__)
// rows x K -> int8 codes, scales and group sums (vcvtps2dq rounds half to even, as
// torch.round does)
void quantize_rows_q8(const float* x, int64_t M, int64_t K, int8_t* q, float* dx, float* xs) {
  const int64_t G = K / kGroup;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  at::parallel_for(0, M * G, 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i++) {
      const int64_t m = i / G, g = i % G;
      const float* xg = x + m * K + g * kGroup;
      __m256 v[4], amax = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
      for (int c = 0; c < 4; c++) {
        v[c] = _mm256_loadu_ps(xg + c * 8);
        amax = _mm256_max_ps(amax, _mm256_and_ps(v[c], abs_mask));
        sum = _mm256_add_ps(sum, v[c]);
      }
      __m128 a4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      a4 = _mm_max_ps(a4, _mm_movehl_ps(a4, a4));
      const float am = _mm_cvtss_f32(_mm_max_ss(a4, _mm_shuffle_ps(a4, a4, 1)));
      const __m256 inv = _mm256_set1_ps(am > 0.0f ? 127.0f / am : 0.0f);
      __m256i qi[4];
      for (int c = 0; c < 4; c++) qi[c] = _mm256_cvtps_epi32(_mm256_mul_ps(v[c], inv));
      // 32 int32 -> 32 int8 in order (the packs interleave 128-bit lanes; the permute undoes it)
      const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]),
                                           _mm256_packs_epi32(qi[2], qi[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + m * K + g * kGroup),
                          _mm256_permutevar8x32_epi32(b, order));
      dx[m * G + g] = am / 127.0f;
      xs[m * G + g] = _mm_cvtss_f32(_mm256_castps256_ps128(vset1_sum(sum)));
    }
  });
}

// The inputs [M, K] rounded to int8 per group of kGroup (q = round(x / dx), dx = max |x| /
// 127) and each group's float sum (int4's min term), for tile_int4_q8 / tile_int8_q8.
struct Q8Inputs {
  std::vector<int8_t> q;  // [M, K]
  std::vector<float> dx, xs;  // [M, K / kGroup]
  Q8Inputs(const float* x, int64_t M, int64_t K)
      : q(M * K), dx(M * (K / kGroup)), xs(M * (K / kGroup)) {
    quantize_rows_q8(x, M, K, q.data(), dx.data(), xs.data());
  }
};

// int4 x int8 on AVX2, every row (one or two rows a tile; the first pair of a panel streams it
// from memory, the others read it from cache), as llama.cpp's Q4_1 x Q8 dot products: per
// run of 4 inputs, the half's 32 bytes hold 8 features' 4 inputs (low nibbles: features
// 8h + f, high: 16 + 8h + f); vpmaddubsw multiplies the unsigned codes by the row's 4 int8
// inputs (broadcast) and adds pairs, int16 sums collect a group's 8 runs (|sum| <= 8 * 2 *
// 15 * 127 = 30480: no overflow), vpmaddwd adds the pairs to int32, and a group ends as
// s * dx * sum q x8 + min * sum x in float. 16 multiply-adds a pair of instructions where the
// float paths need a convert and an FMA per 8 (plus a dequantized panel's stores and loads
// from 3 rows on). SmolLM2's int4 linears + int4 logits, the float paths' build vs this one
// alternated in one process: 1 row 1.30x, 2 rows 1.40x, 3-16 rows 1.5-2x, 32-512 rows
// 1.5-1.8x. The cost is rounding each input to int8 per group of 32, as llama.cpp does; a
// row's result is exact integer sums and the same float steps whatever the batch (so int4
// results no longer depend on the batch size).
template <int MR>
void tile_int4_q8(int64_t K, const Int4Weights& wt, int h, const Dest& d, int64_t m0,
                  bool stream) {
  const Q8Inputs& a = *wt.act;
  const int64_t G = K / kGroup;
  const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  vf acc[MR][2];
#pragma GCC unroll 2
  for (int m = 0; m < MR; m++) acc[m][0] = acc[m][1] = vzero();
  for (int64_t g = 0; g < G; g++) {
    const uint8_t* wg = wt.w + g * kGroup * 16 + h * 32;
    if (h == 0 && stream) wt.prefetch_ahead(g * kGroup);
    __m256i s[MR][2];
#pragma GCC unroll 2
    for (int m = 0; m < MR; m++) s[m][0] = s[m][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int r = 0; r < kGroup / 4; r++) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + r * 64));
      const __m256i lo = _mm256_and_si256(v, nib);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
#pragma GCC unroll 2
      for (int m = 0; m < MR; m++) {
        int32_t x4;
        std::memcpy(&x4, a.q.data() + (m0 + m) * K + g * kGroup + r * 4, 4);
        const __m256i xq = _mm256_set1_epi32(x4);
        s[m][0] = _mm256_add_epi16(s[m][0], _mm256_maddubs_epi16(lo, xq));
        s[m][1] = _mm256_add_epi16(s[m][1], _mm256_maddubs_epi16(hi, xq));
      }
    }
    const uint16_t* sc = wt.scale + g * kPanel + h * W;
    const uint16_t* mn = wt.mins + g * kPanel + h * W;
    const vf s0 = vload_half(sc), s1 = vload_half(sc + 16);
    const vf n0 = vload_half(mn), n1 = vload_half(mn + 16);
#pragma GCC unroll 2
    for (int m = 0; m < MR; m++) {
      const vf dx = _mm256_set1_ps(a.dx[(m0 + m) * G + g]);
      const vf xs = _mm256_set1_ps(a.xs[(m0 + m) * G + g]);
      const vf q0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(s[m][0], ones));
      const vf q1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(s[m][1], ones));
      acc[m][0] = vfma(n0, xs, vfma(vmul(s0, dx), q0, acc[m][0]));
      acc[m][1] = vfma(n1, xs, vfma(vmul(s1, dx), q1, acc[m][1]));
    }
  }
#pragma GCC unroll 2
  for (int m = 0; m < MR; m++) store_pair(d, m0 + m, h, acc[m][0], acc[m][1]);
}

// int8 x int8 on AVX2, every row: MR rows x NV of the half's two vectors (features 8h + f and
// 16 + 8h + f; MR 1-2 take both, 3-4 one at a time: four rows' accumulators of both would not
// fit the 16 registers), from vector j0. Per run of 4 inputs each vector holds 8 features x 4
// inputs; vpmaddubsw needs one unsigned operand, so it multiplies |w| by x8 with w's sign moved
// onto it (vpsignb; |pair sum| <= 2 * 127 * 127 = 32258: no saturation), vpmaddwd adds the
// pairs to int32, a group of 32 inputs ends as dx * sum in float, and the per-feature scale is
// applied at the store (Dest::col_scale). 32 multiply-adds in 4 instructions where the float
// path converts and multiplies 8 at a time. SmolLM2's int8 linears, the float path's build vs
// this one alternated in one process: layers 1 row 1.23x, 2 rows 1.04x, 3-4 rows 1.10-1.16x,
// 5-256 rows 1.22-1.58x; the logits matrix 1.15x, 1.19x, 1.14-1.17x, 1.26-1.61x. The inputs
// are rounded to int8 per group of 32 (relative error of the outputs ~5e-3).
template <int MR, int NV>
void tile_int8_q8(int64_t Kp, const Int8Weights& wt, int h, int j0, const Dest& d, int64_t m0,
                  bool stream) {
  const Q8Inputs& a = *wt.act;
  const int64_t G = Kp / kGroup;
  const __m256i ones = _mm256_set1_epi16(1);
  vf acc[MR][NV];
#pragma GCC unroll 4
  for (int m = 0; m < MR; m++)
#pragma GCC unroll 2
    for (int j = 0; j < NV; j++) acc[m][j] = vzero();
  for (int64_t g = 0; g < G; g++) {
    const int8_t* wg = wt.w + g * kGroup * kPanel;
    if (h == 0 && j0 == 0 && stream)  // the group kInt8Ahead on: its 16 lines
      for (int64_t b = 0; b < kGroup * kPanel; b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(wg + Int8Weights::kInt8Ahead + b),
                     _MM_HINT_T0);
    __m256i s[MR][NV];
#pragma GCC unroll 4
    for (int m = 0; m < MR; m++)
#pragma GCC unroll 2
      for (int j = 0; j < NV; j++) s[m][j] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int r = 0; r < kGroup / 4; r++) {
      __m256i w[NV], aw[NV];
#pragma GCC unroll 2
      for (int j = 0; j < NV; j++) {
        w[j] = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(wg + r * 4 * kPanel + (j0 + j) * 64 + h * 32));
        aw[j] = _mm256_abs_epi8(w[j]);
      }
#pragma GCC unroll 4
      for (int m = 0; m < MR; m++) {
        int32_t x4;
        std::memcpy(&x4, a.q.data() + (m0 + m) * Kp + g * kGroup + r * 4, 4);
        const __m256i xq = _mm256_set1_epi32(x4);
#pragma GCC unroll 2
        for (int j = 0; j < NV; j++)
          s[m][j] = _mm256_add_epi32(s[m][j], _mm256_madd_epi16(
              _mm256_maddubs_epi16(aw[j], _mm256_sign_epi8(xq, w[j])), ones));
      }
    }
#pragma GCC unroll 4
    for (int m = 0; m < MR; m++) {
      const vf dx = _mm256_set1_ps(a.dx[(m0 + m) * G + g]);
#pragma GCC unroll 2
      for (int j = 0; j < NV; j++) acc[m][j] = vfma(_mm256_cvtepi32_ps(s[m][j]), dx, acc[m][j]);
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < MR; m++)
#pragma GCC unroll 2
    for (int j = 0; j < NV; j++)
      store_vec(d, d.out + (m0 + m) * d.ldo, (j0 + j) * 16 + h * W, acc[m][j]);
}

#endif

// rows [m0, m0 + rows) with rows <= MAX, as one tile of exactly `rows` rows
template <int MAX, class Weights>
void tile_rows(int64_t rows, const float* x, int64_t ldx, int64_t K, const Weights& wt, int h,
               const Dest& d, int64_t m0, float* scratch) {
  if constexpr (MAX > 0) {
    if (rows == MAX) {
      constexpr int SPLIT = MAX <= 2 ? 2 : 1;
      if (scratch) return tile<MAX, SPLIT, true>(x, ldx, K, wt, h, d, m0, scratch);
      return tile<MAX, SPLIT, false>(x, ldx, K, wt, h, d, m0, nullptr);
    }
    return tile_rows<MAX - 1>(rows, x, ldx, K, wt, h, d, m0, scratch);
  }
}

// MR rows x one whole fp32 panel of NV 8-float vectors per input (the panel NV * 8 features
// wide), 8-float vectors in either build. Used where every input's NV vectors fit the registers
// beside MR x NV accumulators: the 32-wide panels' one- or two-row tiles on AVX2 (NV 4; the
// half-by-half tiles read every line of the panel twice, the second time from L2: SmolLM2's
// batch-1 linears 21.9 -> 18.7 ms on the AVX2 EPYC) and every tile of the 24-wide panels (NV 3,
// below). SPLIT accumulator sets over alternate inputs keep enough chains in flight for one or
// two rows. pf: prefetch `pf + k * pf_step` (and `+ 16` when pf_two) while reading input k.
template <int MR, int SPLIT, int NV>
void tile_whole_panel(const float* x, int64_t ldx, int64_t K, const float* w, const Dest& d,
                      int64_t m0, const float* pf, int64_t pf_step, bool pf_two) {
  constexpr int64_t PW = NV * 8;
  __m256 acc[SPLIT][MR][NV];
#pragma GCC unroll 2
  for (int s = 0; s < SPLIT; s++)
#pragma GCC unroll 4
    for (int m = 0; m < MR; m++)
#pragma GCC unroll 4
      for (int j = 0; j < NV; j++) acc[s][m][j] = _mm256_setzero_ps();
  const float* xm = x + m0 * ldx;
  for (int64_t k = 0; k < K; k += SPLIT) {
#pragma GCC unroll 2
    for (int s = 0; s < SPLIT; s++) {
      if (k + s >= K) break;  // SPLIT 2, odd K
      if (pf) {
        _mm_prefetch((const char*)(pf + (k + s) * pf_step), _MM_HINT_T0);
        if (pf_two) _mm_prefetch((const char*)(pf + (k + s) * pf_step + 16), _MM_HINT_T0);
      }
      const float* wk = w + (k + s) * PW;
      __m256 wv[NV];
#pragma GCC unroll 4
      for (int j = 0; j < NV; j++) wv[j] = _mm256_loadu_ps(wk + j * 8);
#pragma GCC unroll 4
      for (int m = 0; m < MR; m++) {
        const __m256 xb = _mm256_broadcast_ss(xm + m * ldx + k + s);
#pragma GCC unroll 4
        for (int j = 0; j < NV; j++) acc[s][m][j] = _mm256_fmadd_ps(wv[j], xb, acc[s][m][j]);
      }
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < MR; m++) {
    float* row = d.out + (m0 + m) * d.ldo;
#pragma GCC unroll 4
    for (int j = 0; j < NV; j++) {
      __m256 a = acc[0][m][j];
      if constexpr (SPLIT == 2) a = _mm256_add_ps(a, acc[1][m][j]);
      float* p = row + j * 8;
      if (d.cols >= j * 8 + 8) {
        _mm256_storeu_ps(p, a);
      } else if (d.cols > j * 8) {
        const __m256i first_n = _mm256_cmpgt_epi32(
            _mm256_set1_epi32((int)(d.cols - j * 8)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        _mm256_maskstore_ps(p, first_n, a);
      }
    }
  }
}

// One panel x rows [r0, r1): the first tile from the quantized weights (writing the scratch
// when more rows follow), the rest from the scratch. (AVX2 int8/int4: integer dot products.)
template <class Weights>
void panel_rows(const float* x, int64_t K, const Weights& wt, const Dest& d, int64_t r0,
                int64_t r1, float* scratch) {
  const int64_t first = std::min<int64_t>(r1 - r0, kDirectRows);
  const bool more = r0 + first < r1;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<Weights, Int4Weights>) {
    if (!more && first <= 2) {  // one or two rows, nothing to dequantize for later tiles
      for (int h = 0; h < kHalves; h++) {
        if (first == 1) tile_int4_folded<1, 2>(x, K, K, wt, h, d, r0);
        else tile_int4_folded<2, 2>(x, K, K, wt, h, d, r0);
      }
      return;
    }
  }
#else
  if constexpr (!std::is_same_v<Weights, Fp32Weights>) {  // (int8: K is the padded inputs)
    if constexpr (std::is_same_v<Weights, Int8Weights>) {
      // three or four rows: 4-row tiles of one vector (1.10-1.17x the float path's direct
      // tile, where pairs were 0.75x); from five rows on pairs again (4-row tiles 0.89-0.98x
      // of them). Either way a row's result is the same bits (exact integer sums, the same
      // float steps).
      if (r1 - r0 == 3 || r1 - r0 == 4) {
        for (int h = 0; h < kHalves; h++)
          for (int j = 0; j < 2; j++) {
            if (r1 - r0 == 3) tile_int8_q8<3, 1>(K, wt, h, j, d, r0, true);
            else tile_int8_q8<4, 1>(K, wt, h, j, d, r0, true);
          }
        return;
      }
    }
    for (int h = 0; h < kHalves; h++)  // rows in pairs (the first pair streams the panel)
      for (int64_t m = r0; m < r1; m += 2) {
        const bool two = m + 1 < r1, stream = m == r0;
        if constexpr (std::is_same_v<Weights, Int4Weights>) {
          if (two) tile_int4_q8<2>(K, wt, h, d, m, stream);
          else tile_int4_q8<1>(K, wt, h, d, m, stream);
        } else {
          if (two) tile_int8_q8<2, 2>(K, wt, h, 0, d, m, stream);
          else tile_int8_q8<1, 2>(K, wt, h, 0, d, m, stream);
        }
      }
    return;
  } else
#endif
  for (int h = 0; h < kHalves; h++)
    tile_rows<kDirectRows>(first, x, K, K, wt, h, d, r0, more ? scratch : nullptr);
  if (!more) return;
  const Fp32Weights dequantized{scratch};
  for (int64_t m = r0 + first; m < r1; m += kScratchRows) {
    const int64_t rows = std::min<int64_t>(r1 - m, kScratchRows);
    for (int h = 0; h < kHalves; h++)
      tile_rows<kScratchRows>(rows, x, K, K, dequantized, h, d, m, nullptr);
  }
}

// fp32 panels: every row tile reads the panel itself, the first from memory, the others from
// L2. The weights stream from memory with software prefetches: a single tile (up to
// kScratchRows rows) reads ahead in its own stream (the panel's 32 floats, two cache lines,
// per input k); with more tiles, each fetches its share of the next panel (into L2) evenly
// over its inputs, so the memory traffic spreads over all of the panel's compute.
void panel_rows_fp32(const float* x, int64_t K, const Fp32Weights& wt, const Dest& d, int64_t r0,
                     int64_t r1, const float* next) {
  const int64_t tiles = (r1 - r0 + kScratchRows - 1) / kScratchRows;
  const int64_t per = (r1 - r0 + tiles - 1) / tiles;  // even tiles
  for (int64_t m = r0, t = 0; m < r1; m += per, t++) {
    const int64_t rows = std::min<int64_t>(r1 - m, per);
    Fp32Weights w = wt;
    if (tiles == 1) {
      w.pf = wt.w + kPrefetchFloats;
      w.stream = g_single_tile_stream.load(std::memory_order_relaxed);
    } else if (next) {
      // tile t of T fetches lines [t 2K / T, (t + 1) 2K / T) of the next panel's 2K
      w.pf = next + (t * 2 * K / tiles) * 16;
      w.rate = ((int64_t(2) << 16) + tiles - 1) / tiles;
    }
    if constexpr (kHalves == 2) {  // AVX2: one or two rows take the whole panel in one pass
      if (rows <= 2) {
        // the single tile's stream prefetches of Fp32Weights::Group::pair: both lines per input
        const float* pf = w.stream ? w.pf : nullptr;
        if (rows == 1) tile_whole_panel<1, 2, 4>(x, K, K, w.w, d, m, pf, 32, true);
        else tile_whole_panel<2, 1, 4>(x, K, K, w.w, d, m, pf, 32, true);
        continue;
      }
    }
    for (int h = 0; h < kHalves; h++)
      tile_rows<kScratchRows>(rows, x, K, K, w, h, d, m, nullptr);
  }
}

#if defined(__AVX512F__)
constexpr int kPairRows = 6;  // rows per pair tile: 6 x 4 accumulators + 4 weight vectors
constexpr int64_t kPairAhead = 8;  // inputs ahead that a pair tile prefetches its own lines
// fp32 from kPairBlockMinRows rows on runs panel pairs: below kPairWholeRows in input blocks
// (panel_pair_blocks), from there on a tile over all K (panel_pair_rows). Whole-K pairs against
// one-panel tiles, SmolLM2's 30 layers of linears on the Intel Xeon VM (9 repeats): 24 and 32
// rows even, 48 1.02x, 64 1.05x, 128 1.08x, 256 1.08x, 1024 1.13x (353 GFLOP/s, torch.mm ~380);
// the logits 1.01-1.13x; 8 and 16 rows 0.95x.

// One input k of a pair tile: the pair's four weight vectors of input k (at w in the first
// panel, w1 in the second) times x[m, k] into the MR rows' accumulators; and the tile's
// results stored.
template <int MR>
inline __attribute__((always_inline)) void pair_fma(vf (&acc)[MR][4], const float* xm,
                                                    int64_t ldx, int64_t k, const float* w,
                                                    const float* w1) {
  const vf a0 = vload(w), a1 = vload(w + 16), b0 = vload(w1), b1 = vload(w1 + 16);
#pragma GCC unroll 8
  for (int m = 0; m < MR; m++) {
    const vf xb = vbcast(xm + m * ldx + k);
    acc[m][0] = vfma(a0, xb, acc[m][0]);
    acc[m][1] = vfma(a1, xb, acc[m][1]);
    acc[m][2] = vfma(b0, xb, acc[m][2]);
    acc[m][3] = vfma(b1, xb, acc[m][3]);
  }
}

template <int MR>
inline __attribute__((always_inline)) void pair_store(const vf (&acc)[MR][4], const Dest& d0,
                                                      const Dest& d1, int64_t m0) {
#pragma GCC unroll 8
  for (int m = 0; m < MR; m++) {
    store_pair(d0, m0 + m, 0, acc[m][0], acc[m][1]);
    store_pair(d1, m0 + m, 0, acc[m][2], acc[m][3]);
  }
}

// MR (<= kPairRows) rows x two adjacent fp32 panels (64 features): 4 x MR accumulators, and
// per input k four weight vectors and MR broadcasts for 4 MR FMAs (a one-panel tile of 12
// rows: two weight vectors and 12 broadcasts for 24 FMAs, and 12 row pointers, more than the
// general registers hold: the compiler kept reloading them from the stack). Each input
// prefetches the pair's lines kPairAhead inputs on (into L1: the pair comes from L2 after its
// first tile) and, with `rate`, line (k rate) >> 16 of `next` (the tile's share of the next
// pair, into L2 on Intel, as Fp32Weights does).
template <int MR>
void tile_pair(const float* x, int64_t ldx, int64_t K, const float* w, const Dest& d0,
               const Dest& d1, int64_t m0, const float* next, int64_t rate) {
  vf acc[MR][4];
#pragma GCC unroll 8
  for (int m = 0; m < MR; m++)
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) acc[m][j] = vzero();
  const float* w1 = w + K * kPanel;
  const float* xm = x + m0 * ldx;
  for (int64_t k = 0; k < K; k++) {
    _mm_prefetch((const char*)(w + (k + kPairAhead) * kPanel), _MM_HINT_T0);
    _mm_prefetch((const char*)(w + (k + kPairAhead) * kPanel + 16), _MM_HINT_T0);
    _mm_prefetch((const char*)(w1 + (k + kPairAhead) * kPanel), _MM_HINT_T0);
    _mm_prefetch((const char*)(w1 + (k + kPairAhead) * kPanel + 16), _MM_HINT_T0);
    if (rate > 0) _mm_prefetch((const char*)(next + ((k * rate) >> 16) * 16), kStreamHint);
    pair_fma<MR>(acc, xm, ldx, k, w + k * kPanel, w1 + k * kPanel);
  }
  pair_store<MR>(acc, d0, d1, m0);
}

template <int MAX>
void tile_pair_rows(int64_t rows, const float* x, int64_t K, const float* w, const Dest& d0,
                    const Dest& d1, int64_t m0, const float* next, int64_t rate) {
  if constexpr (MAX > 0) {
    if (rows == MAX) return tile_pair<MAX>(x, K, K, w, d0, d1, m0, next, rate);
    return tile_pair_rows<MAX - 1>(rows, x, K, w, d0, d1, m0, next, rate);
  }
}

// Panels p and p + 1 (w: p's, p + 1's follows) x rows [r0, r1) in tiles of up to kPairRows;
// tile t of T prefetches lines [t L / T, (t + 1) L / T) of the L = 2K next_panels lines that
// follow (the next pair, or the last odd panel: next_panels 2, 1 or 0), spread evenly over its
// inputs.
void panel_pair_rows(const float* x, int64_t K, const float* w, const Dest& d0, const Dest& d1,
                     int64_t r0, int64_t r1, int64_t next_panels) {
  const int64_t tiles = (r1 - r0 + kPairRows - 1) / kPairRows;
  const int64_t per = (r1 - r0 + tiles - 1) / tiles;
  const float* next = next_panels > 0 ? w + 2 * K * kPanel : nullptr;
  for (int64_t m = r0, t = 0; m < r1; m += per, t++) {
    const float* pf = next ? next + (t * 2 * next_panels * K / tiles) * 16 : nullptr;
    const int64_t rate = next ? ((2 * next_panels << 16) + tiles - 1) / tiles : 0;
    tile_pair_rows<kPairRows>(std::min<int64_t>(r1 - m, per), x, K, w, d0, d1, m, pf, rate);
  }
}

// Below kPairWholeRows rows the pairs run their inputs in blocks of kPairBlock (24 KB of the
// pair's weights): every row tile takes the block in turn, its accumulators kept in `c`
// between blocks, so a block comes from memory once (the first tile) and from L1 for the
// others, and each tile prefetches its share of the next block (into L2 on Intel): the
// memory stream runs all along the compute instead of in the first tile's pass of a whole
// pair. Each output is still one chain of FMAs over k = 0..K-1 in order: the same bits as
// tile_pair, and as any other row count. SmolLM2's 30 layers of linears on the Intel Xeon VM
// (weights from memory, 2 threads, the one-panel / whole-K pair tiles before vs this,
// alternated in one process, 9 repeats): 4 rows 1.01x, 8-16 rows 1.22-1.23x, 24 1.27x, 32
// 1.14x, 48 1.09x, 64-127 1.02-1.21x; at 256-550 rows blocks measured 0.96x against the
// whole-K tiles (compute-bound), which stay from kPairWholeRows on.
constexpr int64_t kPairBlock = 96;  // inputs per block (64 and 128 measured alike or slower)
constexpr int64_t kPairBlockMinRows = 4;  // 2-3 rows: 0.97x (the one-panel tiles stay)
constexpr int64_t kPairWholeRows = 128;  // from here on tile_pair over all K
constexpr int64_t kPairBlockRowsMax = kPairWholeRows - 1;
// the pair blocks' next-block prefetches go to L2 below this many rows, to L1 from there on
// (see kStreamHint)
#if defined(PLAIT_PREFETCH_L2)
constexpr int64_t kL1FromRows = std::numeric_limits<int64_t>::max();
#else
constexpr int64_t kL1FromRows = 24;
#endif

inline void stream_prefetch(const float* p, bool l2) {
  if (l2) _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1);
  else _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
}

template <int MR>
void tile_pair_block(const float* x, int64_t ldx, int64_t k0, int64_t k1, const float* w,
                     const float* w1, float* __restrict c, bool first, bool last, const Dest& d0,
                     const Dest& d1, int64_t m0, const float* n0, const float* n1, int64_t rate,
                     bool l2) {
  vf acc[MR][4];
#pragma GCC unroll 8
  for (int m = 0; m < MR; m++)
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) acc[m][j] = first ? vzero() : vload(c + m * 64 + j * W);
  const float* xm = x + m0 * ldx;
  if (rate > 0 && rate < (1 << 16)) {
    // under a line an input: the tile's share of the next block, a line every `every`
    // inputs from a countdown. A line index computed every input (most of them the same line
    // again) cost ~5% of a tile's time at 32 rows with the weights in cache: SmolLM2's
    // linears at 16-64 rows 1.07-1.10x with the weights in L3, 30 layers' gate_up and down
    // from memory at 32 rows 10.80 and 5.98 ms against 11.36 and 6.16; a decode step at
    // batch 32 0.97x, batch 8 0.98x (engines on the old and new kernel interleaved)
    const int64_t every = (int64_t(1) << 16) / rate;
    int64_t left = 1;
    const float *p0 = n0, *p1 = n1;
    for (int64_t k = k0; k < k1; k++) {
      if (--left == 0) {
        stream_prefetch(p0, l2);
        if (p1) stream_prefetch(p1, l2), p1 += 16;
        p0 += 16;
        left = every;
      }
      pair_fma<MR>(acc, xm, ldx, k, w + (k - k0) * kPanel, w1 + (k - k0) * kPanel);
    }
  } else {
    for (int64_t k = k0; k < k1; k++) {
      if (rate > 0) {  // line ((k - k0) rate) >> 16 of the tile's share of the next block
        const int64_t line = (((k - k0) * rate) >> 16) * 16;
        stream_prefetch(n0 + line, l2);
        if (n1) stream_prefetch(n1 + line, l2);
      }
      pair_fma<MR>(acc, xm, ldx, k, w + (k - k0) * kPanel, w1 + (k - k0) * kPanel);
    }
  }
  if (last) return pair_store<MR>(acc, d0, d1, m0);
#pragma GCC unroll 8
  for (int m = 0; m < MR; m++)
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) vstore(c + m * 64 + j * W, acc[m][j]);
}

template <int MAX>
void tile_pair_block_rows(int64_t rows, const float* x, int64_t K, int64_t k0, int64_t k1,
                          const float* w, const float* w1, float* c, bool first, bool last,
                          const Dest& d0, const Dest& d1, int64_t m0, const float* n0,
                          const float* n1, int64_t rate, bool l2) {
  if constexpr (MAX > 0) {
    if (rows == MAX)
      return tile_pair_block<MAX>(x, K, k0, k1, w, w1, c, first, last, d0, d1, m0, n0, n1, rate,
                                  l2);
    return tile_pair_block_rows<MAX - 1>(rows, x, K, k0, k1, w, w1, c, first, last, d0, d1, m0,
                                         n0, n1, rate, l2);
  }
}

// Panels p and p + 1 (w: p's, p + 1's follows) x rows [r0, r1) (at most kPairBlockRowsMax),
// block by block; the next block is the pair's following inputs, after its last block the
// next pair's first (next_panels 2, or 1: the last odd panel; 0: none).
void panel_pair_blocks(const float* x, int64_t K, const float* w, const Dest& d0, const Dest& d1,
                       int64_t r0, int64_t r1, int64_t next_panels) {
  // tiles of as even sizes as can be (32 rows: 6, 6, 5, 5, 5, 5 rather than 6 x 5 and 2:
  // 1.02-1.03x at 14-44 rows)
  const int64_t tiles = (r1 - r0 + kPairRows - 1) / kPairRows;
  const int64_t size = (r1 - r0) / tiles, larger = (r1 - r0) % tiles;
  alignas(64) float c[kPairBlockRowsMax * 64];
  const bool l2 = r1 - r0 < kL1FromRows;
  for (int64_t k0 = 0; k0 < K; k0 += kPairBlock) {
    const int64_t k1 = std::min(K, k0 + kPairBlock);
    const bool last = k1 == K;
    const float *n0 = nullptr, *n1 = nullptr;  // the next block's two panels
    int64_t next_inputs = 0;
    if (!last) {
      n0 = w + k1 * kPanel, n1 = w + (K + k1) * kPanel;
      next_inputs = std::min(K, k1 + kPairBlock) - k1;
    } else if (next_panels > 0) {
      n0 = w + 2 * K * kPanel, next_inputs = std::min(K, kPairBlock);
      if (next_panels > 1) n1 = w + 3 * K * kPanel;
    }
    const int64_t lines = 2 * next_inputs;  // a panel's lines in the next block
    // tile t of T prefetches lines [t L / T, (t + 1) L / T) of each panel's L, spread evenly
    const int64_t rate = n0 ? ((lines << 16) + tiles * (k1 - k0) - 1) / (tiles * (k1 - k0)) : 0;
    for (int64_t m = r0, t = 0; m < r1; m += size + (t < larger), t++) {
      const int64_t skip = (t * lines / tiles) * 16;
      tile_pair_block_rows<kPairRows>(size + (t < larger), x, K, k0, k1, w + k0 * kPanel,
                                      w + (K + k0) * kPanel, c + (m - r0) * 64, k0 == 0, last,
                                      d0, d1, m, n0 ? n0 + skip : nullptr,
                                      n1 ? n1 + skip : nullptr, rate, l2);
    }
  }
}

// The same for int8 / int4 panels of 9-127 rows (their float paths, AVX-512): each block is
// dequantized once into an L1 buffer (both panels, kPairBlock x 32 floats each) that every
// row tile then reads; no software prefetch (a block's quantized bytes are 1.5-3 KB a panel).
// The dequantized values and the order of the sums are those of the one-panel tiles: the same
// bits. Before, a panel's first 8 rows ran from the quantized weights and the rest from a
// whole-K dequantized scratch in L2.
template <class Weights>
void panel_pair_blocks_quantized(const float* x, int64_t K, const Weights& wa,
                                 const Weights& wb, const Dest& d0, const Dest& d1, int64_t r0,
                                 int64_t r1) {
  const int64_t tiles = (r1 - r0 + kPairRows - 1) / kPairRows;
  const int64_t size = (r1 - r0) / tiles, larger = (r1 - r0) % tiles;
  alignas(64) float c[kPairBlockRowsMax * 64];
  alignas(64) float block[2 * kPairBlock * kPanel];
  float* const block1 = block + kPairBlock * kPanel;
  static_assert(kPairBlock % kGroup == 0, "blocks of whole groups");
  for (int64_t k0 = 0; k0 < K; k0 += kPairBlock) {
    const int64_t k1 = std::min(K, k0 + kPairBlock);
    for (int64_t g0 = k0; g0 < k1; g0 += kGroup) {
      const auto ga = wa.group(g0, 0), gb = wb.group(g0, 0);
      const int64_t kn = std::min(kGroup, K - g0);  // < kGroup: int8's last, partial group
      for (int64_t k = 0; k < kn; k++) {
        vf v0, v1;
        ga.pair(k, v0, v1);
        vstore(block + (g0 - k0 + k) * kPanel, v0);
        vstore(block + (g0 - k0 + k) * kPanel + 16, v1);
        gb.pair(k, v0, v1);
        vstore(block1 + (g0 - k0 + k) * kPanel, v0);
        vstore(block1 + (g0 - k0 + k) * kPanel + 16, v1);
      }
    }
    for (int64_t m = r0, t = 0; m < r1; m += size + (t < larger), t++)
      tile_pair_block_rows<kPairRows>(size + (t < larger), x, K, k0, k1, block, block1,
                                      c + (m - r0) * 64, k0 == 0, k1 == K, d0, d1, m, nullptr,
                                      nullptr, 0, false);
  }
}
#endif

// out[M, N] = x[M, K] @ W.T over panels; make_weights(p) gives panel p's weight source. With
// `silu` (fp32 panels of gate and up features, AVX-512): out[M, N / 2] = silu(gate) * up.
#if defined(__AVX512F__)
// ----------------------------------------------------------------------------- fp32 on AMX
// fp32 linears of many rows on the CPU's AMX tiles (Intel Sapphire Rapids and later), with
// fp32's accuracy: each fp32 value is split exactly into three bf16 pieces, a = a1 + a2 + a3
// (a1 its top 8 significant bits, a2 the next 8 of the remainder, a3 the rest, which has at
// most 8: truncations and exact subtractions), and x @ w is the sum of the six products
// x1 w1 + x1 w2 + x2 w1 + x1 w3 + x2 w2 + x3 w1 (each bf16 x bf16 product is exact in fp32;
// the three dropped, x2 w3 + x3 w2 + x3 w3, are below 2^-24 of x w, fp32's own rounding of a
// product). The tile units accumulate in fp32; measured against float64 the results' error is
// about half the FMA panels' (tests/runtime/test_panel_linear_amx.py). AMX does 512 bf16
// multiply-adds a cycle against AVX-512's 32 fp32 ones, but the six products, the weights'
// split per call and a tile unit shared between two vCPUs left it 0.5-1.06x the FMA kernels on
// the project's VM (README), so it runs only where asked (g_amx_rows, woq.py's
// set_fp32_amx_rows, --cpu-amx-linear-rows).
//
// Per call the rows are split once into three pieces laid out as 1 KB A tiles ([row tile]
// [32-input block][16 rows][32 inputs], zero-padded); per work item (a chunk of up to
// kAmxChunk rows x one panel) the panel's fp32 weights are split into three pieces as B tiles
// (AMX's pair layout: [piece][16-feature half][input pair][16 features][2]), 6 KB per 32
// inputs, in a per-thread buffer (L2), then each block of 32 rows runs 24 tile products per 32
// inputs into four result tiles (2 row tiles x 2 feature halves), grouped so that consecutive
// products write different result tiles (one accumulating into the same tile waits for the
// previous one's latency: 3-4x slower in a harness). Buffers are 64-byte aligned: tile rows
// that straddle cache lines made runs 2-3x slower at random.
#define PLAIT_AMX __attribute__((target("avx512f,avx512bw,avx512bf16,amx-tile,amx-bf16")))

int64_t g_amx_rows = 0;  // fp32 linears of at least this many rows run on AMX (0: never)
constexpr int64_t kAmxChunk = 256;  // rows per work item: their split pieces, 6 B an input

// Linux gives a process AMX state only when asked (once per process; threads inherit it)
bool request_amx() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                 18 /* XFEATURE_XTILEDATA */) == 0;
  return ok;
}

struct AlignedBuffer {  // 64-byte aligned, grown on demand
  void* p = nullptr;
  size_t bytes = 0;
  void reserve(size_t n) {
    if (n <= bytes) return;
    std::free(p);
    bytes = (n + 63) / 64 * 64;
    p = std::aligned_alloc(64, bytes);
    TORCH_CHECK(p != nullptr, "fp32 AMX linear: out of memory");
  }
  ~AlignedBuffer() { std::free(p); }
};

// a = hi + mid + lo exactly, each with its low 16 bits zero (a bf16 in the high half)
PLAIT_AMX inline void split3(__m512 a, __m512& hi, __m512& mid, __m512& lo) {
  const __m512i top = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  hi = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a), top));
  const __m512 r = _mm512_sub_ps(a, hi);
  mid = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(r), top));
  lo = _mm512_sub_ps(r, mid);
}

// dword j = bf16 of a_j | bf16 of b_j << 16 (a and b as split3 leaves them)
PLAIT_AMX inline __m512i bf16_pairs(__m512 a, __m512 b) {
  return _mm512_mask_blend_epi16(0xAAAAAAAAu, _mm512_srli_epi32(_mm512_castps_si512(a), 16),
                                 _mm512_castps_si512(b));
}

// rows [m0, m1) of x [*, K] into the pieces' A tiles (piece stride `piece` uint16s; Kp the
// inputs padded to 32); rows past M (up to the tile) are written as zeros by the caller
PLAIT_AMX void amx_split_rows(const float* x, int64_t K, int64_t Kp, int64_t m0, int64_t m1,
                              int64_t piece, uint16_t* out) {
  const int64_t blocks = Kp / 32;
  for (int64_t m = m0; m < m1; m++) {
    for (int64_t k = 0; k < Kp; k += 32) {
      const int64_t n = std::max<int64_t>(0, std::min<int64_t>(32, K - k));
      const __mmask16 lo_mask = n >= 16 ? 0xFFFF : (1u << n) - 1;
      const __mmask16 hi_mask = n >= 32 ? 0xFFFF : n > 16 ? (1u << (n - 16)) - 1 : 0;
      __m512 ah, am, al, bh, bm, bl;
      split3(_mm512_maskz_loadu_ps(lo_mask, x + m * K + k), ah, am, al);
      split3(_mm512_maskz_loadu_ps(hi_mask, x + m * K + k + 16), bh, bm, bl);
      uint16_t* o = out + ((m / 16) * blocks + k / 32) * 512 + (m % 16) * 32;
      // the pieces are exact bf16 values: the conversion's rounding leaves them as they are
      _mm512_store_si512(o, (__m512i)_mm512_cvtne2ps_pbh(bh, ah));
      _mm512_store_si512(o + piece, (__m512i)_mm512_cvtne2ps_pbh(bm, am));
      _mm512_store_si512(o + 2 * piece, (__m512i)_mm512_cvtne2ps_pbh(bl, al));
    }
  }
}

// one fp32 panel w [K, 32] into the pieces' B tiles, out [3][2][Kp / 2][16][2]
PLAIT_AMX void amx_split_panel(const float* w, int64_t K, int64_t Kp, uint16_t* out) {
  const int64_t half = Kp / 2 * 32;  // uint16s per (piece, feature half)
  for (int64_t i = 0; i < Kp / 2; i++) {
    const int64_t k = 2 * i;
    for (int c = 0; c < 2; c++) {
      const __m512 a = k < K ? _mm512_loadu_ps(w + k * 32 + 16 * c) : _mm512_setzero_ps();
      const __m512 b =
          k + 1 < K ? _mm512_loadu_ps(w + (k + 1) * 32 + 16 * c) : _mm512_setzero_ps();
      __m512 ah, am, al, bh, bm, bl;
      split3(a, ah, am, al);
      split3(b, bh, bm, bl);
      uint16_t* o = out + c * half + i * 32;
      _mm512_store_si512(o, bf16_pairs(ah, bh));
      _mm512_store_si512(o + 2 * half, bf16_pairs(am, bm));
      _mm512_store_si512(o + 4 * half, bf16_pairs(al, bl));
    }
  }
}

struct alignas(64) AmxConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tiles 0-3: results (row tile r, feature half c) at 2 r + c; 4, 5: the two row tiles' A
// pieces; 6, 7: the two halves' B pieces; all 16 rows x 64 bytes
PLAIT_AMX void amx_configure() {
  AmxConfig cfg;
  for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  // (GCC 12's _tile_loadconfig declares an 8-byte operand: the stores above could be dropped)
  asm volatile("ldtilecfg %0" : : "m"(cfg));
}

PLAIT_AMX void amx_release() { _tile_release(); }

// rows [16 t, 16 t + 16 (2 if two)) of the split x (A tiles from a, blocks of Kp / 32) times
// one panel's split weights b: the fp32 results, c [32][32] (row stride 32 floats)
// prefetch: `lines` cache lines from pf into L2, spread over the input blocks (the next
// panel's weights, streamed while the tiles compute)
template <bool two>
PLAIT_AMX void amx_tile_rows(const uint16_t* a, int64_t piece, int64_t Kp,
                             const uint16_t* b, float* c, const char* pf, int64_t lines) {
  const int64_t half = Kp / 2 * 32, next_tile = Kp / 32 * 512;
  const int64_t blocks = Kp / 32, per_block = pf ? (lines + blocks - 1) / blocks : 0;
  _tile_zero(0);
  _tile_zero(1);
  if (two) {
    _tile_zero(2);
    _tile_zero(3);
  }
#define PLAIT_AMX_PRODUCTS   \
  _tile_dpbf16ps(0, 4, 6);  \
  _tile_dpbf16ps(1, 4, 7);  \
  if (two) {                \
    _tile_dpbf16ps(2, 5, 6); \
    _tile_dpbf16ps(3, 5, 7); \
  }
#define PLAIT_AMX_LOAD_A(p)                                  \
  _tile_loadd(4, a0 + (p) * piece, 64);                       \
  if (two) {                                                  \
    _tile_loadd(5, a0 + (p) * piece + next_tile, 64);         \
  }
  for (int64_t kb = 0; kb < Kp / 32; kb++) {
    const uint16_t* a0 = a + kb * 512;
    const uint16_t* b0 = b + kb * 512;
    for (int64_t l = kb * per_block; l < std::min(lines, (kb + 1) * per_block); l++)
      _mm_prefetch(pf + 64 * l, _MM_HINT_T1);
    _tile_loadd(6, b0, 64);  // w1
    _tile_loadd(7, b0 + half, 64);
    PLAIT_AMX_LOAD_A(0)  // x1 w1
    PLAIT_AMX_PRODUCTS
    PLAIT_AMX_LOAD_A(1)  // x2 w1
    PLAIT_AMX_PRODUCTS
    PLAIT_AMX_LOAD_A(2)  // x3 w1
    PLAIT_AMX_PRODUCTS
    _tile_loadd(6, b0 + 2 * half, 64);  // w2
    _tile_loadd(7, b0 + 3 * half, 64);
    PLAIT_AMX_LOAD_A(0)  // x1 w2
    PLAIT_AMX_PRODUCTS
    PLAIT_AMX_LOAD_A(1)  // x2 w2
    PLAIT_AMX_PRODUCTS
    _tile_loadd(6, b0 + 4 * half, 64);  // w3
    _tile_loadd(7, b0 + 5 * half, 64);
    PLAIT_AMX_LOAD_A(0)  // x1 w3
    PLAIT_AMX_PRODUCTS
  }
#undef PLAIT_AMX_PRODUCTS
#undef PLAIT_AMX_LOAD_A
  _tile_stored(0, c, 128);
  _tile_stored(1, c + 16, 128);
  if (two) {
    _tile_stored(2, c + 16 * 32, 128);
    _tile_stored(3, c + 16 * 32 + 16, 128);
  }
}

// rows [0, rows) of c [32][32] to the panel's destination rows [m0, m0 + rows)
PLAIT_AMX void amx_write(const float* c, int64_t rows, const Dest& d, int64_t m0) {
  for (int64_t m = 0; m < rows; m++) {
    const float* r = c + m * 32;
    float* o = d.out + (m0 + m) * d.ldo;
    if (d.silu) {  // 16 columns: silu(gate) * up, the gate the first half
      _mm512_storeu_ps(o, silu_mul_exact(_mm512_load_ps(r), _mm512_load_ps(r + 16)));
      continue;
    }
    const int64_t n = d.cols;
    _mm512_mask_storeu_ps(o, n >= 16 ? 0xFFFF : (1u << n) - 1, _mm512_load_ps(r));
    if (n > 16)
      _mm512_mask_storeu_ps(o + 16, n >= 32 ? 0xFFFF : (1u << (n - 16)) - 1,
                            _mm512_load_ps(r + 16));
  }
}

// panel_gemm's fp32 panels (32 wide) on AMX; dest(p) as there
template <class MakeDest>
void amx_panel_gemm(const float* x, int64_t M, int64_t K, const float* w, int64_t panels,
                    const MakeDest& dest) {
  const int64_t Kp = (K + 31) / 32 * 32, Mp = (M + 31) / 32 * 32;
  const int64_t piece = Mp * Kp;
  AlignedBuffer split;
  split.reserve(3 * piece * sizeof(uint16_t));
  auto* xs = static_cast<uint16_t*>(split.p);
  // rows past M, up to the last 32-row block: zeros
  for (int pc = 0; pc < 3; pc++)
    std::memset(xs + pc * piece + (M / 16) * 16 * Kp, 0, (Mp - M / 16 * 16) * Kp * 2);
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    amx_split_rows(x, K, Kp, m0, m1, piece, xs);
  });
  const int64_t chunks = (M + kAmxChunk - 1) / kAmxChunk;
  parallel_panels(chunks * panels, [&](int64_t i0, int64_t i1) {
    thread_local AlignedBuffer panel_split;
    panel_split.reserve(3 * Kp * 32 * sizeof(uint16_t));
    auto* ws = static_cast<uint16_t*>(panel_split.p);
    alignas(64) float c[32 * 32];
    amx_configure();
    for (int64_t i = i0; i < i1; i++) {
      const int64_t p = i % panels, r0 = i / panels * kAmxChunk;
      const int64_t r1 = std::min(M, r0 + kAmxChunk);
      amx_split_panel(w + p * K * kPanel, K, Kp, ws);
      const Dest d = dest(p);
      // the next item's panel into L2 while the first row block computes (within this run)
      const char* next = i + 1 < i1
          ? reinterpret_cast<const char*>(w + (i + 1) % panels * K * kPanel) : nullptr;
      for (int64_t m = r0; m < r1; m += 32) {
        const int64_t rows = std::min<int64_t>(32, r1 - m);
        const uint16_t* a = xs + (m / 16) * (Kp / 32) * 512;
        const char* pf = m == r0 ? next : nullptr;
        if (rows > 16) amx_tile_rows<true>(a, piece, Kp, ws, c, pf, K * 2);
        else amx_tile_rows<false>(a, piece, Kp, ws, c, pf, K * 2);
        amx_write(c, rows, d, m);
      }
    }
    amx_release();
  });
}
#endif


template <class MakeWeights>
void panel_gemm(const float* x, int64_t M, int64_t K, int64_t N, float* out,
                const float* col_scale, MakeWeights make_weights, bool silu = false) {
  if (M == 0) return;
  const int64_t panels = (N + kPanel - 1) / kPanel;
  // where panel p's tiles write
  auto dest = [&](int64_t p) -> Dest {
    if (silu) return {out + p * (kPanel / 2), N / 2, std::min(kPanel, N - p * kPanel) / 2,
                      nullptr, true};
    return {out + p * kPanel, N, std::min(kPanel, N - p * kPanel),
            col_scale ? col_scale + p * kPanel : nullptr};
  };
  const int64_t blocks = (M + kRowBlock - 1) / kRowBlock;
  const int64_t block_rows = (M + blocks - 1) / blocks;  // even blocks: no 1-row remnant
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<decltype(make_weights(0)), Fp32Weights>) {
    if (g_amx_rows > 0 && M >= g_amx_rows) {
      amx_panel_gemm(x, M, K, make_weights(0).w, panels, dest);
      return;
    }
    if (M >= kPairBlockMinRows) {  // panel pairs (a last odd panel alone, as below)
      const float* w = make_weights(0).w;
      const int64_t pairs = (panels + 1) / 2;
      const bool whole = M >= kPairWholeRows;  // else one row block, run in input blocks
      const int64_t rows = whole ? block_rows : M, row_blocks = (M + rows - 1) / rows;
      // work items (pair, row block), pair major: a pair's later row blocks read it from L2,
      // and pairs of few panels split evenly (SmolLM2's o_proj and down_proj have 9 pairs,
      // 5 / 4 between two threads when a thread took a pair for all rows). SmolLM2's 30
      // layers of linears against row-block-major per thread: 128-550 rows 1.07-1.09x, 1024
      // 1.04x
      parallel_panels(row_blocks * pairs, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; i++) {
          const int64_t b = i % row_blocks, q = i / row_blocks;
          const int64_t r0 = b * rows, r1 = std::min(M, r0 + rows);
          const int64_t p = 2 * q;
          const Dest d0 = dest(p);
          if (p + 1 == panels) {
            panel_rows_fp32(x, K, make_weights(p), d0, r0, r1, nullptr);
            continue;
          }
          const Dest d1 = dest(p + 1);
          // the next pair is prefetched by the pair's last row block only (the next item)
          const int64_t next_panels =
              b + 1 < row_blocks ? 0 : std::min<int64_t>(2, panels - p - 2);
          if (whole) panel_pair_rows(x, K, w + p * K * kPanel, d0, d1, r0, r1, next_panels);
          else panel_pair_blocks(x, K, w + p * K * kPanel, d0, d1, r0, r1, next_panels);
        }
      });
      return;
    }
  }
  if constexpr (!std::is_same_v<decltype(make_weights(0)), Fp32Weights>) {
    // pairs in blocks (an odd last panel alone) past the direct tile's rows: SmolLM2's 30
    // layers of linears, alternated: int4 16-32 rows 1.06x, 64 1.10x, 100 1.13x; int8 32
    // 1.03x, 64 1.07x; 4-8 rows 0.87-0.94x (one direct tile dequantizing in registers)
    if (M > kDirectRows && M < kPairWholeRows) {
      const int64_t pairs = (panels + 1) / 2;
      parallel_panels(pairs, [&](int64_t q0, int64_t q1) {
        thread_local std::vector<float> scratch;
        for (int64_t q = q0; q < q1; q++) {
          const int64_t p = 2 * q;
          const Dest d0{out + p * kPanel, N, std::min(kPanel, N - p * kPanel),
                        col_scale ? col_scale + p * kPanel : nullptr};
          if (p + 1 == panels) {
            if ((int64_t)scratch.size() < K * kPanel) scratch.resize(K * kPanel);
            panel_rows(x, K, make_weights(p), d0, 0, M, scratch.data());
            continue;
          }
          const Dest d1{out + (p + 1) * kPanel, N, std::min(kPanel, N - (p + 1) * kPanel),
                        col_scale ? col_scale + (p + 1) * kPanel : nullptr};
          panel_pair_blocks_quantized(x, K, make_weights(p), make_weights(p + 1), d0, d1, 0, M);
        }
      });
      return;
    }
  }
#endif
  parallel_panels(panels, [&](int64_t p0, int64_t p1) {
    thread_local std::vector<float> scratch;  // one dequantized panel
#if defined(__AVX512F__)  // (AVX2 int8/int4: integer tiles, no dequantized panel)
    if (!std::is_same_v<decltype(make_weights(0)), Fp32Weights> && M > kDirectRows &&
        (int64_t)scratch.size() < K * kPanel)
      scratch.resize(K * kPanel);
#endif
    for (int64_t r0 = 0; r0 < M; r0 += block_rows) {
      const int64_t r1 = std::min(M, r0 + block_rows);
      for (int64_t p = p0; p < p1; p++) {
        const Dest d = dest(p);
        if constexpr (std::is_same_v<decltype(make_weights(p)), Fp32Weights>)
          panel_rows_fp32(x, K, make_weights(p), d, r0, r1,
                          p + 1 < panels ? make_weights(p + 1).w : nullptr);
        else
          panel_rows(x, K, make_weights(p), d, r0, r1, scratch.data());
      }
    }
  });
}

// ----------------------------------------------------------------------------- fp32, 24 wide
// fp32 weights in panels of 24 output features, w[p, k, j] = W[24 p + j, k] (woq.py's
// to_panels_fp32 writes them on AVX2-only CPUs), run with 8-float vectors in either build.
// A tile (tile_whole_panel) of up to 4 rows x the whole panel keeps 4 x 3 accumulators, the
// panel's 3 weight vectors and one broadcast in the 16 ymm registers; each input k reads the
// panel's 96 bytes once per tile (the 32-wide panels' AVX2 tiles read a panel half per pass:
// every cache line twice) and each weight vector feeds 4 FMAs. At SmolLM2's batch-32 shapes
// on the AVX2 EPYC (weights streaming from memory, 2 threads) a harness measured 4 x 24 tiles
// 1.2-1.4x faster than the 32-wide panels' 6 x 16 halves.
constexpr int64_t kPanel24 = 24;
constexpr int64_t kRows24 = 4;  // rows per tile
// tiles that share the next panel's prefetch: SmolLM2's linears at 12-32 rows 1.08-1.12x
// faster spread over up to 8 tiles than over the first 2 (even at 8 and 64 rows; old vs new
// build alternated in one process, AVX2 EPYC)
constexpr int64_t kPrefetchTiles24 = 8;

// One 24-wide panel x rows [r0, r1), in even tiles of <= 4 rows. With more than one tile,
// each of the first (up to kPrefetchTiles24) prefetches its share of the next panel (one
// prefetch per input); a single tile streams with the hardware prefetcher alone.
void panel_rows_fp32_24(const float* x, int64_t K, const float* w, const Dest& d, int64_t r0,
                        int64_t r1, const float* next) {
  const int64_t tiles = (r1 - r0 + kRows24 - 1) / kRows24;
  const int64_t per = (r1 - r0 + tiles - 1) / tiles;
  for (int64_t m = r0, t = 0; m < r1; m += per, t++) {
    const int64_t rows = std::min<int64_t>(r1 - m, per);
    const float* pf = nullptr;
    int64_t step = 0;
    // A single tile has no software prefetch: the hardware prefetcher follows its stream (96
    // bytes an input); SmolLM2's 1-row linears + logits on the AVX2 VM without vs with 16 KB-
    // ahead prefetches: 1.16x on huge pages (28.3 -> 32.7 GB/s), 1.07x on 4 KB pages. With
    // more tiles the next panel, a share per tile over the first (up to 8) tiles (without:
    // 8 rows 0.76x, 32 rows 0.85x).
    if (tiles > 1 && next) {
      const int64_t sharing = std::min<int64_t>(tiles, kPrefetchTiles24);
      const int64_t share = (kPanel24 + sharing - 1) / sharing;  // floats per input
      if (t < sharing) pf = next + t * K * share, step = share;
    }
    switch (rows) {
      case 1: tile_whole_panel<1, 2, 3>(x, K, K, w, d, m, pf, step, false); break;
      case 2: tile_whole_panel<2, 2, 3>(x, K, K, w, d, m, pf, step, false); break;
      case 3: tile_whole_panel<3, 1, 3>(x, K, K, w, d, m, pf, step, false); break;
      default: tile_whole_panel<4, 1, 3>(x, K, K, w, d, m, pf, step, false); break;
    }
  }
}

void panel_gemm_fp32_24(const float* x, int64_t M, int64_t K, int64_t N, float* out,
                        const float* w) {
  if (M == 0) return;
  const int64_t panels = (N + kPanel24 - 1) / kPanel24;
  const int64_t blocks = (M + kRowBlock - 1) / kRowBlock;
  const int64_t block_rows = (M + blocks - 1) / blocks;
  parallel_panels(panels, [&](int64_t p0, int64_t p1) {
    for (int64_t r0 = 0; r0 < M; r0 += block_rows) {
      const int64_t r1 = std::min(M, r0 + block_rows);
      for (int64_t p = p0; p < p1; p++) {
        const Dest d{out + p * kPanel24, N, std::min(kPanel24, N - p * kPanel24), nullptr};
        panel_rows_fp32_24(x, K, w + p * K * kPanel24, d, r0, r1,
                           p + 1 < panels ? w + (p + 1) * K * kPanel24 : nullptr);
      }
    }
  });
}

void check_x(const torch::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " features, the weight ", K);
}

void check_vector(const torch::Tensor& t, at::ScalarType type, int64_t numel, const char* what) {
  TORCH_CHECK(t.scalar_type() == type && t.is_contiguous() && t.numel() == numel, what,
              " must be a contiguous ", c10::toString(type), " tensor of ", numel, " elements");
}

}  // namespace

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scale, int64_t N) {
#if defined(__AVX512F__)
  TORCH_CHECK(w.dim() == 3 && w.size(2) == kPanel && w.scalar_type() == torch::kChar &&
              w.is_contiguous(), "w must be contiguous int8 panels [P, K, 32]");
  const int64_t P = w.size(0), K = w.size(1), M = x.size(0);
  TORCH_CHECK(N > (P - 1) * kPanel && N <= P * kPanel, "N does not match the panels");
  check_x(x, K);
  check_vector(scale, torch::kFloat, P * kPanel, "scale");
  auto out = torch::empty({M, N}, x.options());
  const int8_t* wp = w.data_ptr<int8_t>();
  panel_gemm(x.data_ptr<float>(), M, K, N, out.data_ptr<float>(), scale.data_ptr<float>(),
             [&](int64_t p) { return Int8Weights{wp + p * K * kPanel}; });
#else
  TORCH_CHECK(w.dim() == 3 && w.size(2) == 4 * kPanel && w.scalar_type() == torch::kChar &&
              w.is_contiguous(), "w must be contiguous int8 panels [P, K / 4, 128] (AVX2)");
  const int64_t P = w.size(0), Kp = w.size(1) * 4, M = x.size(0);
  TORCH_CHECK(Kp % kGroup == 0, "int8 panels: padded inputs must be a multiple of ", kGroup);
  TORCH_CHECK(N > (P - 1) * kPanel && N <= P * kPanel, "N does not match the panels");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] tensor");
  const int64_t K = x.size(1);
  TORCH_CHECK(K <= Kp && Kp - K < kGroup, "x has ", K, " features, the weight ", Kp,
              " (padded to a multiple of ", kGroup, ")");
  check_vector(scale, torch::kFloat, P * kPanel, "scale");
  auto out = torch::empty({M, N}, x.options());
  if (M == 0) return out;
  const int8_t* wp = w.data_ptr<int8_t>();
  std::vector<float> padded;  // x with zero inputs up to Kp, where K is not a whole group
  const float* xp = x.data_ptr<float>();
  if (K != Kp) {
    padded.assign(M * Kp, 0.0f);
    for (int64_t m = 0; m < M; m++) std::memcpy(&padded[m * Kp], xp + m * K, K * sizeof(float));
    xp = padded.data();
  }
  const Q8Inputs act(xp, M, Kp);
  panel_gemm(xp, M, Kp, N, out.data_ptr<float>(), scale.data_ptr<float>(),
             [&](int64_t p) { return Int8Weights{wp + p * Kp * kPanel, &act}; });
#endif
  return out;
}

torch::Tensor int4_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scale,
                          torch::Tensor mins, int64_t N) {
#if defined(__AVX512F__)
  TORCH_CHECK(w.dim() == 3 && w.size(2) == 16 && w.scalar_type() == torch::kByte &&
              w.is_contiguous(), "w must be contiguous uint8 panels [P, K, 16]");
  const int64_t K = w.size(1);
#else
  TORCH_CHECK(w.dim() == 3 && w.size(2) == 64 && w.scalar_type() == torch::kByte &&
              w.is_contiguous(), "w must be contiguous uint8 panels [P, K / 4, 64] (AVX2)");
  const int64_t K = w.size(1) * 4;
#endif
  const int64_t P = w.size(0), M = x.size(0);
  TORCH_CHECK(K % kGroup == 0, "int4: in_features must be a multiple of ", kGroup);
  TORCH_CHECK(N > (P - 1) * kPanel && N <= P * kPanel, "N does not match the panels");
  check_x(x, K);
  const int64_t G = K / kGroup;
  check_vector(scale, torch::kHalf, P * G * kPanel, "scale");
  check_vector(mins, torch::kHalf, P * G * kPanel, "mins");
  auto out = torch::empty({M, N}, x.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(scale.data_ptr<at::Half>());
  const auto* mp = reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>());
#if defined(__AVX512F__)
  const Q8Inputs* act = nullptr;
#else
  const Q8Inputs rounded(x.data_ptr<float>(), M, K);  // tile_int4_q8 takes every row
  const Q8Inputs* act = &rounded;
#endif
  panel_gemm(x.data_ptr<float>(), M, K, N, out.data_ptr<float>(), nullptr, [&](int64_t p) {
    return Int4Weights{wp + p * K * 16, sp + p * G * kPanel, mp + p * G * kPanel, act};
  });
  return out;
}

torch::Tensor fp32_linear(torch::Tensor x, torch::Tensor w, int64_t N) {
  TORCH_CHECK(w.dim() == 3 && (w.size(2) == kPanel || w.size(2) == kPanel24) &&
              w.scalar_type() == torch::kFloat && w.is_contiguous(),
              "w must be contiguous float32 panels [P, K, 32] or [P, K, 24]");
  const int64_t P = w.size(0), K = w.size(1), M = x.size(0), width = w.size(2);
  TORCH_CHECK(N > (P - 1) * width && N <= P * width, "N does not match the panels");
  check_x(x, K);
  auto out = torch::empty({M, N}, x.options());
  const float* wp = w.data_ptr<float>();
  if (width == kPanel24) {
    panel_gemm_fp32_24(x.data_ptr<float>(), M, K, N, out.data_ptr<float>(), wp);
    return out;
  }
  panel_gemm(x.data_ptr<float>(), M, K, N, out.data_ptr<float>(), nullptr,
             [&](int64_t p) { return Fp32Weights{wp + p * K * kPanel}; });
  return out;
}

#if defined(__AVX512F__)
// silu(gate) * up of a fused gate_up projection in one pass: w holds 32-feature fp32 panels whose
// features j < 16 are gate features and j >= 16 the up features of the same 16 (woq.py's
// interleave_gate_up); N = 2 x intermediate, a multiple of 32. Returns [M, N / 2], equal to
// fused_cpu.cpp's silu_mul of fp32_linear's product in the plain order.
torch::Tensor fp32_linear_silu(torch::Tensor x, torch::Tensor w, int64_t N) {
  TORCH_CHECK(w.dim() == 3 && w.size(2) == kPanel && w.scalar_type() == torch::kFloat &&
              w.is_contiguous(), "w must be contiguous float32 panels [P, K, 32]");
  const int64_t P = w.size(0), K = w.size(1), M = x.size(0);
  TORCH_CHECK(N % kPanel == 0 && N == P * kPanel,
              "N must be the panels' 32 P features (gate and up interleaved by 16)");
  check_x(x, K);
  auto out = torch::empty({M, N / 2}, x.options());
  const float* wp = w.data_ptr<float>();
  panel_gemm(x.data_ptr<float>(), M, K, N, out.data_ptr<float>(), nullptr,
             [&](int64_t p) { return Fp32Weights{wp + p * K * kPanel}; }, true);
  return out;
}
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fp32_linear", &fp32_linear, "y = x @ W.T, W in 32- or 24-feature panels [P, K, 32|24]");
#if defined(__AVX512F__)
  m.def("fp32_linear_silu", &fp32_linear_silu,
        "silu(gate) * up from 32-feature panels of interleaved gate and up features");
  m.def("set_fp32_amx_rows", [](int64_t rows) {
    TORCH_CHECK(rows >= 0, "set_fp32_amx_rows: rows must be >= 0");
    g_amx_rows = rows > 0 && request_amx() ? rows : 0;
    return g_amx_rows;
  }, "fp32 linears of at least `rows` rows on AMX tiles (0: never); the rows in effect (0 "
     "where Linux gives this process no AMX state)");
#endif
  m.def("set_fp32_stream_prefetch", [](bool on) {
    return g_single_tile_stream.exchange(on);
  }, "whether a single row tile of an fp32 linear prefetches its weight stream in software; "
     "returns the setting before");
  m.def("int8_linear", &int8_linear, "y = x @ (q * scale[:, None]).T, q in 32-feature panels");
  m.def("int4_linear", &int4_linear, "y = x @ (q * scale + min, group 32).T, 32-feature panels");
  m.attr("isa") = kIsa;
  // (address, signature) of each linear for fused_cpu.cpp's DecodeLayers, which calls them
  // directly (the signatures are checked there)
  m.def("entry_points", []() {
    py::dict d;
    d["fp32_linear"] = std::make_pair(reinterpret_cast<int64_t>(&fp32_linear),
                                      std::string("Tensor(Tensor x, Tensor w, int64 N)"));
#if defined(__AVX512F__)
    d["fp32_linear_silu"] = std::make_pair(reinterpret_cast<int64_t>(&fp32_linear_silu),
                                           std::string("Tensor(Tensor x, Tensor w, int64 N)"));
#endif
    d["int8_linear"] = std::make_pair(
        reinterpret_cast<int64_t>(&int8_linear),
        std::string("Tensor(Tensor x, Tensor w, Tensor scale, int64 N)"));
    d["int4_linear"] = std::make_pair(
        reinterpret_cast<int64_t>(&int4_linear),
        std::string("Tensor(Tensor x, Tensor w, Tensor scale, Tensor mins, int64 N)"));
    return d;
  });
}

// Decode attention over the KV pool for the CPU, reading K/V rows in place through slot lists.
// Built twice from this one source (plait/kernels/cpu_attention.py picks at run time): with
// -mavx512f... (16-float vectors, masked tails) and with -mavx2 -mfma (8-float vectors).
// The pool may be float32 or bfloat16 (--kv-cache-dtype, for an fp32 model): bf16 K/V are
// widened to fp32 exactly (bits << 16) as they are read; q, the arithmetic and results are fp32.
//
// A sequence b has R query rows per kv head (a decode request: its G grouped-query heads; a
// shared prefix: the G heads of each of its n members, R = n * G) and lens[b] KV rows found
// through slots[b]. Output: out [B, Hkv, R, D] and the log-sum-exp of the scaled scores
// [B, Hkv, R] (for merging partial results over one sequence's split parts or with a shared
// prefix's).
//
// Why it is shaped this way (measured on this project's shared 2-core AVX-512 EPYC with SmolLM2's
// shapes, each of the 30 layers' KV read in turn so that it comes from memory as in a forward
// (one layer's KV at batch 32 x 280 tokens, 13.8 MB, fits the 32 MB L3: a loop over one layer
// measures the L3); benchmarks/decode_attention.py, A/B alternated in one process):
// * One task reads whole pool rows ([Hkv, D], 768 B) once, for every kv head, W tokens (one
//   vector's worth) at a time. The W scores of a query row come from W independent dot
//   products summed by one transposing add tree (vsum_each: ~3 instructions a score against
//   ~8 for a horizontal sum each), and each block's K and V rows are used together (an online
//   softmax), so nothing depends on rows staying in a cache between passes. From cache this
//   runs at ~40 ns a token (AVX-512; AVX2 ~50), near the FMA bound (1152 multiply-adds a
//   token, 16 lanes a cycle on this core).
// * Memory, not arithmetic, is the limit: a streaming read gets ~33 GB/s a core here, and a
//   kernel that requested a block's rows only when it reached them got ~14 (fetch and compute
//   in turn). Rows are scattered (the scheduler gives each request one slot per decode step,
//   B slots apart, and a pool that has served a while hands out scattered prompt slots too),
//   so the hardware prefetcher cannot run ahead; the kernel prefetches every line of the
//   block PREFETCH_AHEAD tokens on. Issued all at once (2 x 16 rows = ~400 lines) the
//   prefetches overflow the core's miss buffers and are lost; spread over the block's units of
//   work (K rows while scoring, V rows during the V pass) they were 1.5x faster than a burst
//   on contiguous, scheduler and served layouts alike. Further ahead, or into L2, was slower
//   there (that EPYC, with the per-unit prefetches); on the Intel Xeon VM into L2 was
//   1.05-1.12x faster at batch 1-32 (its cores' line fill buffers, not L2's queue, bound the
//   misses in flight), further ahead even. With the Cursor below, on a Zen 4 EPYC VM
//   (2026-11-27, decode_attention.py against the same kernel prefetching into L1): into L2
//   1.42-1.57x faster at batch 8 and 32 on all three layouts (24 GB/s of K/V against 16),
//   batch 1 even (0.97-1.02x); two blocks ahead instead of one, into L1, 0.96-1.01x. So the
//   prefetches go to L2 on every CPU.
//   There, with fp32 pools, the spread was still too coarse: a unit's prefetches (two rows'
//   26 lines in a score unit, five rows' 65 in a V unit) overflowed the 16 fill buffers, and
//   the unit's arithmetic waited behind them, so the step took the memory's time plus the
//   arithmetic's (SmolLM2 at batch 32: 19.4 ms for 30 layers against 17.0 for the same loop
//   with the arithmetic taken out). Now a Cursor issues the next block's lines one at a time
//   from inside the arithmetic (every other K vector of score_block, four per token of
//   v_block): 17.0 ms, decode_attention.py's scheduler layout 1.05-1.09x at batch 1-32, a
//   SmolLM2 decode step 0.99x / 0.95x / 0.92x at batch 1 / 8 / 32. bf16 pools (6 lines a row)
//   keep the per-unit spread: the cursor measured 0.86-0.97x for them.
// * A shared prefix has many query rows per kv head (its n members' G heads; judge: 192): from
//   GEMM_ROWS rows on, the block's K rows are transposed once and the scores are a small GEMM
//   (score_rows_gemm), which does the multiply-adds without per-score sums; from LANES_ROWS on
//   the rows go in the vector lanes instead (attend_chunk_lanes: no transposition, an online
//   softmax elementwise over rows), 1.3-1.4x faster again on the Intel Xeon VM.
// * Sequences longer than CHUNK keys are split into chunks (batch 1 had Hkv = 3 tasks for 2
//   threads), merged by their log-sum-exps; threads take chunks from a shared counter. The
//   split is a function of each sequence's length alone, so a request's result does not depend
//   on the thread count or on its batch.
// * The same source is built for AVX-512 and for AVX2; AVX-512 needs fewer instructions (from
//   cache 1.25x faster), on memory-bound steps the two measured alike.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

#if defined(__AVX512F__)
constexpr int64_t W = 16;
using vec = __m512;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vset1(float x) { return _mm512_set1_ps(x); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
// the first n (1..W) floats at p, zeros after: reads nothing past p + n
inline vec vload_n(const float* p, int64_t n) {
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
}
// W bf16 values -> W floats (exact: each value's bits are the high half of its float)
inline vec vwiden(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline vec vload(const at::BFloat16* p) {
  return vwiden(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline vec vload_n(const at::BFloat16* p, int64_t n) {
  return vwiden(_mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), p));
}
inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }
inline float vhmax(vec v) { return _mm512_reduce_max_ps(v); }
inline vec vround(vec x) {
  return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline vec vpow2(vec p, vec n) { return _mm512_scalef_ps(p, n); }  // p * 2^n
// lane i of the result = the sum of a[i]'s lanes (16 horizontal sums in 45 instructions)
inline vec vsum_each(const vec* a) {
  vec x[8], z[4], w[2];
  for (int i = 0; i < 8; i++)  // per 128-bit block: [a0+a2, b0+b2, a1+a3, b1+b3]
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; i++) {  // per block: the block's sums of a, b, c, d
    const __m512d p = _mm512_castps_pd(x[2 * i]), q = _mm512_castps_pd(x[2 * i + 1]);
    z[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(p, q)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(p, q)));
  }
  for (int i = 0; i < 2; i++)  // blocks (0+1, 2+3) of each of two vectors
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(z[2 * i], z[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(z[2 * i], z[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88),
                       _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}
#else
constexpr int64_t W = 8;
using vec = __m256;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vset1(float x) { return _mm256_set1_ps(x); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline vec vload_n(const float* p, int64_t n) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(int(n)), lane));
}
inline vec vwiden(__m128i h) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline vec vload(const at::BFloat16* p) {
  return vwiden(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// (no 16-bit masked load in AVX2: a copy; head_dim % 8 == 0 leaves AVX2 no partial vector)
inline vec vload_n(const at::BFloat16* p, int64_t n) {
  alignas(16) at::BFloat16 b[W] = {};
  std::copy(p, p + n, b);
  return vload(b);
}
inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
inline float vsum(vec v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}
inline float vhmax(vec v) {
  __m128 lo = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_max_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_max_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}
inline vec vround(vec x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// lane i of the result = the sum of a[i]'s lanes
inline vec vsum_each(const vec* a) {
  vec x[4], z[2];
  for (int i = 0; i < 4; i++)
    x[i] = _mm256_add_ps(_mm256_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm256_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 2; i++) {
    const __m256d p = _mm256_castps_pd(x[2 * i]), q = _mm256_castps_pd(x[2 * i + 1]);
    z[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(p, q)),
                         _mm256_castpd_ps(_mm256_unpackhi_pd(p, q)));
  }
  return _mm256_add_ps(_mm256_permute2f128_ps(z[0], z[1], 0x20),
                       _mm256_permute2f128_ps(z[0], z[1], 0x31));
}
inline vec vpow2(vec p, vec n) {
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

// one pool element as a float (bf16: exact)
inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }

// exp(x) for x <= 0 (softmax arguments): 2^n * p(r) with x = n ln2 + r, |r| <= ln2 / 2, a
// degree-6 polynomial for e^r (relative error ~2e-7, below fp32 attention's own rounding).
inline vec vexp(vec x) {
  x = vmax(x, vset1(-87.0f));
  vec n = vround(vmul(x, vset1(1.44269504088896341f)));
  vec r = vsub(x, vmul(n, vset1(0.693359375f)));
  r = vsub(r, vmul(n, vset1(-2.12194440e-4f)));
  vec p = vset1(1.0f / 720.0f);
  p = vfma(p, r, vset1(1.0f / 120.0f));
  p = vfma(p, r, vset1(1.0f / 24.0f));
  p = vfma(p, r, vset1(1.0f / 6.0f));
  p = vfma(p, r, vset1(0.5f));
  p = vfma(p, r, vset1(1.0f));
  p = vfma(p, r, vset1(1.0f));
  return vpow2(p, n);
}

// where the prefetches go: L2 (prefetcht1) on every CPU (see the header: the Intel Xeon VM and
// the Zen 4 EPYC VM both measured it faster than L1 for this kernel)
#define PLAIT_STREAM_HINT _MM_HINT_T1
constexpr int64_t PREFETCH_AHEAD = W;  // tokens: one block (see the header)
constexpr int64_t CHUNK = 256;  // keys per task, about (batch 1 of 280 keys: two tasks of 140)

// every cache line of one pool row of n elements (its first byte's line to its last byte's)
template <typename KV>
inline void prefetch_row(const KV* row, int64_t n) {
  const char* p = reinterpret_cast<const char*>(row);
  const int64_t bytes = n * int64_t(sizeof(KV));
  for (int64_t a = 0; a < bytes; a += 64) _mm_prefetch(p + a, PLAIT_STREAM_HINT);
  _mm_prefetch(p + bytes - 1, PLAIT_STREAM_HINT);
}

// The next block's K rows, then its V rows, prefetched a line at a time from inside the
// current block's arithmetic (step(): score_block and v_block call it as they go), so that
// the line fill buffers take prefetches as fast as lines arrive, the multiply-adds running
// meanwhile; finish() issues whatever the block's arithmetic did not reach.
// (bf16 pools keep their per-unit prefetches: ON false, steps compiled away.)
template <bool ON>
struct Cursor {
  const char* rows[2 * W];
  int64_t nrows = 0, lines = 0;  // rows, lines a row
  int64_t r = 0, l = 0;  // the next line: row r, line l
  inline void step() {
    if (ON && r < nrows) {
      _mm_prefetch(rows[r] + l * 64, PLAIT_STREAM_HINT);
      if (++l == lines) l = 0, r++;
    }
  }
  inline void finish() {
    while (ON && r < nrows) step();
  }
};

template <typename KV>
using KVCursor = Cursor<std::is_same_v<KV, float>>;

struct Shape {
  int64_t H, R, D, nvec, tail, Dp;  // Dp = nvec * W, the padded row length of scratch rows
};

// o[r] = o[r] * alpha[r] + sum over the block's nt tokens of p[r][t] * v[t], for RB rows and
// NV vectors of the row from element d0 (with TAIL, the last of them `tail` long: it ends
// the row); o's rows are Dp floats apart, p's W. The RB * NV accumulators, RB broadcast
// probabilities and one V vector must fit the register file (AVX2: 16): a tile that did not
// (4 x 4, or 3 x 4 with all four V vectors held) kept its accumulators on the stack and ran
// each token through a store-to-load round trip, ~2.5x slower (kVRows/kVVecs below).
template <typename KV, int RB, int NV, bool TAIL>
void v_block(const KV* const* vrows, int64_t nt, const float* p, const float* alpha,
             int64_t d0, int64_t tail, float* o, int64_t o_stride, KVCursor<KV>& pf) {
  vec acc[RB][NV];
  for (int r = 0; r < RB; r++) {
    const vec a = vset1(alpha[r]);
    for (int j = 0; j < NV; j++) acc[r][j] = vmul(vload(o + r * o_stride + d0 + j * W), a);
  }
  for (int64_t t = 0; t < nt; t++) {
    const KV* v = vrows[t] + d0;
    for (int i = 0; i < 4; i++) pf.step();
    vec pr[RB];
    for (int r = 0; r < RB; r++) pr[r] = vset1(p[r * W + t]);
    for (int j = 0; j < NV; j++) {
      const vec vv = (TAIL && j == NV - 1) ? vload_n(v + j * W, tail) : vload(v + j * W);
      for (int r = 0; r < RB; r++) acc[r][j] = vfma(pr[r], vv, acc[r][j]);
    }
  }
  for (int r = 0; r < RB; r++)
    for (int j = 0; j < NV; j++) vstore(o + r * o_stride + d0 + j * W, acc[r][j]);
}

template <typename KV>
using VBlockFn = void (*)(const KV* const*, int64_t, const float*, const float*, int64_t,
                          int64_t, float*, int64_t, KVCursor<KV>&);

#if defined(__AVX512F__)
constexpr int64_t kVRows = 4, kVVecs = 4;  // 16 accumulators of 32 registers
#else
constexpr int64_t kVRows = 3, kVVecs = 4;  // 12 accumulators + 3 broadcasts + 1 V vector = 16
#endif

template <typename KV, int RB, int NV>
VBlockFn<KV> v_block_tail(bool tail) {
  return tail ? v_block<KV, RB, NV, true> : v_block<KV, RB, NV, false>;
}

template <typename KV, int RB>
VBlockFn<KV> v_block_for(int64_t nv, bool tail) {
  switch (nv) {
    case 1: return v_block_tail<KV, RB, 1>(tail);
    case 2: return v_block_tail<KV, RB, 2>(tail);
    case 3: return v_block_tail<KV, RB, 3>(tail);
    default: return v_block_tail<KV, RB, 4>(tail);
  }
}

// rb <= kVRows rows, nv <= kVVecs vectors
template <typename KV>
VBlockFn<KV> v_block_fn(int64_t rb, int64_t nv, bool tail) {
  switch (rb) {
    case 1: return v_block_for<KV, 1>(nv, tail);
    case 2: return v_block_for<KV, 2>(nv, tail);
    case 3: return v_block_for<KV, 3>(nv, tail);
    default: return v_block_for<KV, kVRows>(nv, tail);
  }
}

// the W scores s[t] = q . k_t of one query row against a block of W key rows (D elements each)
template <typename KV>
inline vec score_block(const float* q, const KV* const* krow, const Shape& sh,
                       KVCursor<KV>& pf) {
  vec acc[W];
  for (int64_t t = 0; t < W; t++) acc[t] = vzero();
  for (int64_t j = 0; j < sh.nvec - 1; j++) {
    const vec qv = vload(q + j * W);
    for (int64_t t = 0; t < W; t++) {
      acc[t] = vfma(qv, vload(krow[t] + j * W), acc[t]);
      if (!(t & 1)) pf.step();
    }
  }
  const int64_t j = sh.nvec - 1;
  const vec qv = vload(q + j * W);
  if (sh.tail == W) {
    for (int64_t t = 0; t < W; t++) acc[t] = vfma(qv, vload(krow[t] + j * W), acc[t]);
  } else {  // the row's last vector is partial: read nothing past it
    for (int64_t t = 0; t < W; t++) acc[t] = vfma(qv, vload_n(krow[t] + j * W, sh.tail), acc[t]);
  }
  return vsum_each(acc);
}

// NR (1..8) query rows of qs ([NR, Dp] rows) against the transposed block kt [Dp, W]: s [NR, W].
// A row's multiply-adds over d form one dependency chain; fewer than 5 rows run two chains a
// row over alternate d (one chain a row left the FMA units idle 3 cycles in 4: a 4-row tail
// cost as much as 32 rows in full groups).
template <int NR>
inline void score_rows_tile(const float* q, const float* kt, const Shape& sh, float* s) {
  constexpr int C = NR <= 4 ? 2 : 1;  // chains per row (Dp is a whole number of vectors: even)
  vec acc[C][NR];
  for (int c = 0; c < C; c++)
    for (int i = 0; i < NR; i++) acc[c][i] = vzero();
  for (int64_t d = 0; d < sh.Dp; d += C)
    for (int c = 0; c < C; c++) {
      const vec k = vload(kt + (d + c) * W);
      for (int i = 0; i < NR; i++) acc[c][i] = vfma(vset1(q[i * sh.Dp + d + c]), k, acc[c][i]);
    }
  for (int i = 0; i < NR; i++) {
    vec a = acc[0][i];
    for (int c = 1; c < C; c++) a = vadd(a, acc[c][i]);
    vstore(s + i * W, a);
  }
}

// Many query rows against one block (a shared prefix's n members x G heads): the block's K
// rows transposed once into kt [Dp, W], then scores s[r] = sum_d q[r, d] kt[d] as a small
// GEMM, 8 rows at a time (no horizontal sums). qs: [R, Dp] of one kv head; s: [R, W].
template <typename KV>
void score_rows_gemm(const float* qs, int64_t R, const KV* const* kh, const Shape& sh,
                     float* kt, float* s) {
  for (int64_t t = 0; t < W; t++)
    for (int64_t d = 0; d < sh.D; d++) kt[d * W + t] = to_float(kh[t][d]);
  for (int64_t d = sh.D; d < sh.Dp; d++)
    for (int64_t t = 0; t < W; t++) kt[d * W + t] = 0.0f;
  int64_t r0 = 0;
  for (; r0 + 8 <= R; r0 += 8) score_rows_tile<8>(qs + r0 * sh.Dp, kt, sh, s + r0 * W);
  const float* q = qs + r0 * sh.Dp;
  float* sr = s + r0 * W;
  switch (R - r0) {
    case 1: return score_rows_tile<1>(q, kt, sh, sr);
    case 2: return score_rows_tile<2>(q, kt, sh, sr);
    case 3: return score_rows_tile<3>(q, kt, sh, sr);
    case 4: return score_rows_tile<4>(q, kt, sh, sr);
    case 5: return score_rows_tile<5>(q, kt, sh, sr);
    case 6: return score_rows_tile<6>(q, kt, sh, sr);
    case 7: return score_rows_tile<7>(q, kt, sh, sr);
    default: return;
  }
}

// query rows per kv head from which score_rows_gemm pays for its transposition (measured:
// 0.5x at 3 rows, even at 24, 1.13x at 48, 1.22x at 192, where the whole prefix call then
// runs at this core's FMA peak)
constexpr int64_t GEMM_ROWS = 24;

// Scratch of one thread: block probabilities [H*R, W], running max / sum / rescale [H*R],
// accumulators [H*R, Dp]; for many rows, one head's block scores [R, W] and K^T [Dp, W]; with
// the rows in the lanes over a bf16 pool, the block's K and V rows widened [2, LANE_BLOCK, Dp]
struct Scratch {
  std::vector<float> p, m, l, alpha, o, s, kt, kv;
};

// Many query rows per kv head (from LANES_ROWS): the rows go in the vector lanes instead, each
// row vector W rows. Scores of a key are a broadcast of each K element times the rows' q
// vectors (qT, the rows transposed once per call), the online softmax's max, rescale and sum
// are elementwise over row vectors (no horizontal reductions, no K transposition), and the V
// pass broadcasts each V element into the rows' probability vectors; the accumulators are oT
// [D, rows]. Per key and row vector, D multiply-adds for the score and D for V, four of each
// per broadcast or load (score_rows_gemm: one K vector per 8 broadcast q elements, a
// transposition per block, and per-row softmax reductions).
constexpr int64_t LANE_BLOCK = 32;  // keys per online-softmax block
#if defined(__AVX512F__)
constexpr int kLaneKeys = 4, kLaneVecs = 5, kLaneDims = 4;  // 20 accumulators of 32 registers
#else
constexpr int kLaneKeys = 2, kLaneVecs = 4, kLaneDims = 2;  // 8 accumulators of 16
#endif
// from this many query rows per kv head. One shared prefix's call on SmolLM2's shapes (2
// threads, each of 30 layers' KV in turn), against the row-by-row kernel: 48 rows over 550
// keys 1.43x, 72 1.36x, 96 over 500 1.34x, 192 over 1000 (judge) 1.29x; 33-36 rows even
// (a third row vector mostly empty); 24 rows 0.94x (two vectors, one half empty), so not below
constexpr int64_t LANES_ROWS = 32;
// keys per task with the rows in the lanes: each task sets up its accumulators and writes
// them out transposed, so longer than CHUNK (1.04-1.13x at 36-192 rows)
constexpr int64_t LANE_CHUNK = 512;

// floats per row of qT / oT: R rows padded to whole row vectors
inline int64_t lane_width(int64_t R) { return (R + W - 1) / W * W; }

// s[t][v] = sum_d qT[d][v] k_t[d] for KT keys and NV row vectors from v0 (rows RVW floats).
// (This and the three below are inlined into attend_chunk_lanes as before it had a bf16 twin:
// left to the compiler, they became calls from both, and the fp32 lanes ran ~4% slower.)
template <int KT, int NV>
[[gnu::always_inline]] inline void lane_scores(const float* qT, int64_t RVW,
                                               const float* const* krow, int64_t D, int64_t v0,
                                               float* s) {
  vec acc[KT][NV];
  for (int i = 0; i < KT; i++)
    for (int j = 0; j < NV; j++) acc[i][j] = vzero();
  const float* q = qT + v0 * W;
  for (int64_t d = 0; d < D; d++) {
    vec qv[NV];
    for (int j = 0; j < NV; j++) qv[j] = vload(q + d * RVW + j * W);
    for (int i = 0; i < KT; i++) {
      const vec kb = vset1(krow[i][d]);
      for (int j = 0; j < NV; j++) acc[i][j] = vfma(kb, qv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < KT; i++)
    for (int j = 0; j < NV; j++) vstore(s + i * RVW + (v0 + j) * W, acc[i][j]);
}

// oT[d][v] = oT[d][v] alpha[v] + sum_t<nt p[t][v] v_t[d] for DT dims from d0, NV row vectors
template <int DT, int NV>
[[gnu::always_inline]] inline void lane_values(float* oT, int64_t RVW, const float* p,
                                               const float* alpha, const float* const* vrow,
                                               int64_t nt, int64_t d0, int64_t v0) {
  vec acc[DT][NV];
  for (int j = 0; j < NV; j++) {
    const vec a = vload(alpha + (v0 + j) * W);
    for (int i = 0; i < DT; i++) acc[i][j] = vmul(vload(oT + (d0 + i) * RVW + (v0 + j) * W), a);
  }
  for (int64_t t = 0; t < nt; t++) {
    vec pv[NV];
    for (int j = 0; j < NV; j++) pv[j] = vload(p + t * RVW + (v0 + j) * W);
    for (int i = 0; i < DT; i++) {
      const vec vb = vset1(vrow[t][d0 + i]);
      for (int j = 0; j < NV; j++) acc[i][j] = vfma(vb, pv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < DT; i++)
    for (int j = 0; j < NV; j++) vstore(oT + (d0 + i) * RVW + (v0 + j) * W, acc[i][j]);
}

template <int NV>
[[gnu::always_inline]] inline void lane_scores_n(int64_t nv, const float* qT, int64_t RVW,
                                                 const float* const* krow, int64_t D, int64_t v0,
                                                 float* s) {
  if constexpr (NV > 1) {
    if (nv < NV) return lane_scores_n<NV - 1>(nv, qT, RVW, krow, D, v0, s);
  }
  lane_scores<kLaneKeys, NV>(qT, RVW, krow, D, v0, s);
}

template <int NV>
[[gnu::always_inline]] inline void lane_values_n(int64_t nv, float* oT, int64_t RVW,
                                                 const float* p, const float* alpha,
                                                 const float* const* vrow, int64_t nt, int64_t d0,
                                                 int64_t v0) {
  if constexpr (NV > 1) {
    if (nv < NV) return lane_values_n<NV - 1>(nv, oT, RVW, p, alpha, vrow, nt, d0, v0);
  }
  lane_values<kLaneDims, NV>(oT, RVW, p, alpha, vrow, nt, d0, v0);
}

// a bf16 pool row (sh.D elements) as floats at dst (sh.Dp: zeros after D)
inline void widen_row(const at::BFloat16* src, const Shape& sh, float* dst) {
  for (int64_t j = 0; j < sh.nvec; j++)
    vstore(dst + j * W, j == sh.nvec - 1 && sh.tail < W ? vload_n(src + j * W, sh.tail)
                                                         : vload(src + j * W));
}

// attend_chunk's contract (below) with the rows in the lanes, for row vectors [va, vb) (rows
// va W .. vb W - 1, those below R) only; qT: the query rows transposed (lane_queries),
// [H, D, RVW]. A bf16 pool's rows are widened once a block: the lanes broadcast each element
// into several row vectors, and widening it at each broadcast (a shift and a move to a vector
// register, on a port the multiply-adds use) cost ~10% at 192 rows on the Intel Xeon VM
template <typename KV>
void attend_chunk_lanes(const float* qT_all, const Shape& sh, int64_t va, int64_t vb,
                        const KV* kbuf, const KV* vbuf, int64_t row, const int64_t* slots,
                        int64_t n, float* o_out, float* lse, Scratch& sc) {
  const int64_t H = sh.H, R = sh.R, D = sh.D, RVW = lane_width(R);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  sc.s.resize(LANE_BLOCK * RVW);
  sc.alpha.resize(RVW);
  float* s = sc.s.data();
  float* alpha = sc.alpha.data();
  if constexpr (!std::is_same_v<KV, float>) sc.kv.resize(2 * LANE_BLOCK * sh.Dp);
  for (int64_t h = 0; h < H; h++) {
    const float* qT = qT_all + h * D * RVW;
    sc.o.assign(D * RVW, 0.0f);
    sc.m.assign(RVW, neg_inf);
    sc.l.assign(RVW, 0.0f);
    float* oT = sc.o.data();
    for (int64_t t0 = 0; t0 < n; t0 += LANE_BLOCK) {
      const int64_t nt = std::min(LANE_BLOCK, n - t0);
      const float* krow[LANE_BLOCK];
      const float* vrow[LANE_BLOCK];
      for (int64_t t = 0; t < LANE_BLOCK; t++) {  // past the end: the last row again (unused)
        const int64_t last = std::min(t, nt - 1);
        const KV* k = kbuf + slots[t0 + last] * row + h * D;
        const KV* v = vbuf + slots[t0 + last] * row + h * D;
        if constexpr (std::is_same_v<KV, float>) {
          krow[t] = k, vrow[t] = v;
        } else {  // (past the end: row nt - 1's copy)
          float* kf = sc.kv.data() + last * sh.Dp;
          float* vf = kf + LANE_BLOCK * sh.Dp;
          if (t < nt) widen_row(k, sh, kf), widen_row(v, sh, vf);
          krow[t] = kf, vrow[t] = vf;
        }
      }
      for (int64_t t = t0 + LANE_BLOCK; t < std::min(t0 + 2 * LANE_BLOCK, n); t++) {
        prefetch_row(kbuf + slots[t] * row + h * D, D);
        prefetch_row(vbuf + slots[t] * row + h * D, D);
      }
      for (int64_t k0 = 0; k0 < nt; k0 += kLaneKeys)
        for (int64_t v0 = va; v0 < vb; v0 += kLaneVecs)
          lane_scores_n<kLaneVecs>(std::min<int64_t>(kLaneVecs, vb - v0), qT, RVW, krow + k0, D,
                                   v0, s + k0 * RVW);
      for (int64_t v = va; v < vb; v++) {
        vec bm = vload(s + v * W);
        for (int64_t t = 1; t < nt; t++) bm = vmax(bm, vload(s + t * RVW + v * W));
        const vec m_old = vload(sc.m.data() + v * W);
        const vec m_new = vmax(m_old, bm);
        const vec a = vexp(vsub(m_old, m_new));  // (the first block: exp(-inf), 0)
        vstore(alpha + v * W, a);
        vstore(sc.m.data() + v * W, m_new);
        vec sum = vmul(vload(sc.l.data() + v * W), a);
        for (int64_t t = 0; t < nt; t++) {
          const vec pv = vexp(vsub(vload(s + t * RVW + v * W), m_new));
          vstore(s + t * RVW + v * W, pv);
          sum = vadd(sum, pv);
        }
        vstore(sc.l.data() + v * W, sum);
      }
      for (int64_t d0 = 0; d0 < D; d0 += kLaneDims)
        for (int64_t v0 = va; v0 < vb; v0 += kLaneVecs)
          lane_values_n<kLaneVecs>(std::min<int64_t>(kLaneVecs, vb - v0), oT, RVW, s, alpha, vrow,
                                   nt, d0, v0);
    }
    for (int64_t r = va * W; r < std::min(R, vb * W); r++) {
      const float inv = 1.0f / sc.l[r];
      for (int64_t d = 0; d < D; d++) o_out[(h * R + r) * D + d] = oT[d * RVW + r] * inv;
      lse[h * R + r] = sc.m[r] + std::log(sc.l[r]);
    }
  }
}

// q [N, R, D] (N = sequences x kv heads) -> qT [N, D, RVW], scaled: each head's rows in the
// lanes, padding rows 0 (once per call: a sequence's chunks share them)
std::vector<float> lane_queries(const float* q, float scale, int64_t N, int64_t R, int64_t D) {
  const int64_t RVW = lane_width(R);
  std::vector<float> qT(N * D * RVW, 0.0f);
  for (int64_t i = 0; i < N; i++)
    for (int64_t r = 0; r < R; r++)
      for (int64_t d = 0; d < D; d++) qT[(i * D + d) * RVW + r] = q[(i * R + r) * D + d] * scale;
  return qT;
}

// One task: the KV rows slots[0:n) of one sequence, sh.H kv heads (all, or a run of them: kbuf
// and vbuf then point at the run's first head in the pool rows, `row` elements apart), one pass
// over blocks of W tokens with an online softmax. qs: [H, R, Dp] query rows, pre-scaled,
// zero-padded. Writes o_out [H, R, D] (normalized) and lse [H, R].
template <typename KV>
void attend_chunk(const float* qs, const Shape& sh, const KV* kbuf, const KV* vbuf,
                  int64_t row, const int64_t* slots, int64_t n, float* o_out, float* lse,
                  Scratch& sc) {
  const int64_t H = sh.H, R = sh.R, D = sh.D, Dp = sh.Dp, HR = H * R;
  const int64_t span = H * D;  // elements of each pool row this task reads
  const int64_t row_blocks = (R + kVRows - 1) / kVRows;  // V-pass units of work per kv head
  const float neg_inf = -std::numeric_limits<float>::infinity();
  sc.p.resize(HR * W);
  sc.m.assign(HR, neg_inf);
  sc.l.assign(HR, 0.0f);
  sc.alpha.resize(HR);
  sc.o.assign(HR * Dp, 0.0f);
  float* p = sc.p.data();
  float* o = sc.o.data();
  const bool gemm = R >= GEMM_ROWS;
  if (gemm) {
    sc.s.resize(R * W);
    sc.kt.resize(Dp * W);
  }
  constexpr bool kCursor = std::is_same_v<KV, float>;
  alignas(64) float lane[W];
  // the lines of a pool row's span (rows start on a line where the pool, the run's first head
  // and the row length are line-aligned: then no line beyond the span)
  const int64_t span_bytes = span * int64_t(sizeof(KV));
  const bool aligned = ((reinterpret_cast<uintptr_t>(kbuf) | reinterpret_cast<uintptr_t>(vbuf) |
                         uintptr_t(row * int64_t(sizeof(KV))) | uintptr_t(span_bytes)) & 63) == 0;
  const int64_t row_lines = span_bytes / 64 + (aligned ? 0 : 1);
  for (int64_t t = 0; t < std::min(PREFETCH_AHEAD, n); t++) {
    prefetch_row(kbuf + slots[t] * row, span);
    prefetch_row(vbuf + slots[t] * row, span);
  }
  for (int64_t t0 = 0; t0 < n; t0 += W) {
    const int64_t nt = std::min(W, n - t0);
    // tokens [pf0, pf1): fp32 pools prefetch their K rows, then their V rows, a line at a time
    // from inside the block's arithmetic (Cursor); bf16 pools (half the lines a token) a few
    // rows per score unit (one query row) and V-pass unit (up to 4 query rows), which measured
    // faster for them (see the header)
    const int64_t pf0 = t0 + PREFETCH_AHEAD, pf1 = std::min(pf0 + W, n);
    KVCursor<KV> pf;
    pf.lines = row_lines;
    for (int64_t t = pf0; kCursor && t < pf1; t++) {
      pf.rows[pf.nrows] = reinterpret_cast<const char*>(
          reinterpret_cast<uintptr_t>(kbuf + slots[t] * row) & ~uintptr_t(63));
      pf.rows[pf.nrows + pf1 - pf0] = reinterpret_cast<const char*>(
          reinterpret_cast<uintptr_t>(vbuf + slots[t] * row) & ~uintptr_t(63));
      pf.nrows++;
    }
    pf.nrows *= 2;
    const KV* krow[W];
    const KV* vrow[W];
    for (int64_t t = 0; t < W; t++) {  // past the end: the last row again (probability 0)
      const int64_t slot = slots[t0 + std::min(t, nt - 1)];
      krow[t] = kbuf + slot * row;
      vrow[t] = vbuf + slot * row;
    }
    for (int64_t t = 0; t < W; t++) lane[t] = t < nt ? 1.0f : 0.0f;
    const vec valid = vload(lane);
    // scores of the block, then the online softmax: new max, rescale factor, probabilities
    for (int64_t h = 0; h < H; h++) {
      const KV* kh[W];
      for (int64_t t = 0; t < W; t++) kh[t] = krow[t] + h * D;
      if (gemm) score_rows_gemm(qs + h * R * Dp, R, kh, sh, sc.kt.data(), sc.s.data());
      for (int64_t r = 0; r < R; r++) {
        const int64_t hr = h * R + r;
        if constexpr (!kCursor)
          for (int64_t t = pf0 + hr; t < pf1; t += HR) prefetch_row(kbuf + slots[t] * row, span);
        const vec sv = gemm ? vload(sc.s.data() + r * W) : score_block(qs + hr * Dp, kh, sh, pf);
        // lanes past nt repeat the last row's score: the max is the block's
        const float m_new = std::max(sc.m[hr], vhmax(sv));
        // 0 on the first block; 1 (no exp) while the max stands, as it mostly does
        sc.alpha[hr] = m_new == sc.m[hr] ? 1.0f : std::exp(sc.m[hr] - m_new);
        sc.m[hr] = m_new;
        const vec pv = vmul(vexp(vsub(sv, vset1(m_new))), valid);
        sc.l[hr] = sc.l[hr] * sc.alpha[hr] + vsum(pv);
        vstore(p + hr * W, pv);
      }
    }
    // o = o * alpha + p . V, register-blocked: up to kVRows rows x kVVecs vectors at a time
    for (int64_t h = 0; h < H; h++) {
      const KV* vh[W];
      for (int64_t t = 0; t < W; t++) vh[t] = vrow[t] + h * D;
      for (int64_t r0 = 0; r0 < R; r0 += kVRows) {
        const int64_t rb = std::min<int64_t>(kVRows, R - r0);
        const int64_t hr = h * R + r0;
        if constexpr (!kCursor)
          for (int64_t t = pf0 + h * row_blocks + r0 / kVRows; t < pf1; t += H * row_blocks)
            prefetch_row(vbuf + slots[t] * row, span);
        for (int64_t j0 = 0; j0 < sh.nvec; j0 += kVVecs) {
          const int64_t nv = std::min<int64_t>(kVVecs, sh.nvec - j0);
          const bool tail = j0 + nv == sh.nvec && sh.tail < W;
          v_block_fn<KV>(rb, nv, tail)(vh, nt, p + hr * W, sc.alpha.data() + hr, j0 * W, sh.tail,
                                   o + hr * Dp, Dp, pf);
        }
      }
    }
    pf.finish();
  }
  for (int64_t hr = 0; hr < HR; hr++) {
    const float inv = 1.0f / sc.l[hr];
    for (int64_t d = 0; d < D; d++) o_out[hr * D + d] = o[hr * Dp + d] * inv;
    lse[hr] = sc.m[hr] + std::log(sc.l[hr]);
  }
}

struct Task {
  int64_t b, start, len, part;  // part: index into the partial buffers, -1 = whole sequence
  int64_t h0 = 0, h1 = 0;  // kv heads [h0, h1) (set by decode_attention)
  int64_t v0 = 0, v1 = 0;  // with the rows in the lanes: row vectors [v0, v1)
};

// Split sequences into chunks of about CHUNK keys. The split depends on the sequence's own
// length only, never on the thread count or the rest of the batch: the scheduler changes its
// thread count with the host's load (plait/runtime/thread_tuner.py), and a split that followed
// it changed the rounding of the merge and so, rarely, a greedy token.
std::vector<Task> plan_tasks(const int64_t* lens, int64_t B, std::vector<int64_t>& parts_of,
                             int64_t target) {
  std::vector<Task> tasks;
  parts_of.assign(B + 1, 0);
  int64_t part = 0;
  for (int64_t b = 0; b < B; b++) {
    const int64_t L = lens[b];
    const int64_t chunks = std::max<int64_t>(1, (L + target - 1) / target);
    const int64_t size = (L + chunks - 1) / chunks;
    parts_of[b] = part;
    for (int64_t c = 0; c < chunks; c++) {
      const int64_t start = c * size;
      const int64_t len = std::min(size, L - start);
      if (len <= 0) break;
      tasks.push_back({b, start, len, chunks == 1 ? -1 : part++});
    }
  }
  parts_of[B] = part;
  return tasks;
}

}  // namespace

// q [B, Hkv, R, D] float32; k_buffer, v_buffer [S, Hkv, D] (one layer of the pool), both float32
// or both bfloat16; slots [B, W] int64 (row b's first lens[b] entries are its KV slots); lens [B]
// int64.
std::vector<at::Tensor> decode_attention(at::Tensor q, at::Tensor k_buffer, at::Tensor v_buffer,
                                         at::Tensor slots, at::Tensor lens, double scale) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kFloat, "q: [B, Hkv, R, D] float32");
  const auto kv_type = k_buffer.scalar_type();
  TORCH_CHECK(v_buffer.scalar_type() == kv_type, "K/V buffers: one dtype (K ", kv_type, ", V ",
              v_buffer.scalar_type(), ")");
  TORCH_CHECK(kv_type == at::kFloat || kv_type == at::kBFloat16,
              "K/V buffers: float32 or bfloat16, not ", kv_type);
  TORCH_CHECK(k_buffer.is_contiguous() && v_buffer.is_contiguous(), "K/V buffers: contiguous");
  TORCH_CHECK(k_buffer.sizes() == v_buffer.sizes(), "K/V buffers: same shape");
  TORCH_CHECK(slots.scalar_type() == at::kLong && lens.scalar_type() == at::kLong,
              "slots, lens: int64");
  q = q.contiguous();
  slots = slots.contiguous();
  lens = lens.contiguous();
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), D = q.size(3);
  TORCH_CHECK(D % 8 == 0 && D > 0 && D <= 512, "head_dim must be a multiple of 8, at most 512");
  TORCH_CHECK(k_buffer.dim() == 3 && k_buffer.size(1) == H && k_buffer.size(2) == D,
              "K buffer shape");
  TORCH_CHECK(slots.dim() == 2 && slots.size(0) == B && lens.size(0) == B, "slots/lens batch");
  const int64_t Wd = slots.size(1);
  const int64_t S = k_buffer.size(0);
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; b++) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= Wd, "lens out of range");
    for (int64_t l = 0; l < lp[b]; l++)
      TORCH_CHECK(sp[b * Wd + l] >= 0 && sp[b * Wd + l] < S, "slot out of range");
  }
  Shape sh;
  sh.H = H, sh.R = R, sh.D = D;
  sh.nvec = (D + W - 1) / W;
  sh.tail = D - (sh.nvec - 1) * W;
  sh.Dp = sh.nvec * W;
  const bool lanes = R >= LANES_ROWS;
  // query rows pre-scaled: zero-padded to whole vectors [B, H, R, Dp], or in the lanes
  const float sc = static_cast<float>(scale);
  const float* qp = q.data_ptr<float>();
  std::vector<float> qs, qT;
  if (lanes) {
    qT = lane_queries(qp, sc, B * H, R, D);
  } else {
    qs.assign(B * H * R * sh.Dp, 0.0f);
    for (int64_t i = 0; i < B * H * R; i++)
      for (int64_t d = 0; d < D; d++) qs[i * sh.Dp + d] = qp[i * D + d] * sc;
  }

  auto out = at::empty_like(q);
  auto lse = at::empty({B, H, R}, q.options());
  float* op = out.data_ptr<float>();
  float* lsep = lse.data_ptr<float>();
  const int64_t threads = at::get_num_threads();
  std::vector<int64_t> parts_of;
  // the lanes' chunks are longer: each sets up its accumulators and writes them out transposed
  const std::vector<Task> tasks = plan_tasks(lp, B, parts_of, lanes ? LANE_CHUNK : CHUNK);
  const int64_t nparts = parts_of[B];
  const int64_t per_seq = H * R * D;
  std::vector<float> part_out(nparts * per_seq), part_lse(nparts * H * R);
  // Fewer tasks than threads (batch 1: one, while its keys fit a chunk): each task's kv heads
  // split into runs, one task each. The heads' rows are independent, so this changes no
  // result (unlike a finer split of the keys, whose merge rounds differently). Tasks of many
  // rows (a shared prefix's call: its members' rows together) split into single heads always,
  // and with the rows in the lanes into runs of row vectors too while there are fewer than two
  // items a thread (a 500-token prefix of 64 rows a head: 3 items for 2 threads, one idle a
  // third of the call)
  std::vector<Task> work_items;
  const int64_t head_parts =
      R >= GEMM_ROWS || lanes
          ? H
          : std::min<int64_t>(H, (threads + tasks.size() - 1) / tasks.size());
  const int64_t RV = (R + W - 1) / W;
  const int64_t items = int64_t(tasks.size()) * head_parts;
  // (a part of one row vector is broadcast-bound: 4 multiply-adds a broadcast K element)
  const int64_t row_parts =
      lanes ? std::max<int64_t>(1, std::min(RV / 2, (2 * threads + items - 1) / items)) : 1;
  for (Task t : tasks)
    for (int64_t i = 0; i < head_parts; i++)
      for (int64_t j = 0; j < row_parts; j++) {
        t.h0 = H * i / head_parts, t.h1 = H * (i + 1) / head_parts;
        t.v0 = RV * j / row_parts, t.v1 = RV * (j + 1) / row_parts;
        work_items.push_back(t);
      }
  // the work items over the pool's elements (kp, vp: const float* or const at::BFloat16*)
  auto attend = [&](const auto* kp, const auto* vp) {
    std::atomic<int64_t> next{0};
    auto work = [&](int64_t, int64_t) {
      Scratch scratch;
      for (int64_t i = next.fetch_add(1); i < int64_t(work_items.size());
           i = next.fetch_add(1)) {
        const Task& t = work_items[i];
        float* o = t.part < 0 ? op + t.b * per_seq : part_out.data() + t.part * per_seq;
        float* l = t.part < 0 ? lsep + t.b * H * R : part_lse.data() + t.part * H * R;
        Shape run = sh;
        run.H = t.h1 - t.h0;
        if (lanes)
          attend_chunk_lanes(qT.data() + (t.b * H + t.h0) * D * lane_width(R), run, t.v0, t.v1,
                             kp + t.h0 * D, vp + t.h0 * D, H * D, sp + t.b * Wd + t.start,
                             t.len, o + t.h0 * R * D, l + t.h0 * R, scratch);
        else
          attend_chunk(qs.data() + (t.b * H + t.h0) * R * sh.Dp, run, kp + t.h0 * D,
                       vp + t.h0 * D, H * D, sp + t.b * Wd + t.start, t.len, o + t.h0 * R * D,
                       l + t.h0 * R, scratch);
      }
    };
    if (work_items.size() > 1 && threads > 1)
      at::parallel_for(0, threads, 1, work);
    else
      work(0, 1);
  };
  if (kv_type == at::kBFloat16)
    attend(k_buffer.data_ptr<at::BFloat16>(), v_buffer.data_ptr<at::BFloat16>());
  else
    attend(k_buffer.data_ptr<float>(), v_buffer.data_ptr<float>());
  // merge the chunks of split sequences by their log-sum-exps
  for (int64_t b = 0; b < B; b++) {
    const int64_t p0 = parts_of[b], p1 = parts_of[b + 1];
    if (p1 == p0) continue;
    for (int64_t hr = 0; hr < H * R; hr++) {
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t p = p0; p < p1; p++) m = std::max(m, part_lse[p * H * R + hr]);
      float total = 0.0f;
      for (int64_t p = p0; p < p1; p++) total += std::exp(part_lse[p * H * R + hr] - m);
      float* o = op + b * per_seq + hr * D;
      std::fill(o, o + D, 0.0f);
      for (int64_t p = p0; p < p1; p++) {
        const float w = std::exp(part_lse[p * H * R + hr] - m) / total;
        const float* po = part_out.data() + p * per_seq + hr * D;
        for (int64_t d = 0; d < D; d++) o[d] += w * po[d];
      }
      lsep[b * H * R + hr] = m + std::log(total);
    }
  }
  return {out, lse};
}

// A shared prefix's partial result merged into its members' (in place): member i's query row
// (h, g) is row i * G + g of the prefix call's kv head h. out [B, H, G, D], lse [B, H, G];
// p_out [1, H, n * G, D], p_lse [1, H, n * G] (decode_attention over the prefix's slots).
void merge_prefix(at::Tensor out, at::Tensor lse, at::Tensor members, at::Tensor p_out,
                  at::Tensor p_lse) {
  TORCH_CHECK(out.is_contiguous() && lse.is_contiguous() && p_out.is_contiguous() &&
                  p_lse.is_contiguous() && members.is_contiguous(),
              "merge_prefix: contiguous tensors");
  TORCH_CHECK(out.scalar_type() == at::kFloat && p_out.scalar_type() == at::kFloat &&
                  lse.scalar_type() == at::kFloat && p_lse.scalar_type() == at::kFloat &&
                  members.scalar_type() == at::kLong,
              "merge_prefix: float32 results, int64 members");
  const int64_t B = out.size(0), H = out.size(1), G = out.size(2), D = out.size(3);
  const int64_t n = members.size(0);
  TORCH_CHECK(p_out.dim() == 4 && p_out.size(0) == 1 && p_out.size(1) == H &&
                  p_out.size(2) == n * G && p_out.size(3) == D && p_lse.numel() == H * n * G,
              "merge_prefix: shapes");
  const int64_t* mp = members.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  const float* pop = p_out.data_ptr<float>();
  const float* plp = p_lse.data_ptr<float>();
  for (int64_t i = 0; i < n; i++) {
    TORCH_CHECK(mp[i] >= 0 && mp[i] < B, "merge_prefix: member out of range");
    for (int64_t h = 0; h < H; h++)
      for (int64_t g = 0; g < G; g++) {
        const int64_t r = (mp[i] * H + h) * G + g, pr = h * n * G + i * G + g;
        const float m = std::max(lp[r], plp[pr]);
        const float ws = std::exp(lp[r] - m), wp = std::exp(plp[pr] - m);
        const float inv = 1.0f / (ws + wp);
        float* o = op + r * D;
        const float* po = pop + pr * D;
        for (int64_t d = 0; d < D; d++) o[d] = (o[d] * ws + po[d] * wp) * inv;
        lp[r] = m + std::log(ws + wp);
      }
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("merge_prefix", &merge_prefix,
        "merge a shared prefix's (out, lse) into its members' rows of (out, lse), in place");
  m.def("decode_attention", &decode_attention,
        "q [B, Hkv, R, D] over the pool rows slots[b, :lens[b]] -> (out, lse)");
  // (address, signature) for fused_cpu.cpp's DecodeLayers, which calls them directly
  m.def("entry_points", []() {
    py::dict d;
    d["decode_attention"] = std::make_pair(
        reinterpret_cast<int64_t>(&decode_attention),
        std::string("Tensor[](Tensor q, Tensor k_buffer, Tensor v_buffer, Tensor slots, "
                    "Tensor lens, float scale)"));
    d["merge_prefix"] = std::make_pair(
        reinterpret_cast<int64_t>(&merge_prefix),
        std::string("(Tensor out, Tensor lse, Tensor members, Tensor p_out, Tensor p_lse)"));
    return d;
  });
#if defined(__AVX512F__)
  m.attr("isa") = "avx512";
#else
  m.attr("isa") = "avx2";
#endif
}

// Extend (prefill) attention over the KV pool for the CPU, reading K/V rows in place.
//
// The torch path copies every request's whole KV (cached prefix + new rows) out of the pool
// with index_select, for every layer, and runs one scaled_dot_product_attention per request
// (an explicit [E, S] mask when a prefix is cached). torch's CPU flash kernel does its block
// GEMMs through MKL, which runs its AVX2 code on AMD CPUs: about half of what the oneDNN
// linears of the same forward reach. Here one call per layer attends every request:
//
// * a task is (request, kv head, tile of query positions): the tile's rows are its positions
//   times the G query heads of that kv head (grouped-query attention reads each K/V row once
//   for all G heads); tasks are handed out dynamically, most expensive first;
// * scores are computed transposed, S^T[key, row] = k . q: key rows are read in place through
//   the request's slot list (no gather, no repacking), the tile's queries are packed once,
//   transposed and pre-scaled; the softmax then runs down the columns of S^T, so its max and
//   sum are plain vector ops across query rows (no horizontal reductions);
// * keys come in blocks with an online softmax (flash attention), the causal limit (row at
//   position p sees keys 0..p) applied only on the blocks that cross it; O += P V reads the
//   value rows in place too.
//
// The pool may be fp32 or bf16 (`--kv-cache-dtype bfloat16` for an fp32 model: half the KV
// bytes), q, the math and out fp32 either way. A bf16 block's K and V rows are widened to
// fp32 scratch as the block starts (exact: a bf16 is the top half of the fp32 it stands for),
// once per key, where widening in the GEMMs would redo it on every pass over the tile's rows;
// the GEMMs and the softmax then run the same fp32 code for both pools, in the same order, so
// a bf16 pool gives bitwise the result of an fp32 pool holding the same values.
//
// Register blocking for AVX-512 (W = 16 floats): S^T in 6 keys x 64 rows (24 accumulators),
// O in 6 rows x 64 dims; for AVX2 (W = 8) 6 x 16 and 6 x 16. The code is written with GCC
// vector extensions so one source serves both (the -m flags pick W).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

#if defined(__AVX512F__)
constexpr int W = 16;   // floats per vector
constexpr int QK_V = 4; // S^T block: row vectors per pass
constexpr int PV_C = 4; // O block: head_dim vectors per pass
#else
constexpr int W = 8;
constexpr int QK_V = 2;
constexpr int PV_C = 2;
#endif
constexpr int QK_K = 6;    // S^T block: keys per pass
constexpr int PV_R = 6;    // O block: query rows per pass
constexpr int KB = 128;    // keys per online-softmax block
constexpr int TILE_ROWS = 192;  // most query rows per task (positions x G)

typedef float vf __attribute__((vector_size(W * 4)));
typedef float vfu __attribute__((vector_size(W * 4), aligned(4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));

inline vf load(const float* p) { return *reinterpret_cast<const vfu*>(p); }
inline void store(float* p, vf v) { *reinterpret_cast<vfu*>(p) = v; }
inline vf splat(float s) { return s - vf{}; }  // (0 + s would keep an add: -0 + 0 is +0)
// W bf16 (their bits) -> fp32: zero-extended and shifted into the top half. Intrinsics, as
// GCC 12 splits __builtin_convertvector's widening into halves and reinserts them
inline vf widen(const uint16_t* p) {
#if defined(__AVX512F__)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return (vf)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
#else
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (vf)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#endif
}

// 2^x for x <= 0 (scores minus their running max, in log2 units): 2^n * 2^r with n = x
// rounded, |r| <= 1/2, and 2^r = e^(r ln2) by a degree-6 Taylor polynomial (relative error
// ~1e-7, fp32's own rounding); exactly 0 below -126 (masked keys are -inf).
inline vf exp2_neg(vf x) {
  const vf lo = splat(-126.0f);
  const vi under = x < lo;
  const vf xc = under ? lo : x;
  const vi n = __builtin_convertvector(xc - 0.5f, vi);  // truncation: round-to-nearest for x <= 0
  const vf y = (xc - __builtin_convertvector(n, vf)) * 0.6931471805599453f;
  vf p = splat(1.0f / 720.0f);
  p = p * y + 1.0f / 120.0f;
  p = p * y + 1.0f / 24.0f;
  p = p * y + 1.0f / 6.0f;
  p = p * y + 0.5f;
  p = p * y + 1.0f;
  p = p * y + 1.0f;
  const vi bits = (n + 127) << 23;
  const vf r = p * (vf)bits;  // a bit cast: same size
  return under ? vf{} : r;
}

// S^T[n, r0 : r0 + V*W] = sum_d K[n, d] * QT[d, r0 : ...] for N keys (rows of the pool)
template <int N, int V>
inline void qk_block(const float* const* krow, const float* qt, int64_t mp, int64_t D,
                     float* st, int64_t r0) {
  vf acc[N][V];
  for (int i = 0; i < N; i++)
    for (int j = 0; j < V; j++) acc[i][j] = vf{};
  for (int64_t d = 0; d < D; d++) {
    vf q[V];
    for (int j = 0; j < V; j++) q[j] = load(qt + d * mp + r0 + j * W);
    for (int i = 0; i < N; i++) {
      const vf k = splat(krow[i][d]);
      for (int j = 0; j < V; j++) acc[i][j] += k * q[j];
    }
  }
  for (int i = 0; i < N; i++)
    for (int j = 0; j < V; j++) store(st + i * mp + r0 + j * W, acc[i][j]);
}

// S^T[0 : kn, r0 : r0 + V*W] for all the block's keys: the tile's query panel QT[:, r0 ...]
// stays in L1 while the key rows go by
template <int V>
inline void qk_cols(const float* const* krow, int64_t kn, const float* qt, int64_t mp,
                    int64_t D, float* st, int64_t r0) {
  int64_t n = 0;
  for (; n + QK_K <= kn; n += QK_K) qk_block<QK_K, V>(krow + n, qt, mp, D, st + n * mp, r0);
  switch (kn - n) {
    case 0: break;
    case 1: qk_block<1, V>(krow + n, qt, mp, D, st + n * mp, r0); break;
    case 2: qk_block<2, V>(krow + n, qt, mp, D, st + n * mp, r0); break;
    case 3: qk_block<3, V>(krow + n, qt, mp, D, st + n * mp, r0); break;
    case 4: qk_block<4, V>(krow + n, qt, mp, D, st + n * mp, r0); break;
    case 5: qk_block<5, V>(krow + n, qt, mp, D, st + n * mp, r0); break;
  }
}

// scores of keys [0, kn) of a block against every row of the tile: st [kn, mp]
void qk_tile(const float* const* krow, int64_t kn, const float* qt, int64_t mp, int64_t D,
             float* st) {
  const int64_t nv = mp / W;
  int64_t j = 0;
  for (; j + QK_V <= nv; j += QK_V) qk_cols<QK_V>(krow, kn, qt, mp, D, st, j * W);
  switch (nv - j) {
    case 0: break;
    case 1: qk_cols<1>(krow, kn, qt, mp, D, st, j * W); break;
#if defined(__AVX512F__)
    case 2: qk_cols<2>(krow, kn, qt, mp, D, st, j * W); break;
    case 3: qk_cols<3>(krow, kn, qt, mp, D, st, j * W); break;
#endif
  }
}

// O[r0 + i, d0 : d0 + C*W] += sum_n P^T[n, r0 + i] * V[n, d0 : ...] for R rows
template <int R, int C>
inline void pv_block(const float* const* vrow, int64_t kn, const float* pt, int64_t mp,
                     float* o, int64_t D, int64_t r0, int64_t d0) {
  vf acc[R][C];
  for (int i = 0; i < R; i++)
    for (int j = 0; j < C; j++) acc[i][j] = load(o + (r0 + i) * D + d0 + j * W);
  for (int64_t n = 0; n < kn; n++) {
    vf v[C];
    for (int j = 0; j < C; j++) v[j] = load(vrow[n] + d0 + j * W);
    const float* p = pt + n * mp + r0;
    for (int i = 0; i < R; i++) {
      const vf s = splat(p[i]);
      for (int j = 0; j < C; j++) acc[i][j] += s * v[j];
    }
  }
  for (int i = 0; i < R; i++)
    for (int j = 0; j < C; j++) store(o + (r0 + i) * D + d0 + j * W, acc[i][j]);
}

template <int R>
inline void pv_rows(const float* const* vrow, int64_t kn, const float* pt, int64_t mp, float* o,
                    int64_t D, int64_t r0) {
  const int64_t nv = D / W;
  int64_t j = 0;
  for (; j + PV_C <= nv; j += PV_C) pv_block<R, PV_C>(vrow, kn, pt, mp, o, D, r0, j * W);
  switch (nv - j) {
    case 0: break;
    case 1: pv_block<R, 1>(vrow, kn, pt, mp, o, D, r0, j * W); break;
#if defined(__AVX512F__)
    case 2: pv_block<R, 2>(vrow, kn, pt, mp, o, D, r0, j * W); break;
    case 3: pv_block<R, 3>(vrow, kn, pt, mp, o, D, r0, j * W); break;
#endif
  }
}

// O [rows, D] += P V over keys [0, kn) of a block, for rows [0, rows)
void pv_tile(const float* const* vrow, int64_t kn, const float* pt, int64_t mp, float* o,
             int64_t D, int64_t rows) {
  int64_t r = 0;
  for (; r + PV_R <= rows; r += PV_R) pv_rows<PV_R>(vrow, kn, pt, mp, o, D, r);
  switch (rows - r) {
    case 0: break;
    case 1: pv_rows<1>(vrow, kn, pt, mp, o, D, r); break;
    case 2: pv_rows<2>(vrow, kn, pt, mp, o, D, r); break;
    case 3: pv_rows<3>(vrow, kn, pt, mp, o, D, r); break;
    case 4: pv_rows<4>(vrow, kn, pt, mp, o, D, r); break;
    case 5: pv_rows<5>(vrow, kn, pt, mp, o, D, r); break;
  }
}

struct Task {
  int64_t req;    // row of the request table
  int64_t head;   // kv head
  int64_t t0;     // first new position of the tile (0 = the request's first new token)
  int64_t nt;     // positions in the tile
  int64_t cost;   // keys x rows, for ordering
};

struct Scratch {
  std::vector<float> qt, st, o, m, l;
  std::vector<float> kb, vb;  // a bf16 pool's block rows, widened: [KB, D] each
  std::vector<const float*> krow, vrow;
};

// row n of the block as fp32: an fp32 pool's row in place, a bf16 pool's widened into buf
inline const float* fp32_row(const float* row, std::vector<float>&, int64_t, int64_t) {
  return row;
}
inline const float* fp32_row(const uint16_t* row, std::vector<float>& buf, int64_t n,
                             int64_t D) {
  float* dst = buf.data() + n * D;
  for (int64_t d = 0; d < D; d += W) store(dst + d, widen(row + d));
  return dst;
}

struct Args {
  const float* q;
  int64_t q_s0, q_s1;  // strides of q's token and head dims (its head_dim is contiguous)
  const void* k;       // the pool's element type is run_tile's T
  const void* v;
  int64_t kv_s0;       // stride of a pool row (kv heads x head_dim)
  const int32_t* r2t;  // req_to_token
  int64_t r2t_s0;
  const int64_t* table;  // [n, 4]: first row in q, prefix length, new tokens, req pool index
  float* out;          // [T, H, D]
  int64_t H, G, D;
  float scale_log2;    // softmax scale times log2(e): scores in log2 units
};

// T: the pool's element type, float or uint16_t (bf16 bits)
template <typename T>
void run_tile(const Args& a, const Task& t, Scratch& s) {
  const int64_t* row = a.table + t.req * 4;
  const int64_t start = row[0], prefix = row[1];
  const int64_t G = a.G, D = a.D;
  const int64_t rows = t.nt * G;
  const int64_t mp = (rows + W - 1) / W * W;
  const int64_t first_pos = prefix + t.t0;   // position of the tile's first row
  const int64_t n_end = first_pos + t.nt;    // keys the tile's last row sees
  s.qt.assign(D * mp, 0.0f);
  s.st.resize(KB * mp);
  s.o.assign(mp * D, 0.0f);
  s.m.assign(mp, -std::numeric_limits<float>::infinity());
  s.l.assign(mp, 0.0f);
  s.krow.resize(KB);
  s.vrow.resize(KB);
  if constexpr (!std::is_same_v<T, float>) {
    s.kb.resize(KB * D);
    s.vb.resize(KB * D);
  }
  const T* k = static_cast<const T*>(a.k);
  const T* v = static_cast<const T*>(a.v);
  // QT[d, r] = q[start + t0 + r / G, head * G + r % G, d] * scale * log2(e)
  for (int64_t r = 0; r < rows; r++) {
    const float* src = a.q + (start + t.t0 + r / G) * a.q_s0 + (t.head * G + r % G) * a.q_s1;
    for (int64_t d = 0; d < D; d++) s.qt[d * mp + r] = src[d] * a.scale_log2;
  }
  const int32_t* slots = a.r2t + row[3] * a.r2t_s0;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t row_bytes = D * int64_t(sizeof(T));
  auto prefetch_block = [&](int64_t k0) {  // the slots are scattered: hide the misses
    const int64_t kn = std::min<int64_t>(KB, n_end - k0);
    for (int64_t n = 0; n < kn; n++) {
      const int64_t off = int64_t(slots[k0 + n]) * a.kv_s0 + t.head * D;
      for (int64_t b = 0; b < row_bytes; b += 64) {
        __builtin_prefetch(reinterpret_cast<const char*>(k + off) + b);
        __builtin_prefetch(reinterpret_cast<const char*>(v + off) + b);
      }
    }
  };
  prefetch_block(0);
  for (int64_t k0 = 0; k0 < n_end; k0 += KB) {
    const int64_t kn = std::min<int64_t>(KB, n_end - k0);
    for (int64_t n = 0; n < kn; n++) {
      const int64_t off = int64_t(slots[k0 + n]) * a.kv_s0 + t.head * D;
      s.krow[n] = fp32_row(k + off, s.kb, n, D);
      s.vrow[n] = fp32_row(v + off, s.vb, n, D);
    }
    if (k0 + KB < n_end) prefetch_block(k0 + KB);
    float* st = s.st.data();
    qk_tile(s.krow.data(), kn, s.qt.data(), mp, D, st);
    // causal: key k0 + n is hidden from rows at positions below it, a prefix of the rows
    for (int64_t n = std::max<int64_t>(0, first_pos + 1 - k0); n < kn; n++) {
      const int64_t hidden = std::min(rows, (k0 + n - first_pos) * G);
      std::fill(st + n * mp, st + n * mp + hidden, neg_inf);
    }
    // online softmax down the columns of S^T (one query row per lane)
    for (int64_t r = 0; r < mp; r += W) {
      vf mx = splat(neg_inf);
      for (int64_t n = 0; n < kn; n++) {
        const vf x = load(st + n * mp + r);
        mx = x > mx ? x : mx;
      }
      const vf m_old = load(s.m.data() + r);
      const vf m_new = mx > m_old ? mx : m_old;  // finite: key 0 is seen by every row
      const vf alpha = exp2_neg(m_old - m_new);
      vf sum = vf{};
      for (int64_t n = 0; n < kn; n++) {
        const vf p = exp2_neg(load(st + n * mp + r) - m_new);
        store(st + n * mp + r, p);
        sum += p;
      }
      store(s.m.data() + r, m_new);
      store(s.l.data() + r, load(s.l.data() + r) * alpha + sum);
      if (k0 > 0) {  // rescale what the earlier blocks accumulated
        alignas(64) float al[W];
        store(al, alpha);
        for (int64_t i = 0; i < W && r + i < rows; i++) {
          float* o = s.o.data() + (r + i) * D;
          if (al[i] != 1.0f)
            for (int64_t d = 0; d < D; d++) o[d] *= al[i];
        }
      }
    }
    pv_tile(s.vrow.data(), kn, st, mp, s.o.data(), D, rows);
  }
  for (int64_t r = 0; r < rows; r++) {
    const float inv = 1.0f / s.l[r];
    const float* o = s.o.data() + r * D;
    float* dst = a.out + ((start + t.t0 + r / G) * a.H + t.head * G + r % G) * D;
    for (int64_t d = 0; d < D; d++) dst[d] = o[d] * inv;
  }
}

}  // namespace

// q [T, H, D] float32 (head_dim contiguous; token and head strides free: q may be a view of
// the fused qk projection); k_buffer, v_buffer [S, Hkv, D] contiguous, both float32 or both
// bfloat16 (one layer of the pool, already holding this forward's new rows); req_to_token
// [R, C] int32; table [n, 4] int64, one row per request with new tokens: (first row in q,
// prefix length, new tokens, req pool index). Request i's new rows are
// q[first : first + new], at positions prefix .. prefix + new - 1, attending causally over its
// KV slots req_to_token[pool, : prefix + new].
// Returns out [T, H, D]; rows of q no request owns are left unwritten.
at::Tensor extend_attention(at::Tensor q, at::Tensor k_buffer, at::Tensor v_buffer,
                            at::Tensor req_to_token, at::Tensor table, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "q: [T, H, D] float32");
  TORCH_CHECK(q.stride(2) == 1, "q: head_dim must be contiguous");
  const auto kv_type = k_buffer.scalar_type();
  TORCH_CHECK(v_buffer.scalar_type() == kv_type, "K/V buffers: one dtype, but k_buffer is ",
              kv_type, " and v_buffer ", v_buffer.scalar_type());
  TORCH_CHECK(kv_type == at::kFloat || kv_type == at::kBFloat16,
              "K/V buffers: float32 or bfloat16, not ", kv_type);
  TORCH_CHECK(k_buffer.dim() == 3, "K/V buffers: [S, Hkv, D]");
  TORCH_CHECK(k_buffer.is_contiguous() && v_buffer.is_contiguous() &&
                  k_buffer.sizes() == v_buffer.sizes(),
              "K/V buffers: contiguous, same shape");
  TORCH_CHECK(req_to_token.scalar_type() == at::kInt && req_to_token.dim() == 2 &&
                  req_to_token.stride(1) == 1,
              "req_to_token: [R, C] int32");
  TORCH_CHECK(table.scalar_type() == at::kLong && table.dim() == 2 && table.size(1) == 4,
              "table: [n, 4] int64");
  table = table.contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = k_buffer.size(1), S = k_buffer.size(0);
  TORCH_CHECK(k_buffer.size(2) == D && D % W == 0 && D <= 512,
              "head_dim must match the pool and be a multiple of the vector width");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "query heads must be a multiple of kv heads");
  const int64_t G = H / Hkv;
  const int64_t n = table.size(0);
  const int64_t* tp = table.data_ptr<int64_t>();
  const int32_t* r2t = req_to_token.data_ptr<int32_t>();
  const int64_t r2t_s0 = req_to_token.stride(0);
  std::vector<Task> tasks;
  for (int64_t i = 0; i < n; i++) {
    const int64_t start = tp[i * 4], prefix = tp[i * 4 + 1], ext = tp[i * 4 + 2];
    const int64_t pool = tp[i * 4 + 3];
    TORCH_CHECK(start >= 0 && ext >= 1 && start + ext <= T && prefix >= 0, "table row out of range");
    TORCH_CHECK(pool >= 0 && pool < req_to_token.size(0) && prefix + ext <= req_to_token.size(1),
                "req pool index out of range");
    const int32_t* slots = r2t + pool * r2t_s0;
    for (int64_t j = 0; j < prefix + ext; j++)
      TORCH_CHECK(slots[j] >= 0 && slots[j] < S, "slot out of range");
    // equal tiles of at most TILE_ROWS rows (a request's new rows in one tile when they fit)
    const int64_t max_pos = std::max<int64_t>(1, TILE_ROWS / G);
    const int64_t num_tiles = (ext + max_pos - 1) / max_pos;
    const int64_t tile_pos = (ext + num_tiles - 1) / num_tiles;
    for (int64_t h = 0; h < Hkv; h++)
      for (int64_t t0 = 0; t0 < ext; t0 += tile_pos) {
        const int64_t nt = std::min(tile_pos, ext - t0);
        tasks.push_back({i, h, t0, nt, (prefix + t0 + nt) * nt});
      }
  }
  // the longest first, so the last tasks handed out are short ones (dynamic balance)
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const Task& x, const Task& y) { return x.cost > y.cost; });
  auto out = at::empty({T, H, D}, q.options());
  Args a{q.data_ptr<float>(), q.stride(0), q.stride(1), k_buffer.data_ptr(),
         v_buffer.data_ptr(), Hkv * D, r2t, r2t_s0, tp, out.data_ptr<float>(), H, G, D,
         static_cast<float>(scale * 1.4426950408889634)};
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (int64_t)tasks.size());
  const bool bf16 = kv_type == at::kBFloat16;
  // one chunk per thread of torch's pool; each thread then pulls tasks off a shared counter
  at::parallel_for(0, std::max<int64_t>(threads, 1), 1, [&](int64_t, int64_t) {
    Scratch s;
    for (int64_t i = next++; i < (int64_t)tasks.size(); i = next++)
      bf16 ? run_tile<uint16_t>(a, tasks[i], s) : run_tile<float>(a, tasks[i], s);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("extend_attention", &extend_attention,
        "causal attention of each request's new rows of q over its KV slots -> out [T, H, D]");
}

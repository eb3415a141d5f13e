// The logit screen's bf16 GEMM (plait/runtime/logit_screen.py) on the CPU's AMX tiles
// (screen_gemm) or, without AMX, its AVX512-BF16 vector units (screen_gemm_vec, below): the
// screen values x[r, j] = bf16(fp32 sum over k of hb[r, k] * Wb[j, k]) of every token j for a
// few hidden rows, streaming the bf16 output embedding once.
//
// Why not oneDNN's bf16 linear, which also runs on AMX: at 1-32 rows the GEMM is a stream of
// the weight (SmolLM2: 49,152 x 576 bf16, 57 MB), and on the Intel Xeon VM, the weight cold
// (a 600 MB write between calls), 2 threads, medians, oneDNN took 2.9-3.0 ms at 1-8 rows
// (19 GB/s) and 3.8 at 32; this loop 2.1-2.2 ms (a plain sum over the same bytes: 2.0 ms) and
// 2.7 at 32, where the tile products no longer hide under the stream. The values need not
// equal oneDNN's: both are fp32 accumulations of exact bf16 products, inside the screen's error
// bound, which the caller checks against this kernel before using it.
//
// Layout (screen_kernel.py's pack_weight writes it): the weight padded to V' (a multiple of
// 32 tokens) x K' (a multiple of 32) and cut into blocks of 32 tokens; within a block, for each
// 32 inputs, two 1 KB tiles (tokens 0-15 and 16-31) of 16 input pairs x 16 tokens x 2 (AMX's
// pair-interleaved B layout): [V'/32][K'/32][2][16][16][2]. A thread takes a contiguous run of
// blocks, so each thread's weight stream is sequential (the hardware prefetcher runs ahead of
// it), and prefetches the stream kAhead tile pairs on into L2 besides, 2 KB with each pair it
// takes (a block's 18 KB at once overflowed the line fill buffers: 2.7 ms cold, not 2.1; into
// L2 and 16 pairs on rather than L1 and 8: 2.7 ms at 32 rows, not 2.85, 1-8 rows alike).
//
// Tiles: 0-1 hidden rows 0-15 and 16-31 of a group of 32; 2-3 the block's two token halves;
// 4-7 the four 16 x 16 fp32 results (up to 32 rows: tiles of exactly the rows there are;
// beyond, rows padded with zeros to a multiple of 16, never written out).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <utility>

namespace {

constexpr int kArchReqXcompPerm = 0x1023;  // arch_prctl: ask for an XSAVE feature
constexpr int kXfeatureXtiledata = 18;     // AMX tile data
constexpr int64_t kBlock = 32;             // tokens per block
constexpr int64_t kAhead = 16;             // tile pairs prefetched ahead (32 KB), into L2

// Linux gives a process AMX state only when asked (once per process; threads inherit it)
bool request_amx() {
  static const bool ok = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// hidden-row tiles (0, 1) and their result tiles (4-5, 6-7) of rows0 and rows1 rows
void configure_tiles(int rows0, int rows1) {
  TileConfig cfg;
  for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  cfg.rows[0] = cfg.rows[4] = cfg.rows[5] = rows0;
  cfg.rows[1] = cfg.rows[6] = cfg.rows[7] = rows1;
  // (GCC 12's _tile_loadconfig declares an 8-byte operand, so the compiler may drop the stores
  // above: woq_cpu.cpp's AMX config lost them; here they happened to stay)
  asm volatile("ldtilecfg %0" : : "m"(cfg));
}

// rows [r0, r0 + rows) (rows <= 32; x holds as many rows as the tiles are configured for) of
// the screen values of one block of 32 tokens
void block_rows(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t kb, int64_t rows,
                bool prefetch, float (*c)[kBlock]) {
  const bool two = rows > 16;
  _tile_zero(4);
  _tile_zero(5);
  if (two) {
    _tile_zero(6);
    _tile_zero(7);
  }
  for (int64_t k = 0; k < kb; k++) {
    const uint16_t* tile = w + k * 1024;
    if (prefetch) {  // the stream kAhead tile pairs (2 KB each) on: spread, not in bursts
      const char* pf = reinterpret_cast<const char*>(tile + kAhead * 1024);
      for (int a = 0; a < 2048; a += 64) _mm_prefetch(pf + a, _MM_HINT_T1);
    }
    _tile_loadd(2, tile, 64);
    _tile_loadd(3, tile + 512, 64);
    _tile_loadd(0, x + k * 32, ldx * 2);
    _tile_dpbf16ps(4, 0, 2);
    _tile_dpbf16ps(5, 0, 3);
    if (two) {
      _tile_loadd(1, x + 16 * ldx + k * 32, ldx * 2);
      _tile_dpbf16ps(6, 1, 2);
      _tile_dpbf16ps(7, 1, 3);
    }
  }
  _tile_stored(4, &c[0][0], kBlock * 4);
  _tile_stored(5, &c[0][16], kBlock * 4);
  if (two) {
    _tile_stored(6, &c[16][0], kBlock * 4);
    _tile_stored(7, &c[16][16], kBlock * 4);
  }
}

// What both GEMMs (screen_gemm, screen_gemm_vec) check of their operands: hidden [M, K] bf16,
// packed in pack_weight's layout for K inputs and `vocab` tokens.
struct Operands {
  int64_t M, K, blocks, kb, Kp;  // rows, inputs, blocks of 32 tokens, of 32 inputs, padded K
};

Operands check_operands(const torch::Tensor& hidden, const torch::Tensor& packed,
                        int64_t vocab) {
  TORCH_CHECK(hidden.device().is_cpu() && hidden.scalar_type() == torch::kBFloat16 &&
                  hidden.dim() == 2,
              "hidden: [M, K] bfloat16 CPU rows");
  TORCH_CHECK(packed.scalar_type() == torch::kBFloat16 && packed.is_contiguous() &&
                  packed.dim() == 6 && packed.size(2) == 2 && packed.size(3) == 16 &&
                  packed.size(4) == 16 && packed.size(5) == 2,
              "packed: [V'/32, K'/32, 2, 16, 16, 2] bfloat16 (pack_weight)");
  const Operands o{hidden.size(0), hidden.size(1), packed.size(0), packed.size(1),
                   packed.size(1) * 32};
  TORCH_CHECK(o.K <= o.Kp && o.Kp - o.K < 32, "hidden: ", o.K,
              " inputs against a packed width of ", o.Kp);
  TORCH_CHECK(vocab > 0 && vocab <= o.blocks * kBlock && vocab > (o.blocks - 1) * kBlock,
              "vocab: ", vocab, " tokens against ", o.blocks, " packed blocks of 32");
  return o;
}

// The blocks in contiguous runs, one a thread (each thread's weight stream sequential):
// body(b0, b1) on the thread that takes blocks [b0, b1).
template <class Body>
void over_blocks(int64_t blocks, const Body& body) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), blocks);
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t th = t0; th < t1; th++)
      body(blocks * th / threads, blocks * (th + 1) / threads);
  });
}

// Rows [0, rows) of one block's fp32 sums c, rounded to bf16 (nearest even, as oneDNN does),
// into the output rows from r0 at the block's first token j0 (of `vocab`: the last block's
// tokens past it are not written).
inline void store_block(const float (*c)[kBlock], int64_t rows, uint16_t* op, int64_t vocab,
                        int64_t r0, int64_t j0) {
  const int64_t cols = std::min<int64_t>(kBlock, vocab - j0);
  const __mmask32 keep = cols == kBlock ? ~__mmask32(0) : (__mmask32(1) << cols) - 1;
  for (int64_t r = 0; r < rows; r++) {
    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_load_ps(&c[r][16]), _mm512_load_ps(&c[r][0]));
    _mm512_mask_storeu_epi16(op + (r0 + r) * vocab + j0, keep, (__m512i)v);
  }
}

// hidden [M, K] bf16, packed (pack_weight's layout) -> [M, vocab] bf16 screen values
torch::Tensor screen_gemm(const torch::Tensor& hidden, const torch::Tensor& packed, int64_t vocab) {
  TORCH_CHECK(request_amx(), "screen_gemm: the kernel gives this process no AMX state");
  const Operands ops = check_operands(hidden, packed, vocab);  // (plain names: lambdas take
  const int64_t M = ops.M, K = ops.K, blocks = ops.blocks, kb = ops.kb, Kp = ops.Kp;  // them)
  auto out = torch::empty({M, vocab}, hidden.options());
  if (M == 0) return out;
  // Up to 32 rows the tiles take exactly M rows (fewer rows, faster tile products: 2.07 ms at
  // 1 row, 2.29 at 16, cold); beyond, groups of 32 with the rows padded to a multiple of 16.
  // The hidden rows are read in place when they need no padding, else from a zero-padded copy
  // (to Kp inputs and those rows).
  const bool exact = M <= 32;
  const int rows0 = exact ? std::min<int64_t>(M, 16) : 16;
  const int rows1 = exact ? std::max<int64_t>(M - 16, 1) : 16;
  const int64_t Mp = exact ? M : (M + 15) / 16 * 16;
  torch::Tensor x = hidden;
  if (Mp != M || Kp != K || !hidden.is_contiguous()) {
    x = torch::zeros({Mp, Kp}, hidden.options());
    x.narrow(0, 0, M).narrow(1, 0, K).copy_(hidden);
  }
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t block_elems = kb * 1024;
  over_blocks(blocks, [&](int64_t b0, int64_t b1) {
    configure_tiles(rows0, rows1);
    alignas(64) float c[32][kBlock];
    for (int64_t b = b0; b < b1; b++) {
      for (int64_t r0 = 0; r0 < M; r0 += 32) {
        const int64_t rows = std::min<int64_t>(32, M - r0);
        block_rows(xp + r0 * Kp, Kp, wp + b * block_elems, kb, rows, r0 == 0, c);
        store_block(c, rows, op, vocab, r0, b * kBlock);
      }
    }
    _tile_release();
  });
  return out;
}

// ---------------------------------------------------------------- AVX512-BF16 (no AMX)
// The same packed layout read by vector dot products (vdpbf16ps), for CPUs with AVX512-BF16
// and no AMX (AMD Zen 4, Intel Cooper Lake): a tile row is one input pair of 16 tokens (64
// bytes), so with a hidden row's pair broadcast to every lane one instruction adds that pair's
// two products to 16 tokens' sums. A group of up to kVecRows rows keeps two accumulators a row
// (the block's two token halves); a block's groups run one after another, the first reading
// the block from memory, the others from the core's caches.
//
// Measured on the Zen 4 EPYC VM (2 threads, SmolLM2's 49,152 x 576 weight, a fresh block every
// call so it streams from memory, medians, alternated with oneDNN's bf16 linear that the screen
// ran before): 1 / 8 / 16 / 32 / 48 rows 1.8-2.4 / 1.7-2.3 / 2.6-3.1 / 4.5-5.4 / 7.2 ms against
// oneDNN's 3.2-3.6 / 3.1-4.1 / 4.5-4.9 / 6.2-7.0 / 8.7 (the stream at 25-33 GB/s up to 8 rows,
// and 32 rows at ~0.9 of one vdpbf16ps a cycle). What it took:
// * the weight stream prefetched in software kVecAhead blocks on, its lines spread evenly over
//   every group's k steps (a block's groups are its compute time): without, 7.8 ms at 32 rows,
//   4.1 at 8; into L2 up to two groups (1.6 ms at 4 rows against 2.6 into L1), into L1 from
//   three (4.5 ms at 32 rows against 4.8-5.2);
// * the accumulators in registers: without the unroll pragmas GCC kept acc[][] on the stack
//   (a load and a store around every product);
// * the broadcast as its own instruction, used by both halves (`{1to16}` operands of the
//   products instead, through inline asm: 2x slower at 12-32 rows).
constexpr int kVecRows = 12;       // 24 accumulators of the 32 vector registers
constexpr int64_t kVecAhead = 2;   // blocks

template <int R>
void block_rows_vec(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t kb,
                    const char* pf, int64_t g, int64_t groups, float (*c)[kBlock]) {
  // this group's share of the lines of `pf` (the block kVecAhead on), spread over its k steps
  const int64_t lines = kb * 32, steps = groups * kb;
  __m512 acc[R][2];
#pragma GCC unroll 16
  for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kb; k++) {
    const uint16_t* tile = w + k * 1024;
    const int64_t lo = (g * kb + k) * lines / steps, hi = (g * kb + k + 1) * lines / steps;
    if (groups <= 2)
      for (int64_t l = lo; l < hi; l++) _mm_prefetch(pf + l * 64, _MM_HINT_T1);
    else
      for (int64_t l = lo; l < hi; l++) _mm_prefetch(pf + l * 64, _MM_HINT_T0);
    const int32_t* xk = reinterpret_cast<const int32_t*>(x + k * 32);
    for (int p = 0; p < 16; p++) {
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(tile + p * 32);
      const __m512bh w1 = (__m512bh)_mm512_loadu_si512(tile + 512 + p * 32);
#pragma GCC unroll 16
      for (int r = 0; r < R; r++) {
        const __m512bh h = (__m512bh)_mm512_set1_epi32(xk[r * ldx / 2 + p]);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], h, w0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], h, w1);
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; r++) {
    _mm512_store_ps(&c[r][0], acc[r][0]);
    _mm512_store_ps(&c[r][16], acc[r][1]);
  }
}

using BlockRowsVec = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t,
                              const char*, int64_t, int64_t, float (*)[kBlock]);

template <int... Rs>
BlockRowsVec pick_rows(int rows, std::integer_sequence<int, Rs...>) {
  static const BlockRowsVec table[] = {block_rows_vec<Rs + 1>...};
  return table[rows - 1];
}

torch::Tensor screen_gemm_vec(const torch::Tensor& hidden, const torch::Tensor& packed,
                              int64_t vocab) {
  const Operands ops = check_operands(hidden, packed, vocab);  // (plain names: lambdas take
  const int64_t M = ops.M, K = ops.K, blocks = ops.blocks, kb = ops.kb, Kp = ops.Kp;  // them)
  auto out = torch::empty({M, vocab}, hidden.options());
  if (M == 0) return out;
  torch::Tensor x = hidden;  // rows of Kp inputs, zero-padded, read in place where they are
  if (Kp != K || !hidden.is_contiguous()) {
    x = torch::zeros({M, Kp}, hidden.options());
    x.narrow(1, 0, K).copy_(hidden);
  }
  // groups of at most kVecRows rows, as even as they go (32 rows: 11, 11, 10)
  const int64_t groups = (M + kVecRows - 1) / kVecRows;
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t block_elems = kb * 1024;
  over_blocks(blocks, [&](int64_t b0, int64_t b1) {
    alignas(64) float c[kVecRows][kBlock];
    for (int64_t b = b0; b < b1; b++) {
      const uint16_t* w = wp + b * block_elems;
      // the block kVecAhead on (the last ones: their own, already in cache)
      const char* pf = reinterpret_cast<const char*>(
          b + kVecAhead < blocks ? w + kVecAhead * block_elems : w);
      for (int64_t g = 0; g < groups; g++) {
        const int64_t r0 = M * g / groups, rows = M * (g + 1) / groups - r0;
        pick_rows(static_cast<int>(rows), std::make_integer_sequence<int, kVecRows>())(
            xp + r0 * Kp, Kp, w, kb, pf, g, groups, c);
        store_block(c, rows, op, vocab, r0, b * kBlock);
      }
    }
  });
  return out;
}

bool amx_available() { return request_amx(); }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("screen_gemm", &screen_gemm,
        "[M, K] bf16 hidden rows x the packed bf16 weight -> [M, vocab] bf16 screen values");
  m.def("screen_gemm_vec", &screen_gemm_vec,
        "screen_gemm on AVX512-BF16 vector units (no AMX): the same layout and contract");
  m.def("amx_available", &amx_available, "whether Linux gives this process AMX tile state");
}

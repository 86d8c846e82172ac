// Paged attention on a CPU, reading K and V where they lie in the paged cache.
//
// The PyTorch path (torch_backend.py) first copies every sequence's K/V rows out of the pool
// through its block table, then calls SDPA on the copy: each step moves the whole context twice
// more than attention needs. This kernel follows the block table itself, one block at a time,
// and keeps a running softmax (the online softmax of FlashAttention / flash-decoding), so each
// K and V row is read once, straight from its slot, and nothing is gathered:
//
//     for each (sequence, tile of up to 8 query rows), in parallel:
//       for each logical block b of the context the tile can see:
//         physical = block_table[b]
//         scores  s[r][h][t] = q[r][h] . K[physical, t, h / G] * scale   (G query heads share a KV head;
//                                                                          causal: t <= the row's position)
//         m_new   = max(m, max_t s);  acc *= exp(m - m_new);  l *= exp(m - m_new)
//         p       = exp(s - m_new);   l += sum_t p;  acc += sum_t p . V[physical, t, h / G]
//       out[r][h] = acc / l
//
// Cache layout [num_blocks, block_size, num_kv_heads, head_dim], contiguous; fp32 or bf16
// (bf16 is widened to fp32 on load: a bf16 number is the top half of an fp32). Queries and the
// output are [num_tokens, num_q_heads, head_dim] in fp32 or bf16 (the model's dtype: no conversion
// pass before or after); scores, sums and the running output are fp32, rounded once when stored. Sequence i's
// query rows are cu_seqlens_q[i] .. cu_seqlens_q[i+1]-1, the last q_len of its seq_lens[i]
// tokens, so a decode is a sequence with one row. kernels/reference.py is the specification;
// tests/test_cpu_kernel.py compares the two.
//
// The file also holds what runs around attention in a CPU step: RMSNorm, RoPE with the cache write, and the
// decode-sized matrix products (fp32 and bf16, on AVX-512 or AVX2), each described where it starts.
//
// Which code runs is fixed when the file is compiled (cpu_kernel.py picks -march / -mcpu): the AVX-512 tiles where
// the target has AVX-512F (an x86 macro: never defined on Arm), else the portable C++ tiles, which the compiler
// vectorises for whatever the target has (AVX2, SSE2, NEON). minipaged_features() says which; the tests build
// and run every target the CPU can run.
#include <algorithm>
#if defined(__AVX512F__) && (defined(__x86_64__) || defined(_M_X64))
#define MINIPAGED_AVX512 1
#endif
#if (defined(MINIPAGED_AVX512) || (defined(__AVX2__) && defined(__FMA__))) && (defined(__x86_64__) || defined(_M_X64))
#define MINIPAGED_PRODUCTS 1  // the decode-sized products: AVX-512 tiles where there is AVX-512, else AVX2 ones
#include <immintrin.h>
#include <omp.h>
#endif
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kRowsPerTile = 8;  // query rows that share each K/V row while it is in L1

inline float widen(float x) { return x; }
inline float widen(uint16_t bits) {  // bf16 -> fp32: the 16 bits are the fp32's high half
  uint32_t word = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &word, sizeof f);
  return f;
}

// fp32 -> the storage type. For bf16: round to nearest, ties to even, exactly as PyTorch's c10::BFloat16
// does (a NaN stays a NaN), so an op written here rounds every element as PyTorch's op would.
template <typename T>
inline T narrow(float x);
template <>
inline float narrow<float>(float x) {
  return x;
}
template <>
inline uint16_t narrow<uint16_t>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if (x != x) return 0x7FC0;
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
// x rounded to T and back: what a PyTorch op in dtype T leaves between two steps of a computation.
template <typename T>
inline float round_to(float x) {
  return widen(narrow<T>(x));
}

// e^x for x <= 0 (every exponent here is a score minus a running maximum), written out so that the
// compiler can vectorise a loop of them: x = n·ln2 + r with |r| <= ln2/2, e^r by its Taylor series to
// r^7 (relative error below 1e-8 there), 2^n put straight into the float's exponent bits. Below -87
// the result would be subnormal: 0 instead (a weight of e^-87 changes no fp32 sum).
inline float exp_nonpositive(float x) {
  const float below = x < -87.f ? 0.f : 1.f;
  x = std::max(x, -87.f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;  // ln2 in two parts: n·ln2 exact enough
  float p = 1.f / 5040;
  p = p * r + 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale * below;
}

template <typename T>
inline float dot(const float* q, const T* k, int64_t d) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s = std::fma(q[i], widen(k[i]), s);
  return s;
}

template <typename T>
inline void axpy(float p, const T* v, float* acc, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) acc[i] = std::fma(p, widen(v[i]), acc[i]);
}

struct Shape {
  int64_t num_q_heads, num_kv_heads, head_dim, block_size, table_stride;
  float scale;
};

// One tile: rows row0 .. row0+rows-1 of the packed query, the first of them at absolute position
// first_pos of a sequence whose block table is `table`. Every query head of every row is handled at
// once, so each token's K row (all its KV heads, contiguous) and V row are read in order, once.
template <typename TQ, typename T, int64_t kHeadDim>  // kHeadDim 0: any head_dim, read at run time
void attend_tile(const TQ* query_in, TQ* out, const T* key_cache, const T* value_cache, const int32_t* table,
                 int64_t row0, int64_t rows, int64_t first_pos, const Shape& sh) {
  const int64_t hq = sh.num_q_heads, G = hq / sh.num_kv_heads, bs = sh.block_size;
  const int64_t d = kHeadDim ? kHeadDim : sh.head_dim;  // a constant lets the compiler unroll dot and axpy
  const int64_t slot_stride = sh.num_kv_heads * d;  // elements from one token's K row to the next
  const int64_t nq = rows * hq;                       // query vectors j = r * hq + head
  std::vector<float> m(nq, -std::numeric_limits<float>::infinity()), l(nq, 0.f), acc(nq * d, 0.f), s(nq * bs);
  std::vector<int64_t> seen(rows);
  std::vector<float> query(nq * d);  // the tile's queries in fp32, read from the model's dtype once
  for (int64_t i = 0; i < nq * d; ++i) query[i] = widen(query_in[row0 * hq * d + i]);
  const int64_t last = first_pos + rows - 1;  // the tile's last row sees positions 0..last
  for (int64_t pos0 = 0; pos0 <= last; pos0 += bs) {
    const int64_t physical = table[pos0 / bs];
    const T* k_block = key_cache + physical * bs * slot_stride;
    const T* v_block = value_cache + physical * bs * slot_stride;
    for (int64_t r = 0; r < rows; ++r)  // causal: row r (position first_pos + r) sees up to its own position
      seen[r] = std::max<int64_t>(0, std::min(bs, first_pos + r - pos0 + 1));
    const int64_t tokens = seen[rows - 1];
    // The next block is somewhere else in the pool, where no hardware prefetcher will guess: ask for its
    // rows now, one token's worth per token of this block, so they arrive while this block is computed.
    const T* next_k = pos0 + bs <= last ? key_cache + table[pos0 / bs + 1] * bs * slot_stride : nullptr;
    const T* next_v = next_k ? value_cache + (next_k - key_cache) : nullptr;
    for (int64_t t = 0; t < tokens; ++t) {  // scores, token by token
      const T* k_row = k_block + t * slot_stride;
      if (next_k)
        for (int64_t i = 0; i < slot_stride; i += 64 / static_cast<int64_t>(sizeof(T))) {
          __builtin_prefetch(next_k + t * slot_stride + i, 0, 1);  // into L2, as in the AVX-512 tile
          __builtin_prefetch(next_v + t * slot_stride + i, 0, 1);
        }
      for (int64_t r = 0; r < rows; ++r) {
        if (t >= seen[r]) continue;
        const float* qr = query.data() + r * hq * d;
        for (int64_t h = 0; h < hq; ++h)
          s[(r * hq + h) * bs + t] = dot(qr + h * d, k_row + (h / G) * d, d) * sh.scale;
      }
    }
    for (int64_t r = 0; r < rows; ++r) {  // the running softmax, one query vector at a time
      if (seen[r] == 0) continue;
      for (int64_t h = 0; h < hq; ++h) {
        const int64_t j = r * hq + h;
        float* sj = s.data() + j * bs;
        float block_max = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < seen[r]; ++t) block_max = std::max(block_max, sj[t]);
        const float m_new = std::max(m[j], block_max);
        if (m_new > m[j]) {  // a larger maximum: what was summed so far shrinks by e^(m - m_new)
          const float alpha = exp_nonpositive(m[j] - m_new);  // 0 on the first block (m = -inf)
          float* aj = acc.data() + j * d;
          for (int64_t i = 0; i < d; ++i) aj[i] *= alpha;
          l[j] *= alpha;
          m[j] = m_new;
        }
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < seen[r]; ++t) {  // the exps alone in a loop: vectorised
          sj[t] = exp_nonpositive(sj[t] - m_new);
          sum += sj[t];
        }
        l[j] += sum;
      }
    }
    for (int64_t t = 0; t < tokens; ++t) {  // values, token by token
      const T* v_row = v_block + t * slot_stride;
      for (int64_t r = 0; r < rows; ++r) {
        if (t >= seen[r]) continue;
        for (int64_t h = 0; h < hq; ++h) {
          const int64_t j = r * hq + h;
          const float p = std::is_same_v<T, uint16_t> ? round_to<uint16_t>(s[j * bs + t]) : s[j * bs + t];
          axpy(p, v_row + (h / G) * d, acc.data() + j * d, d);  // bf16 P with a bf16 cache: see the AVX tile
        }
      }
    }
  }
  for (int64_t j = 0; j < nq; ++j) {
    TQ* o = out + (row0 * hq + j) * d;  // row r, head h: (row0 + r) * hq + h = row0 * hq + j
    const float inv = 1.f / l[j];
    for (int64_t i = 0; i < d; ++i) o[i] = narrow<TQ>(acc[j * d + i] * inv);
  }
}


#if defined(MINIPAGED_AVX512)
// ---- the same tile with AVX-512, for head_dim 64 and 128 (what Llama-family models use) ----------------------
// The portable tile above scores one (row, head, token) at a time: every score ends in a horizontal sum of a
// vector, and that, not memory, is what bounds it. Here a KV head's chunk of 16 tokens is scored for one query
// vector at once: 16 vectors of partial products, folded into one vector whose lane t is token t's score
// (reduce16, 42 instructions for 16 scores instead of 16 horizontal sums), and the softmax and the values run
// on that vector:
//
//     for each block, each KV head, each chunk of 16 of the block's tokens:
//       K, V rows of the chunk: fp32 read where they lie; bf16 widened to fp32 once, for the rows x G
//       query vectors of that KV head (copying fp32 rows too cost half the kernel's time: a store per load)
//       for each query vector j of the tile that uses this KV head:
//         s   = [q_j . k_0, ..., q_j . k_15] * scale     (lanes past the row's causal limit: -inf)
//         online softmax on s;  acc_j (D/16 registers) = acc_j * alpha + sum_t p_t v_t
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {  // 16 bf16 -> 16 fp32: widen to 32 bits, shift into the high half
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// 16 fp32 -> bf16 -> fp32: round to nearest even, in integer arithmetic (no AVX512-BF16 needed)
inline __m512 round_bf16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// v[t] holds 16 partial sums of token t's score; lane t of the result is their total.
inline __m512 reduce16(const __m512* v) {
  __m512 x[8], y[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] for a = v[2i], b = v[2i+1]
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the lane's sums of tokens 4i .. 4i+3
    const __m512d a = _mm512_castps_pd(x[2 * i]), b = _mm512_castps_pd(x[2 * i + 1]);
    y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // Add the four 128-bit lanes: 0x88 takes lanes (0, 2) of each source, 0xDD lanes (1, 3).
  const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xDD));
  const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], 0x88), _mm512_shuffle_f32x4(y[2], y[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}

// exp_nonpositive, 16 lanes at once (the same range reduction and polynomial; 2^n by scalef).
inline __m512 exp_nonpositive16(__m512 x) {
  const __m512 floor_ = _mm512_set1_ps(-87.f);
  const __mmask16 keep = _mm512_cmp_ps_mask(x, floor_, _CMP_GE_OQ);
  x = _mm512_max_ps(x, floor_);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040);
  for (const float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_maskz_mov_ps(keep, _mm512_scalef_ps(p, n));
}

template <typename TQ, typename T, int64_t D>
void attend_tile_avx512(const TQ* query_in, TQ* out, const T* key_cache, const T* value_cache, const int32_t* table,
                        int64_t row0, int64_t rows, int64_t first_pos, const Shape& sh) {
  constexpr int64_t V = D / 16;  // vectors per head
  const int64_t hq = sh.num_q_heads, hkv = sh.num_kv_heads, G = hq / hkv, bs = sh.block_size;
  const int64_t slot_stride = hkv * D, nq = rows * hq;
  std::vector<float> query(nq * D), m(nq, -std::numeric_limits<float>::infinity()), l(nq, 0.f), acc(nq * D, 0.f);
  for (int64_t i = 0; i < nq * D; ++i) query[i] = widen(query_in[row0 * hq * D + i]);
  alignas(64) float p[16];
  const __m512 scale = _mm512_set1_ps(sh.scale), minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const int64_t last = first_pos + rows - 1;
  for (int64_t pos0 = 0; pos0 <= last; pos0 += bs) {
    const int64_t physical = table[pos0 / bs];
    const T* k_block = key_cache + physical * bs * slot_stride;
    const T* v_block = value_cache + physical * bs * slot_stride;
    // The next block is elsewhere in the pool: ask for it while this one is computed (see attend_tile), a
    // share of it per KV head, so that the requests trickle out beside the work instead of filling every miss
    // buffer at once (all of it up front stalled the core on the prefetches themselves).
    const int64_t next = pos0 + bs <= last ? table[pos0 / bs + 1] * bs * slot_stride : -1;
    const int64_t share = (bs * slot_stride + hkv - 1) / hkv;
    const int64_t tokens = std::min(bs, last - pos0 + 1);  // the tile's last row sees them all
    for (int64_t kh = 0; kh < hkv; ++kh) {
      if (next >= 0)
        for (int64_t i = kh * share; i < std::min((kh + 1) * share, bs * slot_stride);
             i += 64 / static_cast<int64_t>(sizeof(T))) {
          __builtin_prefetch(key_cache + next + i, 0, 1);  // into L2: L1 holds this block's work
          __builtin_prefetch(value_cache + next + i, 0, 1);
        }
      for (int64_t c0 = 0; c0 < tokens; c0 += 16) {
        const int64_t nt = std::min<int64_t>(16, tokens - c0);
        // This chunk's K and V rows of head kh, read where they lie (a bf16 one widened in registers as it is
        // read): copying them into a buffer first cost half the kernel's time, a store for every load.
        const T* kr = k_block + c0 * slot_stride + kh * D;
        const T* vr = v_block + c0 * slot_stride + kh * D;
        for (int64_t r = 0; r < rows; ++r) {
          // Tokens of this chunk row r may see: up to its own position (causal), and no further than the chunk.
          const int64_t used = std::min(nt, first_pos + r - (pos0 + c0) + 1);
          if (used <= 0) continue;
          const __mmask16 valid = used >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << used) - 1u);
          for (int64_t g = 0; g < G; ++g) {
            const int64_t j = r * hq + kh * G + g;
            __m512 q[V], part[16];
            for (int64_t v = 0; v < V; ++v) q[v] = _mm512_loadu_ps(query.data() + j * D + v * 16);
            for (int64_t t = 0; t < 16; ++t) {
              if (t >= nt) {
                part[t] = _mm512_setzero_ps();
                continue;
              }
              __m512 sum = _mm512_mul_ps(q[0], load16(kr + t * slot_stride));
              for (int64_t v = 1; v < V; ++v)
                sum = _mm512_fmadd_ps(q[v], load16(kr + t * slot_stride + v * 16), sum);
              part[t] = sum;
            }
            const __m512 s = _mm512_mask_mov_ps(minus_inf, valid, _mm512_mul_ps(reduce16(part), scale));
            const float m_new = std::max(m[j], _mm512_reduce_max_ps(s));
            const float alpha = exp_nonpositive(m[j] - m_new);  // 0 on the first chunk (m = -inf)
            const __m512 e = exp_nonpositive16(_mm512_sub_ps(s, _mm512_set1_ps(m_new)));
            m[j] = m_new;
            l[j] = l[j] * alpha + _mm512_reduce_add_ps(e);
            // With a bf16 cache, P.V multiplies bf16 probabilities, as PyTorch's bf16 attention does (its flash
            // kernel rounds P to bf16 for that GEMM; the sum l keeps the fp32 values): the same numbers as a
            // bf16 model's attention in transformers, not a more precise and so different one.
            _mm512_store_ps(p, std::is_same_v<T, uint16_t> ? round_bf16(e) : e);
            float* aj = acc.data() + j * D;
            __m512 a[V];
            for (int64_t v = 0; v < V; ++v) a[v] = _mm512_mul_ps(_mm512_loadu_ps(aj + v * 16), _mm512_set1_ps(alpha));
            for (int64_t t = 0; t < used; ++t) {
              const __m512 pt = _mm512_set1_ps(p[t]);
              for (int64_t v = 0; v < V; ++v) a[v] = _mm512_fmadd_ps(pt, load16(vr + t * slot_stride + v * 16), a[v]);
            }
            for (int64_t v = 0; v < V; ++v) _mm512_storeu_ps(aj + v * 16, a[v]);
          }
        }
      }
    }
  }
  for (int64_t j = 0; j < nq; ++j) {
    TQ* o = out + (row0 * hq + j) * D;
    const float inv = 1.f / l[j];
    for (int64_t i = 0; i < D; ++i) o[i] = narrow<TQ>(acc[j * D + i] * inv);
  }
}
#endif  // MINIPAGED_AVX512

template <typename TQ, typename T>
void paged_attention(const TQ* query, TQ* out, const T* key_cache, const T* value_cache,
                     const int32_t* block_tables, const int32_t* cu_seqlens_q, const int32_t* seq_lens,
                     int64_t num_seqs, int64_t max_q_len, const Shape& sh) {
  // Work items: (sequence, tile of rows). A decode is one item; a 24-token chunk three. Sequences
  // with more than max_q_len rows are left alone (the caller attends them with a GEMM-based kernel).
  std::vector<int64_t> item_seq, item_row;
  for (int64_t i = 0; i < num_seqs; ++i)
    if (cu_seqlens_q[i + 1] - cu_seqlens_q[i] <= max_q_len)
      for (int64_t r = cu_seqlens_q[i]; r < cu_seqlens_q[i + 1]; r += kRowsPerTile) {
      item_seq.push_back(i);
      item_row.push_back(r);
    }
  const int64_t n = static_cast<int64_t>(item_seq.size());
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t w = 0; w < n; ++w) {
    const int64_t i = item_seq[w], row0 = item_row[w];
    const int64_t q_len = cu_seqlens_q[i + 1] - cu_seqlens_q[i];
    const int64_t rows = std::min(kRowsPerTile, cu_seqlens_q[i + 1] - row0);
    const int64_t first_pos = seq_lens[i] - q_len + (row0 - cu_seqlens_q[i]);
    const int32_t* table = block_tables + i * sh.table_stride;
#if defined(MINIPAGED_AVX512)
    if (sh.head_dim == 64) {
      attend_tile_avx512<TQ, T, 64>(query, out, key_cache, value_cache, table, row0, rows, first_pos, sh);
      continue;
    }
    if (sh.head_dim == 128) {
      attend_tile_avx512<TQ, T, 128>(query, out, key_cache, value_cache, table, row0, rows, first_pos, sh);
      continue;
    }
#endif
    if (sh.head_dim == 64)
      attend_tile<TQ, T, 64>(query, out, key_cache, value_cache, table, row0, rows, first_pos, sh);
    else if (sh.head_dim == 128)
      attend_tile<TQ, T, 128>(query, out, key_cache, value_cache, table, row0, rows, first_pos, sh);
    else
      attend_tile<TQ, T, 0>(query, out, key_cache, value_cache, table, row0, rows, first_pos, sh);
  }
}

// ---- the elementwise steps around attention ---------------------------------------------------------------
// Each does in one pass what PyTorch does in several (RMSNorm: eight ops; RoPE on q and k and the cache
// write: seventeen), rounding where PyTorch's ops round, so the engine's numbers stay transformers'.

// RMSNorm as transformers computes it: in fp32, x / sqrt(mean(x^2) + eps), rounded to T, then times the
// weight in T. Rows of x are x_stride elements apart; out is [rows, dim] contiguous.
template <typename T>
void rms_norm(const T* x, int64_t x_stride, const T* weight, T* out, int64_t rows, int64_t dim, float eps) {
#pragma omp parallel for if (rows * dim >= 65536)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * x_stride;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < dim; ++i) sum += widen(xr[i]) * widen(xr[i]);
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(dim) + eps);
    T* o = out + r * dim;
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) o[i] = narrow<T>(widen(weight[i]) * round_to<T>(widen(xr[i]) * inv));
  }
}

// One head's rotation: y = x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1], each product and the
// sum rounded to T as PyTorch's three ops round them.
template <typename T>
inline void rotate(const T* x, const T* c, const T* s, T* y, int64_t d) {
  const int64_t half = d / 2;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i)
    y[i] = narrow<T>(round_to<T>(widen(x[i]) * widen(c[i])) + round_to<T>(-widen(x[i + half]) * widen(s[i])));
#pragma omp simd
  for (int64_t i = half; i < d; ++i)
    y[i] = narrow<T>(round_to<T>(widen(x[i]) * widen(c[i])) + round_to<T>(widen(x[i - half]) * widen(s[i])));
}

// RoPE on this step's q and k and the K/V write, in one pass over the QKV projection's output:
//     qkv row t = [ q: num_q_heads x d | k: num_kv_heads x d | v: num_kv_heads x d ]   (qkv_stride apart)
//     q_out[t]            = rotate(q)                  [num_tokens, num_q_heads, d], contiguous
//     key_cache[slot_t]   = rotate(k),  value_cache[slot_t] = v     (slot_t < 0: padding, nothing written)
// cos and sin are [num_tokens, d] in T (the model computes them once per step for every layer).
template <typename T>
void rope_and_cache(const T* qkv, int64_t qkv_stride, const T* cos, const T* sin, T* q_out, T* key_cache,
                    T* value_cache, const int64_t* slots, int64_t num_tokens, int64_t hq, int64_t hkv, int64_t d) {
#pragma omp parallel for if (num_tokens >= 64)
  for (int64_t t = 0; t < num_tokens; ++t) {
    const T* row = qkv + t * qkv_stride;
    const T* c = cos + t * d;
    const T* s = sin + t * d;
    for (int64_t h = 0; h < hq; ++h) rotate(row + h * d, c, s, q_out + (t * hq + h) * d, d);
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    const T* k = row + hq * d;
    for (int64_t h = 0; h < hkv; ++h) rotate(k + h * d, c, s, key_cache + (slot * hkv + h) * d, d);
    std::memcpy(value_cache + slot * hkv * d, k + hkv * d, sizeof(T) * hkv * d);
  }
}


// ---- decode-sized matrix products (fp32 and bf16, on AVX-512 or AVX2) ------------------------------------------
// A decode step multiplies a few dozen rows through every weight. oneDNN's packed GEMMs, called through PyTorch,
// lose a fifth of their rate there and pay a dispatch, a primitive lookup and a fork and join per call
// (benchmarks/bench_gemm_rows.py). These tiles do the model's products at those sizes (layers.Linear and the
// step program call them alike), with what follows each product applied while the tile is still in registers.
//
// A weight W [N, K] is packed once into panels of 32 output columns. fp32: each panel is K rows of 32 floats.
// bf16: K/2 rows of 32 column pairs, the pair being W's two elements at k and k + 1 (what vdpbf16ps multiplies):
//
//     fp32 panel p = W[32p : 32p + 32, :]^T                        [K][32]       contiguous; panels one after another
//     bf16 panel p = (W[32p + j, 2q], W[32p + j, 2q + 1])          [K/2][32][2]
//
// A tile is R rows of the input times two vectors' worth of a panel's columns, accumulated in fp32 registers:
// on AVX-512, 12 rows x 32 columns (the whole panel; 24 of the 32 zmm); on AVX2, 6 rows x 16 columns (half a panel;
// 12 of the 16 ymm: two tiles per panel). The gate-and-up tile holds both weights' columns, so half as many rows.
// Each panel streams from memory once per tile of rows, in order; the threads split the panels. A bf16 output is
// rounded once, after the residual add or silu(gate) * up, as one PyTorch op in fp32 would round it.
#if defined(MINIPAGED_PRODUCTS)
constexpr int64_t kPanel = 32;

#if !defined(__AMX_BF16__)
// bf16 too, except where the CPU has AMX: oneDNN multiplies bf16 on AMX tiles there, and these were never measured
// against them.
#define MINIPAGED_BF16_PRODUCTS 1
#endif

// bf16 pairs in 32-bit lanes (x[k] low, x[k + 1] high) as two fp32 vectors, for CPUs without vdpbf16ps: a bf16 is
// the high half of an fp32, so the even element shifts up and the odd one keeps its place with the low half cleared.
template <typename V>
struct Pairs {
  V even, odd;
};

#if defined(MINIPAGED_AVX512)

// silu(x) = x / (1 + e^-x), from e^-|x| so the exponent is never positive
inline __m512 silu16(__m512 x) {
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
  const __m512 r = _mm512_div_ps(one, _mm512_add_ps(one, e));                 // sigmoid(|x|)
  const __mmask16 negative = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
  return _mm512_mul_ps(x, _mm512_mask_mul_ps(r, negative, e, r));              // sigmoid(x) = e * r where x < 0
}

// What a tile needs of its vectors and dtype: fp32 accumulators (Acc, kLanes wide) and their arithmetic, the
// elements of K one step takes (kStep), a row's broadcast and a panel's columns (Vec), their multiply-add, the
// residual's load and the output's store, and the tile's rows. bf16 multiplies pairs of K (kStep 2) in every
// build, so its panels are laid out alike everywhere: with vdpbf16ps where the CPU has it, else widened to fp32.
struct Zmm {
  using Acc = __m512;
  static constexpr int64_t kLanes = 16;
  static constexpr int kRows = 12;
  static Acc zero() { return _mm512_setzero_ps(); }
  static Acc add(Acc a, Acc b) { return _mm512_add_ps(a, b); }
  static Acc mul(Acc a, Acc b) { return _mm512_mul_ps(a, b); }
  static Acc silu(Acc x) { return silu16(x); }
};
struct Fp32Tile : Zmm {
  using T = float;
  using Vec = __m512;
  static constexpr int64_t kStep = 1;
  static Vec row(const float* a) { return _mm512_set1_ps(*a); }
  static Vec weights(const float* w) { return _mm512_loadu_ps(w); }
  static Acc madd(Acc acc, Vec x, Vec w) { return _mm512_fmadd_ps(x, w, acc); }
  static Acc load(const float* r) { return _mm512_loadu_ps(r); }
  static void store(float* c, Acc v) { _mm512_storeu_ps(c, v); }
};
#if defined(MINIPAGED_BF16_PRODUCTS) && defined(__AVX512BF16__)
struct Bf16Tile : Zmm {
  using T = uint16_t;
  using Vec = __m512bh;
  static constexpr int64_t kStep = 2;
  static Vec row(const uint16_t* a) {  // the pair a[k], a[k + 1] in every 32-bit lane
    int32_t pair;
    std::memcpy(&pair, a, sizeof pair);
    return (__m512bh)_mm512_set1_epi32(pair);
  }
  static Vec weights(const uint16_t* w) { return (__m512bh)_mm512_loadu_si512(w); }
  static Acc madd(Acc acc, Vec x, Vec w) { return _mm512_dpbf16_ps(acc, x, w); }  // both products of a pair
  static Acc load(const uint16_t* r) { return load16(r); }
  static void store(uint16_t* c, Acc v) {  // round to nearest even (a NaN stays a NaN)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c), (__m256i)_mm512_cvtneps_pbh(v));
  }
};
#elif defined(MINIPAGED_BF16_PRODUCTS)
struct Bf16Tile : Zmm {  // AVX-512 without AVX512-BF16 (a Cascade Lake): the same panels, widened to fp32
  using T = uint16_t;
  using Vec = Pairs<__m512>;
  static constexpr int64_t kStep = 2;
  static Vec split(__m512i pairs) {
    return {_mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)),
            _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))))};
  }
  static Vec row(const uint16_t* a) {
    int32_t pair;
    std::memcpy(&pair, a, sizeof pair);
    return split(_mm512_set1_epi32(pair));
  }
  static Vec weights(const uint16_t* w) { return split(_mm512_loadu_si512(w)); }
  static Acc madd(Acc acc, Vec x, Vec w) { return _mm512_fmadd_ps(x.odd, w.odd, _mm512_fmadd_ps(x.even, w.even, acc)); }
  static Acc load(const uint16_t* r) { return load16(r); }
  static void store(uint16_t* c, Acc v) {  // round_bf16's rounding, a NaN kept a NaN, then the high halves
    const __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(round_bf16(v)), 16);
    const __m512i kept = _mm512_mask_mov_epi32(bits, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c), _mm512_cvtepi32_epi16(kept));
  }
};
#endif

#else  // AVX2 and FMA: 8 lanes

struct Ymm {
  using Acc = __m256;
  static constexpr int64_t kLanes = 8;
  static constexpr int kRows = 6;
  static Acc zero() { return _mm256_setzero_ps(); }
  static Acc add(Acc a, Acc b) { return _mm256_add_ps(a, b); }
  static Acc mul(Acc a, Acc b) { return _mm256_mul_ps(a, b); }
  static Acc silu(Acc x) {  // as silu16, lane by lane: the compiler vectorises the scalar exp_nonpositive
    alignas(32) float v[8];
    _mm256_store_ps(v, x);
#pragma omp simd
    for (int i = 0; i < 8; ++i) {
      const float e = exp_nonpositive(-std::fabs(v[i])), r = 1.f / (1.f + e);
      v[i] *= v[i] < 0.f ? e * r : r;
    }
    return _mm256_load_ps(v);
  }
};
struct Fp32Tile : Ymm {
  using T = float;
  using Vec = __m256;
  static constexpr int64_t kStep = 1;
  static Vec row(const float* a) { return _mm256_broadcast_ss(a); }
  static Vec weights(const float* w) { return _mm256_loadu_ps(w); }
  static Acc madd(Acc acc, Vec x, Vec w) { return _mm256_fmadd_ps(x, w, acc); }
  static Acc load(const float* r) { return _mm256_loadu_ps(r); }
  static void store(float* c, Acc v) { _mm256_storeu_ps(c, v); }
};
#if defined(MINIPAGED_BF16_PRODUCTS)
struct Bf16Tile : Ymm {  // the AVX-512 panels of pairs, widened to fp32 (AVX2 has no bf16 arithmetic)
  using T = uint16_t;
  using Vec = Pairs<__m256>;
  static constexpr int64_t kStep = 2;
  static constexpr int kRows = 4;  // two vectors per pair: 4 rows' 8 accumulators and the pairs fill the 16 ymm
  static Vec split(__m256i pairs) {
    return {_mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16)),
            _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))))};
  }
  static Vec row(const uint16_t* a) {
    int32_t pair;
    std::memcpy(&pair, a, sizeof pair);
    return split(_mm256_set1_epi32(pair));
  }
  static Vec weights(const uint16_t* w) { return split(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w))); }
  static Acc madd(Acc acc, Vec x, Vec w) { return _mm256_fmadd_ps(x.odd, w.odd, _mm256_fmadd_ps(x.even, w.even, acc)); }
  static Acc load(const uint16_t* r) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static void store(uint16_t* c, Acc v) {  // round to nearest even, a NaN kept a NaN, then the high halves
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i high = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    high = _mm256_blendv_epi8(high, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    // packus works within each 128-bit half: [h0..h3, h0..h3 | h4..h7, h4..h7]; quadwords 0 and 2 are h0..h7
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(high, high), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(c), _mm256_castsi256_si128(packed));
  }
};
#endif
#endif  // MINIPAGED_AVX512

// c[R, 2 lanes] = a[R, K] . the panel's columns from `panel` on (+ residual[R, 2 lanes] when there is one)
template <typename D, int R>
void product_tile(const typename D::T* a, int64_t lda, const typename D::T* panel, int64_t k_dim,
                  typename D::T* c, int64_t ldc, const typename D::T* residual, int64_t ldr) {
  constexpr int64_t kHalf = D::kLanes * D::kStep;  // where the tile's second vector of columns starts
  typename D::Acc lo[R], hi[R];  // every loop over them unrolled, so they live in registers
#pragma GCC unroll 12
  for (int i = 0; i < R; ++i) lo[i] = hi[i] = D::zero();
  for (int64_t k = 0; k < k_dim; k += D::kStep) {
    const typename D::Vec b0 = D::weights(panel + k * kPanel), b1 = D::weights(panel + k * kPanel + kHalf);
#pragma GCC unroll 12
    for (int i = 0; i < R; ++i) {
      const typename D::Vec x = D::row(a + i * lda + k);
      lo[i] = D::madd(lo[i], x, b0);
      hi[i] = D::madd(hi[i], x, b1);
    }
  }
#pragma GCC unroll 12
  for (int i = 0; i < R; ++i) {
    if (residual != nullptr) {
      lo[i] = D::add(lo[i], D::load(residual + i * ldr));
      hi[i] = D::add(hi[i], D::load(residual + i * ldr + D::kLanes));
    }
    D::store(c + i * ldc, lo[i]);
    D::store(c + i * ldc + D::kLanes, hi[i]);
  }
}

// c[R, 2 lanes] = silu(a . gate's columns) * (a . up's columns)
template <typename D, int R>
void glu_tile(const typename D::T* a, int64_t lda, const typename D::T* gate, const typename D::T* up, int64_t k_dim,
              typename D::T* c, int64_t ldc) {
  constexpr int64_t kHalf = D::kLanes * D::kStep;
  typename D::Acc g0[R], g1[R], u0[R], u1[R];
#pragma GCC unroll 6
  for (int i = 0; i < R; ++i) g0[i] = g1[i] = u0[i] = u1[i] = D::zero();
  for (int64_t k = 0; k < k_dim; k += D::kStep) {
    const typename D::Vec w0 = D::weights(gate + k * kPanel), w1 = D::weights(gate + k * kPanel + kHalf);
    const typename D::Vec v0 = D::weights(up + k * kPanel), v1 = D::weights(up + k * kPanel + kHalf);
#pragma GCC unroll 6
    for (int i = 0; i < R; ++i) {
      const typename D::Vec x = D::row(a + i * lda + k);
      g0[i] = D::madd(g0[i], x, w0);
      g1[i] = D::madd(g1[i], x, w1);
      u0[i] = D::madd(u0[i], x, v0);
      u1[i] = D::madd(u1[i], x, v1);
    }
  }
#pragma GCC unroll 6
  for (int i = 0; i < R; ++i) {
    D::store(c + i * ldc, D::mul(D::silu(g0[i]), u0[i]));
    D::store(c + i * ldc + D::kLanes, D::mul(D::silu(g1[i]), u1[i]));
  }
}

// One tile column's tiles, for over_rows: the product (with its residual, if any) and the gate-and-up pair.
template <typename D>
struct ProductTiles {
  using T = typename D::T;
  const T* a;
  int64_t lda;
  const T* panel;
  int64_t k;
  T* c;
  int64_t ldc;
  const T* residual;
  int64_t ldr;
  template <int R>
  void operator()(int64_t row) const {
    product_tile<D, R>(a + row * lda, lda, panel, k, c + row * ldc, ldc, residual ? residual + row * ldr : nullptr,
                       ldr);
  }
};
template <typename D>
struct GluTiles {
  using T = typename D::T;
  const T* a;
  int64_t lda;
  const T* gate;
  const T* up;
  int64_t k;
  T* c;
  int64_t ldc;
  template <int R>
  void operator()(int64_t row) const {
    glu_tile<D, R>(a + row * lda, lda, gate, up, k, c + row * ldc, ldc);
  }
};

// fn.operator()<R>(row) over the rows [0, m): full tiles of MaxRows, then one tile of what is left
template <int MaxRows, int R = MaxRows, typename Fn>
inline void remainder_tile(int64_t rest, int64_t row, const Fn& fn) {
  if constexpr (R > 0) {
    if (rest == R) return fn.template operator()<R>(row);
    remainder_tile<MaxRows, R - 1>(rest, row, fn);
  }
}
template <int MaxRows, typename Fn>
inline void over_rows(int64_t m, const Fn& fn) {
  int64_t row = 0;
  for (; row + MaxRows <= m; row += MaxRows) fn.template operator()<MaxRows>(row);
  remainder_tile<MaxRows>(m - row, row, fn);
}

// The calling thread's share [lo, hi) of n_panels panels, split evenly.
inline void my_panels(int64_t n_panels, int64_t& lo, int64_t& hi) {
  const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
  lo = n_panels * t / nt;
  hi = n_panels * (t + 1) / nt;
}

// The products' drivers, per dtype: a panel of 32 columns is kPanel * k elements in either layout; a tile's columns
// start 2 * kLanes columns (times kStep elements) after the last's.
template <typename D>
void pack_panels(const typename D::T* w, typename D::T* out, int64_t n, int64_t k) {
#pragma omp parallel for
  for (int64_t p = 0; p < n / kPanel; ++p)
    for (int64_t kk = 0; kk < k; kk += D::kStep)
      for (int64_t j = 0; j < kPanel; ++j)
        for (int64_t e = 0; e < D::kStep; ++e)
          out[p * k * kPanel + kk * kPanel + j * D::kStep + e] = w[(p * kPanel + j) * k + kk + e];
}

// Rows a product takes at a time: each thread's panels stream once per block, while the block's rows are re-read
// from cache for every panel; past 1,024 rows of a prefill those re-reads fell out of cache (the AVX2 tiles, which
// read the rows twice per panel, lost 10 % at 2,048 rows before the split).
constexpr int64_t kRowBlock = 1024;

// The loop both products share: each thread's panels, a tile column at a time, over blocks of kRowBlock rows.
// fn(r0, rows, w, col) runs the tiles of rows [r0, r0 + rows) for the output columns from col on, whose weights
// start at element w of the packed weight.
template <typename D, typename Fn>
void over_panels(int64_t n, int64_t k, int64_t m, const Fn& fn) {
#pragma omp parallel
  {
    int64_t lo, hi;
    my_panels(n / kPanel, lo, hi);
    for (int64_t r0 = 0; r0 < m; r0 += kRowBlock)
      for (int64_t p = lo; p < hi; ++p)
        for (int64_t col = p * kPanel; col < (p + 1) * kPanel; col += 2 * D::kLanes)
          fn(r0, std::min(kRowBlock, m - r0), p * k * kPanel + (col - p * kPanel) * D::kStep, col);
  }
}

template <typename D>
void decode_product(const void* a, int64_t lda, const void* packed, int64_t n, int64_t k, void* c, int64_t ldc,
                    const void* residual, int64_t ldr, int64_t m) {
  using T = typename D::T;
  const T* at = static_cast<const T*>(a);
  const T* wt = static_cast<const T*>(packed);
  const T* rt = static_cast<const T*>(residual);
  T* ct = static_cast<T*>(c);
  over_panels<D>(n, k, m, [&](int64_t r0, int64_t rows, int64_t w, int64_t col) {
    over_rows<D::kRows>(rows, ProductTiles<D>{at + r0 * lda, lda, wt + w, k, ct + r0 * ldc + col, ldc,
                                              rt ? rt + r0 * ldr + col : nullptr, ldr});
  });
}

template <typename D>
void decode_glu(const void* a, int64_t lda, const void* gate, const void* up, int64_t n, int64_t k, void* c,
                int64_t ldc, int64_t m) {
  using T = typename D::T;
  const T* at = static_cast<const T*>(a);
  const T* gt = static_cast<const T*>(gate);
  const T* ut = static_cast<const T*>(up);
  T* ct = static_cast<T*>(c);
  over_panels<D>(n, k, m, [&](int64_t r0, int64_t rows, int64_t w, int64_t col) {
    over_rows<D::kRows / 2>(rows, GluTiles<D>{at + r0 * lda, lda, gt + w, ut + w, k, ct + r0 * ldc + col, ldc});
  });
}
#endif  // MINIPAGED_PRODUCTS

}  // namespace

extern "C" {

// dtype codes: 0 = fp32, 1 = bf16. Every pointer is to contiguous memory, indices are int32. Output rows of
// sequences with more than max_q_len query rows are not written.
void minipaged_paged_attention(const void* query, void* out, const void* key_cache, const void* value_cache,
                               const int32_t* block_tables, int64_t table_stride, const int32_t* cu_seqlens_q,
                               const int32_t* seq_lens, int64_t num_seqs, int64_t num_q_heads, int64_t num_kv_heads,
                               int64_t head_dim, int64_t block_size, float scale, int64_t max_q_len,
                               int cache_dtype, int query_dtype) {
  const Shape sh{num_q_heads, num_kv_heads, head_dim, block_size, table_stride, scale};
  using bf16 = uint16_t;
  const auto* kb = static_cast<const bf16*>(key_cache);
  const auto* vb = static_cast<const bf16*>(value_cache);
  const auto* kf = static_cast<const float*>(key_cache);
  const auto* vf = static_cast<const float*>(value_cache);
  const auto* qb = static_cast<const bf16*>(query);
  const auto* qf = static_cast<const float*>(query);
  auto* ob = static_cast<bf16*>(out);
  auto* of = static_cast<float*>(out);
  if (cache_dtype == 1 && query_dtype == 1)
    paged_attention(qb, ob, kb, vb, block_tables, cu_seqlens_q, seq_lens, num_seqs, max_q_len, sh);
  else if (cache_dtype == 1)
    paged_attention(qf, of, kb, vb, block_tables, cu_seqlens_q, seq_lens, num_seqs, max_q_len, sh);
  else if (query_dtype == 1)
    paged_attention(qb, ob, kf, vf, block_tables, cu_seqlens_q, seq_lens, num_seqs, max_q_len, sh);
  else
    paged_attention(qf, of, kf, vf, block_tables, cu_seqlens_q, seq_lens, num_seqs, max_q_len, sh);
}

// What this build has: bit 0 the AVX-512 tiles; bits 1 and 2 the vectors its portable loops were compiled
// for, AVX2 or NEON (neither: the target's baseline, SSE2 on x86-64); bit 3 the fp32 decode products (AVX-512, or
// AVX2 with FMA), bit 4 the bf16 ones (the same builds, except with AMX).
int minipaged_features() {
  int features = 0;
#if defined(MINIPAGED_AVX512)
  features |= 1;
#endif
#if defined(MINIPAGED_PRODUCTS)
  features |= 8;
#endif
#if defined(MINIPAGED_BF16_PRODUCTS)
  features |= 16;
#endif
#if defined(__AVX2__)
  features |= 2;
#endif
#if defined(__ARM_NEON)
  features |= 4;
#endif
  return features;
}

void minipaged_rms_norm(const void* x, int64_t x_stride, const void* weight, void* out, int64_t rows, int64_t dim,
                        float eps, int dtype) {
  if (dtype == 1)
    rms_norm(static_cast<const uint16_t*>(x), x_stride, static_cast<const uint16_t*>(weight),
             static_cast<uint16_t*>(out), rows, dim, eps);
  else
    rms_norm(static_cast<const float*>(x), x_stride, static_cast<const float*>(weight), static_cast<float*>(out),
             rows, dim, eps);
}

void minipaged_rope_and_cache(const void* qkv, int64_t qkv_stride, const void* cos, const void* sin, void* q_out,
                              void* key_cache, void* value_cache, const int64_t* slots, int64_t num_tokens,
                              int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim, int dtype) {
  if (dtype == 1) {
    using T = uint16_t;
    rope_and_cache(static_cast<const T*>(qkv), qkv_stride, static_cast<const T*>(cos), static_cast<const T*>(sin),
                   static_cast<T*>(q_out), static_cast<T*>(key_cache), static_cast<T*>(value_cache), slots,
                   num_tokens, num_q_heads, num_kv_heads, head_dim);
  } else {
    using T = float;
    rope_and_cache(static_cast<const T*>(qkv), qkv_stride, static_cast<const T*>(cos), static_cast<const T*>(sin),
                   static_cast<T*>(q_out), static_cast<T*>(key_cache), static_cast<T*>(value_cache), slots,
                   num_tokens, num_q_heads, num_kv_heads, head_dim);
  }
}

// ---- decode-sized products: see above. dtype: 0 fp32, 1 bf16. Callers check minipaged_features() first (bit 3
// fp32, bit 4 bf16): a dtype the build lacks does nothing. Shapes: n a multiple of 32 (and k even in bf16); a [m, k]
// with rows lda apart; c [m, n] with rows ldc apart.
void minipaged_pack_panels(const void* w, void* out, int64_t n, int64_t k, int dtype) {
#if defined(MINIPAGED_PRODUCTS)
  if (dtype == 0) pack_panels<Fp32Tile>(static_cast<const float*>(w), static_cast<float*>(out), n, k);
#endif
#if defined(MINIPAGED_BF16_PRODUCTS)
  if (dtype == 1) pack_panels<Bf16Tile>(static_cast<const uint16_t*>(w), static_cast<uint16_t*>(out), n, k);
#endif
}

// c = a . W^T (+ residual, rows ldr apart, when it is not null; it may be c itself)
void minipaged_decode_product(const void* a, int64_t lda, const void* packed, int64_t n, int64_t k, void* c,
                              int64_t ldc, const void* residual, int64_t ldr, int64_t m, int dtype) {
#if defined(MINIPAGED_PRODUCTS)
  if (dtype == 0) decode_product<Fp32Tile>(a, lda, packed, n, k, c, ldc, residual, ldr, m);
#endif
#if defined(MINIPAGED_BF16_PRODUCTS)
  if (dtype == 1) decode_product<Bf16Tile>(a, lda, packed, n, k, c, ldc, residual, ldr, m);
#endif
}

// c = silu(a . Wgate^T) * (a . Wup^T)
void minipaged_decode_glu(const void* a, int64_t lda, const void* gate, const void* up, int64_t n, int64_t k,
                          void* c, int64_t ldc, int64_t m, int dtype) {
#if defined(MINIPAGED_PRODUCTS)
  if (dtype == 0) decode_glu<Fp32Tile>(a, lda, gate, up, n, k, c, ldc, m);
#endif
#if defined(MINIPAGED_BF16_PRODUCTS)
  if (dtype == 1) decode_glu<Bf16Tile>(a, lda, gate, up, n, k, c, ldc, m);
#endif
}

}  // extern "C"

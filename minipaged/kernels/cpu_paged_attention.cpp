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
// output are fp32 [num_tokens, num_q_heads, head_dim]; scores and sums are fp32. Sequence i's
// query rows are cu_seqlens_q[i] .. cu_seqlens_q[i+1]-1, the last q_len of its seq_lens[i]
// tokens, so a decode is a sequence with one row. kernels/reference.py is the specification;
// tests/test_cpu_kernel.py compares the two.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
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
  for (int64_t i = 0; i < d; ++i) s += q[i] * widen(k[i]);
  return s;
}

template <typename T>
inline void axpy(float p, const T* v, float* acc, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) acc[i] += p * widen(v[i]);
}

struct Shape {
  int64_t num_q_heads, num_kv_heads, head_dim, block_size, table_stride;
  float scale;
};

// One tile: rows row0 .. row0+rows-1 of the packed query, the first of them at absolute position
// first_pos of a sequence whose block table is `table`. Every query head of every row is handled at
// once, so each token's K row (all its KV heads, contiguous) and V row are read in order, once.
template <typename T, int64_t kHeadDim>  // kHeadDim 0: any head_dim, read at run time
void attend_tile(const float* query, float* out, const T* key_cache, const T* value_cache, const int32_t* table,
                 int64_t row0, int64_t rows, int64_t first_pos, const Shape& sh) {
  const int64_t hq = sh.num_q_heads, G = hq / sh.num_kv_heads, bs = sh.block_size;
  const int64_t d = kHeadDim ? kHeadDim : sh.head_dim;  // a constant lets the compiler unroll dot and axpy
  const int64_t slot_stride = sh.num_kv_heads * d;  // elements from one token's K row to the next
  const int64_t nq = rows * hq;                       // query vectors j = r * hq + head
  std::vector<float> m(nq, -std::numeric_limits<float>::infinity()), l(nq, 0.f), acc(nq * d, 0.f), s(nq * bs);
  std::vector<int64_t> seen(rows);
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
          __builtin_prefetch(next_k + t * slot_stride + i);
          __builtin_prefetch(next_v + t * slot_stride + i);
        }
      for (int64_t r = 0; r < rows; ++r) {
        if (t >= seen[r]) continue;
        const float* qr = query + (row0 + r) * hq * d;
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
          axpy(s[j * bs + t], v_row + (h / G) * d, acc.data() + j * d, d);
        }
      }
    }
  }
  for (int64_t j = 0; j < nq; ++j) {
    float* o = out + (row0 * hq + j) * d;  // row r, head h: (row0 + r) * hq + h = row0 * hq + j
    const float inv = 1.f / l[j];
    for (int64_t i = 0; i < d; ++i) o[i] = acc[j * d + i] * inv;
  }
}

template <typename T>
void paged_attention(const float* query, float* out, const T* key_cache, const T* value_cache,
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
    if (sh.head_dim == 64)
      attend_tile<T, 64>(query, out, key_cache, value_cache, table, row0, rows, first_pos, sh);
    else if (sh.head_dim == 128)
      attend_tile<T, 128>(query, out, key_cache, value_cache, table, row0, rows, first_pos, sh);
    else
      attend_tile<T, 0>(query, out, key_cache, value_cache, table, row0, rows, first_pos, sh);
  }
}

}  // namespace

extern "C" {

// cache_dtype: 0 = fp32, 1 = bf16. Every pointer is to contiguous memory, indices are int32. Output rows of
// sequences with more than max_q_len query rows are not written.
void minipaged_paged_attention(const float* query, float* out, const void* key_cache, const void* value_cache,
                               const int32_t* block_tables, int64_t table_stride, const int32_t* cu_seqlens_q,
                               const int32_t* seq_lens, int64_t num_seqs, int64_t num_q_heads, int64_t num_kv_heads,
                               int64_t head_dim, int64_t block_size, float scale, int64_t max_q_len,
                               int cache_dtype) {
  const Shape sh{num_q_heads, num_kv_heads, head_dim, block_size, table_stride, scale};
  if (cache_dtype == 1)
    paged_attention(query, out, static_cast<const uint16_t*>(key_cache), static_cast<const uint16_t*>(value_cache),
                    block_tables, cu_seqlens_q, seq_lens, num_seqs, max_q_len, sh);
  else
    paged_attention(query, out, static_cast<const float*>(key_cache), static_cast<const float*>(value_cache),
                    block_tables, cu_seqlens_q, seq_lens, num_seqs, max_q_len, sh);
}

}  // extern "C"

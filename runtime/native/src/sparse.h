// Sparse attention's block summaries and block selection, for a whole engine step in one call.
//
// Summaries live in preallocated tensors indexed by physical block id (one set per layer) and are
// kept current when keys are written into the paged cache; selection scores every (request, KV
// head, block) of a step and writes, per (request, KV head), the kept blocks as row ids of the
// cache viewed as (blocks * kv_heads, 1, block_size, head_dim): phys * kv_heads + head.
#pragma once

#include <cstdint>

namespace ucm::sparse {

enum class DType : int { F32 = 0, BF16 = 1, F16 = 2, U8 = 3 };  // U8: quantized representations only
enum class Mode : int { Bound = 0, Mean = 1, Hash = 2, Both = 3 };

// What selection reads per (block, head) is the representation `rep`, derived at write time:
//   Bound: [c | r] with c = (lo + hi) / 2, r = (hi - lo) / 2, so that Quest's bound
//          sum_d max(q_d lo_d, q_d hi_d) = q . c + |q| . r  (two dot products);
//   Mean:  the mean key;
//   Both:  [mean | c | r]: each query head's blocks are ranked by both estimates (two softmaxes over
//          the blocks, averaged): a block either one favours is kept.
// Bound with rep_dtype U8: [c_q + 128 | r_q] in bytes and one scale s per (block, head) in rep_scale,
// c_q = round(c / s) in [-127, 127] and r_q = ceil((r + |c - s c_q|) / s) in [0, 255]: the centre's
// rounding error is folded into the radius, so q . (s c_q) + |q| . (s r_q) is still an upper bound
// of every q . k in the block. Half the bytes of bf16, scored in integer dot products (exact, so the
// same on every machine) against the query quantized per head to int8.
// Exact state behind it is kept for maintenance: lo/hi (Bound, Both; in the cache's dtype: minima
// and maxima of stored values are exact) and the running mean in float32 (Mean, Both).
struct Summaries {
  Mode mode;
  DType dtype;              // of lo/hi
  DType rep_dtype;          // of rep
  void* lo;                 // Bound, Both: (P, Hkv, D)
  void* hi;                 // Bound, Both: (P, Hkv, D)
  float* mean;              // Mean, Both: (P, Hkv, D)
  void* rep;                // Bound: (P, Hkv, 2, D); Mean: (P, Hkv, D); Both: (P, Hkv, 3, D)
  float* rep_scale;         // rep_dtype U8: (P, Hkv)
  uint8_t* hashes;          // Hash: (P, B, Hkv, W) sign bits of each token's projected key
  const float* projection;  // Hash: (D, W * 8) row-major
  int32_t* count;           // (P,) tokens summarized; 0 after an invalidation
  int64_t block_size, kv_heads, head_dim, hash_bytes;
};

// Keys (T, Hkv, D) with row stride `token_stride` (elements), written at `slots` (-1: padding).
void write(const Summaries& s, const void* keys, DType key_dtype, int64_t token_stride, const int64_t* slots,
           int64_t tokens);

// Recompute `blocks[i]`'s summary from its first `fill[i]` tokens in the paged key cache: element
// (t, d) of block b, head h lies at base + b * block_stride + h * head_stride + positions[t * D + d].
void refresh(const Summaries& s, const void* key_cache, DType cache_dtype, int64_t block_stride,
             int64_t head_stride, const int32_t* positions, const int32_t* blocks, const int32_t* fill, int64_t n);

struct Selection {
  const void* query;        // (tokens, H, D) with row stride token_stride
  DType query_dtype;
  int64_t token_stride, heads;
  const int32_t* tokens;    // (R,) the query row of each request
  int64_t rows;
  const int32_t* block_table;  // (R, table_stride) physical blocks in logical order
  int64_t table_stride;
  const int32_t* seq_lens;  // (R,)
  const int32_t* budget;    // (R,) blocks kept per KV head, <= the request's blocks
  int64_t init, local;      // first / last blocks always kept
  int64_t keep_channels;    // Mean: score with the channels where the group's |q| is largest (0: all)
  float temperature;        // logit per unit of score (the attention scale; per bit for Hash)
  float mass;               // > 0: keep blocks in score order until this share of the group's
                            // estimated attention (the windows first), at most budget (PSA)
  int32_t* out;             // (R * Hkv, out_stride)
  int64_t out_stride;
  int32_t* kept;            // optional (R * Hkv,): blocks kept per (request, KV head)
  float* scores;            // optional (R * Hkv, score_stride): each block's group score, for tests
  int64_t score_stride;
  const float* prior;       // optional (P * Hkv,): added to each block's group score, by physical
                            // block and KV head (the prompt's own attention, see ucm/sparse/serving.py)
};

void select(const Summaries& s, const Selection& sel);

// Off-load: one layer's kept arena blocks into their request's slots, in place of a full copy per
// step. Table entries from `resident_planes` on name arena planes (block * kv_heads + head, less
// resident_planes); row r * kv_heads + h of the table is request r's head h, whose off-loaded blocks
// are attended through the cache planes slots[r * slot_stride + j] * kv_heads + h. `holds[plane]`
// (one per cache plane) is the arena plane a slot plane holds (-1: none) and `slot_of[arena plane]`
// the slot j that holds it: a kept block already in a slot is a hit and is not copied again; a miss
// takes a slot no kept block holds. Entries are rewritten to the slot planes. Returns the planes
// copied, or -1 when a row has fewer slots than kept arena blocks.
struct Fetch {
  int32_t* table;  // (rows, table_stride)
  int64_t rows, width, table_stride, kv_heads, resident_planes;
  const int64_t* slots;  // (rows / kv_heads, slot_stride), -1 past a request's slots
  int64_t slot_stride;
  int32_t* holds;    // (resident_planes,)
  int32_t* slot_of;  // (arena planes,)
  const uint8_t* arena;  // (arena planes, plane_bytes)
  uint8_t* planes;       // (resident_planes, plane_bytes): the layer's cache
  int64_t plane_bytes;
};

int64_t fetch(const Fetch& f);

}  // namespace ucm::sparse

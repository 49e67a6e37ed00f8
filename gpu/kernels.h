// Launchers of the CUDA backend's kernels. Plain C++ on purpose (no core/ headers): this file is
// included by the .cu translation units (nvcc) and by cuda_backend.cc (the host compiler). Every
// launcher enqueues on `stream`, returns immediately, and reports launch errors only
// (cudaGetLastError after the launch); execution errors surface at the next synchronisation.
// Every launcher first clears the runtime's last-error slot (clear_stale_error), so what it
// returns is its own launches' result, never an error an earlier call left behind.
// Arguments are assumed validated by the caller (CudaBackend).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "gpu/topk_radix.h"

namespace specontext::gpu::kernels {

// The last-error slot (one per host thread) keeps a non-sticky error until cudaGetLastError reads
// it, and a launch that succeeds leaves it as it was: a "not ready" left by a raw
// cudaEventQuery / cudaStreamQuery would make the check after a good launch (ours, or CUB's
// cudaPeekAtLastError) report failure. Such an error was already returned by the call that made
// it, so dropping it loses nothing; a sticky error (a faulted context) is not cleared and fails
// the launch itself.
inline void clear_stale_error() { (void)cudaGetLastError(); }

enum class TableType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };

// Element type of KV pages and working sets (core's DType kF32 / kF16 / kBF16; gpu/kv_convert.h
// has the device conversions). The kernels are templates on it; one type per launch.
enum class KvType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };
inline constexpr int64_t kv_type_bytes(KvType t) { return t == KvType::kF32 ? 4 : 2; }

// out[i, :] = table[ids[i], :] as f32. An id outside [0, rows) yields a row of NaN (the device
// cannot return a Status without a synchronisation; NaN makes the bug loud).
cudaError_t launch_embed(const int32_t* ids, int64_t n, const void* table, TableType type,
                         int64_t rows, int64_t cols, float* out, cudaStream_t stream);

// dst[i] = bf16(src[i]), round to nearest even. dst holds raw bf16 bits.
cudaError_t launch_f32_to_bf16(const float* src, int64_t n, uint16_t* dst, cudaStream_t stream);

// y[r, c] += bias[c] for r < rows, c < cols.
cudaError_t launch_bias_add(float* y, const float* bias, int64_t rows, int64_t cols,
                            cudaStream_t stream);

// y = x / sqrt(mean(x²) + eps) · weight per row; y may alias x.
cudaError_t launch_rmsnorm(const float* x, const float* weight, int64_t rows, int64_t dim,
                           float eps, float* y, cudaStream_t stream);

// In-place rotary embedding on x[n_tokens, n_heads, head_dim]; positions and inv_freq are device
// arrays ([n_tokens] and [head_dim / 2]).
cudaError_t launch_rope(float* x, int64_t n_tokens, int64_t n_heads, int64_t head_dim,
                        const int64_t* positions, const float* inv_freq, bool interleaved,
                        float mscale, cudaStream_t stream);

// out = silu(gate) · up; out may alias gate or up.
cudaError_t launch_swiglu(const float* gate, const float* up, int64_t n, float* out,
                          cudaStream_t stream);

// x += y
cudaError_t launch_add(float* x, const float* y, int64_t n, cudaStream_t stream);

// Writes k, v [n_tokens, kv_heads, head_dim] (f32) at positions start_pos.. of a paged cache of
// element type `type`, rounding to nearest even as core's convert_from_f32 (kv_convert.h).
// page_table is a DEVICE array: [n_touched] K page pointers then [n_touched] V page pointers,
// for the pages first_page .. first_page + n_touched - 1.
cudaError_t launch_kv_append(const float* k, const float* v, int64_t n_tokens, int64_t start_pos,
                             void* const* page_table, KvType type, int64_t first_page, int64_t n_touched,
                             int64_t page_size, int64_t kv_heads, int64_t head_dim, cudaStream_t stream);

// ---- attention ----

// Largest head_dim the attention kernels handle (8 accumulators per lane).
inline constexpr int64_t kAttentionMaxHeadDim = 256;
// Keys per split-K chunk are a multiple of this (one key per lane per shared-memory tile).
inline constexpr int64_t kAttentionKeyTile = 32;
// Warps per attention block; a block serves kAttentionWarps · queries_per_warp query vectors.
inline constexpr int kAttentionWarps = 4;

// One sequence of the batch, as the kernels see it (uploaded as an array).
struct AttentionItemMeta {
  int64_t token_offset;       // first row of the item in q / out
  int64_t n_tokens;           // query rows of the item
  int64_t start_pos;          // position of the first query row
  int64_t page_size;
  int64_t page_table_offset;  // K pages at page_table[off, off + n_pages), V pages right after
  int64_t n_pages;            // pages covering positions [0, start_pos + n_tokens)
  int64_t n_tiles;            // query tiles (per KV head)
  int64_t n_chunks;           // key chunks: ceil((start_pos + n_tokens) / chunk_size)
  int64_t row_begin;          // compact index of the item's first row (prefix of n_tokens)
};

struct AttentionLaunch {
  const float* q = nullptr;  // [rows, n_heads, head_dim]
  float* out = nullptr;      // [rows, n_heads, head_dim]
  const AttentionItemMeta* items = nullptr;  // device [n_items]
  const int64_t* block_begin = nullptr;      // device [n_items + 1]: prefix of n_tiles·n_chunks
  const int64_t* row_begin = nullptr;        // device [n_items + 1]: prefix of n_tokens
  void* const* page_table = nullptr;         // device; pages of kv_type elements
  KvType kv_type = KvType::kF32;             // of every item's pages (widened to f32 on staging)
  int64_t n_items = 0;
  int64_t n_heads = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
  int64_t chunk_size = 0;    // keys per split-K chunk (multiple of kAttentionKeyTile)
  int64_t n_chunks_max = 0;  // stride of the partial buffers; 1 = no split, write out directly
  int64_t total_blocks = 0;  // block_begin[n_items]
  int64_t total_rows = 0;    // row_begin[n_items]
  int queries_per_warp = 1;  // 1, 2 or 4
  float scale = 0.0f;        // 1 / sqrt(head_dim)
  // Split-K partial results, indexed by (r · n_heads + head) · n_chunks_max + chunk where r is
  // the compact row index (row_begin of the item + row within the item); unused
  // (may be null) when n_chunks_max == 1.
  float* partial_o = nullptr;  // [.., head_dim], unnormalised
  float* partial_m = nullptr;  // running max of the chunk, in log2 units
  float* partial_l = nullptr;  // sum of exp2(score - m) of the chunk
};

// Shared memory of one attention block (bytes).
size_t attention_smem_bytes(int64_t head_dim, int queries_per_warp);

// Partial kernel (+ merge kernel when n_chunks_max > 1).
cudaError_t launch_attention(const AttentionLaunch& a, cudaStream_t stream);

// ---- sparse decode over per-sequence working sets ----
// A working set is [kv_heads][slots][head_dim] elements of the cache's KvType for K and for V
// (device memory); head h attends to its first counts[h] slots.

// One copy of kv_gather; the same layout as core's GatherEntry (static_assert in sparse_plan.cc).
struct GatherEntryMeta {
  int32_t kv_head;
  int32_t token;
  int32_t slot;
};

struct KvGatherLaunch {
  const GatherEntryMeta* entries = nullptr;  // device [n_entries]
  // Device: K pointers of logical pages first_page .. first_page + n_pages - 1, then the V
  // pointers of the same pages.
  void* const* page_table = nullptr;
  void* ws_k = nullptr;  // device working set, the cache's element type
  void* ws_v = nullptr;
  KvType kv_type = KvType::kF32;  // elements are copied unchanged; only their size matters
  int64_t n_entries = 0;
  int64_t first_page = 0;
  int64_t n_pages = 0;
  int64_t page_size = 0;
  int64_t slots = 0;
  int64_t head_dim = 0;
  // head_dim · kv_type_bytes(kv_type) % 16 == 0 and every page and working-set base 16-byte aligned: rows
  // copy in 16-byte units (uint4); else in elements.
  bool vec16 = false;
};

// One warp per entry copies the K and V rows (head_dim elements) of (kv_head, token) into
// (kv_head, slot).
// Destinations must be distinct (the planner checks).
cudaError_t launch_kv_gather(const KvGatherLaunch& g, cudaStream_t stream);

// One sequence of a sparse batch, as the kernels see it.
struct SparseItemMeta {
  const void* k;  // device working set of the item (SparseAttentionLaunch::kv_type elements)
  const void* v;
  int64_t token_offset;   // first row of the item in q / out
  int64_t n_tokens;       // query rows; each attends to the whole working set
  int64_t slots;          // row stride of one head's K/V
  int64_t counts_offset;  // counts of the item's KV heads: counts[counts_offset + kvh]
  int64_t n_tiles;        // query tiles (per KV head)
  int64_t n_chunks;       // slot chunks: ceil(max_h counts[h] / chunk_size), at least 1
  int64_t row_begin;      // compact index of the item's first row (prefix of n_tokens)
  // attention_indexed only (k, v unused; slots is the stride of one head's indices): the item's
  // K page pointers at page_table[pages_offset ..], then its n_pages V pointers; its indices at
  // indices[indices_offset + kvh · slots + j].
  int64_t pages_offset;
  int64_t n_pages;
  int64_t page_size;
  int64_t indices_offset;
};

// Same work split as AttentionLaunch: blocks of (item, query tile, key chunk) x KV heads, a
// partial kernel and, when n_chunks_max > 1, a merge kernel. No causal mask. A (row, head)
// whose KV head has counts == 0 gets zeros.
struct SparseAttentionLaunch {
  const float* q = nullptr;               // [rows, n_heads, head_dim]
  float* out = nullptr;                   // [rows, n_heads, head_dim]
  const SparseItemMeta* items = nullptr;  // device [n_items]
  const int64_t* block_begin = nullptr;   // device [n_items + 1]: prefix of n_tiles·n_chunks
  const int64_t* row_begin = nullptr;     // device [n_items + 1]: prefix of n_tokens
  const int32_t* counts = nullptr;        // device [n_items · kv_heads]
  KvType kv_type = KvType::kF32;          // of every item's working set (widened on staging)
  int64_t n_items = 0;
  int64_t n_heads = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
  int64_t chunk_size = 0;    // slots per split-K chunk (multiple of kAttentionKeyTile)
  int64_t n_chunks_max = 0;  // stride of the partial buffers; 1 = no split
  int64_t total_blocks = 0;
  int64_t total_rows = 0;
  int queries_per_warp = 1;  // 1, 2 or 4
  float scale = 0.0f;        // 1 / sqrt(head_dim)
  // Split-K partials, indexed like AttentionLaunch's; unused when n_chunks_max == 1.
  float* partial_o = nullptr;
  float* partial_m = nullptr;  // log2 units
  float* partial_l = nullptr;
  // attention_indexed only: device page tables and token indices of every item (see
  // SparseItemMeta); null for working sets.
  void* const* page_table = nullptr;
  const int32_t* indices = nullptr;
};

cudaError_t launch_attention_sparse(const SparseAttentionLaunch& a, cudaStream_t stream);
// The same kernel pair over the selected positions of each item's paged cache, read in place:
// key j of KV head h is token indices[indices_offset + h · slots + j] (j < counts[h]).
cudaError_t launch_attention_indexed(const SparseAttentionLaunch& a, cudaStream_t stream);

// ---- retrieval head (SpeContext): scores and top-k selection ----

// Threads of a retrieval-score block; a block stages `tile` K rows of one KV head at a time and
// each thread scores one (row, part) against all the group's queries, 8 heads per pass.
inline constexpr int kRetrievalThreads = 128;
inline constexpr int kRetrievalHeadsPerPass = 8;
inline constexpr int64_t kRetrievalMaxHeadDim = 256;
// Static shared memory of the score kernel (its row_base[kRetrievalThreads] pointer array), on top
// of the dynamic smem_bytes: a launch needs both within the device's per-block limit.
inline constexpr size_t kRetrievalStaticSmemBytes = kRetrievalThreads * sizeof(const float*);

struct RetrievalScoresLaunch {
  const float* q = nullptr;        // device [n_heads][head_dim]
  // The head's paged K cache: block b holds tokens [b·block_tokens, (b+1)·block_tokens),
  // [block_tokens][n_kv_heads][head_dim] elements of k_type (the KV cache's), widened to f32 as
  // the score kernel stages them. A device array of device pointers in a launch (the plan holds
  // the caller's host table until CudaBackend uploads it).
  const void* const* k_blocks = nullptr;
  KvType k_type = KvType::kF32;
  int64_t block_tokens = 0;
  float* out = nullptr;            // device [n_kv_heads][length]
  float* logits = nullptr;         // scratch [n_heads][length], log2 units (q pre-scaled)
  float* partial_m = nullptr;      // scratch [n_heads][blocks_per_head]: block max (log2 units)
  float* partial_l = nullptr;      // scratch [n_heads][blocks_per_head]: Σ exp2(logit - max)
  float* stats = nullptr;          // scratch [n_heads][2]: softmax max and 1 / sum
  int64_t length = 0;
  int64_t n_heads = 0;
  int64_t n_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t group = 0;             // n_heads / n_kv_heads
  int64_t tokens_per_block = 0;  // multiple of tile
  int64_t blocks_per_head = 0;   // ceil(length / tokens_per_block)
  int parts = 1;                 // threads per K row (1, 2, 4): head_dim split into parts
  int tile = 0;                  // rows per stage: kRetrievalThreads / parts
  int part_dims = 0;             // dims per part, multiple of 4 (zero-padded beyond head_dim)
  int k_stride = 0;              // floats between staged rows: ≡ 4 (mod 32), conflict-free float4 reads
  bool vec4 = false;             // K rows load 4 elements at a time (head_dim % 4 == 0, every block
                                 // aligned to 4 elements: 16 bytes for f32, 8 for f16 / bf16)
  float q_scale = 0.0f;          // log2(e) / sqrt(head_dim)
  size_t smem_bytes = 0;         // dynamic shared memory of the score kernel
  // smem_bytes + kRetrievalStaticSmemBytes exceeds the default per-block limit: the launcher
  // raises the kernel's cudaFuncAttributeMaxDynamicSharedMemorySize to smem_bytes first.
  bool smem_opt_in = false;
};

// logits + block stats, stats merge, group max of the softmax (three kernels on `stream`).
cudaError_t launch_retrieval_scores(const RetrievalScoresLaunch& a, cudaStream_t stream);

// Threads of the selection kernels (8 warps).
inline constexpr int kSelectThreads = 256;
inline constexpr int kSelectWarps = kSelectThreads / 32;

struct SelectTopLaunch {
  const float* scores = nullptr;  // device [n_segments][length]
  int32_t* out = nullptr;         // device [n_segments][budget]: every row gets budget tokens
  uint32_t* hist = nullptr;       // device [n_segments][kSelectMaxBins], zero before the first pass
  SelectState* state = nullptr;   // device [n_segments], initialised to {0, 0, take, 0}
  int32_t* warp_counts = nullptr; // device [n_segments][blocks_per_segment · kSelectWarps]
  int64_t n_segments = 0;         // KV heads
  int64_t length = 0;
  int64_t budget = 0;
  int64_t sinks = 0;              // tokens [0, sinks) always kept
  int64_t lo = 0;                 // middle [lo, lo + m) competes; lo == sinks
  int64_t m = 0;
  int64_t take = 0;               // middle tokens kept; 0: only sinks and window are written
  int64_t window_begin = 0;       // tokens [window_begin, length) always kept
  int64_t blocks_per_segment = 0;
  int64_t warp_span = 0;          // middle elements per warp in the ordered compaction (multiple of 128)
};

// Radix passes (when take > 0), then the ordered compaction and the fixed part.
cudaError_t launch_select_top(const SelectTopLaunch& a, cudaStream_t stream);

// ---- sampling (Backend::sample_rows) ----
// Every row is one of five modes, decided on the host (gpu/sampling_plan.h). A group of rows runs
// (1) sample_prepare: penalty, then greedy argmax, or softmax written over the row in place, the
//     index-order CDF scan (kSampleIndexCdf), or the row's sort keys (gpu/sample_keys.h) into its
//     sort slot: every index (top-k), or the top-p candidates p >= cutoff (kSampleTopP);
// (2) a segmented radix sort of the slots (descending keys);
// (3) sample_topk (rows with top-k): k-th key and kept sum from the sorted prefix, then the
//     index-order CDF over the kept set, or (kSampleTopKTopP) the keys of the renormalised
//     candidates into the slot again, (4) a second segmented sort of those;
// (5) sample_topp (rows with top-p): llama2.c's prefix and draw over the sorted candidates.
// Tokens go to a device array; the caller downloads them.
inline constexpr int kSampleThreads = 512;

enum SampleMode : int32_t {
  kSampleGreedy = 0,    // temperature == 0: argmax (first index of the max; 0 if logit 0 is NaN)
  kSampleIndexCdf = 1,  // softmax, CDF in index order
  kSampleTopK = 2,      // softmax, top-k, CDF in index order over the kept set
  kSampleTopP = 3,      // softmax, top-p over the sorted candidates
  kSampleTopKTopP = 4,  // softmax, top-k, top-p over the renormalised kept set
};

struct SampleRowMeta {
  float temperature;
  float top_p;
  float penalty;            // repetition penalty; n_penalized == 0 when it is off
  float coin;
  float cutoff;             // (1 - top_p) / (vocab - 1) in float, as the host (top-p modes)
  int32_t mode;             // SampleMode
  int32_t top_k;            // 0 < top_k < vocab in the top-k modes, else 0
  int32_t slot;             // sort slot in the row's group (modes 2-4), else -1
  int32_t seg2;             // segment of the second sort (kSampleTopKTopP), else -1
  int32_t n_penalized;      // in-range, distinct ids at penalized[penalized_offset ..]
  int64_t penalized_offset;
};

// One group of consecutive rows: at most `max_slots` of them sorted, so the key buffers stay
// bounded. Pointers are device memory.
struct SampleLaunch {
  float* logits = nullptr;                // [rows][vocab] of the call, overwritten
  int64_t vocab = 0;
  const SampleRowMeta* meta = nullptr;    // [rows] of the call
  const int32_t* penalized = nullptr;
  int32_t* tokens = nullptr;              // [rows] of the call
  int key_shift = 1;                      // sample_key_shift(vocab)
  int64_t row_begin = 0;                  // the group's rows [row_begin, row_begin + n_rows)
  int64_t n_rows = 0;
  int32_t n_slots = 0;                    // sorted rows of the group (segments of sort 1)
  int32_t n_seg2 = 0;                     // kSampleTopKTopP rows (segments of sort 2)
  int32_t n_topk = 0;                     // rows of sample_topk
  int32_t n_topp = 0;                     // rows of sample_topp
  const int32_t* rows_topk = nullptr;     // [n_topk] absolute row ids
  const int32_t* rows_topp = nullptr;     // [n_topp]
  const int32_t* begin1 = nullptr;        // [n_slots]: slot · vocab
  const int32_t* begin2 = nullptr;        // [n_seg2]: slot · vocab of the row
  int32_t* end1 = nullptr;                // scratch [n_slots], written by sample_prepare
  int32_t* end2 = nullptr;                // scratch [n_seg2], written by sample_topk
  uint64_t* keys_a = nullptr;             // scratch [n_slots · vocab] each
  uint64_t* keys_b = nullptr;
  void* sort_temp = nullptr;              // CUB temporary storage
  size_t sort_temp_bytes = 0;
};

// CUB temporary storage both sorts of a group of n_slots sorted rows (n_seg2 of them sorted
// twice) need. Host only (no launch); may query the current device.
cudaError_t sample_sort_temp_bytes(int64_t vocab, int32_t n_slots, int32_t n_seg2, int key_shift,
                                   size_t* bytes);

// The group's kernels and sorts, in order on `stream`.
cudaError_t launch_sample_rows(const SampleLaunch& a, cudaStream_t stream);

// ---- quantised and bf16 weights: matrix-vector and small-batch products (kernels_quant.cu) ----

// The ggml block types the CUDA backend reads as stored (core's DType kQ8_0, kQ4_0, kQ4_K, kQ5_K,
// kQ6_K; block layouts of ggml-common.h). gpu/quant_blocks.h holds the block decoding the kernels
// and their host mirrors (tests) share.
enum class QuantType : int { kQ8_0 = 0, kQ4_0 = 1, kQ4_K = 2, kQ5_K = 3, kQ6_K = 4 };

// Activation rows the GEMV kernels take (more: dequantised tiles and cuBLAS, or cuBLAS for bf16).
inline constexpr int64_t kQuantGemvMaxRows = 16;
// Warps per GEMV block; each warp computes one weight row for every activation row.
inline constexpr int kQuantGemvWarps = 4;

// Activations quantised per block as ggml's dot products do: quantize_row_q8_0_ref (Q8_0, Q4_0:
// 32-element blocks, scale rounded to f16) or quantize_row_q8_K_ref (K types: 256-element blocks,
// f32 scale). x is [m][cols] f32; act_q [m][nb · block] int8 (blocks past cols zero-padded), act_d
// [m][nb] f32. A block holding a NaN or an infinity gets act_d = NaN and codes 0 (every product with
// it is NaN, as on the CPU).
cudaError_t launch_quantize_activations(QuantType type, const float* x, int64_t m, int64_t cols, int64_t nb,
                                        int8_t* act_q, float* act_d, cudaStream_t stream);

struct QuantGemvLaunch {
  QuantType type = QuantType::kQ8_0;
  const uint8_t* w = nullptr;  // [rows] rows of nb blocks, row_bytes apart; 4-byte aligned
  int64_t row_bytes = 0;
  int64_t rows = 0;
  int64_t nb = 0;               // blocks per row
  const int8_t* act_q = nullptr;  // launch_quantize_activations' output, [m][nb · block]
  const float* act_d = nullptr;   // [m][nb]
  int64_t m = 0;                  // 1 .. kQuantGemvMaxRows
  float* y = nullptr;             // [m][rows]
};

// y[i][r] = Σ_b d_w · d_x · (integer dot product of block b of weight row r and of activation row
// i), ggml's integer block sums (K types: sub-block scales and mins as ggml_vec_dot_q*_K_q8_K).
// One block of kQuantGemvWarps warps per kQuantGemvWarps weight rows, a warp per row, its lanes
// over the blocks (32-element types: 4 lanes a block, 8 blocks a step; K types: the warp a
// super-block, 8 elements a lane), float partial sums reduced by shuffles.
cudaError_t launch_quant_gemv(const QuantGemvLaunch& a, cudaStream_t stream);

// dst[i][c] (row stride ld) = element c < cols of weight row (ids ? ids[i] : first_row + i), decoded
// as ggml_dequantize (bit for bit: no FMA contraction). An id outside [0, table_rows) gives a NaN
// row. For embed (ids) and the dequantised tiles of matmuls with more than kQuantGemvMaxRows rows.
cudaError_t launch_quant_dequantize_rows(QuantType type, const uint8_t* w, int64_t row_bytes, int64_t table_rows,
                                         const int32_t* ids, int64_t first_row, int64_t n_rows, int64_t cols,
                                         int64_t ld, float* dst, cudaStream_t stream);

// y[i][r] = Σ_c x[i][c] · w[r][c] with f32 products and accumulation for m <= kQuantGemvMaxRows;
// w [rows][cols] and x [m][cols] raw bf16 bits (the backend rounds the activations with
// launch_f32_to_bf16 first, as for cuBLAS). A warp per weight row, its lanes over the columns,
// 16-byte loads of w and x when cols % 8 == 0 and both are 16-byte aligned (else 2-byte loads).
cudaError_t launch_bf16_gemv(const uint16_t* w, const uint16_t* x, int64_t m, int64_t rows, int64_t cols, float* y,
                             cudaStream_t stream);

// ---- transport: many small copies in one kernel ----

// One piece of a gathered transfer: bytes from src to dst, both device-visible addresses (device
// memory, or mapped pinned host memory through its UVA device pointer). align is the common
// alignment of src and dst (16, 4 or 1): the piece is copied in uint4 / uint32 / byte units, with
// a byte tail when bytes is not a multiple of align.
struct CopyPiece {
  uint64_t src;
  uint64_t dst;
  uint32_t bytes;  // <= kCopyPieceBytes
  uint32_t align;
};

// A warp copies one piece with every lane's loads in flight before its stores: 32 lanes x 8 uint4.
inline constexpr uint32_t kCopyPieceBytes = 4096;

// Copies every piece of the device array `pieces` (one warp per piece, grid-stride).
cudaError_t launch_gather_copy(const CopyPiece* pieces, int64_t n_pieces, cudaStream_t stream);

}  // namespace specontext::gpu::kernels

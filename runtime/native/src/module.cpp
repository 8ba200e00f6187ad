// Python bindings: the work runs with the GIL released.
#include <nanobind/nanobind.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>
#include <string>
#include <tuple>

#include "copy.h"
#include "sparse.h"
#ifdef UCM_WITH_CUDA
#include "cuda_copy.h"
#endif

namespace nb = nanobind;
using SegmentTuple = std::tuple<uintptr_t, int64_t, int64_t, int64_t, int64_t>;
using MoveFn = void (*)(const std::vector<ucm::Segment>&, const std::vector<int64_t>&, uintptr_t, int64_t, int);

static std::vector<ucm::Segment> segments_of(const std::vector<SegmentTuple>& in) {
  std::vector<ucm::Segment> out;
  out.reserve(in.size());
  for (const auto& [base, block_stride, chunks, chunk_stride, chunk_bytes] : in) {
    if (chunks < 1 || chunk_bytes < 1) throw std::invalid_argument("a segment needs chunks >= 1 and chunk_bytes >= 1");
    out.push_back({base, block_stride, chunks, chunk_stride, chunk_bytes});
  }
  return out;
}

namespace sp = ucm::sparse;

template <typename T>
static T* ptr(uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

static void def_sparse(nb::module_& m) {
  nb::class_<sp::Summaries>(m, "SparseSummaries", "One layer's block summaries (tensors owned by the caller).")
      .def(
          "__init__",
          [](sp::Summaries* self, int mode, int dtype, int rep_dtype, uintptr_t lo, uintptr_t hi, uintptr_t mean,
             uintptr_t rep, uintptr_t rep_scale, uintptr_t hashes, uintptr_t projection, uintptr_t count,
             int64_t block_size, int64_t kv_heads, int64_t head_dim, int64_t hash_bytes) {
            if (mode < 0 || mode > 3) throw std::invalid_argument("mode: 0 (bound), 1 (mean), 2 (hash) or 3 (both)");
            if (dtype < 0 || dtype > 2) throw std::invalid_argument("dtype: 0 (f32), 1 (bf16) or 2 (f16)");
            if (rep_dtype < 0 || rep_dtype > 3)
              throw std::invalid_argument("rep_dtype: 0 (f32), 1 (bf16), 2 (f16) or 3 (u8, quantized)");
            new (self) sp::Summaries{static_cast<sp::Mode>(mode), static_cast<sp::DType>(dtype),
                                     static_cast<sp::DType>(rep_dtype), ptr<void>(lo), ptr<void>(hi),
                                     ptr<float>(mean), ptr<void>(rep), ptr<float>(rep_scale), ptr<uint8_t>(hashes),
                                     ptr<const float>(projection), ptr<int32_t>(count), block_size, kv_heads,
                                     head_dim, hash_bytes};
          },
          nb::arg("mode"), nb::arg("dtype"), nb::arg("rep_dtype"), nb::arg("lo"), nb::arg("hi"), nb::arg("mean"),
          nb::arg("rep"), nb::arg("rep_scale"), nb::arg("hashes"), nb::arg("projection"), nb::arg("count"),
          nb::arg("block_size"), nb::arg("kv_heads"), nb::arg("head_dim"), nb::arg("hash_bytes"))
      .def(
          "write",
          [](const sp::Summaries& s, uintptr_t keys, int key_dtype, int64_t token_stride, uintptr_t slots,
             int64_t tokens) {
            nb::gil_scoped_release release;
            sp::write(s, ptr<const void>(keys), static_cast<sp::DType>(key_dtype), token_stride,
                      ptr<const int64_t>(slots), tokens);
          },
          nb::arg("keys"), nb::arg("key_dtype"), nb::arg("token_stride"), nb::arg("slots"), nb::arg("tokens"),
          "Fold keys written at these slots into the summaries.")
      .def(
          "refresh",
          [](const sp::Summaries& s, uintptr_t key_cache, int cache_dtype, int64_t block_stride, int64_t head_stride,
             uintptr_t positions, uintptr_t blocks, uintptr_t fill, int64_t n) {
            nb::gil_scoped_release release;
            sp::refresh(s, ptr<const void>(key_cache), static_cast<sp::DType>(cache_dtype), block_stride,
                        head_stride, ptr<const int32_t>(positions), ptr<const int32_t>(blocks),
                        ptr<const int32_t>(fill), n);
          },
          nb::arg("key_cache"), nb::arg("cache_dtype"), nb::arg("block_stride"), nb::arg("head_stride"),
          nb::arg("positions"), nb::arg("blocks"), nb::arg("fill"), nb::arg("n"),
          "Recompute blocks' summaries from the paged key cache.")
      .def(
          "select",
          [](const sp::Summaries& s, uintptr_t query, int query_dtype, int64_t token_stride, int64_t heads,
             uintptr_t tokens, int64_t rows, uintptr_t block_table, int64_t table_stride, uintptr_t seq_lens,
             uintptr_t budget, int64_t init, int64_t local, int64_t keep_channels, float temperature, float mass,
             uintptr_t out, int64_t out_stride, uintptr_t kept, uintptr_t scores, int64_t score_stride,
             uintptr_t prior) {
            sp::Selection sel{ptr<const void>(query), static_cast<sp::DType>(query_dtype), token_stride, heads,
                              ptr<const int32_t>(tokens), rows, ptr<const int32_t>(block_table), table_stride,
                              ptr<const int32_t>(seq_lens), ptr<const int32_t>(budget), init, local, keep_channels,
                              temperature, mass, ptr<int32_t>(out), out_stride, ptr<int32_t>(kept),
                              ptr<float>(scores), score_stride, ptr<const float>(prior)};
            nb::gil_scoped_release release;
            sp::select(s, sel);
          },
          nb::arg("query"), nb::arg("query_dtype"), nb::arg("token_stride"), nb::arg("heads"), nb::arg("tokens"),
          nb::arg("rows"), nb::arg("block_table"), nb::arg("table_stride"), nb::arg("seq_lens"), nb::arg("budget"),
          nb::arg("init"), nb::arg("local"), nb::arg("keep_channels"), nb::arg("temperature"), nb::arg("mass"),
          nb::arg("out"), nb::arg("out_stride"), nb::arg("kept") = 0, nb::arg("scores") = 0,
          nb::arg("score_stride") = 0, nb::arg("prior") = 0,
          "Score every (request, KV head, block) of a step and write the kept blocks per (request, KV head).");
  m.def(
      "sparse_fetch",
      [](uintptr_t table, int64_t rows, int64_t width, int64_t table_stride, int64_t kv_heads, int64_t resident_planes,
         uintptr_t slots, int64_t slot_stride, uintptr_t holds, uintptr_t slot_of, uintptr_t arena, uintptr_t planes,
         int64_t plane_bytes) {
        sp::Fetch f{ptr<int32_t>(table), rows,        width,           table_stride,         kv_heads,
                    resident_planes,     ptr<const int64_t>(slots), slot_stride, ptr<int32_t>(holds),
                    ptr<int32_t>(slot_of), ptr<const uint8_t>(arena), ptr<uint8_t>(planes), plane_bytes};
        int64_t copied;
        {
          nb::gil_scoped_release release;
          copied = sp::fetch(f);
        }
        if (copied < 0) throw std::runtime_error("sparse_fetch: a request keeps more off-loaded blocks than its slots");
        return copied;
      },
      nb::arg("table"), nb::arg("rows"), nb::arg("width"), nb::arg("table_stride"), nb::arg("kv_heads"),
      nb::arg("resident_planes"), nb::arg("slots"), nb::arg("slot_stride"), nb::arg("holds"), nb::arg("slot_of"),
      nb::arg("arena"), nb::arg("planes"), nb::arg("plane_bytes"),
      "Off-load: copy a layer's kept arena blocks into their requests' slots (misses only); returns the planes copied.");
}

NB_MODULE(ucm_native, m) {
  m.doc() = "UCM's native transfer layer and sparse attention kernels";
  def_sparse(m);
  auto def_move = [&m](const char* name, MoveFn move, const char* doc) {
    m.def(
        name,
        [move](const std::vector<SegmentTuple>& segments, const std::vector<int64_t>& blocks, uintptr_t buffer,
               int64_t row_stride, int threads) {
          auto segs = segments_of(segments);
          nb::gil_scoped_release release;
          move(segs, blocks, buffer, row_stride, threads);
        },
        nb::arg("segments"), nb::arg("blocks"), nb::arg("buffer"), nb::arg("row_stride"), nb::arg("threads") = 1, doc);
  };
  def_move("gather", ucm::gather, "Copy each block's segments, in order, into row i of the buffer.");
  def_move("scatter", ucm::scatter, "Copy row i of the buffer back into block i's segments.");
  m.def(
      "memcpy",
      [](uintptr_t dst, uintptr_t src, int64_t bytes, int threads) {
        nb::gil_scoped_release release;
        ucm::parallel_memcpy(dst, src, bytes, threads);
      },
      nb::arg("dst"), nb::arg("src"), nb::arg("bytes"), nb::arg("threads") = 1);
#ifdef UCM_WITH_CUDA
  m.attr("cuda") = true;
  m.def(
      "cuda_move",
      [](const std::vector<SegmentTuple>& segments, const std::vector<int64_t>& blocks, uintptr_t buffer,
         int64_t row_stride, bool to_buffer, uintptr_t stream) {
        std::vector<UcmCudaSegment> segs;
        for (const auto& s : segments_of(segments))
          segs.push_back({s.base, s.block_stride, s.chunks, s.chunk_stride, s.chunk_bytes});
        int err;
        {
          nb::gil_scoped_release release;
          err = ucm_cuda_move(segs.data(), static_cast<int>(segs.size()), blocks.data(),
                              static_cast<int64_t>(blocks.size()), reinterpret_cast<void*>(buffer), row_stride,
                              to_buffer, reinterpret_cast<void*>(stream));
        }
        if (err != 0) throw std::runtime_error(std::string("ucm_native.cuda_move: ") + ucm_cuda_error(err));
      },
      nb::arg("segments"), nb::arg("blocks"), nb::arg("buffer"), nb::arg("row_stride"), nb::arg("to_buffer"),
      nb::arg("stream") = 0, "gather (to_buffer) or scatter between device KV blocks and a buffer, one launch");
#else
  m.attr("cuda") = false;
#endif
}

// torch.ops.mla.* — the PyTorch binding of the mla ops (include/mla/ops.hpp).
//
// Every op is "out= style": outputs are passed in and written in place, the op returns nothing,
// so callers (and CUDA graphs) own every allocation. One implementation per op serves the CPU and
// CUDA dispatch keys: it checks the tensors (rank, fixed sizes, dtype, device, strides), turns
// each at::Tensor into an mla::TensorView and calls the library, which dispatches by device
// itself. On CUDA it runs on the tensors' device and on PyTorch's current stream. The Meta key
// runs the same checks and nothing else, which is what fake tensors (torch.compile) need.
//
// Errors: argument problems found here and mla::Error from the library both surface as c10::Error
// (Python RuntimeError) with the message naming the op and the tensor.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <initializer_list>
#include <mutex>
#include <optional>
#include <type_traits>
#include <string>
#include <vector>

#include "mla/error.hpp"
#include "mla/ops.hpp"
#include "mla/schedule.hpp"

#if defined(MLA_WITH_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace mla_torch {
namespace {

using at::ScalarType;
using OptTensor = std::optional<at::Tensor>;

// ---- describing tensors in messages ----------------------------------------------------------
// Messages are built with std::string and std::to_string, not iostreams: a binding loaded into an
// interpreter shares the C++ runtime with everything else there, and string building is the part
// of it least sensitive to that.

void append(std::string& s, const char* v) { s += v; }
void append(std::string& s, const std::string& v) { s += v; }
template <typename T, std::enable_if_t<std::is_integral_v<T> || std::is_floating_point_v<T>, int> = 0>
void append(std::string& s, T v) {
  s += std::to_string(v);
}

std::string list_str(at::IntArrayRef values) {
  std::string s = "[";
  for (size_t i = 0; i < values.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(values[i]);
  }
  return s + "]";
}

// The dtype as Python spells it (torch.<name>).
std::string dtype_name(ScalarType dtype) {
  switch (dtype) {
    case ScalarType::BFloat16: return "bfloat16";
    case ScalarType::Half: return "float16";
    case ScalarType::Float: return "float32";
    case ScalarType::Double: return "float64";
    case ScalarType::Float8_e4m3fn: return "float8_e4m3fn";
    case ScalarType::Float8_e5m2: return "float8_e5m2";
    case ScalarType::Int: return "int32";
    case ScalarType::Long: return "int64";
    case ScalarType::Short: return "int16";
    case ScalarType::Char: return "int8";
    case ScalarType::Byte: return "uint8";
    case ScalarType::Bool: return "bool";
    default: return c10::toString(dtype);
  }
}

// "shape [2, 16, 576], strides [9216, 576, 1], bfloat16 on cuda:0"
std::string describe(const at::Tensor& t) {
  return "shape " + list_str(t.sizes()) + ", strides " + list_str(t.strides()) + ", " +
         dtype_name(t.scalar_type()) + " on " + t.device().str();
}

std::string dtypes_str(std::initializer_list<ScalarType> dtypes) {
  std::string s;
  size_t i = 0;
  for (ScalarType d : dtypes) {
    s += i == 0 ? "" : (i + 1 == dtypes.size() ? " or " : ", ");
    s += dtype_name(d);
    ++i;
  }
  return s;
}

template <typename... Parts>
[[noreturn]] void fail(const char* op, const Parts&... parts) {
  std::string message = std::string("mla.") + op + ": ";
  (append(message, parts), ...);
  TORCH_CHECK(false, message);
}

// ---- the tensor spec checked at the binding layer --------------------------------------------

enum class Layout {
  kInnerContiguous,  // last dim has stride 1 (other strides free)
  kContiguous,       // row-major contiguous
  kAny,              // any non-negative strides (the op indexes every dim by its stride)
};

struct Spec {
  const char* name;
  const char* shape_text;                // e.g. "[T, H, 576]"
  std::vector<int64_t> sizes;            // one per dim; -1 = any
  std::initializer_list<ScalarType> dtypes;
  Layout layout = Layout::kInnerContiguous;
  bool output = false;                   // written by the op: must not overlap itself
};

const std::initializer_list<ScalarType> kActDtypes = {ScalarType::BFloat16, ScalarType::Half,
                                                      ScalarType::Float};
const std::initializer_list<ScalarType> kQueryDtypes = {
    ScalarType::BFloat16, ScalarType::Half, ScalarType::Float8_e4m3fn};
const std::initializer_list<ScalarType> kCacheDtypes = kQueryDtypes;
const std::initializer_list<ScalarType> kIndexDtypes = {ScalarType::Int, ScalarType::Long};
const std::initializer_list<ScalarType> kInt32 = {ScalarType::Int};
const std::initializer_list<ScalarType> kFloat32 = {ScalarType::Float};

mla::DType to_mla_dtype(ScalarType dtype) {
  switch (dtype) {
    case ScalarType::BFloat16: return mla::DType::kBF16;
    case ScalarType::Half: return mla::DType::kFP16;
    case ScalarType::Float: return mla::DType::kFP32;
    case ScalarType::Float8_e4m3fn: return mla::DType::kFP8E4M3;
    case ScalarType::Int: return mla::DType::kInt32;
    case ScalarType::Long: return mla::DType::kInt64;
    default: TORCH_CHECK(false, "mla: unsupported dtype ", dtype_name(dtype));
  }
}

// A raw byte buffer (the split-KV workspace): the library takes it as pointer and size, not as a
// TensorView (mla::DType has no byte type).
struct ByteBuffer {
  bool given = false;
  void* data = nullptr;
  int64_t bytes = 0;
  c10::Device device{c10::kCPU};
};

// Collects the views of one op call, checking each tensor against its spec and all of them for
// one common device.
class Binder {
 public:
  explicit Binder(const char* op) : op_(op) {}

  mla::TensorView operator()(const at::Tensor& t, const Spec& spec) {
    if (!t.defined()) fail(op_, spec.name, " is required but was not given");
    check(t, spec);
    return to_view(t);
  }
  mla::TensorView operator()(const OptTensor& t, const Spec& spec) {
    if (!t.has_value() || !t->defined()) return mla::TensorView{};
    return (*this)(*t, spec);
  }
  // An optional byte buffer, checked like the tensors (its spec should ask for uint8).
  ByteBuffer bytes(const OptTensor& t, const Spec& spec) {
    ByteBuffer b;
    if (!t.has_value() || !t->defined()) return b;
    check(*t, spec);
    b.given = true;
    b.bytes = t->numel() * int64_t(t->element_size());
    b.device = t->device();
    if (!b.device.is_meta()) b.data = t->data_ptr();
    return b;
  }

  // True for fake/meta tensors: checks only, nothing to run.
  bool is_meta() const { return device_ && device_->is_meta(); }
  c10::Device device() const { return device_.value_or(c10::Device(c10::kCPU)); }

 private:
  void check(const at::Tensor& t, const Spec& spec) {
    const c10::Device dev = t.device();
    if (!dev.is_cpu() && !dev.is_cuda() && !dev.is_meta())
      fail(op_, spec.name, " must be a CPU or CUDA tensor, got ", describe(t));
    if (t.dim() != int64_t(spec.sizes.size()))
      fail(op_, spec.name, " must have ", spec.sizes.size(), " dims ", spec.shape_text, ", got ",
           describe(t));
    for (size_t d = 0; d < spec.sizes.size(); ++d) {
      if (spec.sizes[d] >= 0 && t.size(int64_t(d)) != spec.sizes[d])
        fail(op_, spec.name, ".shape[", d, "] must be ", spec.sizes[d], " ", spec.shape_text,
             ", got ", describe(t));
    }
    bool dtype_ok = false;
    for (ScalarType d : spec.dtypes) dtype_ok = dtype_ok || t.scalar_type() == d;
    if (!dtype_ok)
      fail(op_, spec.name, " must be ", dtypes_str(spec.dtypes), ", got ", describe(t));
    for (int64_t d = 0; d < t.dim(); ++d) {
      if (t.stride(d) < 0) fail(op_, spec.name, " has a negative stride: ", describe(t));
      if (spec.output && t.stride(d) == 0 && t.size(d) > 1)
        fail(op_, spec.name, " is written by the op but overlaps itself (stride 0 at dim ", d,
             "): ", describe(t));
    }
    if (spec.layout == Layout::kContiguous && !t.is_contiguous())
      fail(op_, spec.name, " must be contiguous, got ", describe(t));
    if (spec.layout == Layout::kInnerContiguous && t.dim() > 0 && t.size(-1) > 1 &&
        t.stride(-1) != 1)
      fail(op_, spec.name, " must have a contiguous last dim (stride 1), got ", describe(t));
    if (!device_) {
      device_ = dev;
      first_name_ = spec.name;
    } else if (*device_ != dev) {
      fail(op_, spec.name, " is on ", dev.str(), " but ", first_name_, " is on ",
           device_->str(), "; all tensors must be on one device");
    }
  }

  static mla::TensorView to_view(const at::Tensor& t) {
    mla::TensorView v;
    v.dtype = to_mla_dtype(t.scalar_type());
    v.ndim = int(t.dim());
    for (int d = 0; d < v.ndim; ++d) {
      v.shape[d] = t.size(d);
      v.stride[d] = t.stride(d);
    }
    if (t.device().is_cuda()) {
      v.device = mla::Device::cuda(t.device().index());
    } else {
      v.device = mla::Device::cpu();
    }
    if (!t.device().is_meta()) v.data = t.data_ptr();
    return v;
  }

  const char* op_;
  std::optional<c10::Device> device_;
  const char* first_name_ = "";
};

int to_int(const char* op, const char* name, int64_t value) {
  if (value < INT32_MIN || value > INT32_MAX) fail(op, name, " = ", value, " does not fit in int32");
  return int(value);
}

// Runs fn(stream) on the binder's device: nothing for meta tensors, the current CUDA stream of
// the tensors' device on CUDA. Library errors become c10::Error with the message intact.
template <typename Fn>
void run(const Binder& binder, Fn&& fn) {
  if (binder.is_meta()) return;
  mla::Stream stream = nullptr;
#if defined(MLA_WITH_CUDA)
  std::optional<c10::cuda::CUDAGuard> guard;
  if (binder.device().is_cuda()) {
    guard.emplace(binder.device());
    stream = c10::cuda::getCurrentCUDAStream(binder.device().index()).stream();
  }
#endif
  try {
    fn(stream);
  } catch (const mla::Error& e) {
    TORCH_CHECK(false, e.what());
  }
}

// ---- the ops ----------------------------------------------------------------------------------

void append_latent_kv(const at::Tensor& k_nope, const at::Tensor& k_pe, const at::Tensor& loc,
                      const at::Tensor& kv_cache, double k_scale, bool check_metadata) {
  Binder bind("append_latent_kv");
  mla::AppendLatentKvArgs args;
  args.k_nope = bind(k_nope, {"k_nope", "[T, 512]", {-1, mla::kKvLoraRank}, kActDtypes});
  args.k_pe = bind(k_pe, {"k_pe", "[T, 64]", {-1, mla::kRopeDim}, kActDtypes});
  args.loc = bind(loc, {"loc", "[T]", {-1}, kIndexDtypes});
  args.kv_cache = bind(kv_cache, {"kv_cache", "[P, S, 576]", {-1, -1, mla::kLatentDim},
                                  kCacheDtypes, Layout::kContiguous, true});
  args.k_scale = float(k_scale);
  args.check_metadata = check_metadata;
  run(bind, [&](mla::Stream s) { mla::append_latent_kv(args, s); });
}

void build_block_table(const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                       const at::Tensor& seq_lens, int64_t page_size,
                       const at::Tensor& block_table, bool check_metadata) {
  constexpr const char* op = "build_block_table";
  Binder bind(op);
  mla::BuildBlockTableArgs args;
  args.req_to_token = bind(req_to_token, {"req_to_token", "[R, max_context_len]", {-1, -1}, kInt32});
  args.req_pool_indices = bind(req_pool_indices, {"req_pool_indices", "[B]", {-1}, kIndexDtypes});
  args.seq_lens = bind(seq_lens, {"seq_lens", "[B]", {-1}, kIndexDtypes});
  args.block_table = bind(block_table, {"block_table", "[B, max_blocks]", {-1, -1}, kInt32,
                                        Layout::kInnerContiguous, true});
  args.page_size = to_int(op, "page_size", page_size);
  args.check_metadata = check_metadata;
  run(bind, [&](mla::Stream s) { mla::build_block_table(args, s); });
}

void rope_quantize(const at::Tensor& q_nope, const at::Tensor& q_pe, const OptTensor& k_nope,
                   const OptTensor& k_pe, const at::Tensor& cos_sin_cache,
                   const at::Tensor& positions, bool is_neox, const at::Tensor& q_out,
                   const OptTensor& k_nope_out, const OptTensor& k_pe_out, double q_scale,
                   double k_scale, bool check_metadata) {
  Binder bind("rope_quantize");
  mla::RopeQuantizeArgs args;
  args.q_nope = bind(q_nope, {"q_nope", "[T, H, 512]", {-1, -1, mla::kKvLoraRank}, kActDtypes});
  args.q_pe = bind(q_pe, {"q_pe", "[T, H, 64]", {-1, -1, mla::kRopeDim}, kActDtypes});
  args.k_nope = bind(k_nope, {"k_nope", "[T, 512]", {-1, mla::kKvLoraRank}, kActDtypes});
  args.k_pe = bind(k_pe, {"k_pe", "[T, 64]", {-1, mla::kRopeDim}, kActDtypes});
  args.cos_sin_cache = bind(cos_sin_cache, {"cos_sin_cache", "[max_position, 64]",
                                            {-1, mla::kRopeDim}, kFloat32});
  args.positions = bind(positions, {"positions", "[T]", {-1}, kIndexDtypes});
  args.style = is_neox ? mla::RopeStyle::kNeox : mla::RopeStyle::kInterleaved;
  args.q_out = bind(q_out, {"q_out", "[T, H, 576]", {-1, -1, mla::kLatentDim}, kQueryDtypes,
                            Layout::kInnerContiguous, true});
  args.k_nope_out = bind(k_nope_out, {"k_nope_out", "[T, 512]", {-1, mla::kKvLoraRank},
                                      kQueryDtypes, Layout::kInnerContiguous, true});
  args.k_pe_out = bind(k_pe_out, {"k_pe_out", "[T, 64]", {-1, mla::kRopeDim}, kQueryDtypes,
                                  Layout::kInnerContiguous, true});
  args.q_scale = float(q_scale);
  args.k_scale = float(k_scale);
  args.check_metadata = check_metadata;
  run(bind, [&](mla::Stream s) { mla::rope_quantize(args, s); });
}

// make_decode_schedule is a pure function of the workspace and the capacity (and the device),
// but it asks the CUDA runtime about the pointer; a small cache keeps those calls out of CUDA
// graph captures (the eager warm-up before a capture fills it). Least recently used entries go
// first, so a workspace in steady use stays. An entry may outlive its buffer: a new buffer at
// the same address with the same size and capacity has the same schedule.
// split_keys > 0: a deterministic schedule for requests of up to max_kv_len keys.
mla::DecodeSchedule cached_schedule(const ByteBuffer& ws, int max_batch, int max_q_len,
                                    int num_heads, int max_kv_len, int split_keys) {
  struct Entry {
    void* data;
    int64_t bytes;
    int max_batch, max_q_len, num_heads, max_kv_len, split_keys, device;
    mla::DecodeSchedule schedule;
  };
  static std::mutex mutex;
  static std::vector<Entry> cache;
  const std::lock_guard<std::mutex> lock(mutex);
  for (auto it = cache.begin(); it != cache.end(); ++it) {
    if (it->data == ws.data && it->bytes == ws.bytes && it->max_batch == max_batch &&
        it->max_q_len == max_q_len && it->num_heads == num_heads && it->max_kv_len == max_kv_len &&
        it->split_keys == split_keys && it->device == ws.device.index()) {
      std::rotate(it, it + 1, cache.end());  // most recently used last
      return cache.back().schedule;
    }
  }
  mla::DecodeSchedule schedule =
      split_keys > 0 ? mla::make_deterministic_decode_schedule(ws.data, size_t(ws.bytes), max_batch,
                                                               max_q_len, num_heads, max_kv_len,
                                                               split_keys)
                     : mla::make_decode_schedule(ws.data, size_t(ws.bytes), max_batch, max_q_len,
                                                 num_heads);
  if (cache.size() >= 64) cache.erase(cache.begin());
  cache.push_back({ws.data, ws.bytes, max_batch, max_q_len, num_heads, max_kv_len, split_keys,
                   ws.device.index(), schedule});
  return schedule;
}

void mla_decode(const OptTensor& q, const OptTensor& q_nope, const OptTensor& q_pe,
                const at::Tensor& kv_cache, const at::Tensor& block_table,
                const at::Tensor& kv_lens, const OptTensor& cu_q_lens, int64_t q_len,
                int64_t max_q_len, double softmax_scale, double q_scale, double k_scale,
                const at::Tensor& out, const OptTensor& lse, const OptTensor& workspace,
                int64_t workspace_max_batch, int64_t workspace_max_q_len, bool deterministic,
                int64_t workspace_max_kv_len, int64_t workspace_split_keys, bool zero_padding_rows,
                bool check_metadata) {
  constexpr const char* op = "mla_decode";
  const bool has_q = q.has_value() && q->defined();
  const bool has_nope = q_nope.has_value() && q_nope->defined();
  const bool has_pe = q_pe.has_value() && q_pe->defined();
  const bool has_split = has_nope || has_pe;
  if (has_q == has_split)
    fail(op, "give either q [T, H, 576] or both q_nope [T, H, 512] and q_pe [T, H, 64], not ",
         has_q ? "both forms" : "neither");
  if (has_split && !(has_nope && has_pe))
    fail(op, "q_nope [T, H, 512] and q_pe [T, H, 64] go together, but ",
         has_nope ? "q_pe" : "q_nope", " was not given");
  Binder bind(op);
  mla::MlaDecodeArgs args;
  if (has_q) {
    args.q = bind(q, {"q", "[T, H, 576]", {-1, -1, mla::kLatentDim}, kQueryDtypes});
  } else {
    args.q_nope = bind(q_nope, {"q_nope", "[T, H, 512]", {-1, -1, mla::kKvLoraRank}, kQueryDtypes});
    args.q_pe = bind(q_pe, {"q_pe", "[T, H, 64]", {-1, -1, mla::kRopeDim}, kQueryDtypes});
  }
  args.kv_cache = bind(kv_cache, {"kv_cache", "[P, S, 576]", {-1, -1, mla::kLatentDim},
                                  kCacheDtypes, Layout::kContiguous});
  args.block_table = bind(block_table, {"block_table", "[B, max_blocks]", {-1, -1}, kInt32});
  args.kv_lens = bind(kv_lens, {"kv_lens", "[B]", {-1}, kInt32});
  args.cu_q_lens = bind(cu_q_lens, {"cu_q_lens", "[B + 1]", {-1}, kInt32});
  args.q_len = to_int(op, "q_len", q_len);
  args.max_q_len = to_int(op, "max_q_len", max_q_len);
  args.softmax_scale = float(softmax_scale);
  args.q_scale = float(q_scale);
  args.k_scale = float(k_scale);
  args.out = bind(out, {"out", "[T, H, 512]", {-1, -1, mla::kKvLoraRank}, kActDtypes,
                        Layout::kInnerContiguous, true});
  args.lse = bind(lse, {"lse", "[T, H]", {-1, -1}, kFloat32, Layout::kAny, true});
  const ByteBuffer ws = bind.bytes(workspace, {"workspace", "[bytes]", {-1}, {ScalarType::Byte},
                                               Layout::kContiguous, true});
  args.deterministic = deterministic;
  args.zero_padding_rows = zero_padding_rows;
  args.check_metadata = check_metadata;
  const int split_keys = to_int(op, "workspace_split_keys", workspace_split_keys);
  const int ws_max_kv_len = to_int(op, "workspace_max_kv_len", workspace_max_kv_len);
  if (ws.given && (split_keys < 0 || split_keys % 64 != 0))
    fail(op, "workspace_split_keys must be 0 (a balanced workspace) or a positive multiple of 64, "
         "got ", split_keys);
  if (ws.given && split_keys > 0) {
    // What a deterministic workspace covers, checked on every device (the CPU ignores the
    // workspace but takes the same arguments).
    const int64_t table_keys = args.block_table.shape[1] * args.kv_cache.shape[1];
    if (ws_max_kv_len < 1 || table_keys > ws_max_kv_len)
      fail(op, "block_table holds up to ", table_keys, " keys a request (", args.block_table.shape[1],
           " pages of ", args.kv_cache.shape[1], ") but the deterministic workspace was made for "
           "workspace_max_kv_len = ", ws_max_kv_len, " (DecodeWorkspace's max_kv_len)");
  }
  if (deterministic && ws.given && split_keys == 0)
    fail(op, "deterministic=True takes no balanced split-KV workspace (its cuts depend on the "
         "whole batch): pass workspace=None (every request unsplit) or a deterministic workspace "
         "(DecodeWorkspace(..., split_keys=N))");
  if (!deterministic && ws.given && split_keys > 0)
    fail(op, "a deterministic workspace (split_keys ", split_keys, ") plans for "
         "deterministic=True; pass deterministic=True or a workspace without split_keys");
  run(bind, [&](mla::Stream s) {
    // With a workspace on the GPU: plan the split-KV schedule for exactly this batch, then
    // decode with it (both on the stream, no host sync). The CPU ignores the workspace.
    mla::DecodeSchedule schedule;
    if (ws.given && ws.device.is_cuda()) {
      const mla::TensorView& ref = args.q.empty() ? args.q_nope : args.q;
      schedule = cached_schedule(ws, to_int(op, "workspace_max_batch", workspace_max_batch),
                                 to_int(op, "workspace_max_q_len", workspace_max_q_len),
                                 int(ref.shape[1]), ws_max_kv_len, split_keys);
      if (args.kv_lens.shape[0] > 0 && ref.shape[0] > 0)  // as mla_decode, nothing to plan otherwise
        mla::plan_decode(schedule, args.kv_lens, args.cu_q_lens, std::max(args.q_len, 1),
                         args.cu_q_lens.empty() ? std::max(args.q_len, 1) : args.max_q_len, s);
      args.schedule = &schedule;
    }
    mla::mla_decode(args, s);
  });
}

// Bytes of the GPU split-KV workspace for batches of up to max_batch requests of max_q_len
// queries with num_heads heads (on the current CUDA device); split_keys > 0: a deterministic
// workspace for requests of up to max_kv_len keys.
int64_t decode_workspace_bytes(int64_t max_batch, int64_t max_q_len, int64_t num_heads,
                               int64_t max_kv_len, int64_t split_keys) {
  constexpr const char* op = "decode_workspace_bytes";
  try {
    if (split_keys != 0)
      return int64_t(mla::decode_workspace_bytes_deterministic(
          to_int(op, "max_batch", max_batch), to_int(op, "max_q_len", max_q_len),
          to_int(op, "num_heads", num_heads), to_int(op, "max_kv_len", max_kv_len),
          to_int(op, "split_keys", split_keys)));
    return int64_t(mla::decode_workspace_bytes(to_int(op, "max_batch", max_batch),
                                               to_int(op, "max_q_len", max_q_len),
                                               to_int(op, "num_heads", num_heads)));
  } catch (const mla::Error& e) {
    TORCH_CHECK(false, e.what());
  }
}

void mha_prefill(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                 const at::Tensor& cu_q_lens, const at::Tensor& cu_kv_lens, int64_t max_q_len,
                 int64_t max_kv_len, bool causal, double softmax_scale, double q_scale,
                 double k_scale, double v_scale, const at::Tensor& out, const OptTensor& lse,
                 bool check_metadata) {
  constexpr const char* op = "mha_prefill";
  Binder bind(op);
  mla::MhaPrefillArgs args;
  args.q = bind(q, {"q", "[Tq, H, 192]", {-1, -1, 192}, kQueryDtypes});
  args.k = bind(k, {"k", "[Tk, H, 192]", {-1, -1, 192}, kQueryDtypes});
  args.v = bind(v, {"v", "[Tk, H, 128]", {-1, -1, 128}, kQueryDtypes});
  args.cu_q_lens = bind(cu_q_lens, {"cu_q_lens", "[B + 1]", {-1}, kInt32});
  args.cu_kv_lens = bind(cu_kv_lens, {"cu_kv_lens", "[B + 1]", {-1}, kInt32});
  args.max_q_len = to_int(op, "max_q_len", max_q_len);
  args.max_kv_len = to_int(op, "max_kv_len", max_kv_len);
  args.causal = causal;
  args.softmax_scale = float(softmax_scale);
  args.q_scale = float(q_scale);
  args.k_scale = float(k_scale);
  args.v_scale = float(v_scale);
  args.out = bind(out, {"out", "[Tq, H, 128]", {-1, -1, 128}, kActDtypes,
                        Layout::kInnerContiguous, true});
  args.lse = bind(lse, {"lse", "[Tq, H]", {-1, -1}, kFloat32, Layout::kAny, true});
  args.check_metadata = check_metadata;
  run(bind, [&](mla::Stream s) { mla::mha_prefill(args, s); });
}

void merge_states(const at::Tensor& out_a, const at::Tensor& lse_a, const at::Tensor& out_b,
                  const at::Tensor& lse_b, const at::Tensor& out, const OptTensor& lse_out) {
  Binder bind("merge_states");
  mla::MergeStatesArgs args;
  args.out_a = bind(out_a, {"out_a", "[T, H, Dv]", {-1, -1, -1}, kActDtypes});
  args.lse_a = bind(lse_a, {"lse_a", "[T, H]", {-1, -1}, kFloat32, Layout::kAny});
  args.out_b = bind(out_b, {"out_b", "[T, H, Dv]", {-1, -1, -1}, kActDtypes});
  args.lse_b = bind(lse_b, {"lse_b", "[T, H]", {-1, -1}, kFloat32, Layout::kAny});
  args.out = bind(out, {"out", "[T, H, Dv]", {-1, -1, -1}, kActDtypes,
                        Layout::kInnerContiguous, true});
  args.lse_out = bind(lse_out, {"lse_out", "[T, H]", {-1, -1}, kFloat32, Layout::kAny, true});
  run(bind, [&](mla::Stream s) { mla::merge_states(args, s); });
}

void cumulative_lengths(const at::Tensor& lens, const at::Tensor& cu) {
  Binder bind("cumulative_lengths");
  const mla::TensorView lens_view = bind(lens, {"lens", "[B]", {-1}, kIndexDtypes, Layout::kAny});
  const mla::TensorView cu_view = bind(cu, {"cu", "[B + 1]", {-1}, kInt32, Layout::kContiguous, true});
  run(bind, [&](mla::Stream s) { mla::cumulative_lengths(lens_view, cu_view, s); });
}

}  // namespace
}  // namespace mla_torch

TORCH_LIBRARY(mla, m) {
  m.def("append_latent_kv(Tensor k_nope, Tensor k_pe, Tensor loc, Tensor(a!) kv_cache, "
        "float k_scale=1.0, bool check_metadata=False) -> ()");
  m.def("build_block_table(Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, "
        "int page_size, Tensor(a!) block_table, bool check_metadata=False) -> ()");
  m.def("rope_quantize(Tensor q_nope, Tensor q_pe, Tensor? k_nope, Tensor? k_pe, "
        "Tensor cos_sin_cache, Tensor positions, bool is_neox, Tensor(a!) q_out, "
        "Tensor(b!)? k_nope_out, Tensor(c!)? k_pe_out, float q_scale=1.0, "
        "float k_scale=1.0, bool check_metadata=False) -> ()");
  m.def("mla_decode(Tensor? q, Tensor? q_nope, Tensor? q_pe, Tensor kv_cache, "
        "Tensor block_table, Tensor kv_lens, Tensor? cu_q_lens, int q_len, int max_q_len, "
        "float softmax_scale, float q_scale, float k_scale, Tensor(a!) out, "
        "Tensor(b!)? lse, Tensor(c!)? workspace=None, int workspace_max_batch=0, "
        "int workspace_max_q_len=0, bool deterministic=False, int workspace_max_kv_len=0, "
        "int workspace_split_keys=0, bool zero_padding_rows=False, "
        "bool check_metadata=False) -> ()");
  m.def("decode_workspace_bytes(int max_batch, int max_q_len, int num_heads, int max_kv_len=0, "
        "int split_keys=0) -> int",
        &mla_torch::decode_workspace_bytes);
  m.def("mha_prefill(Tensor q, Tensor k, Tensor v, Tensor cu_q_lens, Tensor cu_kv_lens, "
        "int max_q_len, int max_kv_len, bool causal, float softmax_scale, float q_scale, "
        "float k_scale, float v_scale, Tensor(a!) out, Tensor(b!)? lse, "
        "bool check_metadata=False) -> ()");
  m.def("merge_states(Tensor out_a, Tensor lse_a, Tensor out_b, Tensor lse_b, "
        "Tensor(a!) out, Tensor(b!)? lse_out) -> ()");
  m.def("cumulative_lengths(Tensor lens, Tensor(a!) cu) -> ()");
  // Which dispatch keys this build serves: torch.ops.mla.build_info() -> "cpu" or "cpu,cuda".
  m.def("build_info() -> str", []() -> std::string {
#if defined(MLA_WITH_CUDA)
    return "cpu,cuda";
#else
    return "cpu";
#endif
  });
}

#define MLA_TORCH_REGISTER_ALL(m)                                  \
  m.impl("append_latent_kv", &mla_torch::append_latent_kv);       \
  m.impl("build_block_table", &mla_torch::build_block_table);     \
  m.impl("rope_quantize", &mla_torch::rope_quantize);             \
  m.impl("mla_decode", &mla_torch::mla_decode);                   \
  m.impl("mha_prefill", &mla_torch::mha_prefill);                 \
  m.impl("merge_states", &mla_torch::merge_states);               \
  m.impl("cumulative_lengths", &mla_torch::cumulative_lengths)

TORCH_LIBRARY_IMPL(mla, CPU, m) { MLA_TORCH_REGISTER_ALL(m); }
TORCH_LIBRARY_IMPL(mla, Meta, m) { MLA_TORCH_REGISTER_ALL(m); }
#if defined(MLA_WITH_CUDA)
TORCH_LIBRARY_IMPL(mla, CUDA, m) { MLA_TORCH_REGISTER_ALL(m); }
#endif

// The vision tower and projector on the device (see cuda_vision.h).
#include "cuda_vision.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "cuda/common/cuda_check.h"
#include "cuda/common/workspace_layout.h"
#include "event_pool.h"
#include "cuda/launch.h"
#include "device_weights.h"
#include "gemm.h"
#include "kernels.h"
#include "model/vision_internal.h"

namespace msa::model::gpu {

namespace {

// The head dims the dense attention kernel runs (src/cuda/attention/attention.cu).
constexpr int64_t kAttentionHeadDims[] = {64, 80, 128};
// Packed keys are addressed in blocks of this many tokens (any of the kernel's 64 / 128).
constexpr int64_t kKeyBlock = 128;

int64_t padded_head_dim(int64_t dim) {
  for (int64_t d : kAttentionHeadDims)
    if (dim <= d) return d;
  throw_arg_error("vision_config head dim (hidden_size / num_heads)",
                  "at most 128 (the CUDA attention kernels run head dims 64, 80 and 128)", dim);
}

struct Bf16Linear {
  DeviceBuffer weight;  // bf16 [out, in]
  DeviceBuffer bias;    // f32 [out]
  int64_t out = 0, in = 0;
};

struct DeviceLayerNorm {
  DeviceBuffer weight, bias;  // f32 [dim]
};

DeviceBuffer upload(const Tensor& tensor, DType dtype, int64_t expected, const std::string& what) {
  DeviceBuffer buffer(static_cast<size_t>(expected) * dtype_size(dtype));
  copy_to_device(buffer, 0, tensor, dtype, expected, what);
  return buffer;
}

Bf16Linear upload_linear(const LinearWeights& w, int64_t out, int64_t in, const std::string& what) {
  return {upload(w.weight, DType::bf16, out * in, what + ".weight"), upload(w.bias, DType::f32, out, what + ".bias"),
          out, in};
}

DeviceLayerNorm upload_norm(const LayerNormWeights& w, int64_t dim, const std::string& what) {
  return {upload(w.weight, DType::f32, dim, what + ".weight"), upload(w.bias, DType::f32, dim, what + ".bias")};
}

// A batch's device regions, for `rows` patches in `segments` segments. The metadata (the
// attention geometry and the RoPE angles) comes first: one host-to-device copy of
// [0, meta_end). Regions are reused across stages where stream order makes it safe:
// proj holds q;k;v, then fc1's output, then each projector GEMM's output; act holds fc1's
// GELU output, then the projector's bf16 GEMM inputs.
struct BatchLayout {
  size_t q_start, k_len, seq_token_start, seq_of_query, angles, meta_end;
  size_t pixels, x, xn, proj, q, k, v, o, lse, act;
  size_t total;
};

BatchLayout plan_batch(const VisionConfig& c, int64_t text_hidden, int64_t head_dim, int64_t rows,
                       int64_t segments) {
  const int64_t Hv = c.hidden_size, I = c.intermediate_size, Hp = c.projector_hidden_size;
  const int64_t heads_width = c.num_heads * head_dim;
  BatchLayout l{};
  msa::cuda::WorkspaceCursor a;  // 256-byte aligned regions of one device allocation
  l.q_start = a.take_elements<int64_t>(segments + 1);
  l.k_len = a.take_elements<int64_t>(segments);
  l.seq_token_start = a.take_elements<int64_t>(segments);
  l.seq_of_query = a.take_elements<int32_t>(rows);
  l.angles = a.take_elements<float>(rows * 3 * c.rope_frequencies_per_axis());
  l.meta_end = a.total();
  l.pixels = a.take_elements<float>(rows * c.patch_values());
  l.x = a.take_elements<float>(rows * Hv);
  l.xn = a.take_elements<uint16_t>(rows * Hv);
  l.proj = a.take_elements<float>(rows * std::max({3 * Hv, I, Hp, text_hidden}));
  l.q = a.take_elements<uint16_t>(rows * heads_width);
  l.k = a.take_elements<uint16_t>(rows * heads_width);
  l.v = a.take_elements<uint16_t>(rows * heads_width);
  l.o = a.take_elements<uint16_t>(rows * heads_width);
  l.lse = a.take_elements<float>(rows * c.num_heads);
  l.act = a.take_elements<uint16_t>(rows * std::max({I, Hp, text_hidden}));
  l.total = a.total();
  return l;
}

template <class T>
void stage(std::vector<char>& staging, size_t offset, const std::vector<T>& values) {
  std::copy_n(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T), staging.data() + offset);
}

// Grows `buffer` to at least `bytes` (contents are not kept). New memory is all-ones bytes,
// NaN as f32 and as bf16: a region read before it was written shows in the output.
void ensure(DeviceBuffer& buffer, size_t bytes) {
  if (buffer.bytes() >= bytes) return;
  buffer = DeviceBuffer();  // free first: the old and new buffers need not coexist
  buffer = DeviceBuffer(bytes);
  buffer.fill_bytes(0xff);
}

}  // namespace

struct CudaVisionTower::Weights {
  DeviceBuffer patch_embedding;  // f32 [Hv, C*T*P*P]
  DeviceLayerNorm pre_norm;
  struct Layer {
    DeviceLayerNorm norm1, norm2;
    Bf16Linear qkv;       // [q; k; v] rows: [3 Hv, Hv], bias [3 Hv]
    Bf16Linear out_proj;  // [Hv, heads * padded head dim] (zero columns for the pad)
    Bf16Linear fc1, fc2;
  };
  std::vector<Layer> layers;
  Bf16Linear linear_1, linear_2, merge_linear_1, merge_linear_2;
};

// CUDA events around the parts of a call, read once after it (only with a profile).
struct Timer {
  struct Span {
    int64_t layer;  // -1: embedding, -2: projector
    int part;       // VisionProfile::Part; 3: the whole layer
    cudaEvent_t start, stop;
  };
  EventPool pool;
  std::vector<Span> spans;

  cudaEvent_t mark(cudaStream_t stream, bool on) { return on ? pool.record(stream) : nullptr; }
};

struct CudaVisionTower::State {
  cudaStream_t stream = nullptr;
  Gemm gemm;
  DeviceBuffer activations, attention_workspace;
  std::vector<char> staging;
  Timer timer;

  State() { MSA_CUDA_CHECK(cudaStreamCreate(&stream)); }  // blocking: ordered after legacy-stream copies
  ~State() {
    if (stream) cudaStreamDestroy(stream);
  }
};

// One batch of whole segments: its rows of pixel_values and where its output rows go.
struct CudaVisionTower::Batch {
  std::span<const VisionSegment> segments;
  const float* pixels = nullptr;  // host, the batch's first row
  int64_t rows = 0, longest = 0;
  BatchLayout l;
  char* base = nullptr;
  msa::cuda::AttentionLaunch attention;
  // Host f32 rows of each segment's output: a batch may hold segments of several grids (one
  // output tensor each), so its projected rows are scattered segment by segment.
  std::vector<float*> segment_out;

  float* f32(size_t offset) const { return reinterpret_cast<float*>(base + offset); }
  uint16_t* bf16(size_t offset) const { return reinterpret_cast<uint16_t*>(base + offset); }
  int32_t* i32(size_t offset) const { return reinterpret_cast<int32_t*>(base + offset); }
  int64_t* i64(size_t offset) const { return reinterpret_cast<int64_t*>(base + offset); }
};

CudaVisionTower::CudaVisionTower(const VisionConfig& config, const VisionWeights& host)
    : config_(config), text_hidden_(host.linear_2.weight.defined() ? host.linear_2.weight.size(0) : 0) {
  const VisionConfig& c = config_;
  c.validate();
  const int64_t Hv = c.hidden_size, D = c.head_dim(), heads = c.num_heads, I = c.intermediate_size;
  const int64_t Hp = c.projector_hidden_size, H = text_hidden_, m2 = c.merge_window();
  attention_head_dim_ = padded_head_dim(D);
  const int64_t Dp = attention_head_dim_;
  MSA_CHECK_ARG(H > 0, "linear_2", "a [hidden, projector hidden] weight", "none");
  MSA_CHECK_ARG(static_cast<int64_t>(host.layers.size()) == c.num_layers, "vision layers",
                std::to_string(c.num_layers) + " layers", host.layers.size());
  auto w = std::make_unique<Weights>();
  w->patch_embedding = upload(host.patch_embedding, DType::f32, Hv * c.patch_values(), "patch_embedding");
  w->pre_norm = upload_norm(host.pre_norm, Hv, "pre_layrnorm");
  for (int64_t layer = 0; layer < c.num_layers; ++layer) {
    const VisionLayerWeights& h = host.layers[layer];
    const std::string name = "vision layers." + std::to_string(layer) + ".";
    Weights::Layer l;
    l.norm1 = upload_norm(h.norm1, Hv, name + "layer_norm1");
    l.norm2 = upload_norm(h.norm2, Hv, name + "layer_norm2");
    l.qkv = {DeviceBuffer(static_cast<size_t>(3 * Hv * Hv) * 2), DeviceBuffer(static_cast<size_t>(3 * Hv) * 4),
             3 * Hv, Hv};
    const LinearWeights* parts[3] = {&h.q_proj, &h.k_proj, &h.v_proj};
    const char* part_names[3] = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"};
    for (int64_t p = 0; p < 3; ++p) {
      copy_to_device(l.qkv.weight, p * Hv * Hv, parts[p]->weight, DType::bf16, Hv * Hv,
                     name + part_names[p] + ".weight");
      copy_to_device(l.qkv.bias, p * Hv, parts[p]->bias, DType::f32, Hv, name + part_names[p] + ".bias");
    }
    // out_proj's input is the attention output [N, heads, Dp]: column h * Dp + i takes the
    // weight's column h * D + i, the pad columns are zero.
    MSA_CHECK_ARG(h.out_proj.weight.defined() && h.out_proj.weight.numel() == Hv * Hv, name + "self_attn.out_proj.weight",
                  std::to_string(Hv * Hv) + " elements",
                  h.out_proj.weight.defined() ? std::to_string(h.out_proj.weight.numel()) : std::string("no tensor"));
    Tensor out_proj = h.out_proj.weight.to(DType::f32);
    if (Dp != D) {
      Tensor padded = Tensor::zeros({Hv, heads * Dp}, DType::f32);
      const Tensor dense = out_proj.is_contiguous() ? out_proj : out_proj.clone();
      for (int64_t r = 0; r < Hv; ++r)
        for (int64_t head = 0; head < heads; ++head)
          std::copy_n(dense.data<float>() + r * Hv + head * D, D, padded.data<float>() + r * heads * Dp + head * Dp);
      out_proj = padded;
    }
    l.out_proj = {upload(out_proj, DType::bf16, Hv * heads * Dp, name + "self_attn.out_proj.weight"),
                  upload(h.out_proj.bias, DType::f32, Hv, name + "self_attn.out_proj.bias"), Hv, heads * Dp};
    l.fc1 = upload_linear(h.fc1, I, Hv, name + "mlp.fc1");
    l.fc2 = upload_linear(h.fc2, Hv, I, name + "mlp.fc2");
    w->layers.push_back(std::move(l));
  }
  w->linear_1 = upload_linear(host.linear_1, Hp, Hv, "multi_modal_projector.linear_1");
  w->linear_2 = upload_linear(host.linear_2, H, Hp, "multi_modal_projector.linear_2");
  w->merge_linear_1 = upload_linear(host.merge_linear_1, Hp, m2 * H, "patch_merge_mlp.linear_1");
  w->merge_linear_2 = upload_linear(host.merge_linear_2, H, Hp, "patch_merge_mlp.linear_2");
  weights_ = std::move(w);
  state_ = std::make_unique<State>();
}

CudaVisionTower::~CudaVisionTower() = default;

void* CudaVisionTower::stream() const { return state_->stream; }

std::vector<Tensor> CudaVisionTower::encode(const Tensor& pixel_values, std::span<const VisionGrid> grids,
                                            const ForwardTap& tap, VisionProfile* profile) {
  const VisionConfig& c = config_;
  State& st = *state_;
  if (grids.empty()) throw_arg_error("grids", "at least one image or video grid", 0);
  const std::vector<VisionSegment> segments = vision_segments(grids, c);
  int64_t patches = 0;
  for (const VisionGrid& grid : grids) patches += grid.patches();
  const Tensor pixels = checked_pixel_values(pixel_values, c, patches);
  const int64_t m2 = c.merge_window(), H = text_hidden_, heads = c.num_heads, Dp = attention_head_dim_;
  std::vector<Tensor> out;
  for (const VisionGrid& grid : grids) {
    // NaN until a batch writes the rows: a row no batch covers cannot pass for a result.
    out.push_back(Tensor::zeros({grid.patches() / m2, H}, DType::f32));
    std::fill_n(out.back().data<float>(), out.back().numel(), std::nanf(""));
  }
  std::vector<int64_t> grid_first_row(grids.size(), 0);
  for (size_t i = 1; i < grids.size(); ++i) grid_first_row[i] = grid_first_row[i - 1] + grids[i - 1].patches();

  // The batches' shapes and attention launches (pointers set per batch), then the call's
  // device memory, sized for the largest batch once.
  std::vector<Batch> batches;
  int64_t max_rows = 0, max_segments = 0;
  size_t attention_bytes = 0;
  for (const auto& [begin, end] : vision_batches(segments)) {
    Batch b;
    b.segments = std::span<const VisionSegment>(segments.data() + begin, end - begin);
    for (const VisionSegment& s : b.segments) {
      b.rows += s.grid.patches();
      b.longest = std::max(b.longest, s.grid.patches());
    }
    b.pixels = pixels.data<float>() + b.segments.front().first_row * c.patch_values();
    msa::cuda::AttentionLaunch& a = b.attention;
    const msa::cuda::KeyLayout keys{.block_size = kKeyBlock,
                                    .token_stride = heads * Dp,
                                    .head_stride = Dp,
                                    .block_stride = kKeyBlock * heads * Dp};
    a.k = keys;
    a.v = keys;
    a.q_heads = heads;
    a.kv_heads = heads;
    a.head_dim = Dp;
    a.batch.batch = static_cast<int64_t>(b.segments.size());
    a.batch.total_q = b.rows;
    a.batch.max_q_len = b.longest;
    a.batch.max_k_len = b.longest;
    a.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.head_dim())));
    a.o_type = msa::cuda::OutputType::bf16;
    a.causal = false;  // every patch attends to every patch of its segment
    a.dense_engine = attention_engine_;
    attention_bytes = std::max(attention_bytes, msa::cuda::attention_workspace_bytes(a));
    max_rows = std::max(max_rows, b.rows);
    max_segments = std::max<int64_t>(max_segments, static_cast<int64_t>(b.segments.size()));
    batches.push_back(b);
  }
  const BatchLayout layout = plan_batch(c, H, Dp, max_rows, max_segments);
  ensure(st.activations, layout.total);
  ensure(st.attention_workspace, std::max<size_t>(attention_bytes, 1));
  st.staging.assign(layout.meta_end, 0);
  st.timer.pool.next = 0;
  st.timer.spans.clear();

  for (Batch& b : batches) {
    b.l = layout;
    b.base = static_cast<char*>(st.activations.get());
    b.segment_out.clear();
    for (const VisionSegment& s : b.segments)
      b.segment_out.push_back(out[s.source].data<float>() + (s.first_row - grid_first_row[s.source]) / m2 * H);
    run_batch(b, tap, profile);
  }
  if (profile) {
    MSA_CUDA_CHECK(cudaStreamSynchronize(st.stream));
    if (static_cast<int64_t>(profile->layer_ms.size()) < c.num_layers) profile->layer_ms.resize(c.num_layers);
    std::vector<std::array<double, 4>> layer(c.num_layers);
    for (const Timer::Span& s : st.timer.spans) {
      float ms = 0;
      MSA_CUDA_CHECK(cudaEventElapsedTime(&ms, s.start, s.stop));
      if (s.layer == -1) profile->embed_ms += ms;
      else if (s.layer == -2) profile->projector_ms += ms;
      else layer[s.layer][s.part] += ms;
    }
    for (int64_t i = 0; i < c.num_layers; ++i) {
      auto& t = layer[i];
      auto& p = profile->layer_ms[i];
      p[VisionProfile::gemm] += t[0];
      p[VisionProfile::attention] += t[1];
      p[VisionProfile::other] += std::max(0.0, t[3] - t[0] - t[1]);
    }
    ++profile->calls;
  }
  return out;
}

// A batch is consecutive rows of pixel_values (segments are in row order); its projected
// rows go segment by segment to their grids' output tensors (merge windows never cross a
// frame, so never a segment).
void CudaVisionTower::run_batch(Batch& b, const ForwardTap& tap, VisionProfile* profile) {
  const VisionConfig& c = config_;
  State& st = *state_;
  const Weights& w = *weights_;
  const BatchLayout& l = b.l;
  cudaStream_t stream = st.stream;
  const int64_t N = b.rows, Hv = c.hidden_size, D = c.head_dim(), heads = c.num_heads, I = c.intermediate_size;
  const int64_t Dp = attention_head_dim_, Hp = c.projector_hidden_size, H = text_hidden_, m2 = c.merge_window();
  const int64_t S = static_cast<int64_t>(b.segments.size());
  const float eps = static_cast<float>(c.layer_norm_eps);
  Gemm& gemm = st.gemm;
  const bool timed = profile != nullptr;
  auto mark = [&] { return st.timer.mark(stream, timed); };
  auto span = [&](int64_t layer, int part, cudaEvent_t start, cudaEvent_t stop) {
    if (timed) st.timer.spans.push_back({layer, part, start, stop});
  };
  auto observe = [&](const std::string& name, const float* data, int64_t rows, int64_t cols) {
    if (!tap) return;
    Tensor host = Tensor::zeros({rows, cols}, DType::f32);
    MSA_CUDA_CHECK(cudaMemcpyAsync(host.raw(), data, host.nbytes(), cudaMemcpyDeviceToHost, stream));
    MSA_CUDA_CHECK(cudaStreamSynchronize(stream));
    tap(name, host);
  };

  // Metadata: the segments as attention sequences and each patch's RoPE angles (the CPU
  // path's tables), one upload; then the batch's pixels.
  std::vector<int64_t> q_start{0}, k_len, seq_token_start;
  std::vector<int32_t> seq_of_query;
  std::vector<PatchPosition> positions;
  for (int64_t s = 0; s < S; ++s) {
    const VisionSegment& segment = b.segments[s];
    const int64_t n = segment.grid.patches();
    seq_token_start.push_back(q_start.back());
    k_len.push_back(n);
    q_start.push_back(q_start.back() + n);
    seq_of_query.insert(seq_of_query.end(), static_cast<size_t>(n), static_cast<int32_t>(s));
    const std::vector<PatchPosition> p = vision_patch_positions(segment.grid, c.spatial_merge_size);
    positions.insert(positions.end(), p.begin(), p.end());
  }
  const std::vector<float> angles = vision_rope_angles(positions, vision_rope_inverse_frequencies(c));
  std::vector<char>& staging = st.staging;
  stage(staging, l.q_start, q_start);
  stage(staging, l.k_len, k_len);
  stage(staging, l.seq_token_start, seq_token_start);
  stage(staging, l.seq_of_query, seq_of_query);
  stage(staging, l.angles, angles);
  MSA_CUDA_CHECK(cudaMemcpyAsync(b.base, staging.data(), l.meta_end, cudaMemcpyHostToDevice, stream));
  MSA_CUDA_CHECK(cudaMemcpyAsync(b.f32(l.pixels), b.pixels, static_cast<size_t>(N * c.patch_values()) * sizeof(float),
                                 cudaMemcpyHostToDevice, stream));

  msa::cuda::AttentionLaunch& a = b.attention;
  a.q = b.bf16(l.q);
  a.k.data = b.bf16(l.k);
  a.v.data = b.bf16(l.v);
  a.k.seq_token_start = b.i64(l.seq_token_start);
  a.v.seq_token_start = b.i64(l.seq_token_start);
  a.batch.q_start = b.i64(l.q_start);
  a.batch.k_len = b.i64(l.k_len);
  a.batch.seq_of_query = b.i32(l.seq_of_query);
  a.o = b.bf16(l.o);
  a.lse = b.f32(l.lse);

  float* x = b.f32(l.x);
  float* proj = b.f32(l.proj);
  uint16_t* xn = b.bf16(l.xn);
  uint16_t* act = b.bf16(l.act);
  cudaEvent_t start = mark();
  gemm.linear(b.f32(l.pixels), c.patch_values(), w.patch_embedding.get(), DType::f32, N, Hv, c.patch_values(), x,
              DType::f32, Hv, false, stream);
  observe("vision.patch_embed", x, N, Hv);
  layer_norm_rows(x, N, Hv, w.pre_norm.weight.as<float>(), w.pre_norm.bias.as<float>(), eps, nullptr, x, stream);
  span(-1, 0, start, mark());
  observe("vision.pre_norm", x, N, Hv);

  HeadTransform heads_job;
  heads_job.src_stride = 3 * Hv;
  heads_job.tokens = N;
  heads_job.heads = heads;
  heads_job.dim = D;
  heads_job.dst_dim = Dp;
  heads_job.angles = b.f32(l.angles);
  for (int64_t layer = 0; layer < c.num_layers; ++layer) {
    const Weights::Layer& lw = w.layers[layer];
    cudaEvent_t layer_start = mark();
    layer_norm_rows(x, N, Hv, lw.norm1.weight.as<float>(), lw.norm1.bias.as<float>(), eps, xn, nullptr, stream);
    cudaEvent_t g0 = mark();
    gemm.linear(xn, Hv, lw.qkv.weight.get(), DType::bf16, N, 3 * Hv, Hv, proj, DType::f32, 3 * Hv, false, stream);
    span(layer, VisionProfile::gemm, g0, mark());
    // q and k: bias + 3D RoPE over the first 6F channels; v: bias; all bf16, padded heads.
    const int64_t rotary = 6 * c.rope_frequencies_per_axis();
    uint16_t* dst[3] = {b.bf16(l.q), b.bf16(l.k), b.bf16(l.v)};
    for (int64_t p = 0; p < 3; ++p) {
      heads_job.src = proj + p * Hv;
      heads_job.bias = lw.qkv.bias.as<float>() + p * Hv;
      heads_job.rotary_dim = p < 2 ? rotary : 0;
      heads_job.dst = dst[p];
      head_norm_rope(heads_job, stream);
    }
    cudaEvent_t a0 = mark();
    msa::cuda::attention(a, st.attention_workspace.get(), stream);
    span(layer, VisionProfile::attention, a0, mark());
    cudaEvent_t g1 = mark();
    gemm.linear(b.bf16(l.o), heads * Dp, lw.out_proj.weight.get(), DType::bf16, N, Hv, heads * Dp, x, DType::f32, Hv,
                true, stream);
    span(layer, VisionProfile::gemm, g1, mark());
    bias_gelu(x, N, Hv, lw.out_proj.bias.as<float>(), false, nullptr, true, stream);
    layer_norm_rows(x, N, Hv, lw.norm2.weight.as<float>(), lw.norm2.bias.as<float>(), eps, xn, nullptr, stream);
    cudaEvent_t g2 = mark();
    gemm.linear(xn, Hv, lw.fc1.weight.get(), DType::bf16, N, I, Hv, proj, DType::f32, I, false, stream);
    span(layer, VisionProfile::gemm, g2, mark());
    bias_gelu(proj, N, I, lw.fc1.bias.as<float>(), true, act, false, stream);
    cudaEvent_t g3 = mark();
    gemm.linear(act, I, lw.fc2.weight.get(), DType::bf16, N, Hv, I, x, DType::f32, Hv, true, stream);
    span(layer, VisionProfile::gemm, g3, mark());
    bias_gelu(x, N, Hv, lw.fc2.bias.as<float>(), false, nullptr, true, stream);
    span(layer, 3, layer_start, mark());
    observe("vision.layers." + std::to_string(layer), x, N, Hv);
  }

  // The projector (stream order makes the reuse of proj and act safe: each GEMM's input is
  // consumed before the next kernel overwrites it).
  cudaEvent_t p0 = mark();
  f32_to_bf16(x, N * Hv, xn, stream);
  gemm.linear(xn, Hv, w.linear_1.weight.get(), DType::bf16, N, Hp, Hv, proj, DType::f32, Hp, false, stream);
  bias_gelu(proj, N, Hp, w.linear_1.bias.as<float>(), true, act, false, stream);
  gemm.linear(act, Hp, w.linear_2.weight.get(), DType::bf16, N, H, Hp, proj, DType::f32, H, false, stream);
  bias_gelu(proj, N, H, w.linear_2.bias.as<float>(), false, act, static_cast<bool>(tap), stream);
  observe("projector.patches", proj, N, H);
  const int64_t windows = N / m2;  // act viewed as [windows, m2 * H]: a window's rows side by side
  gemm.linear(act, m2 * H, w.merge_linear_1.weight.get(), DType::bf16, windows, Hp, m2 * H, proj, DType::f32, Hp,
              false, stream);
  bias_gelu(proj, windows, Hp, w.merge_linear_1.bias.as<float>(), true, act, false, stream);
  gemm.linear(act, Hp, w.merge_linear_2.weight.get(), DType::bf16, windows, H, Hp, proj, DType::f32, H, false, stream);
  bias_gelu(proj, windows, H, w.merge_linear_2.bias.as<float>(), false, nullptr, true, stream);
  span(-2, 0, p0, mark());
  Tensor projected = Tensor::zeros({windows, H}, DType::f32);
  MSA_CUDA_CHECK(cudaMemcpyAsync(projected.raw(), proj, projected.nbytes(), cudaMemcpyDeviceToHost, stream));
  MSA_CUDA_CHECK(cudaStreamSynchronize(stream));
  int64_t at = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = b.segments[s].grid.patches() / m2;
    std::copy_n(projected.data<float>() + at * H, n * H, b.segment_out[s]);
    at += n;
  }
  if (tap) tap("projector", projected);
}

std::shared_ptr<CudaVisionTower> make_cuda_vision_tower(const ModelConfig& config, const ModelWeights& host) {
  if (!config.vision || !host.vision) return nullptr;
  return std::make_shared<CudaVisionTower>(*config.vision, *host.vision);
}

std::vector<Tensor> cuda_encode_vision(CudaVisionTower& tower, const Tensor& pixel_values,
                                       std::span<const VisionGrid> grids, const ForwardTap& tap) {
  return tower.encode(pixel_values, grids, tap);
}

}  // namespace msa::model::gpu

// Python entry points of the CPU kernels: argument checks, output allocation and the split
// of the work across threads (at::parallel_for, torch's own OpenMP pool). Built for the
// baseline x86-64. Every entry point takes the KernelSet it runs; the module has one
// submodule per set (`avx512`, `avx2`) with the same functions, and `isas()` names the sets
// this CPU runs, best first. engine/kernels/cpu_ext.py picks the submodule (what the CPU
// reports, or PREHEAT_CPU_KERNELS) before it calls anything in it.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <cpuid.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels.h"
#include "step_team.h"

namespace preheat {

bool cpu_has_avx2_kernels() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

bool cpu_has_avx512_kernels() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bf16") &&
         __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

volatile bool amx_bf16_on = false;
volatile bool fp8_vbmi_on = false;

// Whether this CPU has AVX512_VBMI (the fp8 pages' table lookup, fp8_vbmi_on); PREHEAT_CPU_VBMI=0
// leaves it unused.
bool fp8_vbmi_usable() {
  static const bool usable = [] {
    const char* env = getenv("PREHEAT_CPU_VBMI");
    if (env != nullptr && strcmp(env, "0") == 0) return false;
    return cpu_has_avx512_kernels() && __builtin_cpu_supports("avx512vbmi");  // (it inits the CPU check)
  }();
  return usable;
}

// Whether this process may run AMX-BF16 tiles: the CPU reports AMX-TILE and AMX-BF16
// (CPUID leaf 7: EDX bits 24 and 22) and Linux grants the tile data state on request
// (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA; Linux 5.16+), without which the
// first tile load faults. Asked once; PREHEAT_CPU_AMX=0 leaves the tiles unused.
bool amx_bf16_usable() {
  static const bool usable = [] {
    const char* env = getenv("PREHEAT_CPU_AMX");
    if (env != nullptr && strcmp(env, "0") == 0) return false;
    if (!cpu_has_avx512_kernels()) return false;
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    if (!(edx & (1u << 24)) || !(edx & (1u << 22))) return false;
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return usable;
}

#define PREHEAT_KERNEL_SET(ns, check)                                                                   \
  KernelSet{#ns, check, ns::decode_attention_scratch, ns::decode_attention_tasks, ns::decode_attention_combine, \
            ns::gemm_bf16_blocks, ns::gemm_f32_blocks, ns::ACTIVATION_BITS, ns::quantize_activations, ns::gemm_int8_blocks, ns::rms_norm_rows,         \
            ns::silu_mul_rows, ns::rope_kv_rows, ns::argmax_rows, ns::unpack_bf16_blocks, ns::dequantize_int8_blocks
const KernelSet AVX512 = PREHEAT_KERNEL_SET(avx512, cpu_has_avx512_kernels), avx512::extend_attention_scratch,
                                            avx512::extend_attention_task, avx512::gemm_int8_bf16_blocks,
                                            avx512::INT8_BF16_PANEL_ROWS};
const KernelSet AVX2 = PREHEAT_KERNEL_SET(avx2, cpu_has_avx2_kernels), avx2::extend_attention_scratch,
                                          avx2::extend_attention_task, nullptr, 0};
#undef PREHEAT_KERNEL_SET
const KernelSet* const SETS[] = {&AVX512, &AVX2};  // best first

namespace {

int dtype_code(const at::Tensor& t) {
  if (t.scalar_type() == at::kFloat) return 0;
  if (t.scalar_type() == at::kBFloat16) return 1;
  TORCH_CHECK(false, "preheat cpu kernels: float32 or bfloat16 expected, got ", t.scalar_type());
}

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "preheat cpu kernels: ", name, " must be on the CPU");
}

constexpr int64_t MAX_CHUNKS = 512;
// What a decode attention task costs besides its keys (loading its queries, its softmax, writing
// its partial), in tokens' worth: a guess of the right size; it only steers the threads' split.
constexpr int64_t TASK_FIXED_TOKENS = 16;

// at::parallel_for over tasks [0, n), one at a time, each of torch's threads handed its own
// `per_thread` floats of scratch: f(begin, end, scratch).
template <typename F>
void parallel_with_scratch(int64_t n, int64_t per_thread, F&& f) {
  const int64_t threads = at::get_num_threads();
  std::vector<float> scratch(per_thread * threads);
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    f(begin, end, scratch.data() + per_thread * std::min<int64_t>(at::get_thread_num(), threads - 1));
  });
}

// What a batch's decode attention needs besides the layer's q, caches and output: the chunk
// size, the tasks (row, chunk) and their split between threads, the partials' buffer. A
// step plans once; every layer of it reads the same rows (decode_stack.h).
struct DecodeAttnPlan {
  at::Tensor pt, lens;  // contiguous, held for the pointers in `a`
  DecodeAttnArgs a{};   // all but q, the caches and out
  std::vector<int32_t> num_chunks, task_b, task_chunk;
  std::vector<int64_t> first_task;
  std::vector<int64_t> cut;  // runs + 1 task boundaries: run r holds tasks [cut[r], cut[r + 1])
  std::vector<float> partial;
  int64_t runs = 0, scratch = 0;

  // Run r's tasks with `args` (`a` with one layer's q, caches and out) and its own
  // `scratch` floats.
  void run(const KernelSet& k, const DecodeAttnArgs& args, int64_t r, float* mine) const {
    k.decode_attention_tasks(args, task_b.data(), task_chunk.data(), num_chunks.data(), mine, cut[r], cut[r + 1]);
  }
  // Whether rows were split into chunks whose partials `combine` merges.
  bool chunked() const { return (int64_t)task_b.size() > a.B; }
  // Merges the partials of (row, head) pairs [begin, end) of B * H.
  void combine(const KernelSet& k, const DecodeAttnArgs& args, int64_t begin, int64_t end) const {
    k.decode_attention_combine(args, first_task.data(), num_chunks.data(), begin, end);
  }
};

// A KV cache's format for activations of `dtype`: 0 the same dtype, 1 float8_e4m3fn, 2
// float8_e5m2 (RopeKVArgs::kv_dtype); anything else is refused.
int kv_cache_format(const at::Tensor& k_cache, const at::Tensor& v_cache, at::ScalarType dtype, const char* who) {
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), who, ": the K and V caches must share a dtype");
  if (k_cache.scalar_type() == at::kFloat8_e4m3fn) return 1;
  if (k_cache.scalar_type() == at::kFloat8_e5m2) return 2;
  TORCH_CHECK(k_cache.scalar_type() == dtype, who, ": caches must be of the activation dtype or fp8");
  return 0;
}

// The attention kernels' two factors for a cache of format `kv_dtype` (kv_cache_format): the
// score scale (scale times an fp8 cache's key scale) and the outputs' factor (its value
// scale), each times 256 for e4m3, which the kernels read as value / 256 (load16_fp8). A
// cache in the activations' dtype has neither scale.
std::pair<float, float> attention_scales(int kv_dtype, double scale, double k_scale, double v_scale) {
  if (kv_dtype == 0) k_scale = v_scale = 1.0;
  const double fp8_mult = kv_dtype == 1 ? 256.0 : 1.0;
  return {(float)(scale * k_scale * fp8_mult), (float)(v_scale * fp8_mult)};
}

// Checks the caches, page table and lengths against q's shape [B, H, D] and plans the tasks
// for `threads` threads; the caller sets a.q (and strides), a.k_cache, a.v_cache and a.out.
DecodeAttnPlan plan_decode_attention(const KernelSet& k, int64_t B, int64_t H, int64_t D, int q_dtype,
                                     const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& page_table,
                                     const at::Tensor& seq_lens, double scale, double k_scale, double v_scale,
                                     int64_t threads) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.stride(3) == 1 && v_cache.strides() == k_cache.strides(),
              "caches must be [pages, page_size, kv_heads, D] with equal strides");
  const int kv_dtype = kv_cache_format(k_cache, v_cache, q_dtype == 0 ? at::kFloat : at::kBFloat16, "decode_attention");
  const auto [score_scale, v_mult] = attention_scales(kv_dtype, scale, k_scale, v_scale);
  TORCH_CHECK(page_table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "page_table and seq_lens must be int32");
  const int64_t S = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && D % 16 == 0 && D <= 256, "head_dim must be a multiple of 16, at most 256");
  TORCH_CHECK(H % KVH == 0 && H <= 256, "query heads must be a multiple of the kv heads, at most 256");
  DecodeAttnPlan p;
  p.pt = page_table.contiguous();
  p.lens = seq_lens.contiguous();
  TORCH_CHECK(p.pt.size(0) == B && p.lens.size(0) == B, "page_table and seq_lens need one row per query");
  const int32_t* len = p.lens.data_ptr<int32_t>();
  int64_t total = 0, longest = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(len[b] >= 1 && (len[b] + S - 1) / S <= p.pt.size(1), "seq_lens out of range of the page table");
    total += len[b];
    longest = std::max<int64_t>(longest, len[b]);
  }
  // Chunks small enough that every thread gets several tasks, large enough to amortise
  // loading the queries and merging partials; at most MAX_CHUNKS per row. Up to 512 tokens:
  // with 256, rows of 300 (a batch of chat turns) split into 256 + 44, the short task paying
  // the whole of a task's fixed work and a merge; the kernel alone (benchmarks/
  // decode_attention.py's batches, AMD EPYC Zen 4, builds alternating in one process) took
  // 0.87-0.94x the time for 8 and 16 rows of 300, the same for 2 x 1200 and 4 x 600; whole
  // decode steps 0.97-1.01x (decode_attention_chunk512_steps.md: attention is a fifth of them).
  int64_t chunk = (total + 4 * threads - 1) / (4 * threads);
  chunk = std::clamp<int64_t>(chunk, 32, 512);
  chunk = std::max<int64_t>(chunk, (longest + MAX_CHUNKS - 1) / MAX_CHUNKS);
  chunk = (chunk + 15) / 16 * 16;  // whole blocks of 16 tokens
  TORCH_CHECK(chunk <= 512, "context too long for the CPU decode kernel");
  p.num_chunks.resize(B);
  p.first_task.resize(B);
  for (int64_t b = 0; b < B; ++b) {
    p.num_chunks[b] = (int32_t)((len[b] + chunk - 1) / chunk);
    p.first_task[b] = (int64_t)p.task_b.size();
    for (int32_t c = 0; c < p.num_chunks[b]; ++c) {
      p.task_b.push_back((int32_t)b);
      p.task_chunk.push_back(c);
    }
  }
  const int64_t tasks = (int64_t)p.task_b.size();
  p.partial.resize(tasks > B ? tasks * H * (D + 2) : 0);
  p.a = DecodeAttnArgs{nullptr, 0, 0, nullptr, nullptr, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                       p.pt.data_ptr<int32_t>(), p.pt.stride(0), len, nullptr, p.partial.data(), B, H, KVH, D, S,
                       chunk, score_scale, q_dtype, kv_dtype, v_mult};
  p.scratch = B > 0 ? k.decode_attention_scratch(p.a) : 0;
  // Each thread a run of tasks holding about as many keys as the others' (a task costs its
  // tokens plus about TASK_FIXED_TOKENS for its queries, softmax and partial): rows of very
  // different lengths split evenly by task count left one thread most of the keys.
  const int64_t runs = p.runs = std::min<int64_t>(threads, tasks);
  p.cut.assign(runs + 1, tasks);
  p.cut[0] = 0;
  std::vector<int64_t> cost(tasks);
  int64_t all = 0;
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t t0 = p.task_chunk[t] * chunk;
    cost[t] = std::min<int64_t>(len[p.task_b[t]], t0 + chunk) - t0 + TASK_FIXED_TOKENS;
    all += cost[t];
  }
  int64_t sum = 0, t = 0;
  for (int64_t r = 1; r < runs; ++r) {
    sum += cost[t++];  // run r - 1 holds a task at least
    // Then up to the boundary nearest r / runs of the cost, leaving each later run a task.
    while (t < tasks - (runs - r) && 2 * (sum + cost[t]) * runs <= 2 * r * all + cost[t] * runs) sum += cost[t++];
    p.cut[r] = t;
  }
  return p;
}

at::Tensor decode_attention(const KernelSet& k, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& page_table, const at::Tensor& seq_lens, double scale,
                            double k_scale, double v_scale) {
  check_cpu(q, "q");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [B, H, D] with contiguous heads");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  DecodeAttnPlan p = plan_decode_attention(k, B, H, D, dtype_code(q), k_cache, v_cache, page_table, seq_lens, scale,
                                           k_scale, v_scale, at::get_num_threads());
  auto out = at::empty({B, H, D}, q.options());
  if (B == 0) return out;
  p.a.q = q.data_ptr();
  p.a.q_stride_b = q.stride(0);
  p.a.q_stride_h = q.stride(1);
  p.a.k_cache = k_cache.data_ptr();
  p.a.v_cache = v_cache.data_ptr();
  p.a.out = out.data_ptr();
  parallel_with_scratch(p.runs, p.scratch, [&](int64_t begin, int64_t end, float* mine) {
    for (int64_t r = begin; r < end; ++r) p.run(k, p.a, r, mine);
  });
  if (p.chunked()) at::parallel_for(0, B * H, 16, [&](int64_t begin, int64_t end) { p.combine(k, p.a, begin, end); });
  return out;
}

// The new tokens of B sequences back to back in q [T, H, D]: sequence b's extend_lens[b]
// rows see its prefix_lens[b] cached tokens and, causally, each other (their K/V already in
// the pages). Tasks are (sequence, kv head, up to EXTEND_TASK_ROWS rows), dealt so that both halves of
// the list (at::parallel_for's split) hold as much work: a late row sees more keys.
at::Tensor extend_attention(const KernelSet& k, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& page_table, const at::Tensor& prefix_lens,
                            const at::Tensor& extend_lens, double scale, double k_scale, double v_scale) {
  check_cpu(q, "q");
  TORCH_CHECK(k.extend_attention_task != nullptr, "extend_attention: not in the ", k.name, " build");
  const int dtype = dtype_code(q);
  // bfloat16 rows are read in pairs (the AVX-512 kernel's vdpbf16ps operands): even strides.
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && (dtype == 0 || (q.stride(0) % 2 == 0 && q.stride(1) % 2 == 0)),
              "q must be [T, H, D] with contiguous heads (bfloat16: even-strided)");
  const int kv_dtype = kv_cache_format(k_cache, v_cache, q.scalar_type(), "extend_attention");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.stride(3) == 1 && v_cache.strides() == k_cache.strides() &&
                  (kv_dtype != 0 || dtype == 0 || k_cache.stride(2) % 2 == 0),
              "caches must be of q's dtype or fp8, [pages, page_size, kv_heads, D] with equal strides");
  const auto [score_scale, v_mult] = attention_scales(kv_dtype, scale, k_scale, v_scale);
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), S = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK((D == 64 || D == 128) && k_cache.size(3) == D, "head_dim must be 64 or 128");
  TORCH_CHECK(H % KVH == 0, "query heads must be a multiple of the kv heads");
  auto pt = page_table.contiguous();
  auto pre = prefix_lens.to(at::kInt).contiguous();
  auto ext = extend_lens.to(at::kInt).contiguous();
  const int64_t B = pre.size(0);
  TORCH_CHECK(ext.size(0) == B && pt.size(0) == B && pt.scalar_type() == at::kInt, "one page-table row, prefix and extend length per sequence");
  const int32_t* p = pre.data_ptr<int32_t>();
  const int32_t* e = ext.data_ptr<int32_t>();
  std::vector<int64_t> start(B);
  std::vector<std::array<int64_t, 4>> tasks;  // (b, kvh, r0, r1)
  std::vector<int64_t> cost;
  int64_t rows = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(p[b] >= 0 && e[b] >= 0 && (p[b] + e[b] + S - 1) / S <= pt.size(1), "lengths out of range of the page table");
    start[b] = rows;
    rows += e[b];
    for (int64_t r0 = 0; r0 < e[b]; r0 += EXTEND_TASK_ROWS) {
      const int64_t r1 = std::min<int64_t>(r0 + EXTEND_TASK_ROWS, e[b]);
      for (int64_t h = 0; h < KVH; ++h) {
        tasks.push_back({b, h, r0, r1});
        cost.push_back(p[b] + r1);  // keys its last row sees
      }
    }
  }
  TORCH_CHECK(rows == T, "q has ", T, " rows, the extend lengths sum to ", rows);
  auto out = at::empty({T, H, D}, q.options());
  if (tasks.empty()) return out;
  // Costliest first, then dealt alternately to the two ends of the list.
  std::vector<int64_t> order(tasks.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = (int64_t)i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return cost[x] > cost[y]; });
  std::vector<int64_t> dealt(order.size());
  size_t lo = 0, hi = order.size();
  for (size_t i = 0; i < order.size(); ++i) dealt[i % 2 == 0 ? lo++ : --hi] = order[i];
  ExtendAttnArgs a{q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
                   k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), pt.data_ptr<int32_t>(), pt.stride(0),
                   p, start.data(), out.data_ptr(), H, KVH, D, S, score_scale, kv_dtype, v_mult, dtype};
  parallel_with_scratch((int64_t)dealt.size(), k.extend_attention_scratch(a), [&](int64_t begin, int64_t end,
                                                                                    float* mine) {
    for (int64_t i = begin; i < end; ++i) {
      const auto& t = tasks[dealt[i]];
      k.extend_attention_task(a, t[0], t[1], t[2], t[3], mine);
    }
  });
  return out;
}

// A product's bias [N] of the activations' dtype, or null.
const void* checked_bias(const c10::optional<at::Tensor>& bias, int64_t N, at::ScalarType dtype) {
  if (!bias) return nullptr;
  TORCH_CHECK(bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == dtype, "bad bias");
  return bias->data_ptr();
}

at::Tensor make_output(const at::Tensor& x, int64_t N, const c10::optional<at::Tensor>& bias,
                       const c10::optional<at::Tensor>& residual, GemmArgs& a) {
  const int64_t M = x.size(0);
  auto y = at::empty({M, N}, x.options());
  a.residual = nullptr;
  a.ldr = 0;
  a.bias = checked_bias(bias, N, x.scalar_type());
  if (residual) {
    TORCH_CHECK(residual->dim() == 2 && residual->size(0) >= M && residual->size(1) == N &&
                    residual->stride(1) == 1 && residual->scalar_type() == x.scalar_type(),
                "bad residual");
    a.residual = residual->data_ptr();
    a.ldr = residual->stride(0);
  }
  a.y = y.data_ptr();
  a.ldy = N;
  a.M = M;
  a.N = N;
  a.out_dtype = dtype_code(x);
  return y;
}

// Splits column blocks across threads in contiguous ranges (each thread streams its part
// of the weights once).
template <typename F>
void over_column_blocks(int64_t N, F&& f) {
  const int64_t blocks = (N + 15) / 16;
  at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) { f(begin, end); });
}

// x [M, K] times a packed float weight (bf16 pairs or float32 columns; the caller checked
// the layout against x), one kernel call per thread's range of column blocks.
at::Tensor packed_product(void (*blocks)(const GemmArgs&, int64_t, int64_t), const at::Tensor& x,
                          const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias,
                          const c10::optional<at::Tensor>& residual) {
  GemmArgs a{};
  a.x = x.data_ptr();
  a.ldx = x.stride(0);
  a.w = packed.data_ptr();
  a.K = x.size(1);
  auto y = make_output(x, N, bias, residual, a);
  if (a.M == 0) return y;
  over_column_blocks(N, [&](int64_t b, int64_t e) { blocks(a, b, e); });
  return y;
}

// The packed weights' checks against N outputs and K inputs, shared by the entry points
// below and the decode stack's team (decode_stack.h).
void check_packed_bf16(const at::Tensor& packed, int64_t N, int64_t K) {
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 2 && packed.is_contiguous() &&
                  packed.size(0) == (N + 15) / 16 && packed.size(1) * 2 == K,
              "packed weight does not match x");
}

void check_packed_f32(const at::Tensor& packed, int64_t N, int64_t K) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 16 && packed.is_contiguous() &&
                  packed.scalar_type() == at::kFloat && packed.size(0) == (N + 15) / 16 && packed.size(1) == K,
              "packed float32 weight [ceil(N/16), K, 16] does not match x");
}

at::Tensor linear_bf16(const KernelSet& k, const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias,
                       const c10::optional<at::Tensor>& residual) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16, "x must be [M, K] bfloat16");
  check_packed_bf16(packed, N, x.size(1));
  return packed_product(k.gemm_bf16_blocks, x, packed, N, bias, residual);
}

at::Tensor linear_f32(const KernelSet& k, const at::Tensor& x, const at::Tensor& packed, int64_t N,
                      const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kFloat, "x must be [M, K] float32");
  check_packed_f32(packed, N, x.size(1));
  return packed_product(k.gemm_f32_blocks, x, packed, N, bias, residual);
}

// (code width, inputs K) of packed int8 codes for N outputs: [ceil(N/16), K/2, 16, 2] at 8
// bits or [ceil(N/16), K/4, 32] at 4 (int8.pack); checks the layout and the scales beside it.
std::pair<int, int64_t> packed_codes(const at::Tensor& codes, const at::Tensor& dm, int64_t N, const char* what) {
  const bool eight = codes.dim() == 4 && codes.size(2) == 16 && codes.size(3) == 2;
  const bool four = codes.dim() == 3 && codes.size(2) == 32;
  TORCH_CHECK((eight || four) && codes.is_contiguous() && codes.scalar_type() == at::kByte &&
                  codes.size(0) == (N + 15) / 16,
              what, ": packed int8 codes [ceil(N/16), K/2, 16, 2] or [ceil(N/16), K/4, 32] expected");
  const int64_t K = eight ? codes.size(1) * 2 : codes.size(1) * 4;
  TORCH_CHECK(dm.is_contiguous() && dm.scalar_type() == at::kHalf && dm.numel() == codes.size(0) * (K / 32) * 32,
              what, ": int8 weight scales do not match");
  return {eight ? 8 : 4, K};
}

void check_activation_bits(const KernelSet& k, int64_t activation_bits) {
  TORCH_CHECK(activation_bits == 16 || (activation_bits == 8 && k.activation_bits == 8), "linear_int8: the ", k.name,
              " build takes activation_bits ", k.activation_bits == 8 ? "8 or 16" : "16", ", got ", activation_bits);
}

// The code width of packed int8 codes for N outputs that must take K inputs.
int int8_code_bits(const at::Tensor& codes, const at::Tensor& dm, int64_t N, int64_t K) {
  TORCH_CHECK(K % 32 == 0, "K must be a multiple of 32");
  const auto [bits, codes_k] = packed_codes(codes, dm, N, "linear_int8");
  TORCH_CHECK(codes_k == K, "int8 weight codes do not match x");
  return bits;
}

// Whether `rows` rows of activations (dtype code `dt`) at `activation_bits` multiply a bf16
// panel of the dequantized codes rather than their own codes (`panel_rows`: from how many rows).
bool int8_bf16_panel(const KernelSet& k, int64_t activation_bits, int dt, int64_t rows, int64_t panel_rows) {
  return activation_bits == 16 && dt == 1 && k.gemm_int8_bf16_blocks != nullptr && panel_rows > 0 &&
         rows >= panel_rows;
}

// `bf16_panel_rows`: rows from which bf16 rows at 16-bit codes multiply a bf16 panel of the
// dequantized codes; -1: this build's int8_bf16_panel_rows, 0: never (a benchmark's side).
at::Tensor linear_int8(const KernelSet& k, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& dm, int64_t N,
                       const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual,
                       int64_t activation_bits, int64_t bf16_panel_rows) {
  check_activation_bits(k, activation_bits);
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [M, K] with contiguous rows");
  const int64_t M = x.size(0), K = x.size(1), KB = K / 32;
  const int bits = int8_code_bits(codes, dm, N, K);
  const int dt = dtype_code(x);
  GemmArgs a{};
  a.w = codes.data_ptr();
  a.dm = (const uint16_t*)dm.data_ptr();
  a.K = K;
  a.code_bits = bits;
  a.act_bits = (int)activation_bits;
  auto y = make_output(x, N, bias, residual, a);
  if (M == 0) return y;
  const int64_t panel_rows = bf16_panel_rows < 0 ? k.int8_bf16_panel_rows : bf16_panel_rows;
  if (int8_bf16_panel(k, activation_bits, dt, M, panel_rows)) {
    // A prompt's bf16 rows: the codes dequantized into a bf16 panel per group of column
    // blocks, multiplied by the bf16 GEMM: 0.73-0.84x the time of the int16 products at 64+
    // rows, 0.9-0.94x at 32 (benchmarks/results/long_prompt_matmul.md).
    a.x = x.data_ptr();
    a.ldx = x.stride(0);
    over_column_blocks(N, [&](int64_t b, int64_t e) { k.gemm_int8_bf16_blocks(a, b, e); });
    return y;
  }
  auto xq = at::empty({M, K}, x.options().dtype(activation_bits == 8 ? at::kChar : at::kShort));
  auto xs = at::empty({M, KB}, x.options().dtype(at::kFloat));
  auto xsum = at::empty({M, KB}, x.options().dtype(at::kFloat));
  at::parallel_for(0, M, 64, [&](int64_t b, int64_t e) {
    k.quantize_activations(x.data_ptr(), x.stride(0), dt, K, (int)activation_bits, xq.data_ptr(), xs.data_ptr<float>(),
                           xsum.data_ptr<float>(), b, e);
  });
  a.x = xq.data_ptr();
  a.ldx = K;
  a.xs = xs.data_ptr<float>();
  a.xsum = xsum.data_ptr<float>();
  over_column_blocks(N, [&](int64_t b, int64_t e) { k.gemm_int8_blocks(a, b, e); });
  return y;
}

// Packed weights as dense rows [N, K] for a library GEMM (see linear.py's long-prompt path).
at::Tensor dense_bf16(const KernelSet& k, const at::Tensor& packed, int64_t N) {
  check_cpu(packed, "packed");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 2 && packed.is_contiguous() &&
                  packed.scalar_type() == at::kBFloat16 && packed.size(0) == (N + 15) / 16,
              "dense_bf16: packed bf16 weight [ceil(N/16), K/2, 16, 2] expected");
  GemmArgs a{};
  a.w = packed.data_ptr();
  a.N = N;
  a.K = packed.size(1) * 2;
  auto y = at::empty({N, a.K}, packed.options());
  a.y = y.data_ptr();
  over_column_blocks(N, [&](int64_t b, int64_t e) { k.unpack_bf16_blocks(a, b, e); });
  return y;
}

at::Tensor dense_int8(const KernelSet& k, const at::Tensor& codes, const at::Tensor& dm, int64_t N,
                      at::ScalarType dtype) {
  check_cpu(codes, "codes");
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "dense_int8: bfloat16 or float32 rows");
  GemmArgs a{};
  a.w = codes.data_ptr();
  a.N = N;
  std::tie(a.code_bits, a.K) = packed_codes(codes, dm, N, "dense_int8");
  a.dm = (const uint16_t*)dm.data_ptr();
  a.out_dtype = dtype == at::kFloat ? 0 : 1;
  auto y = at::empty({N, a.K}, codes.options().dtype(dtype));
  a.y = y.data_ptr();
  over_column_blocks(N, [&](int64_t b, int64_t e) { k.dequantize_int8_blocks(a, b, e); });
  return y;
}

at::Tensor rms_norm(const KernelSet& k, const at::Tensor& x, const at::Tensor& w, double eps) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && w.is_contiguous() && w.numel() == x.size(1) &&
                  w.scalar_type() == x.scalar_type(),
              "rms_norm: x [M, n] and weight [n] of one dtype expected");
  auto y = at::empty({x.size(0), x.size(1)}, x.options());
  const int dt = dtype_code(x);
  at::parallel_for(0, x.size(0), 64, [&](int64_t b, int64_t e) {
    k.rms_norm_rows(x.data_ptr(), x.stride(0), w.data_ptr(), y.data_ptr(), x.size(1), x.size(1), (float)eps, dt, b, e);
  });
  return y;
}

at::Tensor silu_mul(const KernelSet& k, const at::Tensor& gu) {
  check_cpu(gu, "gate_up");
  TORCH_CHECK(gu.dim() == 2 && gu.stride(1) == 1 && gu.size(1) % 2 == 0, "silu_mul: [M, 2 I] expected");
  const int64_t inter = gu.size(1) / 2;
  auto y = at::empty({gu.size(0), inter}, gu.options());
  const int dt = dtype_code(gu);
  at::parallel_for(0, gu.size(0), 16, [&](int64_t b, int64_t e) {
    k.silu_mul_rows(gu.data_ptr(), gu.stride(0), y.data_ptr(), inter, inter, dt, b, e);
  });
  return y;
}

// Each row's argmax, as torch.argmax(x, -1) gives it (see kernel_functions.h): torch's own
// took ~28 us a row of a 49k vocabulary (7 GB/s), ~0.1 ms a step at 8 rows.
at::Tensor argmax_rows(const KernelSet& k, const at::Tensor& x) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.size(1) > 0,
              "argmax_rows: x must be [M, N] float32 with contiguous rows and N > 0");
  auto out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  const float* p = x.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, x.size(0), 4, [&](int64_t b, int64_t e) { k.argmax_rows(p, x.stride(0), x.size(1), o, b, e); });
  return out;
}

// rope_kv's checks of the cos/sin table for head_dim D and activations of `dtype`.
void check_rope_table(const at::Tensor& cos_sin, at::ScalarType dtype, int64_t D) {
  TORCH_CHECK(D % 32 == 0, "rope_kv: head_dim must be a multiple of 32");
  TORCH_CHECK(cos_sin.is_contiguous() && cos_sin.scalar_type() == dtype, "rope_kv: bad cos_sin table");
}

// rope_kv's checks of the first `rows` positions (rows of the table) and slots (of caches
// holding num_slots): the contiguous positions and slots.
std::pair<at::Tensor, at::Tensor> checked_rope_rows(const at::Tensor& positions, const at::Tensor& slots, int64_t rows,
                                                    const at::Tensor& cos_sin, int64_t num_slots) {
  auto pos = positions.contiguous();
  auto sl = slots.contiguous();
  TORCH_CHECK(pos.scalar_type() == at::kLong && sl.scalar_type() == at::kLong && pos.numel() >= rows &&
                  sl.numel() >= rows,
              "rope_kv: int64 positions and slots for every row expected");
  const int64_t* p = pos.data_ptr<int64_t>();
  const int64_t* s = sl.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows; ++i) {
    TORCH_CHECK(p[i] >= 0 && p[i] < cos_sin.size(0), "rope_kv: position beyond the cos/sin table");
    TORCH_CHECK(s[i] >= 0 && s[i] < num_slots, "rope_kv: slot out of range");
  }
  return {pos, sl};
}

// k_scale / v_scale: an fp8 cache's scales (a value is stored as x / scale); 1 otherwise.
at::Tensor rope_kv(const KernelSet& k, const at::Tensor& qkv, int64_t rows, int64_t H, int64_t KVH, const at::Tensor& cos_sin,
                   const at::Tensor& positions, const at::Tensor& slots, const at::Tensor& k_cache,
                   const at::Tensor& v_cache, double k_scale, double v_scale) {
  check_cpu(qkv, "qkv");
  const int64_t D = cos_sin.size(1) / 2;
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (H + 2 * KVH) * D && qkv.size(0) >= rows,
              "rope_kv: qkv [T, (H + 2 KVH) D] expected");
  check_rope_table(cos_sin, qkv.scalar_type(), D);
  const int kv_dtype = kv_cache_format(k_cache, v_cache, qkv.scalar_type(), "rope_kv");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.size(-1) == D && k_cache.size(-2) == KVH,
              "rope_kv: caches must be contiguous [.., KVH, D] of the activation dtype or fp8");
  TORCH_CHECK(D <= 256, "rope_kv: head_dim at most 256");
  const auto [pos, sl] = checked_rope_rows(positions, slots, rows, cos_sin, k_cache.numel() / (KVH * D));
  const int64_t* p = pos.data_ptr<int64_t>();
  const int64_t* s = sl.data_ptr<int64_t>();
  auto q = at::empty({rows, H, D}, qkv.options());
  RopeKVArgs a{qkv.data_ptr(), qkv.stride(0), H, KVH, D, cos_sin.data_ptr(), p, s, q.data_ptr(),
               k_cache.data_ptr(), v_cache.data_ptr(), dtype_code(qkv), kv_dtype, (float)k_scale, (float)v_scale};
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) { k.rope_kv_rows(a, b, e); });
  return q;
}

#include "decode_stack.h"

}  // namespace
}  // namespace preheat

namespace preheat {
namespace {

// `use_<name>(on)` (sets `flag` to on where `usable()`, returns the previous setting) and
// `<name>()` (the setting now): a build feature the CPU may lack, on by default where usable.
void bind_switch(pybind11::module_& m, const std::string& name, volatile bool& flag, bool (*usable)(),
                 const std::string& doc) {
  m.def(
      ("use_" + name).c_str(),
      [&flag, usable](bool on) {
        const bool was = flag;
        flag = on && usable();
        return was;
      },
      pybind11::arg("on"), (doc + "; returns the previous setting").c_str());
  m.def(name.c_str(), [&flag] { return (bool)flag; }, (doc + ": the setting now").c_str());
}

// The functions of one KernelSet, bound into `m` (its submodule).
void bind_set(pybind11::module_& m, const KernelSet& k) {
  namespace py = pybind11;
  using py::arg;
  const KernelSet* set = &k;
  auto nogil = py::call_guard<py::gil_scoped_release>();
  m.attr("isa") = k.name;
  m.attr("int8_activation_bits_choices") =
      k.activation_bits == 8 ? std::vector<int>{16, 8} : std::vector<int>{16};
  m.def("supported", k.runs_here, "whether this CPU runs this build of the kernels");
  if (set == &AVX512) {
    bind_switch(m, "amx", amx_bf16_on, amx_bf16_usable,
                "whether the bf16 GEMM (and the int8 prompt path's bf16 panel) runs on AMX tiles where the CPU "
                "and OS allow them (the default)");
    bind_switch(m, "vbmi", fp8_vbmi_on, fp8_vbmi_usable,
                "whether the attention kernels widen fp8 pages by AVX-512 VBMI table lookups where the CPU has "
                "them (the default; else through float16 and float32)");
  }
  m.def(
      "decode_attention",
      [set](const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& pt, const at::Tensor& sl,
            double scale, double k_scale, double v_scale) {
        return decode_attention(*set, q, kc, vc, pt, sl, scale, k_scale, v_scale);
      },
      nogil, arg("q"), arg("k_cache"), arg("v_cache"), arg("page_table"), arg("seq_lens"), arg("scale"),
      arg("k_scale") = 1.0, arg("v_scale") = 1.0);
  m.attr("has_extend_attention") = k.extend_attention_task != nullptr;
  m.attr("int8_bf16_panel_rows") = k.gemm_int8_bf16_blocks != nullptr ? k.int8_bf16_panel_rows : (int64_t)0;
  m.def(
      "extend_attention",
      [set](const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& pt,
            const at::Tensor& prefix_lens, const at::Tensor& extend_lens, double scale, double k_scale,
            double v_scale) {
        return extend_attention(*set, q, kc, vc, pt, prefix_lens, extend_lens, scale, k_scale, v_scale);
      },
      nogil, arg("q"), arg("k_cache"), arg("v_cache"), arg("page_table"), arg("prefix_lens"), arg("extend_lens"),
      arg("scale"), arg("k_scale") = 1.0, arg("v_scale") = 1.0);
  m.def(
      "linear_bf16",
      [set](const at::Tensor& x, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias,
            const c10::optional<at::Tensor>& residual) { return linear_bf16(*set, x, packed, n, bias, residual); },
      nogil, arg("x"), arg("packed"), arg("n"), arg("bias") = py::none(), arg("residual") = py::none());
  m.def(
      "linear_f32",
      [set](const at::Tensor& x, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias,
            const c10::optional<at::Tensor>& residual) { return linear_f32(*set, x, packed, n, bias, residual); },
      nogil, arg("x"), arg("packed"), arg("n"), arg("bias") = py::none(), arg("residual") = py::none());
  m.def(
      "linear_int8",
      [set](const at::Tensor& x, const at::Tensor& codes, const at::Tensor& dm, int64_t n,
            const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual,
            int64_t activation_bits, int64_t bf16_panel_rows) {
        return linear_int8(*set, x, codes, dm, n, bias, residual, activation_bits, bf16_panel_rows);
      },
      nogil, arg("x"), arg("codes"), arg("dm"), arg("n"), arg("bias") = py::none(), arg("residual") = py::none(),
      arg("activation_bits") = 16, arg("bf16_panel_rows") = -1);
  m.def(
      "dense_bf16", [set](const at::Tensor& packed, int64_t n) { return dense_bf16(*set, packed, n); }, nogil,
      arg("packed"), arg("n"));
  m.def(
      "dense_int8",
      [set](const at::Tensor& codes, const at::Tensor& dm, int64_t n, at::ScalarType dtype) {
        return dense_int8(*set, codes, dm, n, dtype);
      },
      nogil, arg("codes"), arg("dm"), arg("n"), arg("dtype"));
  m.def(
      "rms_norm", [set](const at::Tensor& x, const at::Tensor& w, double eps) { return rms_norm(*set, x, w, eps); },
      nogil, arg("x"), arg("weight"), arg("eps"));
  m.def(
      "silu_mul", [set](const at::Tensor& gu) { return silu_mul(*set, gu); }, nogil, arg("gate_up"));
  m.def(
      "argmax_rows", [set](const at::Tensor& x) { return argmax_rows(*set, x); }, nogil, arg("x"));
  m.def(
      "rope_kv",
      [set](const at::Tensor& qkv, int64_t rows, int64_t H, int64_t KVH, const at::Tensor& cos_sin,
            const at::Tensor& positions, const at::Tensor& slots, const at::Tensor& k_cache,
            const at::Tensor& v_cache, double k_scale, double v_scale) {
        return rope_kv(*set, qkv, rows, H, KVH, cos_sin, positions, slots, k_cache, v_cache, k_scale, v_scale);
      },
      nogil, arg("qkv"), arg("rows"), arg("num_heads"), arg("num_kv_heads"), arg("cos_sin"), arg("positions"),
      arg("slots"), arg("k_cache"), arg("v_cache"), arg("k_scale") = 1.0, arg("v_scale") = 1.0);
  m.def(
      "decode_stack",
      [set](const std::vector<at::Tensor>& input_norms, const std::vector<at::Tensor>& post_norms,
            const std::vector<DecodeStack::LinearSpec>& linears, double eps, int64_t H, int64_t KVH, int64_t D,
            double scale) { return DecodeStack(set, input_norms, post_norms, linears, eps, H, KVH, D, scale); },
      arg("input_norms"), arg("post_norms"), arg("linears"), arg("eps"), arg("num_heads"), arg("num_kv_heads"),
      arg("head_dim"), arg("scale"),
      "a decode step's dense layers in one call (decode_stack.h); linears: (kind, packed, scales, bias, n, "
      "activation_bits) for qkv, o, gate_up, down of each layer, kind 0 bf16 / 1 f32 / 2 int8");
}

}  // namespace
}  // namespace preheat

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def(
      "isas",
      [] {
        std::vector<std::string> names;
        for (const preheat::KernelSet* k : preheat::SETS)
          if (k->runs_here()) names.push_back(k->name);
        return names;
      },
      "the kernel builds this CPU runs, best first");
  m.def(
      "supported", [] { return preheat::AVX512.runs_here() || preheat::AVX2.runs_here(); }, "whether this CPU runs any build of the kernels");
  pybind11::class_<preheat::DecodeStack>(m, "DecodeStack")
      .def("forward", &preheat::DecodeStack::forward, pybind11::call_guard<pybind11::gil_scoped_release>(),
           pybind11::arg("h"), pybind11::arg("cos_sin"), pybind11::arg("positions"), pybind11::arg("slots"),
           pybind11::arg("k_caches"), pybind11::arg("v_caches"), pybind11::arg("page_table"), pybind11::arg("seq_lens"))
      .def("forward_calls", &preheat::DecodeStack::forward_calls, pybind11::call_guard<pybind11::gil_scoped_release>(),
           pybind11::arg("h"), pybind11::arg("cos_sin"), pybind11::arg("positions"), pybind11::arg("slots"),
           pybind11::arg("k_caches"), pybind11::arg("v_caches"), pybind11::arg("page_table"), pybind11::arg("seq_lens"),
           "the layers one entry point at a time, each its own parallel region (what forward does on one thread)")
      .def("set_kv_scales", &preheat::DecodeStack::set_kv_scales, pybind11::arg("scales"),
           "an fp8 pool's scales [layers, 2, ...] (K, V; read at every step, so calibrating them in place "
           "reaches the stack), or None for a pool in the activations' dtype")
      .def("set_head", &preheat::DecodeStack::set_head, pybind11::arg("final_norm"), pybind11::arg("head"),
           pybind11::arg("eps"), "the final norm and the LM head (kind, packed, scales, bias, n, activation_bits)")
      .def_property_readonly("has_head", &preheat::DecodeStack::has_head)
      .def("forward_logits", &preheat::DecodeStack::forward_logits, pybind11::call_guard<pybind11::gil_scoped_release>(),
           pybind11::arg("h"), pybind11::arg("cos_sin"), pybind11::arg("positions"), pybind11::arg("slots"),
           pybind11::arg("k_caches"), pybind11::arg("v_caches"), pybind11::arg("page_table"), pybind11::arg("seq_lens"),
           "forward, the final norm and the LM head: (normed hidden, float32 logits)")
      .def("forward_logits_calls", &preheat::DecodeStack::forward_logits_calls,
           pybind11::call_guard<pybind11::gil_scoped_release>(), pybind11::arg("h"), pybind11::arg("cos_sin"),
           pybind11::arg("positions"), pybind11::arg("slots"), pybind11::arg("k_caches"), pybind11::arg("v_caches"),
           pybind11::arg("page_table"), pybind11::arg("seq_lens"),
           "forward_calls, then rms_norm and the head's product, each its own call")
      .def_property_readonly("num_layers", &preheat::DecodeStack::num_layers);
  preheat::amx_bf16_on = preheat::amx_bf16_usable();
  preheat::fp8_vbmi_on = preheat::fp8_vbmi_usable();
  for (const preheat::KernelSet* k : preheat::SETS) {
    auto sub = m.def_submodule(k->name, "the kernels built for this instruction set");
    preheat::bind_set(sub, *k);
  }
}

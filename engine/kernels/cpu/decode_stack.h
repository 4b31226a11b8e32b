// A decode step's layers in one call (included by bindings.cpp, inside its namespace, after
// the entry points it calls). At batch 1 a SmolLM-sized step makes ~270 kernel calls (30
// layers x two norms, four products, the rotary KV write, attention, the SiLU gate); from
// Python each costs 1.5-4.5 us of binding and wrapper on top of the kernel, ~0.6 ms a step
// against a 4 ms step. The stack holds every layer's weights once and runs the same entry
// points in the same order with the same arguments as DecoderLayer.forward's decode path
// (engine/model/decoder.py, layers.py), so its output is the same to the bit; only the
// Python between the calls is gone. With two threads or more it goes further: one parallel
// region for the whole step, the same kernels split the same way phase by phase, a barrier
// between phases (forward_team, step_team.h). It takes what that path's CPU kernels take —
// dense layers (SiLU-gated MLP), no q/k norm, packed weights, the pool's dtype the
// activations' — and engine/model/decode_stack.py decides when a step may use it.

// One packed product, as linear.apply calls it for rows below its dense threshold.
struct StackLinear {
  int64_t kind;  // 0: bf16 pairs, 1: float32 columns, 2: int8 / 4-bit codes
  at::Tensor packed;
  c10::optional<at::Tensor> scales, bias;
  int64_t n, activation_bits;

  at::Tensor apply(const KernelSet& k, const at::Tensor& x, const c10::optional<at::Tensor>& residual) const {
    if (kind == 0) return linear_bf16(k, x, packed, n, bias, residual);
    if (kind == 1) return linear_f32(k, x, packed, n, bias, residual);
    return linear_int8(k, x, packed, *scales, n, bias, residual, activation_bits, -1);
  }
};

struct StackLayer {
  at::Tensor input_norm, post_norm;
  StackLinear qkv, o, gate_up, down;
};

// One layer product as a phase of forward_team: its arguments, filled in before the region,
// and the kernel that runs a thread's column blocks; int8 codes first quantize their rows.
struct TeamProduct {
  GemmArgs a{};
  void (*blocks)(const GemmArgs&, int64_t, int64_t) = nullptr;
  int act_bits = 0;  // 8 or 16: the activations are quantized first; 0: read as they are

  bool quantizes() const { return act_bits != 0; }
  void quantize(const KernelSet& k, const void* x, int64_t ldx, int dt, int64_t m0, int64_t m1) const {
    if (act_bits != 0 && m0 < m1)
      k.quantize_activations(x, ldx, dt, a.K, act_bits, const_cast<void*>(a.x), const_cast<float*>(a.xs),
                             const_cast<float*>(a.xsum), m0, m1);
  }
  // Thread t's column blocks, as over_column_blocks splits them among nt.
  void run(int t, int nt) const {
    const auto [b, e] = share_of((a.N + 15) / 16, 4, t, nt);
    if (b < e) blocks(a, b, e);
  }
  // The weights thread t's run reads, for it to fetch while it waits before (WaitFetch).
  WaitFetch share_fetch(int t, int nt) const {
    const auto [b, e] = share_of((a.N + 15) / 16, 4, t, nt);
    WaitFetch f;
    if (b < e && a.w != nullptr) {
      f.next = (const char*)a.w + b * w_block;
      f.bytes = (e - b) * w_block;
      if (a.dm != nullptr) {
        f.next2 = (const char*)a.dm + b * s_block;
        f.bytes2 = (e - b) * s_block;
      }
    }
    return f;
  }
  // Bytes per column block of 16 of the packed weights (a.w) and of int8 codes' scales (a.dm).
  int64_t w_block = 0, s_block = 0;
};

// Checks a product against its input width K as linear_bf16 / linear_f32 / linear_int8 do and
// chooses the kernel they would for `rows` rows of h's dtype.
// x [rows, K] in, y [rows, N] out (plus `residual` [rows, N] when given); xq, xs, xsum:
// the shared buffers of activation codes, scales and sums.
inline TeamProduct team_product(const KernelSet& k, const StackLinear& l, const void* x, int64_t K, int64_t rows,
                                const void* residual, void* y, const at::Tensor& h, const at::Tensor& xq,
                                const at::Tensor& xs, const at::Tensor& xsum) {
  TeamProduct p;
  GemmArgs& a = p.a;
  const int dt = dtype_code(h);
  const int64_t N = l.n;
  if (l.kind == 0) {
    TORCH_CHECK(dt == 1, "x must be [M, K] bfloat16");
    check_packed_bf16(l.packed, N, K);
    p.blocks = k.gemm_bf16_blocks;
  } else if (l.kind == 1) {
    TORCH_CHECK(dt == 0, "x must be [M, K] float32");
    check_packed_f32(l.packed, N, K);
    p.blocks = k.gemm_f32_blocks;
  } else {
    check_activation_bits(k, l.activation_bits);
    a.code_bits = int8_code_bits(l.packed, *l.scales, N, K);
    a.dm = (const uint16_t*)l.scales->data_ptr();
    a.act_bits = (int)l.activation_bits;
  }
  a.x = x;
  a.ldx = K;
  if (l.kind == 2) {
    if (int8_bf16_panel(k, l.activation_bits, dt, rows, k.int8_bf16_panel_rows)) {
      p.blocks = k.gemm_int8_bf16_blocks;  // bf16 rows times a dequantized panel, as linear_int8 at these rows
    } else {
      p.blocks = k.gemm_int8_blocks;
      p.act_bits = (int)l.activation_bits;
      a.x = xq.data_ptr();  // [rows, K] codes (buffers as wide as the widest product)
      a.xs = xs.data_ptr<float>();
      a.xsum = xsum.data_ptr<float>();
    }
  }
  a.w = l.packed.data_ptr();
  a.K = K;
  a.bias = checked_bias(l.bias, N, h.scalar_type());
  a.residual = residual;
  a.ldr = residual != nullptr ? N : 0;
  a.y = y;
  a.ldy = N;
  a.M = rows;
  a.N = N;
  a.out_dtype = dt;
  const int64_t blocks = (N + 15) / 16;  // every packing's outer dimension
  p.w_block = l.packed.nbytes() / blocks;
  if (l.kind == 2) p.s_block = l.scales->nbytes() / blocks;
  return p;
}

class DecodeStack {
 public:
  using LinearSpec = std::tuple<int64_t, at::Tensor, c10::optional<at::Tensor>, c10::optional<at::Tensor>, int64_t, int64_t>;

  DecodeStack(const KernelSet* k, const std::vector<at::Tensor>& input_norms, const std::vector<at::Tensor>& post_norms,
              const std::vector<LinearSpec>& linears, double eps, int64_t H, int64_t KVH, int64_t D, double scale)
      : k_(k), eps_(eps), H_(H), KVH_(KVH), D_(D), scale_(scale) {
    TORCH_CHECK(input_norms.size() == post_norms.size() && linears.size() == 4 * input_norms.size(),
                "decode stack: per layer two norms and four products (qkv, o, gate_up, down)");
    auto linear = [](const LinearSpec& s) {
      const auto& [kind, packed, scales, bias, n, bits] = s;
      TORCH_CHECK(kind >= 0 && kind <= 2 && (kind != 2 || scales.has_value()), "decode stack: bad product kind");
      return StackLinear{kind, packed, scales, bias, n, bits};
    };
    for (size_t i = 0; i < input_norms.size(); ++i)
      layers_.push_back({input_norms[i], post_norms[i], linear(linears[4 * i]), linear(linears[4 * i + 1]),
                         linear(linears[4 * i + 2]), linear(linears[4 * i + 3])});
    for (const StackLayer& l : layers_)
      uniform_ = uniform_ && l.qkv.n == layers_[0].qkv.n && l.o.n == layers_[0].o.n &&
                 l.gate_up.n == layers_[0].gate_up.n && l.down.n == layers_[0].down.n;
  }

  // Whether a step runs in one parallel region (forward_team): two threads or more, not
  // already inside a region, every layer's products the same shapes (one set of buffers).
  bool in_one_region() const { return at::get_num_threads() >= 2 && !at::in_parallel_region() && uniform_; }

  // h [rows, hidden] (the embedded tokens) -> the last layer's output, before the final norm.
  // With two threads or more, one parallel region runs every layer (forward_team); else, or
  // when the layers' products differ in shape (forward_team shares one set of buffers), one
  // entry point after another (forward_calls). Both give the same bits.
  at::Tensor forward(const at::Tensor& h, const at::Tensor& cos_sin, const at::Tensor& positions,
                     const at::Tensor& slots, const std::vector<at::Tensor>& k_caches,
                     const std::vector<at::Tensor>& v_caches, const at::Tensor& page_table,
                     const at::Tensor& seq_lens) const {
    if (!in_one_region())
      return forward_calls(h, cos_sin, positions, slots, k_caches, v_caches, page_table, seq_lens);
    return forward_team(h.contiguous(), cos_sin, positions, slots, k_caches, v_caches, page_table, seq_lens, nullptr);
  }

  // The final norm and the LM head (set_head), run after the layers as the step's last
  // phases: a decode step streams the head's weights on from the last layer's, in the same
  // parallel region, instead of returning to Python and starting a region of its own for
  // them (at batch 1 on SmolLM2 4-bit the head is ~30% of a step's bytes).
  void set_head(const at::Tensor& final_norm, const LinearSpec& head, double eps) {
    const auto& [kind, packed, scales, bias, n, bits] = head;
    TORCH_CHECK(kind >= 0 && kind <= 2 && (kind != 2 || scales.has_value()), "decode stack: bad head kind");
    TORCH_CHECK(final_norm.dim() == 1 && final_norm.is_contiguous(), "decode stack: the final norm must be [hidden]");
    final_norm_ = final_norm;
    head_ = StackLinear{kind, packed, scales, bias, n, bits};
    head_eps_ = eps;
    has_head_ = true;
  }
  bool has_head() const { return has_head_; }

  // An fp8 pool's per-layer scales (engine/kv/pool.py: [layers, 2, 1] float32, K then V),
  // held and read at each step; None: the pool is in the activations' dtype.
  void set_kv_scales(const c10::optional<at::Tensor>& scales) {
    if (scales.has_value()) {
      TORCH_CHECK(scales->scalar_type() == at::kFloat && scales->is_contiguous() && scales->device().is_cpu() &&
                      scales->numel() == 2 * (int64_t)layers_.size(),
                  "decode stack: kv scales must be a contiguous float32 [layers, 2(, 1)] on the CPU");
    }
    kv_scales_ = scales;
  }

  // forward, then the final norm and the LM head: (normed [rows, hidden], logits [rows, vocab]
  // float32), the bits of rms_norm and the head's product (widened to float32) called after
  // forward.
  std::tuple<at::Tensor, at::Tensor> forward_logits(const at::Tensor& h, const at::Tensor& cos_sin,
                                                    const at::Tensor& positions, const at::Tensor& slots,
                                                    const std::vector<at::Tensor>& k_caches,
                                                    const std::vector<at::Tensor>& v_caches,
                                                    const at::Tensor& page_table, const at::Tensor& seq_lens) const {
    TORCH_CHECK(has_head_, "decode stack: no head set (set_head)");
    if (!in_one_region() || h.size(0) == 0 || layers_.empty())  // forward_team returns those before the head
      return forward_logits_calls(h, cos_sin, positions, slots, k_caches, v_caches, page_table, seq_lens);
    Head out;
    forward_team(h.contiguous(), cos_sin, positions, slots, k_caches, v_caches, page_table, seq_lens, &out);
    return {out.normed, out.logits};
  }

  std::tuple<at::Tensor, at::Tensor> forward_logits_calls(const at::Tensor& h, const at::Tensor& cos_sin,
                                                          const at::Tensor& positions, const at::Tensor& slots,
                                                          const std::vector<at::Tensor>& k_caches,
                                                          const std::vector<at::Tensor>& v_caches,
                                                          const at::Tensor& page_table,
                                                          const at::Tensor& seq_lens) const {
    TORCH_CHECK(has_head_, "decode stack: no head set (set_head)");
    auto normed = rms_norm(*k_, forward_calls(h, cos_sin, positions, slots, k_caches, v_caches, page_table, seq_lens),
                           final_norm_, head_eps_);
    auto logits = head_.apply(*k_, normed, c10::nullopt).to(at::kFloat);
    return {normed, logits};
  }

  // The layers one entry point at a time, each its own parallel region: what the layers'
  // Python path calls, in its order.
  at::Tensor forward_calls(at::Tensor h, const at::Tensor& cos_sin, const at::Tensor& positions, const at::Tensor& slots,
                           const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches,
                           const at::Tensor& page_table, const at::Tensor& seq_lens) const {
    TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size(),
                "decode stack: one K and one V cache per layer");
    const int64_t rows = h.size(0);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const StackLayer& l = layers_[i];
      auto qkv = l.qkv.apply(*k_, rms_norm(*k_, h, l.input_norm, eps_), c10::nullopt);
      const auto [ks, vs] = kv_scale((int64_t)i);
      auto q = rope_kv(*k_, qkv, rows, H_, KVH_, cos_sin, positions, slots, k_caches[i], v_caches[i], ks, vs);
      auto o = decode_attention(*k_, q, k_caches[i], v_caches[i], page_table, seq_lens, scale_, ks, vs);
      h = l.o.apply(*k_, o.reshape({rows, H_ * D_}), h);
      auto gu = l.gate_up.apply(*k_, rms_norm(*k_, h, l.post_norm, eps_), c10::nullopt);
      h = l.down.apply(*k_, silu_mul(*k_, gu), h);
    }
    return h;
  }

  // What forward_team writes for the head: the final norm's rows, the head's product (in the
  // activations' dtype) and the logits (float32, as DecoderModel.logits hands them out).
  struct Head {
    at::Tensor normed, product, logits;
  };

  // Thread t's columns of the head's bf16 product (the blocks its share of the product
  // computed, so no barrier) into float32 logits: the bits of .to(float32), in the team
  // rather than a call of its own from Python (~0.1 ms at batch 1 with cold caches).
  static void widen_columns(const at::Tensor& product, const at::Tensor& logits, int t, int nt) {
    const int64_t rows = product.size(0), n = product.size(1);
    const auto [b, e] = share_of((n + 15) / 16, 4, t, nt);
    const int64_t c0 = b * 16, c1 = std::min<int64_t>(e * 16, n);
    const uint16_t* src = (const uint16_t*)product.data_ptr();
    uint32_t* dst = (uint32_t*)logits.data_ptr();  // float32 bit patterns
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t c = c0; c < c1; ++c) dst[m * n + c] = (uint32_t)src[m * n + c] << 16;
  }

  // The same kernels with the same arguments and splits, but the threads stay in one
  // parallel region for the whole step and meet at a barrier between phases (step_team.h):
  // a region per call cost a fork and a join five times a layer, and at batch 1 the second
  // thread sat idle through ~a third of the step while the first allocated outputs, checked
  // arguments and ran the one-row kernels (perf, SmolLM2 4-bit). Buffers are allocated and
  // arguments checked once, before the region.
  // `head`: when given, the final norm and the LM head as two more phases (set_head).
  at::Tensor forward_team(const at::Tensor& h, const at::Tensor& cos_sin, const at::Tensor& positions,
                          const at::Tensor& slots, const std::vector<at::Tensor>& k_caches,
                          const std::vector<at::Tensor>& v_caches, const at::Tensor& page_table,
                          const at::Tensor& seq_lens, Head* head) const {
    const int64_t L = (int64_t)layers_.size();
    TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size(),
                "decode stack: one K and one V cache per layer");
    check_cpu(h, "h");
    TORCH_CHECK(h.dim() == 2 && h.is_contiguous(), "decode stack: h must be a contiguous [rows, hidden]");
    const int dt = dtype_code(h);
    const int64_t rows = h.size(0), hidden = h.size(1), HD = H_ * D_, QKV = (H_ + 2 * KVH_) * D_;
    auto out = at::empty({rows, hidden}, h.options());
    if (rows == 0 || L == 0) return L == 0 ? h : out;
    // The rotary write's checks (rope_kv), once for all layers.
    TORCH_CHECK(cos_sin.dim() == 2 && cos_sin.size(1) == 2 * D_, "rope_kv: bad cos_sin table");
    check_rope_table(cos_sin, h.scalar_type(), D_);
    const int kv_dtype = kv_cache_format(k_caches[0], v_caches[0], h.scalar_type(), "decode stack");
    TORCH_CHECK(kv_dtype == 0 || kv_scales_.has_value(), "decode stack: fp8 caches need their scales (set_kv_scales)");
    for (int64_t i = 0; i < L; ++i) {
      const at::Tensor &kc = k_caches[i], &vc = v_caches[i];
      TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() && kc.scalar_type() == k_caches[0].scalar_type() &&
                      vc.scalar_type() == kc.scalar_type() && kc.dim() == 4 && kc.size(-1) == D_ &&
                      kc.size(-2) == KVH_ && kc.sizes() == k_caches[0].sizes() && vc.sizes() == kc.sizes(),
                  "decode stack: every layer's caches contiguous [pages, page_size, KVH, D], of the activation "
                  "dtype or all of one fp8 dtype");
    }
    TORCH_CHECK(D_ <= 256, "rope_kv: head_dim at most 256");
    const auto [pos, sl] = checked_rope_rows(positions, slots, rows, cos_sin, k_caches[0].numel() / (KVH_ * D_));
    const int64_t* p = pos.data_ptr<int64_t>();
    const int64_t* s = sl.data_ptr<int64_t>();
    const int64_t threads = at::get_num_threads();
    DecodeAttnPlan plan = plan_decode_attention(*k_, rows, H_, D_, dt, k_caches[0], v_caches[0], page_table, seq_lens,
                                                scale_, 1.0, 1.0, threads);
    // Activations, each layer's in the same buffers; the residual stream alternates between
    // `mid` (after attention) and `out` (after the MLP), the first layer reading h.
    auto opts = h.options();
    auto xn = at::empty({rows, hidden}, opts), mid = at::empty({rows, hidden}, opts);
    auto qkv = at::empty({rows, QKV}, opts), q = at::empty({rows, H_, D_}, opts), att = at::empty({rows, H_, D_}, opts);
    const int64_t inter = layers_[0].gate_up.n / 2;
    auto gu = at::empty({rows, 2 * inter}, opts), act = at::empty({rows, inter}, opts);
    const int64_t widest = std::max({hidden, HD, inter});
    auto xq = at::empty({rows, widest}, opts.dtype(at::kShort));
    auto xs = at::empty({rows, widest / 32 + 1}, opts.dtype(at::kFloat));
    auto xsum = at::empty({rows, widest / 32 + 1}, opts.dtype(at::kFloat));
    const KernelSet& k = *k_;
    std::vector<TeamProduct> products(4 * L);
    for (int64_t i = 0; i < L; ++i) {
      const StackLayer& l = layers_[i];
      TORCH_CHECK(l.input_norm.numel() == hidden && l.post_norm.numel() == hidden &&
                      l.input_norm.scalar_type() == h.scalar_type() && l.post_norm.scalar_type() == h.scalar_type(),
                  "rms_norm: x [M, n] and weight [n] of one dtype expected");
      TORCH_CHECK(l.qkv.n == QKV && l.o.n == hidden && l.gate_up.n == 2 * inter && l.down.n == hidden,
                  "decode stack: layer ", i, "'s products do not chain (qkv, o, gate_up, down)");
      const void* resid = i == 0 ? h.data_ptr() : out.data_ptr();
      products[4 * i] = team_product(k, l.qkv, xn.data_ptr(), hidden, rows, nullptr, qkv.data_ptr(), h, xq, xs, xsum);
      products[4 * i + 1] = team_product(k, l.o, att.data_ptr(), HD, rows, resid, mid.data_ptr(), h, xq, xs, xsum);
      products[4 * i + 2] = team_product(k, l.gate_up, xn.data_ptr(), hidden, rows, nullptr, gu.data_ptr(), h, xq, xs, xsum);
      products[4 * i + 3] = team_product(k, l.down, act.data_ptr(), inter, rows, mid.data_ptr(), out.data_ptr(), h, xq, xs, xsum);
    }
    TeamProduct head_product;
    if (head != nullptr) {
      TORCH_CHECK(final_norm_.numel() == hidden && final_norm_.scalar_type() == h.scalar_type(),
                  "rms_norm: x [M, n] and weight [n] of one dtype expected");
      head->normed = at::empty({rows, hidden}, opts);
      head->logits = at::empty({rows, head_.n}, opts.dtype(at::kFloat));
      // bf16 rows: the head's product in bf16 (as its own call gives), then widened.
      head->product = dt == 1 ? at::empty({rows, head_.n}, opts) : head->logits;
      head_product = team_product(k, head_, head->normed.data_ptr(), hidden, rows, nullptr, head->product.data_ptr(), h,
                                  xq, xs, xsum);
    }
    RopeKVArgs rope{qkv.data_ptr(), QKV, H_, KVH_, D_, cos_sin.data_ptr(), p, s, q.data_ptr(), nullptr, nullptr, dt,
                    kv_dtype};
    // Each layer's scales, once before the region: the rotary write's (an fp8 cache stores
    // x / scale) and attention's, folded as decode_attention's plan folds them.
    struct LayerScales {
      float k, v, score, v_mult;
    };
    std::vector<LayerScales> layer_scales(L);
    for (int64_t i = 0; i < L; ++i) {
      const auto [ks, vs] = kv_scale(i);
      if (kv_dtype != 0) TORCH_CHECK(ks > 0 && vs > 0, "decode stack: kv scales must be positive");
      const auto [score, v_mult] = attention_scales(kv_dtype, scale_, ks, vs);
      layer_scales[i] = {(float)ks, (float)vs, score, v_mult};
    }
    DecodeAttnArgs attn = plan.a;
    attn.q = q.data_ptr();
    attn.q_stride_b = H_ * D_;
    attn.q_stride_h = D_;
    attn.out = att.data_ptr();
    std::vector<float> scratch(plan.scratch * threads);
    SpinBarrier barrier;
    const float eps = (float)eps_;
#pragma omp parallel num_threads(threads)
    {
      const int nt = omp_get_num_threads(), t = omp_get_thread_num();
      float* mine = scratch.data() + plan.scratch * std::min<int64_t>(t, threads - 1);
      // Rows of the one-row kernels (norms, quantizing, the rotary write, SiLU), each thread
      // a share: the calls kept up to 16 or 64 rows on one thread, as a fork cost more than
      // the rows; here the others would wait at the barrier. A row's norm or SiLU and its
      // quantizing fall to the same thread and need no barrier between them.
      const auto [r0, r1] = share_of(rows, 1, t, nt);
      // (row, head) pairs whose chunk partials this thread merges: its own rows', so that it
      // quantizes them for the o product with no barrier between.
      const int64_t c0 = r0 * H_, c1 = r1 * H_;
      // Every wait names the next product: the waiting thread fetches its share of that
      // product's weights (WaitFetch), carried on from wait to wait until the product runs.
      WaitFetch fetch;
      const TeamProduct* fetching = nullptr;
      auto sync = [&](const TeamProduct& next) {
        if (fetching != &next) {
          fetch = next.share_fetch(t, nt);
          fetching = &next;
        }
        barrier.wait(nt, &fetch);
      };
      for (int64_t i = 0; i < L; ++i) {
        const StackLayer& l = layers_[i];
        const TeamProduct* pr = products.data() + 4 * i;
        const void* resid = i == 0 ? h.data_ptr() : out.data_ptr();
        k.rms_norm_rows(resid, hidden, l.input_norm.data_ptr(), xn.data_ptr(), hidden, hidden, eps, dt, r0, r1);
        pr[0].quantize(k, xn.data_ptr(), hidden, dt, r0, r1);
        sync(pr[0]);
        pr[0].run(t, nt);
        sync(pr[1]);
        RopeKVArgs ri = rope;
        ri.k_cache = k_caches[i].data_ptr();
        ri.v_cache = v_caches[i].data_ptr();
        ri.k_scale = layer_scales[i].k;
        ri.v_scale = layer_scales[i].v;
        k.rope_kv_rows(ri, r0, r1);
        sync(pr[1]);
        DecodeAttnArgs ai = attn;
        ai.k_cache = k_caches[i].data_ptr();
        ai.v_cache = v_caches[i].data_ptr();
        ai.scale = layer_scales[i].score;
        ai.v_mult = layer_scales[i].v_mult;
        for (int64_t r = t; r < plan.runs; r += nt) plan.run(k, ai, r, mine);
        if (plan.chunked() || pr[1].quantizes()) {
          sync(pr[1]);
          if (plan.chunked() && c0 < c1) plan.combine(k, ai, c0, c1);
          pr[1].quantize(k, att.data_ptr(), HD, dt, r0, r1);
        }
        sync(pr[1]);
        pr[1].run(t, nt);
        sync(pr[2]);
        k.rms_norm_rows(mid.data_ptr(), hidden, l.post_norm.data_ptr(), xn.data_ptr(), hidden, hidden, eps, dt, r0, r1);
        pr[2].quantize(k, xn.data_ptr(), hidden, dt, r0, r1);
        sync(pr[2]);
        pr[2].run(t, nt);
        sync(pr[3]);
        k.silu_mul_rows(gu.data_ptr(), 2 * inter, act.data_ptr(), inter, inter, dt, r0, r1);
        pr[3].quantize(k, act.data_ptr(), inter, dt, r0, r1);
        sync(pr[3]);
        pr[3].run(t, nt);
        sync(i + 1 < L ? pr[4] : head_product);
      }
      if (head != nullptr) {
        k.rms_norm_rows(out.data_ptr(), hidden, final_norm_.data_ptr(), head->normed.data_ptr(), hidden, hidden,
                        (float)head_eps_, dt, r0, r1);
        head_product.quantize(k, head->normed.data_ptr(), hidden, dt, r0, r1);
        sync(head_product);
        head_product.run(t, nt);
        if (dt == 1) widen_columns(head->product, head->logits, t, nt);
      }
    }
    return out;
  }

  int64_t num_layers() const { return (int64_t)layers_.size(); }

  // Layer i's K and V scales as the layers' Python path passes them (float(scale)): 1 for a
  // cache in the activations' dtype.
  std::pair<double, double> kv_scale(int64_t i) const {
    if (!kv_scales_.has_value()) return {1.0, 1.0};
    const float* s = kv_scales_->data_ptr<float>();
    return {(double)s[2 * i], (double)s[2 * i + 1]};
  }

 private:
  const KernelSet* k_;
  std::vector<StackLayer> layers_;
  bool uniform_ = true;  // every layer's products the same shapes (forward_team's buffers fit all)
  bool has_head_ = false;
  at::Tensor final_norm_;
  StackLinear head_{};
  double head_eps_ = 0.0;
  c10::optional<at::Tensor> kv_scales_;
  double eps_;
  int64_t H_, KVH_, D_;
  double scale_;
};

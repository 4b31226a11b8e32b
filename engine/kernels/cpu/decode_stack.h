// A decode step's layers in one call (included by bindings.cpp, inside its namespace, after
// the entry points it calls). At batch 1 a SmolLM-sized step makes ~270 kernel calls (30
// layers x two norms, four products, the rotary KV write, attention, the SiLU gate); from
// Python each costs 1.5-4.5 us of binding and wrapper on top of the kernel, ~0.6 ms a step
// against a 4 ms step. The stack holds every layer's weights once and runs the same entry
// points in the same order with the same arguments as DecoderLayer.forward's decode path
// (engine/model/decoder.py, layers.py), so its output is the same to the bit; only the
// Python between the calls is gone. It takes what that path's CPU kernels take — dense
// layers (SiLU-gated MLP), no q/k norm, packed weights, the pool's dtype the activations' —
// and engine/model/decode_stack.py decides when a step may use it.

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
  }

  // h [rows, hidden] (the embedded tokens) -> the last layer's output, before the final norm.
  at::Tensor forward(at::Tensor h, const at::Tensor& cos_sin, const at::Tensor& positions, const at::Tensor& slots,
                     const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches,
                     const at::Tensor& page_table, const at::Tensor& seq_lens) const {
    TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size(),
                "decode stack: one K and one V cache per layer");
    const int64_t rows = h.size(0);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const StackLayer& l = layers_[i];
      auto qkv = l.qkv.apply(*k_, rms_norm(*k_, h, l.input_norm, eps_), c10::nullopt);
      auto q = rope_kv(*k_, qkv, rows, H_, KVH_, cos_sin, positions, slots, k_caches[i], v_caches[i]);
      auto o = decode_attention(*k_, q, k_caches[i], v_caches[i], page_table, seq_lens, scale_, 1.0, 1.0);
      h = l.o.apply(*k_, o.reshape({rows, H_ * D_}), h);
      auto gu = l.gate_up.apply(*k_, rms_norm(*k_, h, l.post_norm, eps_), c10::nullopt);
      h = l.down.apply(*k_, silu_mul(*k_, gu), h);
    }
    return h;
  }

  int64_t num_layers() const { return (int64_t)layers_.size(); }

 private:
  const KernelSet* k_;
  std::vector<StackLayer> layers_;
  double eps_;
  int64_t H_, KVH_, D_;
  double scale_;
};

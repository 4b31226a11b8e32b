// The kernels every instruction set implements; kernels.h includes this file once inside
// each set's namespace (no include guard on purpose). What each computes is the contract
// both builds meet (tests/kernels/test_cpu_kernels.py runs every test against each build
// this CPU can run).

// Paged decode attention. Floats of per-thread scratch one task needs.
int64_t decode_attention_scratch(const DecodeAttnArgs& a);
// Task t covers the tokens [task_chunk[t] * chunk, ...) of row task_b[t], every head; a
// row whose context fits one chunk is written to `out` directly.
void decode_attention_tasks(const DecodeAttnArgs& a, const int32_t* task_b, const int32_t* task_chunk,
                            const int32_t* num_chunks, float* scratch, int64_t begin, int64_t end);
// Merges the chunk partials of rows (b, h) in [begin, end) of B*H.
void decode_attention_combine(const DecodeAttnArgs& a, const int64_t* first_task, const int32_t* num_chunks,
                              int64_t begin, int64_t end);

// Paged extend attention (see ExtendAttnArgs). Floats of per-thread scratch one task needs
// (for any dtype and kv_dtype of these shapes), and one task: sequence b, kv head kvh,
// query rows [r0, r1) of b (at most EXTEND_TASK_ROWS).
int64_t extend_attention_scratch(const ExtendAttnArgs& a);
void extend_attention_task(const ExtendAttnArgs& a, int64_t b, int64_t kvh, int64_t r0, int64_t r1, float* scratch);

// bf16 GEMM: column blocks [nb_begin, nb_end) of 16, all rows.
void gemm_bf16_blocks(const GemmArgs& a, int64_t nb_begin, int64_t nb_end);
// float32 GEMM (weights [ceil(N/16), K, 16] float32, activations and output float32):
// column blocks [nb_begin, nb_end) of 16, all rows.
void gemm_f32_blocks(const GemmArgs& a, int64_t nb_begin, int64_t nb_end);

// int8-weight GEMM (see GemmArgs): activations to `bits`-bit codes (8: int8, 16: int16;
// [M, K]) per block of 32, then the column blocks [nb_begin, nb_end) of 16, all rows, at
// a.act_bits. ACTIVATION_BITS: the widths this build runs, 8 meaning 8 and 16, 16 only 16.
extern const int ACTIVATION_BITS;
void quantize_activations(const void* x, int64_t ldx, int dtype, int64_t K, int bits, void* codes, float* scales,
                          float* sums, int64_t m_begin, int64_t m_end);
void gemm_int8_blocks(const GemmArgs& a, int64_t nb_begin, int64_t nb_end);

// transformers' Llama RMSNorm: y = w * round(x / rms(x)), normalised in float32.
void rms_norm_rows(const void* x, int64_t ldx, const void* w, void* y, int64_t ldy, int64_t n, float eps,
                   int dtype, int64_t m_begin, int64_t m_end);
// y = silu(gu[:, :I]) * gu[:, I:], rounded to the dtype after each op as torch does.
void silu_mul_rows(const void* gu, int64_t ldg, void* y, int64_t ldy, int64_t inter, int dtype,
                   int64_t m_begin, int64_t m_end);
// out[m] = the index of row m's largest value (x [M, n] float32, row stride ldx, n >= 1) for
// rows [m_begin, m_end): the first of equal ones, and a row's first NaN where it holds one,
// as torch.argmax picks (it counts NaN the largest). Greedy sampling's choice per row.
void argmax_rows(const float* x, int64_t ldx, int64_t n, int64_t* out, int64_t m_begin, int64_t m_end);
// Rotary embedding and the KV write of rows [m_begin, m_end) (see RopeKVArgs).
void rope_kv_rows(const RopeKVArgs& a, int64_t m_begin, int64_t m_end);

// Packed weights back to dense rows, column blocks [nb_begin, nb_end) of 16 (a.w, a.dm,
// a.N, a.K, a.code_bits in; a.y [N, K] out, bf16 or, for int8 codes, float32 when
// a.out_dtype is 0): what a library GEMM multiplies a long prompt by.
void unpack_bf16_blocks(const GemmArgs& a, int64_t nb_begin, int64_t nb_end);
void dequantize_int8_blocks(const GemmArgs& a, int64_t nb_begin, int64_t nb_end);

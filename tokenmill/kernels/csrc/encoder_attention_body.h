// The body of the encoder's varlen attention (encoder_attention.cpp), included once per
// instruction set inside its own namespace and `#pragma GCC target` region. The includer
// defines the vector type `VF`, its lanes `W`, the register tiles (`kScoreRows` x
// `kScoreVecs` for Q.K^T, `kOutRows` x `kOutVecs` for P.V) and the wrappers `vzero`, `vload`,
// `vstore`, `vset1`, `vfma`, `vmul`, `vadd`,
// `vsub`, `vmax`, `vexp` (exp_approx's polynomial), `reduce_max`, `reduce_add`. One task: one sequence's queries [q_begin, q_end) of one
// head; its keys are transposed and its values widened once, then blocks of queries go
// through two register-tiled products around an exact softmax (a whole row of scores fits:
// an encoder's sequence is at most a few thousand tokens).
// (No include guard and no includes: included on purpose several times.)

// s[r][c] = sum_j q[r][j] * kt[j][c], for `MR` rows and `NR` vectors of columns.
template <int MR, int NR>
inline void score_tile(const float* q, int64_t d, const float* kt, int64_t ldk, float* s,
                       int64_t lds) {
  VF acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NR; ++v) acc[r][v] = vzero();
  for (int64_t j = 0; j < d; ++j) {
    VF b[NR];
    for (int v = 0; v < NR; ++v) b[v] = vload(kt + j * ldk + v * W);
    for (int r = 0; r < MR; ++r) {
      const VF a = vset1(q[r * d + j]);
      for (int v = 0; v < NR; ++v) acc[r][v] = vfma(a, b[v], acc[r][v]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NR; ++v) vstore(s + r * lds + v * W, acc[r][v]);
}

template <int MR>
inline void score_rows(const float* q, int64_t d, const float* kt, int64_t cols, float* s) {
  int64_t c = 0;
  for (; c + kScoreVecs * W <= cols; c += kScoreVecs * W)
    score_tile<MR, kScoreVecs>(q, d, kt + c, cols, s + c, cols);
  for (; c < cols; c += W) score_tile<MR, 1>(q, d, kt + c, cols, s + c, cols);
}

// o[r][c] = inverse[r] * sum_t p[r][t] * v[t][c], for `MR` rows and `NV` vectors of columns.
template <int MR, int NV>
inline void out_tile(const float* p, int64_t ldp, int64_t len, const float* v, int64_t d,
                     const float* inverse, float* o) {
  VF acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = vzero();
  for (int64_t t = 0; t < len; ++t) {
    VF b[NV];
    for (int c = 0; c < NV; ++c) b[c] = vload(v + t * d + c * W);
    for (int r = 0; r < MR; ++r) {
      const VF a = vset1(p[r * ldp + t]);
      for (int c = 0; c < NV; ++c) acc[r][c] = vfma(a, b[c], acc[r][c]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NV; ++c) vstore(o + r * d + c * W, vmul(acc[r][c], vset1(inverse[r])));
}

template <int MR>
inline void out_rows(const float* p, int64_t ldp, int64_t len, const float* v, int64_t d,
                     const float* inverse, float* o) {
  int64_t c = 0;
  for (; c + kOutVecs * W <= d; c += kOutVecs * W)
    out_tile<MR, kOutVecs>(p, ldp, len, v + c, d, inverse, o + c);
  for (; c < d; c += W) out_tile<MR, 1>(p, ldp, len, v + c, d, inverse, o + c);
}

// The row's first `len` scores become their softmax's numerators exp(s - max) in place; returns
// 1 / their sum. Columns [len, cols) are set to -inf first, so whole vectors run (their
// exp is ~1e-38: the sum is off by at most 1e-37 relative).
inline float softmax_row(float* row, int64_t len, int64_t cols) {
  for (int64_t t = len; t < cols; ++t) row[t] = -INFINITY;
  VF top = vset1(-INFINITY);
  for (int64_t t = 0; t < cols; t += W) top = vmax(top, vload(row + t));
  const VF shift = vset1(reduce_max(top));
  VF total = vzero();
  for (int64_t t = 0; t < cols; t += W) {
    const VF e = vexp(vsub(vload(row + t), shift));
    vstore(row + t, e);
    total = vadd(total, e);
  }
  return 1.0f / reduce_add(total);
}

template <typename C>
void attend_sequence(const EncoderAttentionArgs& a, const EncoderAttentionTask& task,
                     float* scratch) {
  const int64_t d = a.d, start = a.cu_seqlens[task.seq];
  const int64_t len = a.cu_seqlens[task.seq + 1] - start;
  const int64_t cols = (len + W - 1) / W * W;
  const int64_t kv_head = task.head / (a.heads / a.kv_heads);
  float* kt = scratch;                           // [d, cols]: keys transposed
  float* values = kt + d * cols;                 // [len, d]
  float* qf = values + len * d;                  // [kEncoderQueryBlock, d], scaled
  float* scores = qf + kEncoderQueryBlock * d;   // [kEncoderQueryBlock, cols]
  float* out = scores + kEncoderQueryBlock * cols;  // [kEncoderQueryBlock, d]
  float* inverse = out + kEncoderQueryBlock * d;    // [kEncoderQueryBlock]
  const C* key = static_cast<const C*>(a.key) + start * a.k_stride + kv_head * d;
  const C* value = static_cast<const C*>(a.value) + start * a.v_stride + kv_head * d;
  for (int64_t t = 0; t < len; ++t) {
    for (int64_t j = 0; j < d; ++j) kt[j * cols + t] = load_float(key + t * a.k_stride + j);
#pragma omp simd
    for (int64_t j = 0; j < d; ++j) values[t * d + j] = load_float(value + t * a.v_stride + j);
  }
  for (int64_t j = 0; j < d; ++j)
    for (int64_t t = len; t < cols; ++t) kt[j * cols + t] = 0.0f;

  for (int64_t q0 = task.q_begin; q0 < task.q_end; q0 += kEncoderQueryBlock) {
    const int64_t rows = std::min<int64_t>(kEncoderQueryBlock, task.q_end - q0);
    for (int64_t r = 0; r < rows; ++r) {
      const C* src = static_cast<const C*>(a.query) + (start + q0 + r) * a.q_stride +
                     task.head * d;
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) qf[r * d + j] = load_float(src + j) * a.scale;
    }
    int64_t r = 0;
    for (; r + kScoreRows <= rows; r += kScoreRows)
      score_rows<kScoreRows>(qf + r * d, d, kt, cols, scores + r * cols);
    for (; r < rows; ++r) score_rows<1>(qf + r * d, d, kt, cols, scores + r * cols);
    for (r = 0; r < rows; ++r) inverse[r] = softmax_row(scores + r * cols, len, cols);
    for (r = 0; r + kOutRows <= rows; r += kOutRows)
      out_rows<kOutRows>(scores + r * cols, cols, len, values, d, inverse + r, out + r * d);
    for (; r < rows; ++r)
      out_rows<1>(scores + r * cols, cols, len, values, d, inverse + r, out + r * d);
    for (r = 0; r < rows; ++r) {
      C* dst = static_cast<C*>(a.out) + (start + q0 + r) * a.out_stride + task.head * d;
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) store_float(dst + j, out[r * d + j]);
    }
  }
}

// A residual add and the RMSNorm after it in one call, for decoders that run their layers as
// torch modules (models/hybrid.py): in torch that is ~8 ops a norm (the upcast, pow, mean,
// rsqrt, the products, the downcast, the (1 + w) scale), 49 norms a Qwen3.5-0.8B step, each op
// a few microseconds of dispatch around a few hundred nanoseconds of arithmetic.
//   sum = hidden + delta (in the activations' dtype); normed = rms_norm(sum) * (offset + w)
// rounded where torch rounds (the sum; the scale `w + offset` in the dtype; the normed row once,
// after the scale, as F.rms_norm does), so a bfloat16 model gets the torch path's numbers.
#include <cmath>
#include <tuple>

#include "cpu_common.h"
#include "thread_pool.h"

namespace tokenmill {
namespace {

template <typename T>
inline float rounded_to(float x) {
  T stored;
  store_float(&stored, x);
  return load_float(&stored);
}

template <typename T>
void add_norm_row(const T* hidden, const T* delta, const T* weight, float offset, float eps,
                  int64_t size, T* sum, T* normed) {
  float squares = 0.f;
  for (int64_t j = 0; j < size; ++j) {
    const float x = delta == nullptr ? load_float(hidden + j)
                                     : rounded_to<T>(load_float(hidden + j) + load_float(delta + j));
    if (sum != nullptr) store_float(sum + j, x);
    squares += x * x;
  }
  const float inverse = 1.f / std::sqrt(squares / static_cast<float>(size) + eps);
  const T* source = sum != nullptr ? sum : hidden;
  for (int64_t j = 0; j < size; ++j) {
    const float scale = offset == 0.f ? load_float(weight + j)
                                      : rounded_to<T>(load_float(weight + j) + offset);
    store_float(normed + j, load_float(source + j) * inverse * scale);
  }
}

template <typename T>
void add_norm_rows(const at::Tensor& hidden, const T* delta, const at::Tensor& weight,
                   float offset, float eps, T* sum, at::Tensor& normed) {
  const int64_t rows = hidden.size(0), size = hidden.size(1);
  const T* h = hidden.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
  T* n = normed.data_ptr<T>();
  parallel_chunks(rows, [&](int64_t r, int) {
    add_norm_row<T>(h + r * size, delta == nullptr ? nullptr : delta + r * size, w, offset, eps,
                    size, sum == nullptr ? nullptr : sum + r * size, n + r * size);
  }, rows * size >= (1 << 16) ? team_size() : 1);
}

}  // namespace

// (hidden + delta, its norm); without delta, (hidden, hidden's norm).
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& hidden,
                                                const c10::optional<at::Tensor>& delta,
                                                const at::Tensor& weight, double offset,
                                                double eps) {
  const auto dtype = hidden.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && hidden.dim() == 2 &&
                  hidden.is_contiguous() && weight.scalar_type() == dtype &&
                  weight.is_contiguous() && weight.numel() == hidden.size(1),
              "add_rms_norm: contiguous [rows, size] float32 or bfloat16, a weight [size] alike");
  if (delta.has_value()) {
    TORCH_CHECK(delta->scalar_type() == dtype && delta->is_contiguous() &&
                    delta->sizes() == hidden.sizes(),
                "add_rms_norm: delta as hidden");
  }
  at::Tensor normed = at::empty(hidden.sizes(), hidden.options());
  at::Tensor sum = delta.has_value() ? at::empty(hidden.sizes(), hidden.options()) : hidden;
  const float o = static_cast<float>(offset), e = static_cast<float>(eps);
  if (dtype == at::kFloat) {
    const float* d = delta.has_value() ? delta->data_ptr<float>() : nullptr;
    add_norm_rows<float>(hidden, d, weight, o, e,
                         delta.has_value() ? sum.data_ptr<float>() : nullptr, normed);
  } else {
    const bf16* d = delta.has_value() ? delta->data_ptr<bf16>() : nullptr;
    add_norm_rows<bf16>(hidden, d, weight, o, e,
                        delta.has_value() ? sum.data_ptr<bf16>() : nullptr, normed);
  }
  return {sum, normed};
}

}  // namespace tokenmill

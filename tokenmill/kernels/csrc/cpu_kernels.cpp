// tokenmill's CPU kernels: the module's entry points and the ISA level they run at.
//
// Each hot loop is compiled for several instruction sets (GCC target attributes) and picked at
// run time from `current_isa()`. Python (tokenmill/kernels/native.py) sets the level: the
// CPU's best, or lower through TOKENMILL_CPU_ISA so that tests run every path on one machine.
#include <cpuid.h>
#include <torch/csrc/utils/pybind.h>

#include <tuple>

#include "cpu_common.h"
#include "decoder_stack.h"
#include "int_linear.h"
#include "linear.h"
#include "lora.h"
#include "moe.h"
#include "paged_attention.h"
#include "thread_pool.h"

namespace tokenmill {

at::Tensor argmax_rows(const at::Tensor& logits);  // argmax.cpp
at::Tensor gated_delta_decode(const at::Tensor& query, const at::Tensor& key,
                              const at::Tensor& value, const at::Tensor& decay,
                              const at::Tensor& beta, at::Tensor& state_pool,
                              const at::Tensor& slots);  // gated_delta.cpp
at::Tensor gated_delta_prefill(const at::Tensor& query, const at::Tensor& key,
                               const at::Tensor& value, const at::Tensor& decay,
                               const at::Tensor& beta, at::Tensor& state);  // gated_delta.cpp
at::Tensor gated_deltanet_decode(const at::Tensor& mixed, const at::Tensor& z,
                                 const at::Tensor& b, const at::Tensor& a,
                                 const at::Tensor& a_log, const at::Tensor& dt_bias,
                                 const at::Tensor& conv_weight, at::Tensor& conv_states,
                                 at::Tensor& state_pool, const at::Tensor& slots,
                                 const at::Tensor& norm_weight, int64_t k_heads,
                                 double eps);  // gated_deltanet_decode.cpp
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& hidden,
                                                const c10::optional<at::Tensor>& delta,
                                                const at::Tensor& weight, double offset,
                                                double eps);  // add_rms_norm.cpp
void encoder_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                       const at::Tensor& cu_seqlens, double scale,
                       at::Tensor& out);  // encoder_attention.cpp
at::Tensor draft_chain(DecoderStack& stack, const at::Tensor& embedding,
                       const PackedLinear& lm_head, const at::Tensor& first_tokens,
                       at::Tensor& positions, at::Tensor& slot_mapping,
                       const at::Tensor& query_start_loc, at::Tensor& seq_lens,
                       const at::Tensor& block_tables, const std::vector<at::Tensor>& kv_caches,
                       int64_t block_size, int64_t steps);  // draft_chain.cpp
at::Tensor draft_proposal(DecoderStack& stack, const at::Tensor& embedding,
                          const PackedLinear& lm_head, const at::Tensor& catch_up_ids,
                          const at::Tensor& catch_up_positions, const at::Tensor& catch_up_slots,
                          const at::Tensor& catch_up_query_start_loc,
                          const at::Tensor& catch_up_seq_lens, at::Tensor& positions,
                          at::Tensor& slot_mapping, const at::Tensor& query_start_loc,
                          at::Tensor& seq_lens, const at::Tensor& block_tables,
                          const std::vector<at::Tensor>& kv_caches, int64_t block_size,
                          int64_t steps);  // draft_chain.cpp

namespace {

int g_isa = kPortable;

// AMX-BF16 and AMX-TILE (CPUID 7.0 EDX bits 22 and 24), the OS saving tile state (XCR0 bits
// 17 and 18), and Linux letting this process use it.
bool cpu_has_amx_bf16() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  if (!((edx >> 22) & 1) || !((edx >> 24) & 1)) return false;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !((ecx >> 27) & 1)) return false;  // OSXSAVE
  unsigned xcr0_low, xcr0_high;
  __asm__ volatile("xgetbv" : "=a"(xcr0_low), "=d"(xcr0_high) : "c"(0));
  if (((xcr0_low >> 17) & 3) != 3) return false;
  return amx_permitted();
}

}  // namespace

int detect_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    if (!__builtin_cpu_supports("avx512bf16") || !__builtin_cpu_supports("avx512vnni"))
      return kAvx512;
    return cpu_has_amx_bf16() ? kAmx : kAvx512Bf16;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c"))
    return kAvx2;
  return kPortable;
}

int current_isa() { return g_isa; }

int set_isa(int level) {
  g_isa = std::max(0, std::min(level, detect_isa()));
  return g_isa;
}

}  // namespace tokenmill

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace tokenmill;
  // The products, attention and the stack run without the GIL: a server's event loop streams
  // while a forward runs (with it held, no chunk could be written for 30-100 ms a step).
  const auto no_gil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("detect_isa", &detect_isa, "best ISA level of this CPU (0-4)");
  m.def("set_isa", &set_isa, "run at this ISA level (at most the CPU's best); returns it");
  m.def("get_isa", &current_isa);
  m.def("pack_linear_weight", &pack_linear_weight, "[n, k] weight -> the packed layout");
  m.def("unpack_linear_weight", &unpack_linear_weight, "the packed layout -> [n, k]");
  m.def("packed_linear", &packed_linear, "x @ weight.T + bias on a packed weight", no_gil);
  m.def("set_quant_prefetch", &set_quant_prefetch, "tuning: VNNI products' prefetch distance");
  m.def("phase_profile_enable", &PhaseProfile::enable,
        "sum each kind of native phase's wall time from now on (off: stop)");
  m.def(
      "phase_profile_take",
      [] {
        pybind11::dict totals;
        for (const auto& [label, e] : PhaseProfile::take())
          totals[pybind11::str(label)] = pybind11::make_tuple(e.nanoseconds, e.phases, e.bytes);
        return totals;
      },
      "{label: (nanoseconds, phases, bytes)} since the last take; clears them");
  m.def("quant_amx_min_rows", [] { return kQuantAmxMinRows; },
        "rows from which quantized products run on AMX tiles (ISA level 4)");
  pybind11::class_<PackedLinear>(m, "PackedLinear")
      .def_static("dense", &PackedLinear::dense, "a packed dense weight [n, k]")
      .def_static("quantized", &int_codes_linear,
                  "packed int8/int4 codes with float16 scales (and offsets) per group")
      .def("forward", &PackedLinear::forward, "x @ weight.T + bias", no_gil)
      .def(
          "rows",
          [](const PackedLinear& linear, const at::Tensor& rows) {
            return quant_rows(linear.weight(), rows);
          },
          "float32 rows of a quantized weight (an embedding lookup)", no_gil);
  m.def("paged_attention", &paged_attention, "paged attention, reading the cache in place",
        no_gil);
  m.def("lora_shrink_expand", &lora_shrink_expand,
        "y += (x A[slot]^T) B^T[slot] per segment of rows (multi-LoRA)", no_gil);
  m.def("argmax_rows", &argmax_rows, "the first maximal index of each row (float32)", no_gil);
  m.def("gated_delta_decode", &gated_delta_decode,
        "one token of the gated delta rule per row, its state updated in its slot", no_gil);
  m.def("gated_delta_prefill", &gated_delta_prefill,
        "one sequence's tokens of the gated delta rule, its state updated in place", no_gil);
  m.def("gated_deltanet_decode", &gated_deltanet_decode,
        "a gated DeltaNet layer's decode rows: conv, the delta rule, the gated norm", no_gil);
  m.def("add_rms_norm", &add_rms_norm,
        "(hidden + delta, rms_norm(hidden + delta) * (offset + weight)) in the dtype", no_gil);
  m.def("encoder_attention", &encoder_attention,
        "bidirectional attention over packed variable-length sequences (cu_seqlens)", no_gil);
  pybind11::class_<DecoderStack>(m, "DecoderStack")
      .def(pybind11::init<const std::vector<std::vector<c10::optional<at::Tensor>>>&,
                          const std::vector<std::vector<std::vector<PackedLinear>>>&,
                          const at::Tensor&,
                          const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t,
                          int64_t, double, int64_t>())
      .def("set_family_options", &DecoderStack::set_family_options)
      .def("set_kv_groups", &DecoderStack::set_kv_groups)
      .def("set_attention_softcap", &DecoderStack::set_attention_softcap)
      .def("set_final_norm", &DecoderStack::set_final_norm)
      .def("set_lora", &DecoderStack::set_lora)
      .def("set_moe", &DecoderStack::set_moe, "layer's MLP: these experts, router, top_k, renormalize")
      .def("forward", &DecoderStack::forward, no_gil, pybind11::arg("hidden"),
           pybind11::arg("positions"), pybind11::arg("kv_caches"), pybind11::arg("slot_mapping"),
           pybind11::arg("query_start_loc"), pybind11::arg("seq_lens"),
           pybind11::arg("block_tables"), pybind11::arg("lora_segments") = pybind11::none());
  m.def("draft_chain", &draft_chain,
        "a draft model's greedy chain: k - 1 steps of embedding, stack, LM head and argmax",
        no_gil);
  m.def("draft_proposal", &draft_proposal,
        "a draft model's whole proposal: the catch-up forward, its argmax, then the chain",
        no_gil);
  pybind11::class_<MoEExperts>(m, "MoEExperts")
      .def(pybind11::init<std::vector<PackedLinear>, std::vector<PackedLinear>, int64_t,
                          std::vector<at::Tensor>, std::vector<at::Tensor>, int64_t, double,
                          double>(),
           pybind11::arg("gate_up"), pybind11::arg("down"), pybind11::arg("intermediate_size"),
           pybind11::arg("gate_up_bias") = std::vector<at::Tensor>{},
           pybind11::arg("down_bias") = std::vector<at::Tensor>{},
           pybind11::arg("activation") = static_cast<int64_t>(kMoESilu),
           pybind11::arg("alpha") = 1.702, pybind11::arg("limit") = 7.0)
      .def("forward", &MoEExperts::forward, "an MoE block's routed experts", no_gil)
      .def("set_per_expert", &MoEExperts::set_per_expert,
           "each expert's products in turn (the reference of the one-job path)");
}

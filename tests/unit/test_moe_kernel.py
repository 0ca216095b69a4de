"""The native MoE kernel (kernels/moe.py, csrc/moe.cpp) against the torch reference
(layers/fused_moe.py's `torch_experts`) over the same experts, at every ISA level this CPU
runs, for float32, bfloat16 and int8 experts; routing as each family does it; its one pool job
against its per-expert path, bit for bit, in every weight format."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels import native
from tokenmill.kernels.int_linear import native_quant_linear, pack
from tokenmill.kernels.moe import CLAMPED_SWIGLU, SILU, moe_kernel, native_moe_experts
from tokenmill.layers.fused_moe import ExpertMLP, RouterLinear, route, torch_experts
from tokenmill.layers.linear import DenseLinearMethod, PackedLinearMethod, replace_linears
from tokenmill.quantization.int8 import Int8LinearMethod

module = native.native_kernels()
needs_native = pytest.mark.skipif(module is None, reason="native kernels not buildable here")
# Widths off the 16-row blocks; 5 experts, 2 active.
HIDDEN, WIDTH, NUM_EXPERTS, TOP_K = 48, 40, 5, 2
# method -> (dtype, the method, tolerance against float32 F.linear experts, against the torch
# path over the same linears; bf16: that path rounds gate/up and the products to bf16; int8:
# int8 activations at VNNI levels).
METHODS = {
    "float32": (torch.float32, lambda: PackedLinearMethod(torch.float32), 1e-5, 1e-5),
    "bfloat16": (torch.bfloat16, lambda: PackedLinearMethod(torch.bfloat16), 3e-2, 3e-2),
    "int8": (torch.float32, lambda: Int8LinearMethod(), 6e-2, 1e-5),
}


def make_experts(method: str, seed: int = 0) -> tuple[nn.ModuleList, nn.ModuleList]:
    """(the experts with `method`'s linears, the same float32 experts with `F.linear`)."""
    dtype, make_method, _, _ = METHODS[method]
    torch.manual_seed(seed)
    plain = nn.ModuleList(ExpertMLP(HIDDEN, WIDTH) for _ in range(NUM_EXPERTS))
    for expert in plain:
        for linear in (expert.gate_up_proj, expert.down_proj):
            nn.init.normal_(linear.weight, std=linear.in_features**-0.5)
    fast = nn.ModuleList(ExpertMLP(HIDDEN, WIDTH) for _ in range(NUM_EXPERTS))
    fast.load_state_dict(plain.state_dict())
    fast.to(dtype)
    layers = replace_linears(fast, lambda name, linear: make_method())
    for name, layer in layers.items():
        if not layer.quant_method.holds_float_weight:
            weight = plain.get_submodule(name).weight.detach()
            layer.quant_method.load_weight(layer, weight, 0)
        layer.quant_method.process_weights_after_loading(layer)
    replace_linears(plain, lambda name, linear: DenseLinearMethod())
    return fast, plain


def routed(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=generator)
    logits = torch.randn(tokens, NUM_EXPERTS, generator=generator)
    weights, ids = route(logits, TOP_K, renormalize=seed % 2 == 0)
    return x, weights, ids


@needs_native
@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("tokens", [1, 3, 17])
def test_native_experts_match_the_torch_reference(isa: int, method: str, tokens: int) -> None:
    dtype, _, tolerance, same_tolerance = METHODS[method]
    fast, plain = make_experts(method)
    x, weights, ids = routed(tokens, seed=tokens)
    kernel = native_moe_experts(fast, x.to(dtype))
    assert kernel is not None
    got = kernel(x.to(dtype), weights, ids)
    assert got.dtype == dtype and got.shape == x.shape
    reference = torch_experts(x, weights, ids, plain)
    scale = reference.abs().max().item()
    assert (got.float() - reference).abs().max().item() <= tolerance * scale
    same_linears = torch_experts(x.to(dtype), weights, ids, fast).float()
    assert (got.float() - same_linears).abs().max().item() <= same_tolerance * scale


@needs_native
def test_only_the_chosen_experts_are_read() -> None:
    """An expert no token picked may hold anything (NaN here): the result does not see it,
    as a batch of one touches only its k experts' weights."""
    fast, _ = make_experts("float32")
    x, weights, ids = routed(1, seed=4)
    unused = next(e for e in range(NUM_EXPERTS) if e not in ids.tolist()[0])
    poisoned, _ = make_experts("float32")
    with torch.no_grad():
        poisoned[unused].gate_up_proj.packed_weight.fill_(float("nan"))
    expected = native_moe_experts(fast, x)(x, weights, ids)
    got = native_moe_experts(poisoned, x)(x, weights, ids)
    assert torch.equal(got, expected)


def test_routing_follows_each_family() -> None:
    """Softmax over every expert, then the top k: renormalised (Mixtral, Qwen3-MoE) they sum
    to one; not (Qwen2-MoE) they are the softmax's own values."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, 3.0, 0.1, 0.2]])
    weights, ids = route(logits, 2, renormalize=False)
    probs = F.softmax(logits, dim=-1)
    assert ids.tolist() == [[0, 1], [1, 3]]
    assert torch.allclose(weights, probs.gather(1, ids))
    renormalised, same_ids = route(logits, 2, renormalize=True)
    assert torch.equal(same_ids, ids)
    assert torch.allclose(renormalised.sum(-1), torch.ones(2))
    assert torch.allclose(renormalised, weights / weights.sum(-1, keepdim=True))


def test_torch_reference_equals_a_loop_over_tokens() -> None:
    _, plain = make_experts("float32")
    x, weights, ids = routed(9, seed=2)
    expected = torch.stack(
        [
            sum(weights[t, j] * plain[int(ids[t, j])](x[t : t + 1])[0] for j in range(TOP_K))
            for t in range(x.shape[0])
        ]
    )
    assert torch.allclose(torch_experts(x, weights, ids, plain), expected, atol=1e-5)


def test_the_router_multiplies_in_float32() -> None:
    """A bfloat16 router's logits are its weight times the input in float32 (torch's bf16
    CPU product of a row was 11 ms for a 2048 x 64 router; float32 logits feed the softmax)."""
    router = RouterLinear(64, 8).to(torch.bfloat16)
    nn.init.normal_(router.weight)
    x = torch.randn(3, 64).to(torch.bfloat16)
    logits = router(x)
    assert logits.dtype == torch.float32
    assert torch.allclose(logits, F.linear(x.float(), router.weight.float()), atol=1e-5)


# gpt-oss's experts (models/gpt_oss_moe.py): biases on both products, the clamped SwiGLU on
# interleaved gate/up columns. variant -> (hidden, width, model dtype, MXFP4, tolerance against
# the float32 torch path: bf16 rounds activations; MXFP4's 5-bit products round them to int8).
GPT_OSS = {
    "float32": (48, 40, torch.float32, False, 1e-5),
    "bfloat16": (48, 40, torch.bfloat16, False, 3e-2),
    "mxfp4": (64, 96, torch.bfloat16, True, 6e-2),
}


def gpt_oss_experts(variant: str, mxfp4_weights: bool):
    from tokenmill.models.gpt_oss_moe import GptOssExperts, GptOssMoEShape
    from tokenmill.quantization import mxfp4

    hidden, width, _, _, _ = GPT_OSS[variant]
    shape = GptOssMoEShape(hidden, NUM_EXPERTS, TOP_K, width, 1.702, 7.0, mxfp4_weights)
    experts = GptOssExperts(shape)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, rows, cols in (("gate_up_proj", 2 * width, hidden), ("down_proj", hidden, width)):
            # std 3 outputs: gate/up values beyond the limit of 7 are clamped.
            weight = torch.randn(NUM_EXPERTS, rows, cols, generator=generator) * 3 / cols**0.5
            if mxfp4_weights:
                blocks, scales = mxfp4.quantize(weight)
                getattr(experts, f"{name}_blocks").copy_(blocks)
                getattr(experts, f"{name}_scales").copy_(scales)
            else:
                getattr(experts, name).copy_(weight)
            bias = torch.randn(NUM_EXPERTS, rows, generator=generator) / 4
            getattr(experts, f"{name}_bias").copy_(bias)
    return experts


@needs_native
@pytest.mark.parametrize("variant", sorted(GPT_OSS))
@pytest.mark.parametrize("tokens", [1, 6])
def test_gpt_oss_experts_in_the_kernel_match_torch(isa: int, variant: str, tokens: int) -> None:
    """Biases and the clamped SwiGLU in the native kernel, at each ISA level, against the
    experts' own torch path in float32 (MXFP4: its exact expansion)."""
    hidden, _, dtype, is_mxfp4, tolerance = GPT_OSS[variant]
    reference_experts = gpt_oss_experts(variant, is_mxfp4)
    generator = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=generator)
    weights, ids = route(torch.randn(tokens, NUM_EXPERTS, generator=generator), TOP_K, True)
    calls = [lambda rows, e=e: reference_experts.expert(e, rows) for e in range(NUM_EXPERTS)]
    reference = torch_experts(x, weights, ids, calls)
    fast = gpt_oss_experts(variant, is_mxfp4).to(dtype)
    got = fast(x.to(dtype), weights, ids)
    assert fast.uses_native_kernel and got.dtype == dtype
    scale = reference.abs().max().item()
    assert (got.float() - reference).abs().max().item() <= tolerance * scale


def test_gpt_oss_mxfp4_in_float32_keeps_the_exact_expansion() -> None:
    experts = gpt_oss_experts("mxfp4", True)
    assert experts.native_kernel(torch.zeros(1, 64)) is None


# The one pool job over every active expert's blocks (csrc/moe.cpp's default) against the
# per-expert path (each expert's products in turn through the formats' own
# `PackedLinear::forward`): equal bit for bit at every ISA level, for dense float32 and bf16
# experts (and bf16 weights under float32 inputs, which take the per-expert path), int8, int4
# with offsets and K-quant-style factored scales, and gpt-oss's biased clamped SwiGLU.


def dense_linear(rows: int, cols: int, dtype: torch.dtype, generator: torch.Generator):
    weight = (torch.randn(rows, cols, generator=generator) / cols**0.5).to(dtype)
    return module.PackedLinear.dense(module.pack_linear_weight(weight), rows, cols)


def quantized_linear(rows: int, cols: int, bits: int, generator: torch.Generator):
    """Random codes; int4 with offsets and scales that factor as a K-quant's (int8 times a
    float16 per 256 columns); int8 with plain float16 scales."""
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    codes = torch.randint(low, high + 1, (rows, cols), generator=generator)
    subs = torch.randint(1, 64, (rows, cols // 32), generator=generator).float()
    scales = subs * 2.0**-12 if bits == 4 else subs / 64 / cols**0.5
    offsets = torch.randn(rows, cols // 32, generator=generator) / 64 if bits == 4 else None
    weight = pack(codes, scales.half(), None if offsets is None else offsets.half(), bits, 32)
    assert (weight.super_scales is not None) == (bits == 4)
    return native_quant_linear(weight)


# format -> (model dtype, hidden, width, a linear of [rows, cols])
ONE_JOB_FORMATS = {
    "float32": (torch.float32, 48, 40, lambda r, c, g: dense_linear(r, c, torch.float32, g)),
    "bfloat16": (torch.bfloat16, 48, 40, lambda r, c, g: dense_linear(r, c, torch.bfloat16, g)),
    "int8": (torch.bfloat16, 64, 96, lambda r, c, g: quantized_linear(r, c, 8, g)),
    "int4-k-quant": (torch.float32, 256, 256, lambda r, c, g: quantized_linear(r, c, 4, g)),
    "bf16-weights-f32-input": (
        torch.float32,
        48,
        64,
        lambda r, c, g: dense_linear(r, c, torch.bfloat16, g),
    ),
}


def one_job_kernels(fmt: str, activation: int = SILU, biased: bool = False):
    """(one-job kernel, per-expert kernel) over the same experts, and the model dtype."""
    dtype, hidden, width, make = ONE_JOB_FORMATS[fmt]
    generator = torch.Generator().manual_seed(7)
    gate_up = [make(2 * width, hidden, generator) for _ in range(NUM_EXPERTS)]
    down = [make(hidden, width, generator) for _ in range(NUM_EXPERTS)]
    biases = None
    if biased:
        biases = (
            [torch.randn(2 * width, generator=generator) for _ in range(NUM_EXPERTS)],
            [torch.randn(hidden, generator=generator) for _ in range(NUM_EXPERTS)],
        )
    made = [
        moe_kernel(gate_up, down, width, biases, activation, per_expert=per_expert)
        for per_expert in (False, True)
    ]
    return made[0], made[1], dtype, hidden


def one_job_inputs(tokens: int, hidden: int, dtype: torch.dtype, seed: int):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=generator).to(dtype)
    weights, ids = route(torch.randn(tokens, NUM_EXPERTS, generator=generator), TOP_K, True)
    return x, weights, ids


@needs_native
@pytest.mark.parametrize("fmt", sorted(ONE_JOB_FORMATS))
@pytest.mark.parametrize("tokens", [1, 2, 17])
def test_one_job_equals_the_per_expert_products(isa: int, fmt: str, tokens: int) -> None:
    one_job, per_expert, dtype, hidden = one_job_kernels(fmt)
    x, weights, ids = one_job_inputs(tokens, hidden, dtype, seed=tokens)
    got = one_job(x, weights, ids)
    expected = per_expert(x, weights, ids)
    assert got.dtype == dtype and got.shape == x.shape
    assert got.abs().max().item() > 0
    assert torch.equal(got, expected)


@needs_native
@pytest.mark.parametrize("fmt", ["bfloat16", "int4-k-quant"])
def test_one_job_equals_per_expert_with_biases_and_clamped_swiglu(isa: int, fmt: str) -> None:
    """gpt-oss's experts: a bias on each product, the clamped SwiGLU."""
    one_job, per_expert, dtype, hidden = one_job_kernels(fmt, CLAMPED_SWIGLU, biased=True)
    x, weights, ids = one_job_inputs(5, hidden, dtype, seed=3)
    assert torch.equal(one_job(x, weights, ids), per_expert(x, weights, ids))


@needs_native
def test_no_tokens_give_no_rows() -> None:
    one_job, _, dtype, hidden = one_job_kernels("float32")
    x, weights, ids = one_job_inputs(0, hidden, dtype, seed=0)
    assert one_job(x, weights, ids).shape == (0, hidden)

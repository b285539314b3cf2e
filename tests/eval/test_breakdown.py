"""hf_kbit.eval.breakdown: kernels grouped by origin, each charged its exposed time, and the kbit modules that
launch in one decode step, in call order (the profiling itself runs on the GPU machine only)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_llama as tiny_model

from hf_kbit.eval.breakdown import kbit_call_order, kbit_module_summary, kernel_breakdown, kernel_group
from hf_kbit.eval.timing import GreedyDecodeStep, random_prompt

PROMPT_LEN = 8


@pytest.mark.parametrize("name, group", [
    ("void kbit::gemv_kernel<__nv_bfloat16, 4, 0>(kbit::MmParams)", "kbit"),  # holds "gemv", is still ours
    ("void kbit::splitk_reduce_kernel<__nv_bfloat16>(float const*, __nv_bfloat16*, long, int)", "kbit"),
    ("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", "cublas"),
    ("void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, 128, 16, 4, 4, false>(...)", "cublas"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64", "cublas"),
    ("void pytorch_flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4>>(Flash_fwd_params)",
     "attention"),
    ("cudnn_generated_fort_native_sdpa_sm80_flash_fprop_wmma_f16_knob_3_64x64x128_4x1x1_cga1x1x1_kernel0_0",
     "attention"),
    ("_decode_attention_slice_kernel", "attention"),  # hf_kbit.attention's Triton kernels
    ("_decode_attention_merge_kernel", "attention"),
    ("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0", "triton"),
    ("triton_poi_fused__scaled_dot_product_cudnn_attention__to_copy_add_cat_1", "triton"),  # fused around SDPA
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<long>>(int, ...)", "other"),
])
def test_kernel_group_by_origin(name, group):
    assert kernel_group(name) == group


def test_kernel_breakdown_charges_each_kernel_its_exposed_time():
    # Two steps. The second kbit kernel starts before the triton kernel ends (a programmatic dependent
    # launch): its duration (12) counts 2 us the triton kernel is charged. An idle gap of 1 us before the
    # cuBLAS kernel is charged to no group. Exposed times and idle add up to the span (0 .. 35).
    kernels = [("void kbit::gemv_kernel<a>", 0.0, 10.0), ("triton_poi_fused_add_0", 9.0, 12.0),
               ("void kbit::gemv_kernel<a>", 10.0, 22.0), ("nvjet_tst_x", 23.0, 29.0),
               ("void at::native::reduce_kernel<b>", 29.0, 30.0), ("triton_poi_fused_add_0", 30.0, 35.0)]
    split = kernel_breakdown(kernels, steps=2, top=2)
    assert split["us_per_step"] == {"kbit": 10.0, "cublas": 3.0, "triton": 3.5, "attention": 0.0, "other": 0.5}
    assert split["kernel_us_per_step"] == {"kbit": 11.0, "cublas": 3.0, "triton": 4.0, "attention": 0.0, "other": 0.5}
    assert split["kernels_per_step"] == {"kbit": 1.0, "cublas": 0.5, "triton": 1.0, "attention": 0.0, "other": 0.5}
    assert split["idle_us_per_step"] == pytest.approx(0.5)
    assert split["total_us_per_step"] == pytest.approx(17.5)  # (35 - 0) / 2
    assert split["top"] == [{"kernel": "void kbit::gemv_kernel<a>", "group": "kbit", "us_per_step": 10.0},
                            {"kernel": "triton_poi_fused_add_0", "group": "triton", "us_per_step": 3.5}]
    with pytest.raises(ValueError, match="steps must be >= 1, got 0"):
        kernel_breakdown(kernels, steps=0)
    with pytest.raises(ValueError, match="kernel 'triton_x' ends before it starts"):
        kernel_breakdown([("triton_x", 5.0, 4.0)], steps=1)


def test_kernel_breakdown_charges_nothing_to_a_kernel_hidden_behind_another():
    # A kernel that ends before the kernel before it (it ran beside it) adds no exposed time.
    kernels = [("void kbit::gemv_kernel<a>", 0.0, 10.0), ("triton_a", 2.0, 6.0), ("triton_b", 10.0, 11.0)]
    split = kernel_breakdown(kernels, steps=1)
    assert split["us_per_step"]["triton"] == 1.0
    assert split["kernel_us_per_step"]["triton"] == 5.0
    assert split["total_us_per_step"] == 11.0


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_kbit_call_order_names_the_launching_kbit_modules_in_forward_order(fused):
    # intermediate_size a multiple of 16: gate/up fuse too
    model = tiny_model(torch.float32, 4, fuse_projections=fused, intermediate_size=192)
    prompt = random_prompt(model.config.vocab_size, 1, PROMPT_LEN, "cpu")
    step = GreedyDecodeStep(model, prompt, PROMPT_LEN + 3)
    per_layer = (["self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"] if fused else
                 ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"])
    layers = model.config.num_hidden_layers
    assert kbit_call_order(step) == [f"model.layers.{i}.{m}" for i in range(layers) for m in per_layer]
    assert step.position.item() == PROMPT_LEN  # rewound: the step is unchanged
    assert not any(m._forward_hooks for m in model.modules())  # the hooks are gone
    assert kbit_call_order(GreedyDecodeStep(tiny_model(torch.float32), prompt, PROMPT_LEN + 3)) == []


def test_kernel_breakdown_pools_each_module_over_layers():
    calls = ["model.layers.0.q", "model.layers.0.mlp", "model.layers.1.q", "model.layers.1.mlp"]
    gemv, reduce = "void kbit::gemv_kernel<4>", "void kbit::splitk_reduce_kernel<bf16>"
    durations = [(gemv, 4.0), ("triton_a", 1.0), (gemv, 10.0), (reduce, 2.0), (gemv, 6.0), (gemv, 12.0)] * 2
    kernels, t = [], 0.0
    for name, us in durations:  # back to back
        kernels.append((name, t, t + us))
        t += us
    split = kernel_breakdown(kernels, steps=2, kbit_calls=calls)
    assert split["kbit_us_by_module"] == {"model.layers.N.q": 5.0, "model.layers.N.mlp": 11.0}  # reduce: not a call
    assert kbit_module_summary(split) == "q 5.0, mlp 11.0"
    assert kernel_breakdown(kernels, steps=2)["kbit_us_by_module"] is None
    assert kernel_breakdown(kernels, steps=2, kbit_calls=calls[:3])["kbit_us_by_module"] is None  # 8 vs 6

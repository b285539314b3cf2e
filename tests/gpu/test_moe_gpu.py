"""GPU tests of the MoE experts layer (KbitExperts) and ``kbit::grouped_mm`` on CUDA.

Run on the GPU machine with ``scripts/run_gpu_tests.sh`` (or ``pytest -m gpu tests/gpu``).
Everything goes through the public module and op, so the tests hold for whatever serves
``kbit::grouped_mm`` on CUDA tensors: the grouped CUDA kernel once ``hf_kbit.backends.cuda``
registers one, the PyTorch reference until then. The reference is always the CPU op / the CPU
forward of the same packed weights. CUDA-graph capture and ``torch.compile`` are skipped while
no CUDA kernel is registered (the reference reads the routing offsets on the host).

Tiny models are built from the real config classes of each family (random weights, no
downloads), with sizes chosen so that tiles and blocks are partial (H = 96 is not a multiple of
the 128-element tile, I = 40 not of the 32-element block).
"""

from __future__ import annotations

import copy
import functools
import json
import sys
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

import hf_kbit
from hf_kbit import _ops
from hf_kbit import format as fmt
from hf_kbit.eval.timing import capture_cuda_graph
from hf_kbit.nn import KbitExperts, KbitLinear
from hf_kbit.nn.experts import PROJECTIONS

from kernel_cases import bits_cases, table_cases

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

DEVICE = "cuda"

HIDDEN, NUM_EXPERTS, TOP_K = 96, 8, 2
_COMMON = dict(
    hidden_size=HIDDEN,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,
    vocab_size=128,
    max_position_embeddings=64,
    num_experts_per_tok=TOP_K,
)
_MLA = dict(
    num_key_value_heads=4, head_dim=8, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=16,
)
_DEEPSEEK_MOE = dict(n_routed_experts=NUM_EXPERTS, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1)
FAMILIES = {  # the families of tests/nn/test_experts.py; mixtral's experts use intermediate_size
    "qwen3_moe": ("Qwen3MoeConfig", dict(moe_intermediate_size=40, num_experts=NUM_EXPERTS)),
    "qwen3_next": (
        "Qwen3NextConfig",
        dict(
            moe_intermediate_size=40,
            shared_expert_intermediate_size=48,
            num_experts=NUM_EXPERTS,
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            full_attention_interval=2,
        ),
    ),
    "glm4_moe": ("Glm4MoeConfig", dict(moe_intermediate_size=40, **_DEEPSEEK_MOE)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=NUM_EXPERTS, intermediate_size=72)),
    "deepseek_v3": ("DeepseekV3Config", dict(moe_intermediate_size=40, **_DEEPSEEK_MOE, **_MLA)),
    "gpt_oss": ("GptOssConfig", dict(num_local_experts=NUM_EXPERTS, intermediate_size=40, sliding_window=16)),
}
TOKENS = (1, 3, 16, 130)

# ||y_cuda - y_ref|| / ||y_ref|| of a whole bf16 experts layer (two grouped matmuls, the gating,
# the weighted sum) against the CPU reference forward of the same packed weights. Measured on
# the CPU: the bf16 reference is 0.3-0.7% from its float32 forward, and a forward that also
# rounds the dequantized weights to bf16 (a legitimate kernel choice) is 0.45-0.6% from the
# reference; the bound leaves 3x for summation order and inductor's fusion of the gating.
EXPERTS_REL_TOL = 2e-2
# grouped_mm against the CPU reference op: one rounding of the output in the activation dtype
# (and, for a kernel that dequantizes into x's dtype, of the weight); as MM_REL_TOL for kbit::mm.
GROUPED_MM_REL_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
# Per-expert codebooks and sentinel rows change nothing else: same bound.
WEIGHT_STD = 0.1  # activations of order 1 at H = 96, I = 40


def kbit_grouped_mm_on_cuda() -> bool:
    """Whether ``kbit::grouped_mm`` has a CUDA kernel (else the reference, with a host sync, serves CUDA)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("kbit::grouped_mm", "CUDA")


needs_grouped_kernel = pytest.mark.skipif(
    not kbit_grouped_mm_on_cuda(),
    reason="kbit::grouped_mm has no CUDA kernel registered (hf_kbit.backends.cuda): the reference serving CUDA "
    "tensors reads the routing offsets on the host, so CUDA graphs and fullgraph compile cannot hold it",
)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    assert torch.isfinite(out).all(), "non-finite output"
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


# ---------------------------------------------------------------------------- tiny models and layers


def _config(family: str):
    class_name, extra = FAMILIES[family]
    config_class = getattr(transformers, class_name, None)
    if config_class is None:
        pytest.skip(f"transformers {transformers.__version__} has no {class_name}")
    return config_class(**{**_COMMON, **extra})


@functools.lru_cache(maxsize=None)
def _tiny_model(family: str):
    """bf16, on the CPU; shared between tests: never modify it."""
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(_config(family), dtype=torch.bfloat16).eval()


def _experts_modules(model) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in model.named_modules() if name.endswith(".experts")}


@functools.lru_cache(maxsize=None)
def _bf16_experts(family: str) -> tuple[str, torch.nn.Module]:
    """A bf16 CPU copy of the family's first experts module with N(0, WEIGHT_STD) weights and biases."""
    name, experts = next(iter(_experts_modules(_tiny_model(family)).items()))
    experts = copy.deepcopy(experts)
    g = torch.Generator().manual_seed(len(family))
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * WEIGHT_STD)
    return name, experts


@functools.lru_cache(maxsize=None)
def _kbit_pair(family: str, gate_up_bits: int, down_bits: int) -> tuple[KbitExperts, KbitExperts]:
    """``(cpu, cuda)``: one KbitExperts packed on the CPU (reference) and a copy of it on CUDA."""
    name, experts = _bf16_experts(family)
    cpu = KbitExperts.from_experts(experts, gate_up_bits, down_bits, name=name).eval()
    return cpu, copy.deepcopy(cpu).to(DEVICE)


def _routing(num_tokens: int, seed: int, num_experts: int = NUM_EXPERTS):
    """``(hidden_states [T, H] bf16, top_k_index [T, k] int64, top_k_weights [T, k] bf16)`` on the CPU."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=g).to(torch.bfloat16)
    scores = torch.rand(num_tokens, num_experts, generator=g)
    weights, index = scores.topk(TOP_K, dim=-1)
    return x, index, torch.softmax(weights, dim=-1).to(torch.bfloat16)


def _on_device(t: torch.Tensor) -> bool:
    return t.device.type == torch.device(DEVICE).type


def _to(device, *tensors):
    return tuple(t.to(device) for t in tensors)


# ---------------------------------------------------------------------------- quantize-on-load


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    saved = {}

    def get(family: str) -> Path:
        if family not in saved:
            path = tmp_path_factory.mktemp(f"{family}-bf16")
            _tiny_model(family).save_pretrained(path)
            saved[family] = path
        return saved[family]

    return get


@pytest.mark.parametrize("family", list(FAMILIES))
def test_quantize_on_load_on_cuda_packs_experts_like_cpu(family, bf16_checkpoint):
    """``device_map="cuda"`` quantize-on-load packs every expert weight on the GPU, bit-identical to
    a CPU load of the same checkpoint, and the quantized model runs on the GPU."""
    path = bf16_checkpoint(family)
    config = hf_kbit.KbitConfig(bits=4)
    gpu = AutoModelForCausalLM.from_pretrained(path, quantization_config=config, device_map=DEVICE)
    cpu = AutoModelForCausalLM.from_pretrained(path, quantization_config=hf_kbit.KbitConfig(bits=4))
    experts = _experts_modules(gpu)
    assert experts and all(isinstance(m, KbitExperts) for m in experts.values())
    float_3d = [n for n, p in gpu.named_parameters() if p.dim() == 3 and n.rsplit(".", 1)[-1] in PROJECTIONS]
    assert float_3d == []
    cpu_state = cpu.state_dict()
    compared = 0
    for module_name, module in gpu.named_modules():
        if not isinstance(module, (KbitExperts, KbitLinear)):
            continue
        if isinstance(module, KbitExperts):
            assert module.placeholders() == [], module_name
        for key, value in module.state_dict().items():
            full = f"{module_name}.{key}"
            assert _on_device(value), f"{full} is on {value.device}"
            assert value.dtype == cpu_state[full].dtype and torch.equal(value.cpu(), cpu_state[full]), full
            compared += 1
    assert compared > 0
    input_ids = torch.tensor([[3, 17, 99, 5, 64, 1, 127, 42]], device=DEVICE)
    with torch.no_grad():
        logits = gpu(input_ids).logits
    assert logits.shape == (1, 8, 128) and torch.isfinite(logits).all()


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_from_experts_on_cuda_packs_like_cpu(family):
    """KbitExperts.from_experts of a CUDA module quantizes on the GPU, bit-identical to the CPU."""
    name, experts = _bf16_experts(family)
    cpu = KbitExperts.from_experts(experts, 5, 2, name=name)
    gpu = KbitExperts.from_experts(copy.deepcopy(experts).to(DEVICE), 5, 2, name=name)
    for key, value in cpu.state_dict().items():
        got = gpu.state_dict()[key]
        assert _on_device(got) and got.dtype == value.dtype and torch.equal(got.cpu(), value), key


# ---------------------------------------------------------------------------- the layer's forward


@pytest.mark.parametrize("num_tokens", TOKENS, ids=lambda t: f"T{t}")
@pytest.mark.parametrize("bits", [(4, 3), (2, 5)], ids=lambda b: "gate_up{}-down{}".format(*b))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_experts_forward_on_cuda_equals_cpu_reference(family, bits, num_tokens):
    cpu, gpu = _kbit_pair(family, *bits)
    x, index, weights = _routing(num_tokens, seed=num_tokens)
    with torch.no_grad():
        expected = cpu(x, index, weights)
        out = gpu(*_to(DEVICE, x, index, weights))
    assert _on_device(out) and out.dtype == torch.bfloat16 and out.shape == (num_tokens, HIDDEN)
    assert rel_err(out, expected) < EXPERTS_REL_TOL


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_experts_forward_on_cuda_ignores_sentinel_ids(family):
    """Expert-parallel sentinels (ids outside [0, E)) contribute nothing, on CUDA as on the CPU."""
    cpu, gpu = _kbit_pair(family, 4, 4)
    x, index, weights = _routing(9, seed=5)
    index[0, 1] = NUM_EXPERTS
    index[4] = torch.tensor([-1, NUM_EXPERTS + 3])  # a token routed to no local expert: zero output
    with torch.no_grad():
        expected = cpu(x, index, weights)
        out = gpu(*_to(DEVICE, x, index, weights)).cpu()
    assert not expected[4].any() and not out[4].any()
    assert rel_err(out, expected) < EXPERTS_REL_TOL


# ---------------------------------------------------------------------------- the grouped op


@functools.lru_cache(maxsize=None)
def _packed_experts(num_experts: int, n: int, k: int, bits: int, per_expert_codebook: bool = False):
    """Reference-packed [E, N, K] weights on the CPU (rows of varied magnitude)."""
    g = torch.Generator().manual_seed(1000 * bits + n + 7 * k + num_experts)
    w = torch.randn(num_experts, n, k, generator=g) * torch.rand(num_experts, n, 1, generator=g).add(0.1)
    if per_expert_codebook:
        names = ("nf", "nf-sym")
        codebook = torch.stack([fmt.make_codebook(names[e % 2], bits) for e in range(num_experts)])
        packed = [fmt.quantize(w[e], codebook[e]) for e in range(num_experts)]
        planes, scales, row_scales = (torch.stack([p[i] for p in packed]) for i in range(3))
    else:
        codebook = fmt.make_codebook(None, bits)
        planes, scales, row_scales = fmt.quantize(w, codebook)
    return planes, scales, row_scales, codebook


def _expert_ids(rows: int, num_experts: int, seed: int, dtype=torch.int64) -> torch.Tensor:
    """Random ids that leave expert 1 without rows and put sentinels (-1, E, E + 7) on some rows."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, num_experts, (rows,), generator=g)
    ids[ids == 1] = 0
    if rows >= 5:
        ids[1], ids[3], ids[-1] = -1, num_experts, num_experts + 7
    return ids.to(dtype)


def _check_grouped(out, expected, ids, num_experts, dtype, what=""):
    assert _on_device(out) and out.dtype == dtype and out.shape == expected.shape
    out = out.cpu()
    valid = (ids >= 0) & (ids < num_experts)
    assert not out[~valid].any(), f"{what}rows of expert ids outside [0, {num_experts}) must be zero"
    for e in ids[valid].unique().tolist():
        rows = ids == e
        err = rel_err(out[rows], expected[rows])
        assert err < GROUPED_MM_REL_TOL[dtype], f"{what}expert {e} ({int(rows.sum())} rows): rel err {err:.2e}"


# (E, N, K): partial tiles and blocks; K = 8200 for split-K; the last, Qwen3-Next's gate_up with 16 experts.
GROUPED_SHAPES = [(8, 80, 96), (5, 257, 515), (3, 40, 8200), (16, 1024, 2048)]
GROUPED_ROWS = (1, 5, 64, 300, 2050)


@pytest.mark.parametrize("rows", GROUPED_ROWS, ids=lambda s: f"S{s}")
@pytest.mark.parametrize("shape", GROUPED_SHAPES, ids=lambda s: "E{}N{}K{}".format(*s))
@pytest.mark.parametrize("bits,dtype", table_cases("grouped_gemv"))
def test_grouped_mm_on_cuda_equals_reference(bits, dtype, shape, rows):
    num_experts, n, k = shape
    packed = _packed_experts(num_experts, n, k, bits)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g).to(dtype)
    ids = _expert_ids(rows, num_experts, seed=rows + bits)
    expected = torch.ops.kbit.grouped_mm(x, ids, *packed, k)  # CPU: the reference
    args = _to(DEVICE, x, ids, *packed)
    _poison_allocator(rows * n, dtype)  # the op's output block holds NaN until written: sentinel rows must be
    out = torch.ops.kbit.grouped_mm(*args, k)
    _check_grouped(out, expected, ids, num_experts, dtype)


@pytest.mark.parametrize("tokens", (1, 8, 100), ids=lambda t: f"T{t}")  # x 8 rows: per-row mode to 64, grouped above
@pytest.mark.parametrize("bits,dtype", table_cases("grouped_gemv"))
def test_grouped_mm_on_cuda_x_repeat_equals_repeated_rows(bits, dtype, tokens):
    """x_repeat = top-k: the grouped GEMV stages row s from token s // k, bit for bit the product of the tokens
    repeated k times, with and without the layer's routing."""
    num_experts, n, k, top_k = 16, 200, 576, 8
    packed = _to(DEVICE, *_packed_experts(num_experts, n, k, bits))
    g = torch.Generator().manual_seed(tokens + bits)
    x = torch.randn(tokens, k, generator=g).to(dtype).to(DEVICE)
    ids = _expert_ids(tokens * top_k, num_experts, seed=tokens).to(DEVICE)
    repeated = x.repeat_interleave(top_k, 0)
    out = torch.ops.kbit.grouped_mm(x, ids, *packed, k, None, None, None, top_k)
    assert torch.equal(out, torch.ops.kbit.grouped_mm(repeated, ids, *packed, k))
    order, offsets = _ops.expert_offsets(ids, num_experts)
    assert torch.equal(torch.ops.kbit.grouped_mm(x, ids, *packed, k, order, offsets, None, top_k),
                       torch.ops.kbit.grouped_mm(repeated, ids, *packed, k, order, offsets))


@pytest.mark.parametrize("rows", (1, 8, 64, 65, 300), ids=lambda s: f"S{s}")  # per-row mode to 64, grouped above
@pytest.mark.parametrize("k", (576, 515), ids=lambda k: f"K{k}")  # K % 8 != 0: the staging's scalar loads
@pytest.mark.parametrize("bits,dtype", table_cases("grouped_gemv"))
def test_grouped_mm_silu_mul_on_cuda_equals_the_unfused_ops(bits, dtype, k, rows):
    """The down projection staging silu(gate) * up itself (the two halves of a gate_up output, one row pitch)
    gives the unfused ops' result bit for bit, with and without the layer's routing; rows of no expert are zeros."""
    num_experts, n = 16, 200
    packed = _to(DEVICE, *_packed_experts(num_experts, n, k, bits))
    g = torch.Generator().manual_seed(rows + k + bits)
    gate_up = (torch.randn(rows, 2 * k, generator=g) * 3).to(dtype).to(DEVICE)
    gate, up = gate_up.chunk(2, dim=-1)
    ids = _expert_ids(rows, num_experts, seed=rows).to(DEVICE)
    expected = torch.ops.kbit.grouped_mm(torch.ops.kbit.silu_glu(gate_up), ids, *packed, k)
    _poison_allocator(rows * n, dtype)
    out = torch.ops.kbit.grouped_mm_silu_mul(gate, up, ids, *packed, k)
    assert torch.equal(out, expected)
    order, offsets = _ops.expert_offsets(ids, num_experts)
    assert torch.equal(torch.ops.kbit.grouped_mm_silu_mul(gate, up, ids, *packed, k, order, offsets), expected)


def test_grouped_mm_silu_mul_on_cuda_fallbacks():
    """Where the fused staging does not serve, the unfused ops: gate and up of different row pitches, float32."""
    num_experts, n, k, rows = 6, 96, 256, 5
    packed = _to(DEVICE, *_packed_experts(num_experts, n, k, 4))
    ids = _expert_ids(rows, num_experts, seed=3).to(DEVICE)
    gate = torch.randn(rows, k, device=DEVICE, dtype=torch.bfloat16)
    up = torch.randn(rows, 2 * k, device=DEVICE, dtype=torch.bfloat16)[:, :k]
    expected = torch.ops.kbit.grouped_mm(_ops.silu_mul(gate, up), ids, *packed, k)
    assert torch.equal(torch.ops.kbit.grouped_mm_silu_mul(gate, up, ids, *packed, k), expected)
    gate32, up32 = gate.float(), up.float()
    expected = torch.ops.kbit.grouped_mm(_ops.silu_mul(gate32, up32), ids, *packed, k)
    assert torch.equal(torch.ops.kbit.grouped_mm_silu_mul(gate32, up32, ids, *packed, k), expected)


def _poison_allocator(numel: int, dtype: torch.dtype) -> None:
    """Leave NaN in the caching allocator's next block of ``numel`` elements (the next allocation of that size
    reuses it), so an output that is not written everywhere shows it."""
    torch.full((numel,), float("nan"), dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("bits", bits_cases("grouped_gemv"))
def test_grouped_mm_on_cuda_per_expert_codebook(bits, ids_dtype):
    num_experts, n, k = 4, 48, 300
    packed = _packed_experts(num_experts, n, k, bits, per_expert_codebook=True)
    x = torch.randn(37, k, dtype=torch.bfloat16)
    ids = _expert_ids(37, num_experts, seed=bits, dtype=ids_dtype)
    expected = torch.ops.kbit.grouped_mm(x, ids, *packed, k)
    out = torch.ops.kbit.grouped_mm(*_to(DEVICE, x, ids, *packed), k)
    _check_grouped(out, expected, ids, num_experts, torch.bfloat16)


def test_grouped_mm_on_cuda_noncontiguous_input():
    num_experts, n, k = 4, 96, 300
    packed = _packed_experts(num_experts, n, k, 4)
    x = torch.randn(40, 2 * k, dtype=torch.bfloat16)[:, ::2]
    ids = _expert_ids(40, num_experts, seed=3)
    expected = torch.ops.kbit.grouped_mm(x.contiguous(), ids, *packed, k)
    out = torch.ops.kbit.grouped_mm(x.to(DEVICE), ids.to(DEVICE), *_to(DEVICE, *packed), k)
    _check_grouped(out, expected, ids, num_experts, torch.bfloat16)


@pytest.mark.parametrize("rows", [0, 6], ids=["S0", "all-sentinels"])
def test_grouped_mm_on_cuda_without_routed_rows(rows):
    """No row for any expert: an empty input, or every id a sentinel. The output is zeros."""
    num_experts, n, k = 4, 48, 300
    packed = _packed_experts(num_experts, n, k, 3)
    x = torch.randn(rows, k, dtype=torch.bfloat16)
    ids = torch.tensor([-1, num_experts, -5, num_experts + 1, -1, num_experts], dtype=torch.int64)[:rows]
    out = torch.ops.kbit.grouped_mm(*_to(DEVICE, x, ids, *packed), k)
    torch.cuda.synchronize()
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16 and not out.cpu().any()


@pytest.mark.parametrize("rows", [300, 2050], ids=lambda s: f"S{s}")
def test_grouped_mm_on_cuda_per_row_mode_with_many_experts(rows):
    """More experts than grouped mode's shared memory holds (a prefix sum per expert): per-row mode serves
    every row, in the balanced plan while a CTA's row tiles touch at most 8 rows (S300: up to 4 staged at
    once, ranges across row boundaries) and in units beyond (S2050). Random packed bytes, the CPU op's result."""
    num_experts, n, k, bits = 60000, 16, 64, 4
    shapes = fmt.packed_shapes(n, k, bits)
    g = torch.Generator().manual_seed(rows)
    planes = torch.randint(-(2**31), 2**31 - 1, (num_experts, *shapes["planes"]), dtype=torch.int32, generator=g)
    scales = torch.randint(120, 180, (num_experts, *shapes["block_scales"]), dtype=torch.uint8, generator=g)
    packed = (planes, scales, torch.rand(num_experts, n, generator=g) + 0.5, fmt.make_codebook(None, bits))
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    ids = _expert_ids(rows, num_experts, seed=rows)
    expected = torch.ops.kbit.grouped_mm(x, ids, *packed, k)
    _poison_allocator(rows * n, torch.bfloat16)
    out = torch.ops.kbit.grouped_mm(*_to(DEVICE, x, ids, *packed), k)
    _check_grouped(out, expected, ids, num_experts, torch.bfloat16)


# ---------------------------------------------------------------------------- CUDA graphs, torch.compile


@needs_grouped_kernel
@pytest.mark.parametrize("num_tokens", [1, 16, 130], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("family", list(FAMILIES))
def test_cuda_graph_replay_of_experts_equals_eager(family, num_tokens):
    """A captured layer replays on new hidden states *and new routing* (the offsets live on the device)."""
    cpu, gpu = _kbit_pair(family, 4, 3)
    x, index, weights = _to(DEVICE, *_routing(num_tokens, seed=1))
    with torch.no_grad():
        before = gpu(x, index, weights).clone()
        graph, captured = capture_cuda_graph(lambda: gpu(x, index, weights))
        new = _routing(num_tokens, seed=2)
        for static, value in zip((x, index, weights), new):
            static.copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        eager = gpu(x, index, weights)
        expected = cpu(*new)
    assert rel_err(captured, eager) < EXPERTS_REL_TOL
    assert rel_err(captured, expected) < EXPERTS_REL_TOL
    assert rel_err(captured, before) > 0.5, "the replay did not follow the new inputs"


@needs_grouped_kernel
@pytest.mark.parametrize("mode", [None, "reduce-overhead"], ids=["default", "reduce-overhead"])
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_torch_compile_fullgraph_of_experts_runs(family, mode):
    """fullgraph compile (inductor; reduce-overhead adds CUDA graphs, as generate's static cache
    does) across token counts, against the eager layer."""
    torch._dynamo.reset()
    _, gpu = _kbit_pair(family, 4, 4)
    compiled = torch.compile(gpu, fullgraph=True, mode=mode)
    with torch.no_grad():
        for num_tokens in (1, 5, 16, 16):
            x, index, weights = _to(DEVICE, *_routing(num_tokens, seed=num_tokens))
            out = compiled(x, index, weights).clone()
            assert out.shape == (num_tokens, HIDDEN) and out.dtype == torch.bfloat16
            assert rel_err(out, gpu(x, index, weights)) < EXPERTS_REL_TOL


# ---------------------------------------------------------------------------- fused routing (hf_kbit.nn.routing)


def test_softmax_topk_has_its_cuda_kernel():
    assert torch._C._dispatch_has_kernel_for_dispatch_key("kbit::softmax_topk", "CUDA")


def _check_topk(logits, weights, indices, k, renormalize, cast):
    """weights/indices of softmax_topk against the reference on the CPU. Probabilities can tie (bf16 logits often
    do), and a tie's order is free: each rank's expert must carry the reference's probability at that rank."""
    ref_weights, ref_indices = torch.ops.kbit.softmax_topk(logits.cpu(), k, renormalize, cast)
    assert weights.dtype == ref_weights.dtype and indices.dtype == torch.int64 and weights.shape == ref_weights.shape
    weights, indices = weights.cpu(), indices.cpu()
    tol = dict(rtol=2 ** -7, atol=1e-6) if cast and logits.dtype != torch.float32 else dict(rtol=4e-6, atol=1e-7)
    torch.testing.assert_close(weights, ref_weights, **tol)
    probs = torch.softmax(logits.cpu().float(), dim=-1)
    torch.testing.assert_close(probs.gather(1, indices), probs.gather(1, ref_indices), rtol=4e-6, atol=1e-7)
    assert all(len(set(row)) == k for row in indices.tolist()), "an expert chosen twice"
    if logits.dtype == torch.float32:  # random float32 logits do not tie: the very same experts
        assert torch.equal(indices, ref_indices)


@pytest.mark.parametrize("cast", [False, True], ids=["float32", "cast"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("renormalize", [False, True], ids=["plain", "renormalized"])
@pytest.mark.parametrize("rows", [1, 7, 64], ids=lambda r: f"T{r}")
@pytest.mark.parametrize("experts,k", [(8, 2), (60, 4), (128, 8), (512, 10), (3, 3)], ids=lambda v: str(v))
def test_softmax_topk_on_cuda_equals_reference(experts, k, rows, renormalize, dtype, cast):
    """The Triton kernel against the op's CPU reference (float32 sums in another order)."""
    logits = (torch.randn(rows, experts, generator=torch.Generator().manual_seed(rows * experts + k)) * 3).to(dtype)
    weights, indices = torch.ops.kbit.softmax_topk(logits.to(DEVICE), k, renormalize, cast)
    _check_topk(logits, weights, indices, k, renormalize, cast)


def test_softmax_topk_replays_in_a_cuda_graph():
    logits = torch.randn(4, 128, device=DEVICE)
    with torch.no_grad():
        graph, captured = capture_cuda_graph(lambda: torch.ops.kbit.softmax_topk(logits, 8, True))
        logits.copy_(torch.randn(4, 128, device=DEVICE))
        graph.replay()
        torch.cuda.synchronize()
    _check_topk(logits, *captured, 8, True, False)


def test_router_softmax_topk_has_its_cuda_kernel():
    assert torch._C._dispatch_has_kernel_for_dispatch_key("kbit::router_softmax_topk", "CUDA")


def _router_case(rows, hidden, experts, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    weight = (torch.randn(experts, hidden, generator=g) * hidden ** -0.5).to(dtype)
    return x, weight


def _check_router(x, weight, got, k, renormalize, cast):
    """The fused router's logits against the float32 product rounded once to x's dtype (float32 sums in another
    order: a last-bit difference at most; cuBLAS's own bf16 GEMV may reduce in bf16 and lie further off), and its
    weights/indices against softmax_topk's rule on its own logits (a tie's order is free)."""
    from hf_kbit.backends import triton_moe

    logits, weights, indices = got
    if x.shape[0] > triton_moe.ROUTER_FUSED_MAX_ROWS:  # the matmul, then softmax_topk: F.linear's logits
        assert torch.equal(logits, torch.nn.functional.linear(x.to(DEVICE), weight.to(DEVICE)))
    else:
        ref = torch.nn.functional.linear(x.float(), weight.float()).to(x.dtype)
        assert logits.dtype == ref.dtype and logits.shape == ref.shape
        torch.testing.assert_close(logits.float().cpu(), ref.float(), rtol=ROUTER_LOGIT_RTOL, atol=1e-5)
    _check_topk(logits, weights, indices, k, renormalize, cast)


ROUTER_LOGIT_RTOL = 2 ** -7  # one bf16 rounding apart (fp16's is finer)


@pytest.mark.parametrize("cast", [False, True], ids=["float32", "cast"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rows", [1, 2, 8], ids=lambda r: f"T{r}")
@pytest.mark.parametrize("hidden", [96, 2000, 2048], ids=lambda h: f"H{h}")
@pytest.mark.parametrize("experts,k", [(8, 2), (60, 4), (128, 8), (512, 10), (3, 3)], ids=lambda v: str(v))
def test_router_softmax_topk_on_cuda(experts, k, hidden, rows, dtype, cast):
    """One row the fused kernel (more: the matmul + softmax_topk), Qwen3-MoE's 128 x 2048 among the shapes;
    renormalized as the Qwen families, not as Mixtral (the rule's code is softmax_topk's, tested above)."""
    x, weight = _router_case(rows, hidden, experts, dtype, seed=rows * hidden + experts)
    renormalize = experts != 8
    got = torch.ops.kbit.router_softmax_topk(x.to(DEVICE), weight.to(DEVICE), k, renormalize, cast)
    _check_router(x, weight, got, k, renormalize, cast)


def test_router_softmax_topk_repeats_and_replays_in_a_cuda_graph():
    """Many calls in a row, of routers of two sizes (the arrival counter returns to zero after each), and the same
    calls captured in one CUDA graph and replayed on new inputs."""
    a = _router_case(1, 2048, 128, torch.bfloat16, seed=1)
    b = _router_case(1, 1024, 60, torch.bfloat16, seed=2)
    a, b = [t.to(DEVICE) for t in a], [t.to(DEVICE) for t in b]
    op = torch.ops.kbit.router_softmax_topk
    first = op(*a, 8, True, True), op(*b, 4, True, True)
    for _ in range(20):
        again = op(*a, 8, True, True), op(*b, 4, True, True)
        for one, two in zip(first, again):
            for p, q in zip(one, two):
                assert torch.equal(p, q)
    with torch.no_grad():
        graph, captured = capture_cuda_graph(lambda: (op(*a, 8, True, True), op(*b, 4, True, True)))
        for t in (a[0], b[0]):
            t.copy_(torch.randn(t.shape, device=DEVICE))
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
    _check_router(a[0].cpu(), a[1].cpu(), captured[0], 8, True, True)
    _check_router(b[0].cpu(), b[1].cpu(), captured[1], 4, True, True)


def test_router_softmax_topk_under_compiled_cuda_graphs(monkeypatch):
    """torch.compile's CUDA graphs (what generate() with a static cache runs) warm up and record the fused router
    before any arrival counter exists: the counters are made outside the graphs' memory pool (one made inside is a
    live tensor of the pool that no output owns, which cudagraph trees refuse), and the replays route as the op."""
    from hf_kbit.backends import triton_moe

    monkeypatch.setattr(triton_moe, "_router_counters", {})
    monkeypatch.setattr(triton_moe, "_router_slots", {})
    torch._dynamo.reset()
    x, weight = (t.to(DEVICE) for t in _router_case(1, 2048, 128, torch.bfloat16, seed=3))
    compiled = torch.compile(lambda x: torch.ops.kbit.router_softmax_topk(x, weight, 8, True, True),
                             fullgraph=True, mode="reduce-overhead")
    with torch.no_grad():
        for step in range(4):  # warm-up, recording, replays
            x = torch.randn(1, 2048, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(step))
            x = x.to(torch.bfloat16)
            got = [t.clone() for t in compiled(x)]
            _check_router(x.cpu(), weight.cpu(), got, 8, True, True)
    assert torch.cuda.current_device() in triton_moe._router_counters, "the fused kernel did not run"
    torch._dynamo.reset()


def test_router_counters_per_stream_and_none_in_a_capture_before_any(monkeypatch):
    """Each stream its own zeroed slot of the device's array; a CUDA graph captured before the array exists routes
    unfused (the array is not made inside a capture) and still as the op."""
    from hf_kbit.backends import triton_moe

    monkeypatch.setattr(triton_moe, "_router_counters", {})
    monkeypatch.setattr(triton_moe, "_router_slots", {})
    x, weight = (t.to(DEVICE) for t in _router_case(1, 1024, 60, torch.bfloat16, seed=4))
    op = torch.ops.kbit.router_softmax_topk
    torch.ops.kbit.softmax_topk(torch.nn.functional.linear(x, weight), 4, True, True)  # nothing lazy in the capture
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        assert triton_moe._router_counter(x.device) is None
        captured = op(x, weight, 4, True, True)
    assert not triton_moe._router_counters
    x.copy_(torch.randn(x.shape, device=DEVICE))
    graph.replay()
    torch.cuda.synchronize()
    _check_router(x.cpu(), weight.cpu(), captured, 4, True, True)

    first = triton_moe._router_counter(x.device)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        second = triton_moe._router_counter(x.device)
        for _ in range(3):
            got = op(x, weight, 4, True, True)
    side.synchronize()
    _check_router(x.cpu(), weight.cpu(), got, 4, True, True)
    assert first.data_ptr() != second.data_ptr()
    assert triton_moe._router_counter(x.device) is first
    assert int(first) == 0 and int(second) == 0, "a call left its arrival counter non-zero"


# ---------------------------------------------------------------------------- the experts layer's elementwise ops


@pytest.mark.parametrize("op", ["silu_glu", "experts_combine", "expert_offsets", "sigmoid_group_topk", "topk_softmax"])
def test_experts_layer_ops_have_their_cuda_kernels(op):
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"kbit::{op}", "CUDA")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rows,inter", [(1, 768), (8, 1000), (64, 3000), (3, 5)], ids=lambda v: str(v))
def test_silu_glu_on_cuda_equals_torchs_silu_times_up(rows, inter, dtype):
    """The Triton kernel against torch's own CUDA ops on the same tensor (silu of the first half, times the second):
    bit for bit, on a row-strided input (a slice of a wider tensor)."""
    g = torch.Generator().manual_seed(rows * inter)
    wide = (torch.randn(rows, 2 * inter + 16, generator=g) * 6).to(dtype).to(DEVICE)
    gate_up = wide[:, : 2 * inter]
    out = torch.ops.kbit.silu_glu(gate_up)
    expected = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    assert out.dtype == dtype and out.shape == (rows, inter)
    assert torch.equal(out, expected), f"{int((out != expected).sum())} of {out.numel()} elements differ"


@pytest.mark.parametrize("weights_dtype", ["float32", "same"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("tokens,top_k,n", [(1, 8, 2048), (7, 2, 33), (64, 10, 2048), (5, 1, 1100)],
                         ids=lambda v: str(v))
def test_experts_combine_on_cuda_equals_reference(tokens, top_k, n, dtype, weights_dtype):
    """The Triton kernel against a float64 sum of the same rounded products (one rounding of a float32 sum of at
    most 10 products apart), with sentinel ids whose weights are NaN and inf; and against the op's reference (a
    batched matmul) on the same GPU, within one rounding of the output."""
    g = torch.Generator().manual_seed(tokens * top_k + n)
    num_experts = 16
    y = torch.randn(tokens * top_k, n, generator=g).to(dtype)
    ids = torch.randint(0, num_experts, (tokens * top_k,), generator=g)
    weights = torch.rand(tokens, top_k, generator=g).to(torch.float32 if weights_dtype == "float32" else dtype)
    if tokens * top_k >= 4:
        ids[0], ids[-1] = -1, num_experts + 3
        weights.view(-1)[0], weights.view(-1)[-1] = float("nan"), float("inf")
    valid = (ids >= 0) & (ids < num_experts)
    w = torch.where(valid, weights.view(-1), 0).to(dtype).double()
    expected = (w[:, None] * y.double()).view(tokens, top_k, n).sum(1)
    out = torch.ops.kbit.experts_combine(*_to(DEVICE, y, ids, weights), num_experts)
    assert out.dtype == dtype and out.shape == (tokens, n)
    ulp = {torch.bfloat16: 2**-8, torch.float16: 2**-11}[dtype]
    torch.testing.assert_close(out.cpu().double(), expected, rtol=ulp, atol=1e-5)
    torch.testing.assert_close(out, _ops._experts_combine_ref(*_to(DEVICE, y, ids, weights), num_experts),
                               rtol=2 * ulp, atol=1e-5)


def _check_offsets(ids, order, offsets, num_experts):
    """order/offsets of expert_offsets on CUDA against the reference's: the same offsets and the same rows of each
    expert in the same (row) order; the rows of no expert before offsets[0] (ids < 0) and from offsets[E] on
    (ids >= E), in any order."""
    ref_order, ref_offsets = _ops._expert_offsets_ref(ids.cpu(), num_experts)
    order, offsets = order.cpu(), offsets.cpu()
    assert order.dtype == offsets.dtype == torch.int64 and order.shape == ids.shape
    assert torch.equal(offsets, ref_offsets)
    lo, hi = int(offsets[0]), int(offsets[-1])
    assert torch.equal(order[lo:hi], ref_order[lo:hi])
    assert sorted(order[:lo].tolist()) == sorted(ref_order[:lo].tolist())
    assert sorted(order[hi:].tolist()) == sorted(ref_order[hi:].tolist())


@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32], ids=["int64", "int32"])
@pytest.mark.parametrize("rows", [1, 65, 128, 1000, 4096, 5000], ids=lambda r: f"S{r}")
@pytest.mark.parametrize("num_experts", [8, 128, 512, 1024], ids=lambda e: f"E{e}")
def test_expert_offsets_on_cuda_group_rows_as_the_reference(num_experts, rows, ids_dtype):
    """The Triton kernel (one program up to 4096 rows; 5000 takes the reference) with sentinel ids on both sides."""
    g = torch.Generator().manual_seed(rows + num_experts)
    ids = torch.randint(-3, num_experts + 3, (rows,), generator=g).to(ids_dtype)
    order, offsets = _ops.expert_offsets(ids.to(DEVICE), num_experts)
    _check_offsets(ids, order, offsets, num_experts)


def test_expert_offsets_replay_in_a_cuda_graph():
    ids = torch.randint(0, 128, (128,), device=DEVICE)
    with torch.no_grad():
        graph, (order, offsets) = capture_cuda_graph(lambda: _ops.expert_offsets(ids, 128))
        ids.copy_(torch.randint(-1, 129, (128,), device=DEVICE))
        graph.replay()
        torch.cuda.synchronize()
    _check_offsets(ids, order, offsets, 128)


def test_experts_layer_ops_replay_in_a_cuda_graph():
    gate_up = torch.randn(8, 2 * 768, device=DEVICE, dtype=torch.bfloat16)
    y = torch.randn(8, 2048, device=DEVICE, dtype=torch.bfloat16)
    ids = torch.arange(8, device=DEVICE)
    weights = torch.rand(1, 8, device=DEVICE, dtype=torch.bfloat16)
    with torch.no_grad():
        graph, (h, out) = capture_cuda_graph(
            lambda: (torch.ops.kbit.silu_glu(gate_up), torch.ops.kbit.experts_combine(y, ids, weights, 8)))
        for t in (gate_up, y, weights):
            t.copy_(torch.rand_like(t))
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(h, _ops._silu_glu_ref(gate_up))
    torch.testing.assert_close(out, _ops._experts_combine_ref(y, ids, weights, 8), rtol=2**-7, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_fused_routers_on_cuda_route_as_the_familys(family):
    """A quantized model's fused routers on CUDA: the family router's experts and scores (within one rounding of
    the scores' dtype; a tie of bf16 logits may take either expert, so the model's logits are only checked to be
    finite: a tie at the k-th place changes an expert)."""
    from hf_kbit.nn.routing import KbitSoftmaxTopKRouter, unfuse_routers

    model = hf_kbit.quantize_model(copy.deepcopy(_tiny_model(family)), hf_kbit.KbitConfig(bits=4), progress=False)
    model = model.to(DEVICE)
    plain = unfuse_routers(copy.deepcopy(model))
    assert not isinstance(plain.model.layers[0].mlp.gate, KbitSoftmaxTopKRouter)
    router = model.model.layers[0].mlp.gate
    assert isinstance(router, KbitSoftmaxTopKRouter)
    x = torch.randn(9, HIDDEN, device=DEVICE, dtype=torch.bfloat16)
    ids = torch.randint(0, 128, (2, 6), device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(0))
    with torch.inference_mode():
        logits, scores, indices = router(x)
        ref_logits, ref_scores, ref_indices = plain.model.layers[0].mlp.gate(x)
        out = model(ids).logits
    assert torch.equal(logits, ref_logits) and scores.dtype == ref_scores.dtype
    torch.testing.assert_close(scores.float(), ref_scores.float(), rtol=2 ** -7, atol=1e-6)
    probs = torch.softmax(logits.float(), dim=-1)  # a tie of bf16 logits may take either expert
    torch.testing.assert_close(probs.gather(1, indices), probs.gather(1, ref_indices), rtol=4e-6, atol=1e-7)
    assert out.shape == (2, 6, model.config.vocab_size) and bool(out.isfinite().all())


def _same_choices(indices, ref_indices, weights, ref_weights, rtol):
    """Per row, the same experts with the same weights, in any order (the references' top-k are unsorted)."""
    order, ref_order = indices.argsort(dim=1), ref_indices.argsort(dim=1)
    assert torch.equal(indices.gather(1, order), ref_indices.gather(1, ref_order))
    torch.testing.assert_close(weights.gather(1, order).float(), ref_weights.gather(1, ref_order).float(),
                               rtol=rtol, atol=1e-6)


@pytest.mark.parametrize("renormalize", [False, True], ids=["plain", "renormalized"])
@pytest.mark.parametrize("rows", [1, 7, 64], ids=lambda r: f"T{r}")
@pytest.mark.parametrize("experts,groups,topk_groups,k", [(256, 8, 4, 8), (160, 1, 1, 8), (64, 8, 3, 6), (16, 4, 2, 4)],
                         ids=lambda v: str(v))
def test_sigmoid_group_topk_on_cuda_equals_reference(experts, groups, topk_groups, k, rows, renormalize):
    """The Triton kernel against the op's reference on the GPU (DeepSeek-V3's shape, GLM-4.5's one group, others):
    float32 logits do not tie, so the very same experts, with their weights within float32 sums' rounding."""
    g = torch.Generator().manual_seed(rows * experts + k)
    logits = (torch.randn(rows, experts, generator=g) * 2).to(DEVICE)
    bias = (torch.randn(experts, generator=g) * 0.1).to(DEVICE)
    args = (logits, bias, k, groups, topk_groups, renormalize, 2.5)
    weights, indices = torch.ops.kbit.sigmoid_group_topk(*args)
    ref_weights, ref_indices = _ops._sigmoid_group_topk_ref(*args)
    assert weights.dtype == torch.float32 and indices.dtype == torch.int64 and weights.shape == (rows, k)
    _same_choices(indices, ref_indices, weights, ref_weights, rtol=4e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("rows", [1, 7, 64], ids=lambda r: f"T{r}")
@pytest.mark.parametrize("experts,k", [(32, 4), (128, 4), (16, 1)], ids=lambda v: str(v))
def test_topk_softmax_on_cuda_equals_reference(experts, k, rows, dtype):
    """The Triton kernel against the op's reference on the GPU. bf16 logits tie often, and a tie's order is free:
    each rank's expert must carry the reference's logit at that rank; the weights within one rounding."""
    logits = (torch.randn(rows, experts, generator=torch.Generator().manual_seed(rows + experts)) * 3).to(dtype)
    logits = logits.to(DEVICE)
    weights, indices = torch.ops.kbit.topk_softmax(logits, k)
    ref_weights, ref_indices = _ops._topk_softmax_ref(logits, k)
    assert weights.dtype == dtype and indices.dtype == torch.int64 and weights.shape == (rows, k)
    assert torch.equal(logits.gather(1, indices), logits.gather(1, ref_indices))
    assert all(len(set(row)) == k for row in indices.tolist()), "an expert chosen twice"
    rtol = 2**-7 if dtype == torch.bfloat16 else 4e-6
    torch.testing.assert_close(weights.float(), ref_weights.float(), rtol=rtol, atol=1e-6)


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe", "gpt_oss"])
def test_grouped_and_gpt_oss_routers_on_cuda_route_as_the_familys(family):
    """A quantized model's fused DeepSeek-V3 / GLM-4 MoE / GPT-OSS routers on CUDA: the family router's logits, and
    its experts and scores as sets per token (float32 logits of the grouped routers do not tie; GPT-OSS's bf16
    logits may, so there each rank's logit is compared); the model runs and its logits are finite."""
    from hf_kbit.nn.routing import KbitRouter, unfuse_routers

    model = hf_kbit.quantize_model(copy.deepcopy(_tiny_model(family)), hf_kbit.KbitConfig(bits=4), progress=False)
    model = model.to(DEVICE)
    plain = unfuse_routers(copy.deepcopy(model))
    (name, router), *_ = [(n, m) for n, m in model.named_modules() if isinstance(m, KbitRouter)]
    ref_router = plain.get_submodule(name)
    assert not isinstance(ref_router, KbitRouter)
    x = torch.randn(9, HIDDEN, device=DEVICE, dtype=torch.bfloat16)
    ids = torch.randint(0, 128, (2, 6), device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(0))
    with torch.inference_mode():
        logits, scores, indices = router(x)
        ref_logits, ref_scores, ref_indices = ref_router(x)
        out = model(ids).logits
    assert torch.equal(logits, ref_logits) and scores.dtype == ref_scores.dtype
    if family == "gpt_oss":
        assert torch.equal(logits.gather(1, indices), logits.gather(1, ref_indices))
        torch.testing.assert_close(scores.float(), ref_scores.float(), rtol=2**-7, atol=1e-6)
    else:
        _same_choices(indices, ref_indices, scores, ref_scores, rtol=4e-6)
    assert out.shape == (2, 6, model.config.vocab_size) and bool(out.isfinite().all())


# ---------------------------------------------------------------------------- the benchmark script


def test_bench_moe_smoke_on_cuda(tmp_path):
    """scripts/bench_moe.py on CUDA: the bf16 baseline is transformers' grouped_mm path, captured in a
    CUDA graph; kbit is captured too once the op has a CUDA kernel (else timed with events)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import bench_moe

    argv = ["--smoke", "--device", "cuda", "--tokens", "1", "16", "--budget-s", "0.1", "--out", str(tmp_path / "m")]
    bench_moe.main(argv)
    payload = json.loads((tmp_path / "m.json").read_text())
    (info,) = payload["presets"]
    assert info["bf16_baseline"]["is_grouped_mm_path"], info["bf16_baseline"]
    kernel = kbit_grouped_mm_on_cuda()
    assert payload["meta"]["kbit_grouped_mm_cuda_kernel"] == kernel
    for row in payload["results"]:
        assert row["bf16_timing"] == "cuda_graph"
        assert row["k4_timing"] == "cuda_graph" if kernel else row["k4_timing"].startswith("events (")
        assert row["k4_rel_err"] < 0.25
    assert (tmp_path / "m.md").read_text().count("| 1 |") == 1

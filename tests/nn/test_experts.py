"""KbitExperts on transformers' fused MoE experts: module, op, quantize-on-load, save/reload.

Tiny models are built from the real config classes (no downloads); CPU only.
"""

from __future__ import annotations

import copy
import functools
import json
import struct

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

import hf_kbit
from hf_kbit import format as fmt
from hf_kbit.checkpoint import KbitCheckpointError
from hf_kbit.kernel_table import SUPPORTED_BITS
from hf_kbit.nn import KbitExperts, KbitLinear
from hf_kbit.nn.experts import PROJECTIONS, fused_experts_layout

transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

_COMMON = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=128,
    max_position_embeddings=64,
)
_MLA = dict(num_key_value_heads=4, head_dim=8, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
_DEEPSEEK_MOE = dict(n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1)
# moe_intermediate_size 40: the down projection's K is not a multiple of the 32-element block.
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(moe_intermediate_size=40, num_experts=8)),
    "qwen3_next": (
        "Qwen3NextConfig",
        dict(
            moe_intermediate_size=40,
            shared_expert_intermediate_size=48,
            num_experts=8,
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            full_attention_interval=2,
        ),
    ),
    "glm4_moe": ("Glm4MoeConfig", dict(moe_intermediate_size=40, **_DEEPSEEK_MOE)),
    "glm4_moe_lite": ("Glm4MoeLiteConfig", dict(moe_intermediate_size=40, **_DEEPSEEK_MOE, **_MLA)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=8)),
    "deepseek_v3": ("DeepseekV3Config", dict(moe_intermediate_size=40, **_DEEPSEEK_MOE, **_MLA)),
    "gpt_oss": ("GptOssConfig", dict(num_local_experts=8, intermediate_size=40, sliding_window=16)),
}

# Relative error ||y_q - y|| / ||y|| of one experts layer vs its float weights (random routing,
# normal weights): the noise of two quantized matmuls and the gating, measured 0.73-0.80 /
# 0.32 / 0.155 / 0.088 (single weights: 0.42 / 0.18 / 0.088 / 0.049).
EXPERTS_REL_ERROR = {2: 0.95, 3: 0.40, 4: 0.20, 5: 0.11}
# Relative error of a whole tiny model's logits vs bf16 (every Linear and expert quantized;
# random-init models, measured 0.31-0.72 / 0.12-0.29 / 0.06-0.13 / 0.04-0.11).
LOGITS_REL_ERROR = {2: 0.95, 3: 0.45, 4: 0.25, 5: 0.2}
# KbitExperts vs the model's own experts module holding the dequantized weights (float32):
# the same math up to summation order.
SAME_MATH_REL_ERROR = 1e-5
# grouped_mm vs a per-row float32 matmul with the dequantized weight: summation order only
# (float32), plus one rounding of the output (bf16).
GROUPED_MM_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


def _config(family: str):
    class_name, extra = FAMILIES[family]
    config_class = getattr(transformers, class_name, None)
    if config_class is None:
        pytest.skip(f"transformers {transformers.__version__} has no {class_name}")
    return config_class(**{**_COMMON, "num_experts_per_tok": 2, **extra})


@functools.lru_cache(maxsize=None)
def _tiny_model(family: str, dtype=torch.bfloat16):
    """Shared between tests: never modify it, copy what you change (see :func:`_float_experts`)."""
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(_config(family), dtype=dtype).eval()


def _float_experts(family: str, std: float = 0.5) -> tuple[str, torch.nn.Module]:
    """A float32 copy of the family's first experts module with N(0, std) weights and biases."""
    name, experts = next(iter(_experts_modules(_tiny_model(family, torch.float32)).items()))
    experts = copy.deepcopy(experts)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, std)
    return name, experts


def _experts_modules(model):
    return {name: m for name, m in model.named_modules() if name.endswith(".experts")}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _routing(num_tokens: int, num_experts: int, top_k: int, generator: torch.Generator):
    scores = torch.rand(num_tokens, num_experts, generator=generator)
    weights, index = scores.topk(top_k, dim=-1)
    return index, torch.softmax(weights, dim=-1)


@pytest.fixture(scope="module")
def bf16_checkpoints(tmp_path_factory):
    """One saved bf16 tiny model per family (saved the transformers way: per-expert keys where
    the family's conversion mapping splits the fused tensors)."""
    saved = {}

    def get(family: str):
        if family not in saved:
            model = _tiny_model(family)
            path = tmp_path_factory.mktemp(f"{family}-bf16")
            model.save_pretrained(path)
            saved[family] = (path, model)
        return saved[family]

    return get


def _logits(model, input_ids):
    with torch.no_grad():
        return model(input_ids).logits.float()


INPUT_IDS = torch.tensor([[3, 17, 99, 5, 64, 1, 127, 42], [8, 8, 120, 33, 7, 0, 12, 90]])


# ---------------------------------------------------------------------------- the grouped op


def _packed_experts(num_experts: int, n: int, k: int, bits: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(num_experts, n, k, generator=g)
    codebook = fmt.make_codebook(None, bits)
    planes, block_scales, row_scales = torch.ops.kbit.quantize(w, codebook)
    return planes, block_scales, row_scales, codebook


@pytest.mark.parametrize("bits", [2, 4, 5], ids=lambda b: f"k{b}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(4, 48, 72), (1, 1, 32), (3, 16, 200)], ids=lambda s: "E{}xN{}xK{}".format(*s))
def test_grouped_mm_matches_per_row_reference(shape, dtype, bits):
    num_experts, n, k = shape
    planes, block_scales, row_scales, codebook = _packed_experts(num_experts, n, k, bits)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(11, k, generator=g).to(dtype)
    ids = torch.randint(0, num_experts, (11,), generator=g)
    ids[3] = num_experts  # an expert-parallel sentinel: its row is zero
    ids[5] = -1
    out = torch.ops.kbit.grouped_mm(x, ids, planes, block_scales, row_scales, codebook, k)
    w = fmt.dequantize(planes, block_scales, row_scales, codebook, k)
    for row in range(11):
        e = int(ids[row])
        if not 0 <= e < num_experts:
            assert not out[row].any(), f"row {row} of expert id {e} must be zero"
            continue
        expected = x[row].float() @ w[e].T
        torch.testing.assert_close(out[row].float(), expected, **GROUPED_MM_TOL[dtype])
    assert out.dtype == dtype and out.shape == (11, n)


def test_grouped_mm_per_expert_codebook():
    planes, block_scales, row_scales, codebook = _packed_experts(2, 16, 64, 3)
    per_expert = torch.stack([codebook, codebook])
    x = torch.randn(5, 64)
    ids = torch.tensor([1, 0, 1, 1, 0])
    torch.testing.assert_close(
        torch.ops.kbit.grouped_mm(x, ids, planes, block_scales, row_scales, per_expert, 64),
        torch.ops.kbit.grouped_mm(x, ids, planes, block_scales, row_scales, codebook, 64),
        rtol=0,
        atol=0,
    )


@pytest.mark.parametrize("routed", [False, True], ids=["per-row", "routed"])
def test_grouped_mm_x_repeat_equals_repeated_rows(routed):
    """x_repeat = k reads row s from x row s // k: the product and x's gradient equal those of the tokens
    repeated k times (repeat_interleave), bit for bit on the reference."""
    planes, block_scales, row_scales, codebook = _packed_experts(4, 24, 96, 4)
    g = torch.Generator().manual_seed(2)
    tokens, top_k = 5, 3
    x = torch.randn(tokens, 96, generator=g, requires_grad=True)
    ids = torch.randint(0, 4, (tokens * top_k,), generator=g)
    ids[4] = -1  # a sentinel row: zero output, no gradient
    routing = hf_kbit._ops.expert_offsets(ids, 4) if routed else (None, None)
    packed = (planes, block_scales, row_scales, codebook)
    out = torch.ops.kbit.grouped_mm(x, ids, *packed, 96, *routing, None, top_k)
    x_rep = x.detach().clone().requires_grad_(True)
    expected = torch.ops.kbit.grouped_mm(x_rep.repeat_interleave(top_k, 0), ids, *packed, 96, *routing)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    grad = torch.randn(out.shape, generator=g)
    out.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(x.grad, x_rep.grad, rtol=0, atol=1e-6)


def test_grouped_mm_rejects_bad_inputs():
    planes, block_scales, row_scales, codebook = _packed_experts(2, 16, 64, 4)
    x = torch.randn(5, 64)
    with pytest.raises(RuntimeError, match="expert_ids must be"):
        torch.ops.kbit.grouped_mm(x, torch.zeros(4, dtype=torch.long), planes, block_scales, row_scales, codebook, 64)
    with pytest.raises(RuntimeError, match="one leading expert dim"):
        torch.ops.kbit.grouped_mm(x, torch.zeros(5, dtype=torch.long), planes[0], block_scales[0], row_scales[0], codebook, 64)
    with pytest.raises(RuntimeError, match=r"expert_ids must be \[S\] = \[5 rows of x \* x_repeat 2\]"):
        torch.ops.kbit.grouped_mm(x, torch.zeros(5, dtype=torch.long), planes, block_scales, row_scales, codebook, 64,
                                  None, None, None, 2)
    with pytest.raises(RuntimeError, match="x_repeat must be an int >= 1, got 0"):
        torch.ops.kbit.grouped_mm(x, torch.zeros(5, dtype=torch.long), planes, block_scales, row_scales, codebook, 64,
                                  None, None, None, 0)


def test_grouped_mm_opcheck():
    planes, block_scales, row_scales, codebook = _packed_experts(3, 32, 64, 4)
    x = torch.randn(7, 64, dtype=torch.bfloat16)
    ids = torch.tensor([2, 0, 0, 1, 2, 2, 0], dtype=torch.int32)
    torch.library.opcheck(torch.ops.kbit.grouped_mm, (x, ids, planes, block_scales, row_scales, codebook, 64))
    x_tokens = torch.randn(4, 64, dtype=torch.bfloat16)
    ids = torch.tensor([2, 0, 0, 1, 2, 2, 0, 1], dtype=torch.int32)
    torch.library.opcheck(torch.ops.kbit.grouped_mm,
                          (x_tokens, ids, planes, block_scales, row_scales, codebook, 64, None, None, None, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_grouped_mm_silu_mul_is_grouped_mm_of_the_gated_rows(dtype):
    """The down projection of a gated gate_up output: grouped_mm of silu(gate) * up (kbit::silu_glu's roundings),
    bit for bit, with and without the layer's routing; its fake impl and schema pass opcheck."""
    planes, block_scales, row_scales, codebook = _packed_experts(3, 32, 64, 4)
    g = torch.Generator().manual_seed(4)
    gate_up = (torch.randn(7, 128, generator=g) * 3).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    ids = torch.tensor([2, 0, -1, 1, 2, 2, 0])
    packed = (planes, block_scales, row_scales, codebook)
    expected = torch.ops.kbit.grouped_mm(torch.ops.kbit.silu_glu(gate_up), ids, *packed, 64)
    torch.testing.assert_close(torch.ops.kbit.grouped_mm_silu_mul(gate, up, ids, *packed, 64), expected, rtol=0,
                               atol=0)
    routing = hf_kbit._ops.expert_offsets(ids, 3)
    torch.testing.assert_close(torch.ops.kbit.grouped_mm_silu_mul(gate, up, ids, *packed, 64, *routing), expected,
                               rtol=0, atol=0)
    torch.library.opcheck(torch.ops.kbit.grouped_mm_silu_mul, (gate, up, ids, *packed, 64),
                          test_utils=("test_schema", "test_faketensor"))
    with pytest.raises(RuntimeError, match="up must match x"):
        torch.ops.kbit.grouped_mm_silu_mul(gate, up[:6], ids, *packed, 64)


def test_expert_offsets_group_rows_without_host_sizes():
    ids = torch.tensor([2, 0, 5, 2, -1, 1, 0])
    order, offsets = hf_kbit._ops.expert_offsets(ids, 3)
    assert offsets.tolist() == [1, 3, 4, 6]  # -1 sorts before expert 0, 5 after expert 2
    assert order[1:3].tolist() == [1, 6] and order[3:4].tolist() == [5] and order[4:6].tolist() == [0, 3]


# ---------------------------------------------------------------------------- the module


@pytest.mark.parametrize("family", list(FAMILIES))
def test_detects_fused_experts_by_parameters(family):
    model = _tiny_model(family)
    experts = _experts_modules(model)
    assert experts, f"{family}: no *.experts module"
    for name, module in experts.items():
        layout = fused_experts_layout(module, name)
        assert layout.num_experts == 8 and layout.hidden_size == 64
        assert layout.is_transposed == (family == "gpt_oss") and layout.has_bias == (family == "gpt_oss")
    for name, module in model.named_modules():
        if not name.endswith(".experts"):
            assert fused_experts_layout(module, name) is None, name


# 40 tokens x top-2 = 80 rows > the CUDA backend's GROUP_ROWS_ABOVE: there the layer sorts the rows
# once and hands the routing to both grouped_mm calls.
@pytest.mark.parametrize("num_tokens", [9, 40], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("family", list(FAMILIES))
def test_module_equals_models_experts_with_dequantized_weights(family, num_tokens):
    """Same gating, activation, layout and biases as the model's own forward."""
    name, experts = _float_experts(family)
    kbit = KbitExperts.from_experts(experts, gate_up_bits=4, down_bits=3, name=name)
    assert kbit.placeholders() == [] and kbit.bits == {"gate_up_proj": 4, "down_proj": 3}
    g = torch.Generator().manual_seed(0)
    x = torch.randn(num_tokens, 64, generator=g)
    index, weights = _routing(num_tokens, 8, 2, g)
    with torch.no_grad():
        for projection in PROJECTIONS:
            getattr(experts, projection).copy_(kbit.dequantize_weight(projection))
        expected = experts(x, index, weights)
    assert _rel(kbit(x, index, weights), expected) < SAME_MATH_REL_ERROR


class _RecordOps(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("per_row", [True, False], ids=["per-row", "grouped"])
@pytest.mark.parametrize("family, silu", [("qwen3_moe", True), ("mixtral", True), ("gpt_oss", False)])
def test_module_runs_silu_gating_and_the_weighted_sum_as_one_op_each(family, silu, per_row, monkeypatch):
    """A SiLU act_fn's gating: where the rows are not grouped (a backend's per-row mode, decode), staged by the down
    projection, kbit::grouped_mm_silu_mul (no gated copy, one launch less on CUDA); grouped, kbit::silu_glu. A
    model's own _apply_gate (gpt_oss's clamped GLU) runs as it is, then kbit::grouped_mm; every family's weighted
    sum is kbit::experts_combine. With gradients: the torch ops and kbit::grouped_mm. All give the same result."""
    from transformers.activations import ACT2FN

    from hf_kbit import _ops
    from hf_kbit.nn.experts import _is_silu

    if per_row:  # as the CUDA backend registers: up to 64 rows not grouped
        monkeypatch.setitem(_ops.GROUP_ROWS_ABOVE, "cpu", 64)

    assert _is_silu(ACT2FN["silu"]) and _is_silu(torch.nn.SiLU())
    assert not _is_silu(ACT2FN["gelu"]) and not _is_silu(ACT2FN["relu"])
    name, experts = _float_experts(family)
    kbit = KbitExperts.from_experts(experts, name=name)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=g)
    index, weights = _routing(3, 8, 2, g)
    with torch.no_grad(), _RecordOps() as ops:
        out = kbit(x, index, weights)
    fused = silu and per_row
    assert ("kbit.grouped_mm_silu_mul" in ops.names) == fused and ("kbit.silu_glu" in ops.names) == (silu and not fused)
    assert ops.names.count("kbit.grouped_mm") == (1 if fused else 2) and ops.names.count("kbit.experts_combine") == 1
    x.requires_grad_(True)
    with _RecordOps() as ops:
        trained = kbit(x, index, weights)
    assert "kbit.grouped_mm_silu_mul" not in ops.names and "kbit.experts_combine" not in ops.names
    assert torch.equal(trained.detach(), out)


@pytest.mark.parametrize("num_tokens, sorts", [(20, 0), (40, 1)], ids=["40-rows", "80-rows"])
def test_module_sorts_rows_once_for_both_projections(num_tokens, sorts, monkeypatch):
    """Above the rows a backend registers (_ops.GROUP_ROWS_ABOVE, by device type) the layer groups them
    by expert once (not once per projection); at or below it, not at all (a kernel may serve each row
    on its own). With no threshold registered (the reference), always once."""
    from hf_kbit import _ops

    name, experts = _float_experts("qwen3_moe")
    kbit = KbitExperts.from_experts(experts, name=name)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(num_tokens, 64, generator=g)
    index, weights = _routing(num_tokens, 8, 2, g)
    expected = kbit(x, index, weights)
    calls = []
    original = _ops.expert_offsets
    monkeypatch.setattr(_ops, "expert_offsets", lambda *a: calls.append(a) or original(*a))
    assert torch.equal(kbit(x, index, weights), expected) and len(calls) == 1
    calls.clear()
    monkeypatch.setitem(_ops.GROUP_ROWS_ABOVE, "cpu", 64)
    out = kbit(x, index, weights)
    # The reference op sorts by itself when it gets no routing: 2 calls without the layer's.
    assert len(calls) == (1 if sorts else 2)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("bits", SUPPORTED_BITS, ids=lambda b: f"k{b}")
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_module_quantization_error(family, bits):
    name, experts = _float_experts(family)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 64, generator=g)
    index, weights = _routing(32, 8, 2, g)
    with torch.no_grad():
        expected = experts(x, index, weights)
    kbit = KbitExperts.from_experts(experts, bits, bits, name=name)
    assert _rel(kbit(x, index, weights), expected) < EXPERTS_REL_ERROR[bits]


@pytest.mark.parametrize("fitting_rule", ["absmax", "fit"])
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])  # gpt_oss stores its experts transposed
def test_pack_fits_one_codebook_on_all_experts(family, fitting_rule, monkeypatch):
    """The experts of a projection share one codebook, fitted on the rows of all of them stacked
    ([E * N, K]); packing a few experts at a time with the whole's codebook gives the same bytes."""
    name, experts = _float_experts(family)
    kbit = KbitExperts.from_experts(experts, 3, 3, name=name, fitting_rule=fitting_rule)
    for projection, prefix in PROJECTIONS.items():
        weight = kbit.linear_weight(projection, getattr(experts, projection).detach())
        want = hf_kbit.nn.quantize_layer(weight, 3, fitting_rule=fitting_rule)
        for t, value in zip(("planes", "block_scales", "row_scales", "codebook"), want):
            assert torch.equal(getattr(kbit, f"{prefix}_{t}"), value), (projection, t)
        monkeypatch.setattr(hf_kbit.nn.experts, "_QUANTIZE_CHUNK_ELEMENTS", weight[0].numel() * 3)
        chunked = kbit.pack(projection, getattr(experts, projection).detach(), None, name, fitting_rule)
        for t in ("planes", "block_scales", "row_scales", "codebook"):
            assert torch.equal(chunked[f"{prefix}_{t}"], getattr(kbit, f"{prefix}_{t}")), (projection, t)
        monkeypatch.undo()


def test_module_keeps_format_dtypes_on_cast():
    name, experts = _float_experts("gpt_oss")
    kbit = KbitExperts.from_experts(experts, name=name).to(torch.bfloat16)
    assert kbit.gate_up_row_scales.dtype == torch.float32 and kbit.down_codebook.dtype == torch.float32
    assert kbit.gate_up_planes.dtype == torch.int32 and kbit.gate_up_proj_bias.dtype == torch.bfloat16


def test_module_compiles_fullgraph():
    name, experts = _float_experts("qwen3_moe")
    kbit = KbitExperts.from_experts(experts, name=name)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=g)
    index, weights = _routing(5, 8, 2, g)
    compiled = torch.compile(kbit, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, index, weights), kbit(x, index, weights), rtol=0, atol=0)


def _guard_managers(manager):
    """Every guard manager of the tree under ``manager``, dict managers' keys and values included."""
    yield manager
    children = list(manager.get_child_managers())
    if hasattr(manager, "get_key_value_managers"):
        children += [m for pair in manager.get_key_value_managers().values() for m in pair if m is not None]
    for child in children:
        yield from _guard_managers(child)


@pytest.mark.parametrize("family, rotation", [("qwen3_moe", False), ("gpt_oss", False), ("qwen3_moe", True)])
def test_compiled_forward_can_skip_the_modules_guards(family, rotation):
    """The forward reads only ints, dicts, tensors and the model's gating function of the module, so dynamo's
    recursive dict tags (``use_recursive_dict_tags_for_guards``) can skip its guards while its dicts are unchanged:
    its guard manager is tag safe. An object attribute (such as the layout dataclass) or a class's ``__qualname__``
    read in the forward would make every compiled decode step evaluate every experts module's guards (about 12 us
    per layer of a Qwen3-30B-A3B-shaped model on the GPU machine's host, torch 2.11)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    name, experts = _float_experts(family)
    kbit = KbitExperts.from_experts(experts, name=name, rotation=rotation).to(torch.bfloat16)
    assert any(kbit.rotated.values()) == rotation

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = kbit

        def forward(self, x, index, weights):
            return self.experts(x, index, weights)

    block = Block()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    index, weights = _routing(3, kbit.num_experts, 2, g)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(use_recursive_dict_tags_for_guards=True):
        step = torch.compile(block.forward, fullgraph=True, backend="eager")
        for _ in range(2):
            step(x, index, weights.to(torch.bfloat16))
        (entry,) = _debug_get_cache_entry_list(Block.forward.__code__)
        managers = [m for m in _guard_managers(entry.guard_manager.root)
                    if m.get_type_of_guarded_value() is KbitExperts]
        assert managers and all(m.is_tag_safe() for m in managers)
        assert not any(".layout" in m.get_source() for m in _guard_managers(entry.guard_manager.root))
    torch._dynamo.reset()


# ---------------------------------------------------------------------------- quantize-on-load, save, reload


def _quantize_on_load(path, **config):
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=hf_kbit.KbitConfig(**config))


@pytest.fixture(scope="module")
def kbit4_models(bf16_checkpoints):
    """One bits=4 quantize-on-load model per family, shared by the tests that only read it."""
    loaded = {}

    def get(family: str):
        if family not in loaded:
            loaded[family] = _quantize_on_load(bf16_checkpoints(family)[0], bits=4)
        return loaded[family]

    return get


@pytest.mark.parametrize("bits", [2, 4], ids=lambda b: f"k{b}")
@pytest.mark.parametrize("family", list(FAMILIES))
def test_quantize_on_load_packs_every_expert_weight(family, bits, bf16_checkpoints, kbit4_models):
    path, bf16 = bf16_checkpoints(family)
    model = kbit4_models(family) if bits == 4 else _quantize_on_load(path, bits=bits)
    experts = _experts_modules(model)
    assert experts and all(isinstance(m, KbitExperts) for m in experts.values())
    float_3d = [n for n, p in model.named_parameters() if p.dim() == 3 and n.rsplit(".", 1)[-1] in PROJECTIONS]
    assert float_3d == []
    for module in experts.values():
        assert module.placeholders() == [] and module.gate_up_planes.shape[0] == 8
    assert _rel(_logits(model, INPUT_IDS), _logits(bf16, INPUT_IDS)) < LOGITS_REL_ERROR[bits]


@pytest.mark.parametrize("family", FAMILIES)
def test_save_reload_is_bit_identical(family, kbit4_models, tmp_path):
    model = kbit4_models(family)
    model.save_pretrained(tmp_path)
    header = _header(tmp_path / "model.safetensors")
    expert_keys = [k for k in header if ".experts." in k]
    assert expert_keys and not any(k.split(".experts.")[1][0].isdigit() for k in expert_keys)  # no per-expert keys
    assert {k.split(".experts.")[1] for k in expert_keys} >= set(model.get_submodule(next(iter(_experts_modules(model)))).packed_shapes())
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert all(isinstance(m, KbitExperts) for m in _experts_modules(reloaded).values())
    torch.testing.assert_close(_logits(reloaded, INPUT_IDS), _logits(model, INPUT_IDS), rtol=0, atol=0)
    for key, value in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[key], value), key


def test_mixtral_reload_of_module_names(kbit4_models, tmp_path):
    """Saved without the legacy renaming, a Mixtral kbit checkpoint reloads 1:1."""
    model = kbit4_models("mixtral")
    model.save_pretrained(tmp_path, save_original_format=False)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    torch.testing.assert_close(_logits(reloaded, INPUT_IDS), _logits(model, INPUT_IDS), rtol=0, atol=0)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_modules_to_not_convert_excludes_experts_and_keeps_routers(family, bf16_checkpoints):
    path, bf16 = bf16_checkpoints(family)
    model = _quantize_on_load(path, bits=4, modules_to_not_convert=["lm_head", "experts"])
    reference = dict(bf16.named_parameters())
    for name, module in _experts_modules(model).items():
        assert not isinstance(module, KbitExperts), name
        for projection in PROJECTIONS:
            assert torch.equal(getattr(module, projection), reference[f"{name}.{projection}"]), name
    routers = [n for n, m in model.named_modules() if n.endswith((".gate", ".router"))]
    assert routers
    for name in routers:  # routers are not nn.Linear in v5: never quantized, loaded as they were
        for pname, p in model.get_submodule(name).named_parameters():
            assert torch.equal(p, reference[f"{name}.{pname}"]), f"{name}.{pname}"
    assert any(isinstance(m, KbitLinear) for m in model.modules())  # attention is still quantized


@pytest.mark.parametrize("family", ["qwen3_next", "glm4_moe", "deepseek_v3"])
def test_shared_experts_can_be_excluded(family, bf16_checkpoints):
    path, bf16 = bf16_checkpoints(family)
    model = _quantize_on_load(path, bits=4, modules_to_not_convert=["lm_head", r".*\.shared_experts?\..*"])
    shared = {n: m for n, m in model.named_modules() if ".shared_expert" in n and "shared_expert_gate" not in n}
    assert shared and not any(isinstance(m, KbitLinear) for m in shared.values())
    assert all(isinstance(m, KbitExperts) for m in _experts_modules(model).values())


def test_qwen3_next_shared_expert_gate(bf16_checkpoints, kbit4_models, tmp_path):
    """Linear(H, 1): quantized (N = 1, padded to one tile internally) or skipped, both work."""
    path, bf16 = bf16_checkpoints("qwen3_next")
    quantized = kbit4_models("qwen3_next")
    gate = quantized.model.layers[0].mlp.shared_expert_gate
    assert isinstance(gate, KbitLinear) and gate.out_features == 1
    skipped = _quantize_on_load(path, bits=4, modules_to_not_convert=["lm_head", "shared_expert_gate"])
    assert isinstance(skipped.model.layers[0].mlp.shared_expert_gate, torch.nn.Linear)
    reference = _logits(bf16, INPUT_IDS)
    assert _rel(_logits(skipped, INPUT_IDS), reference) < LOGITS_REL_ERROR[4]
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(gate(x).float(), x.float() @ gate.dequantize_weight().T, rtol=1.6e-2, atol=1e-3)


def test_module_bits_per_projection(bf16_checkpoints):
    path, _ = bf16_checkpoints("qwen3_moe")
    model = _quantize_on_load(path, bits=4, module_bits={r"experts\.down_proj": 5})
    experts = next(iter(_experts_modules(model).values()))
    assert experts.bits == {"gate_up_proj": 4, "down_proj": 5} and experts.down_planes.shape[-3] == 5


def test_dequantize_restores_the_models_experts(bf16_checkpoints):
    """Each restored experts module computes what its kbit module did, on the inputs the model gave
    it (compared per module: a near-tie in a later router could flip an expert between two runs)."""
    path, bf16 = bf16_checkpoints("gpt_oss")
    model = _quantize_on_load(path, bits=4)
    inputs, outputs = {}, {}
    hooks = [
        module.register_forward_hook(functools.partial(_keep_call, name, inputs, outputs), with_kwargs=True)
        for name, module in _experts_modules(model).items()
    ]
    _logits(model, INPUT_IDS)
    for hook in hooks:
        hook.remove()
    source_class = type(_experts_modules(bf16)["model.layers.0.mlp.experts"])
    model.dequantize()
    for name, module in _experts_modules(model).items():
        assert type(module) is source_class and module.gate_up_proj.shape == (8, 64, 80), name
        args, kwargs = inputs[name]
        with torch.no_grad():
            assert _rel(module(*args, **kwargs), outputs[name]) < 0.02, name


def _keep_call(name, inputs, outputs, module, args, kwargs, output):
    inputs[name], outputs[name] = (args, kwargs), output


# ---------------------------------------------------------------------------- malformed checkpoints


def _header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return {k: v for k, v in json.loads(f.read(n)).items() if k != "__metadata__"}


def _rewrite(path, key, value):
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    tensors[key] = value
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize(
    "corrupt",
    [
        pytest.param(lambda t: t[:-1].clone(), id="wrong-E"),
        pytest.param(lambda t: t.flatten(-2).clone(), id="wrong-shape"),
        pytest.param(lambda t: t.to(torch.int16), id="wrong-dtype"),
    ],
)
@pytest.mark.parametrize("tensor", ["gate_up_planes", "down_row_scales"])
def test_malformed_expert_tensor_fails_naming_it(corrupt, tensor, kbit4_models, tmp_path):
    kbit4_models("qwen3_moe").save_pretrained(tmp_path)
    key = f"model.layers.1.mlp.experts.{tensor}"
    from safetensors.torch import load_file

    _rewrite(tmp_path / "model.safetensors", key, corrupt(load_file(tmp_path / "model.safetensors")[key]))
    with pytest.raises(KbitCheckpointError, match=key.replace(".", r"\.")):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_quantize_on_load_rejects_wrong_fused_shape(bf16_checkpoints):
    """A bf16 checkpoint whose fused tensor does not fit the config fails naming the tensor."""
    path, bf16 = bf16_checkpoints("gpt_oss")
    name = "model.layers.1.mlp.experts"
    kbit = KbitExperts.from_experts(copy.deepcopy(_experts_modules(_tiny_model("gpt_oss"))[name]), name=name)
    with pytest.raises(ValueError, match=rf"{name}\.gate_up_proj: the fused expert weight has shape \(7, 64, 80\)"):
        kbit.pack("gate_up_proj", torch.zeros(7, 64, 80), kbit.gate_up_codebook, name)


def test_packed_experts_of_unconverted_module_are_refused(kbit4_models, tmp_path):
    """config.json says the experts stay full precision but the file holds their packed tensors."""
    kbit4_models("mixtral").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = ["lm_head", "experts"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(KbitCheckpointError, match=r"experts\.(gate_up|down)_\w+'.*MixtralExperts.*full precision"):
        AutoModelForCausalLM.from_pretrained(tmp_path)

"""GPU tests of the warp-specialized wgmma GEMM (csrc/wgmma_ws_kernel.cuh, sm_90a) against the
reference: every (bits, dtype) of the kernel table, the M of issue 35 (17 .. 4096), odd N and K, every
token block and split-K plan, rotated layers, x that the tensor map cannot read as stored, CUDA-graph
replay and launches right after the kernels that write the operands.

The planner takes this kernel when asked (hf_kbit.backends.cuda.set_gemm_kernel("wgmma_ws"), or
HF_KBIT_GEMM_KERNEL=wgmma_ws); the module asks for it around each test and restores the default.
"""

from __future__ import annotations

import functools

import pytest
import torch

from hf_kbit import _lib
from hf_kbit import format as fmt
from hf_kbit.eval.timing import capture_cuda_graph
from kernel_cases import table_cases

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not _lib.available(), reason="needs the compiled kbit CUDA library (libhf_kbit_cuda.so)"),
    pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0),
                       reason="the warp-specialized GEMM is sm_90a code"),
]

DEVICE = "cuda"
# ||out - ref|| / ||ref|| against a float64 product of the reference weight (test_cuda_kernels.MM_REL_TOL):
# the output's rounding plus the codebook pairs and their block scaling in the activation dtype.
MM_REL_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
MS = (17, 32, 63, 64, 65, 128, 255, 256, 1000, 1024)
# (N, K): odd N and K (partial row tiles, K tiles and blocks; K % 8 != 0 takes the padded copy of x),
# K % 8 == 0 with many row blocks, and a Llama-3-8B projection (split-K plans at small M).
SHAPES = [(257, 515), (1000, 333), (4100, 264), (4096, 4096)]


@pytest.fixture(autouse=True)
def warp_specialized():
    from hf_kbit.backends import cuda as backend

    backend.set_gemm_kernel("wgmma_ws")
    yield backend
    backend.set_gemm_kernel(None)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "non-finite output"
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


@functools.lru_cache(maxsize=None)
def gpu_packed(n: int, k: int, bits: int, seed: int = 0):
    """A weight quantized by the GPU kernel (bit-exact with the reference) and its float32 dequantization."""
    g = torch.Generator(device=DEVICE).manual_seed(seed + 1000 * bits + n + 7 * k)
    w = torch.randn(n, k, generator=g, device=DEVICE) * torch.rand(n, 1, generator=g, device=DEVICE).add(0.1)
    cb = fmt.make_codebook(None, bits).to(DEVICE)
    planes, scales, rs = torch.ops.kbit.quantize(w, cb)
    return (planes, scales, rs, cb), torch.ops.kbit.dequantize(planes, scales, rs, cb, k, torch.float32)


def gemm_plan(n: int, k: int, m: int, bits: int = 4) -> dict:
    import ctypes

    lib = _lib.load()
    vals = [ctypes.c_int() for _ in range(4)]
    _lib.check(lib.kbit_gemm_plan(torch.cuda.current_device(), m, n, k, bits, *(ctypes.byref(v) for v in vals)),
               "kbit_gemm_plan")
    return dict(zip(("kernel", "block_m", "splits", "ctas"), (v.value for v in vals)))


@pytest.mark.parametrize("m", MS, ids=lambda m: f"M{m}")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"N{s[0]}K{s[1]}")
@pytest.mark.parametrize("bits,dtype", table_cases("wgmma_ws_gemm"))
def test_gemm_matches_reference(warp_specialized, bits, dtype, shape, m):
    n, k = shape
    assert gemm_plan(n, k, m, bits)["kernel"] == 2
    (planes, scales, rs, cb), wq = gpu_packed(n, k, bits)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    out = warp_specialized.run_path("gemm", x, planes, scales, rs, cb, k)
    assert out.shape == (m, n) and out.dtype == dtype
    assert rel_err(out, x.double() @ wq.double().T) < MM_REL_TOL[dtype], gemm_plan(n, k, m, bits)


@pytest.mark.parametrize("bits,dtype", table_cases("wgmma_ws_gemm"))
def test_gemm_m4096(warp_specialized, bits, dtype):
    n, k, m = 1000, 333, 4096
    (planes, scales, rs, cb), wq = gpu_packed(n, k, bits)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    out = warp_specialized.run_path("gemm", x, planes, scales, rs, cb, k)
    assert rel_err(out, x.double() @ wq.double().T) < MM_REL_TOL[dtype]


def test_plans_stay_on_the_gpu_and_report_the_kernel():
    plans = {(n, k, m): gemm_plan(n, k, m) for n, k in SHAPES for m in MS}
    assert all(p["kernel"] == 2 and p["ctas"] <= torch.cuda.get_device_properties(0).multi_processor_count
               for p in plans.values()), plans


@pytest.fixture
def forced_plan(warp_specialized):
    yield warp_specialized.set_wgmma_ws_plan
    warp_specialized.set_wgmma_ws_plan(None, None)


# Every token block with and without K splits, whatever the cost model picks: 3 splits of 32 K tiles (11, 11, 10)
# or of 5 (2, 2, 1), 4 splits of 5 K tiles (2, 2, 1 and an empty one, which adds zeros).
@pytest.mark.parametrize("nb,splits", [(1, 1), (2, 1), (4, 1), (1, 3), (2, 3), (4, 3), (4, 4)],
                         ids=lambda v: str(v))
@pytest.mark.parametrize("bits,dtype", table_cases("wgmma_ws_gemm"))
def test_every_plan_matches_reference(forced_plan, bits, dtype, nb, splits):
    forced_plan(nb, splits)
    from hf_kbit.backends import cuda as backend

    for n, k, m in [(4096, 4096, 300), (300, 600, 65), (1000, 333, 130)]:
        plan = gemm_plan(n, k, m, bits)
        assert plan["block_m"] == 64 * nb and plan["splits"] == min(splits, -(-k // 128)), plan
        (planes, scales, rs, cb), wq = gpu_packed(n, k, bits)
        x = torch.randn(m, k, device=DEVICE).to(dtype)
        out = backend.run_path("gemm", x, planes, scales, rs, cb, k)
        assert rel_err(out, x.double() @ wq.double().T) < MM_REL_TOL[dtype], (n, k, m, plan)


@pytest.mark.parametrize("m", [64, 300], ids=lambda m: f"M{m}")
def test_misaligned_x_gives_the_aligned_result(warp_specialized, m):
    """x at an odd element offset (the tensor map needs 16-byte alignment: the backend copies it)."""
    n, k = 300, 1024
    (planes, scales, rs, cb), _ = gpu_packed(n, k, 4)
    x = torch.randn(m * k + 1, device=DEVICE, dtype=torch.bfloat16)[1:].view(m, k)
    aligned = warp_specialized.run_path("gemm", x.clone(), planes, scales, rs, cb, k)
    assert torch.equal(warp_specialized.run_path("gemm", x, planes, scales, rs, cb, k), aligned)


@pytest.mark.parametrize("m", [17, 200], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("bits", [2, 5])
def test_rotated_layer(warp_specialized, bits, m):
    """A rotated layer: the standalone rotation writes x R into the workspace's head, which the GEMM's
    tensor map reads; the result is the unrotated kernel's on x R."""
    from hf_kbit import rotation

    n, k = 1000, 512
    (planes, scales, rs, cb), _ = gpu_packed(n, k, bits)
    signs = rotation.sign_words(k, 3, device=DEVICE)
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    xr = rotation.rotate_words(x, signs).to(x.dtype)  # float32, rounded once: the kernels' x R
    out = warp_specialized.run_path("gemm", x, planes, scales, rs, cb, k, signs=signs)
    assert torch.equal(out, warp_specialized.run_path("gemm", xr, planes, scales, rs, cb, k))


@pytest.mark.parametrize("m", [64, 1000], ids=lambda m: f"M{m}")
def test_cuda_graph_replay_equals_eager(warp_specialized, m):
    n, k = 4096, 4096  # split-K at M = 64 (the reduce kernel in the graph), 256-token blocks at M = 1000
    (planes, scales, rs, cb), _ = gpu_packed(n, k, 3)
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    eager = torch.ops.kbit.mm(x, planes, scales, rs, cb, k)
    graph, captured = capture_cuda_graph(lambda: torch.ops.kbit.mm(x, planes, scales, rs, cb, k))
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, torch.ops.kbit.mm(x, planes, scales, rs, cb, k))
    assert not torch.equal(captured, eager)


def test_mm_right_after_the_kernels_that_write_its_operands():
    """A programmatic dependent launch: the table and barriers are set up before griddepcontrol.wait, x is
    read after it. Each round runs kbit::mm straight after the quantize that wrote its weight (into memory
    that held the previous round's), then straight after the elementwise kernel that wrote its x."""
    n, k, m = 2048, 4096, 256
    cb = fmt.make_codebook(None, 4).to(DEVICE)
    x0 = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    for r in range(4):
        w = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16)
        planes, scales, rs = torch.ops.kbit.quantize(w, cb)
        x1 = x0 * (r + 1)
        after = torch.ops.kbit.mm(x1, planes, scales, rs, cb, k)
        wq = torch.ops.kbit.dequantize(planes, scales, rs, cb, k, torch.float32).double()
        assert rel_err(after, x1.double() @ wq.T) < MM_REL_TOL[torch.bfloat16], f"round {r}"


def test_set_gemm_kernel_rejects_unknown_names(warp_specialized):
    with pytest.raises(ValueError, match="set_gemm_kernel: name must be one of"):
        warp_specialized.set_gemm_kernel("cutlass")
    with pytest.raises(ValueError, match="nb must be 0"):
        warp_specialized.set_wgmma_ws_plan(3)


# ---------------------------------------------------------------------------- grouped calls (MoE prefill)

# The grouped GEMV's tolerance (test_moe_gpu.GROUPED_MM_REL_TOL): the same roundings per expert.
GROUPED_REL_TOL = MM_REL_TOL
# (E, N, K): partial tiles and blocks with K % 8 != 0 (the padded sorted copy), Qwen3-30B-A3B's gate_up
# and down with 128 experts, and few experts with many rows each (token blocks of 128 and 256 rows).
GROUPED_SHAPES = [(5, 257, 515), (128, 1536, 2048), (128, 2048, 768), (4, 1000, 1024)]


@functools.lru_cache(maxsize=None)
def packed_experts(num_experts: int, n: int, k: int, bits: int):
    """[E, N, K] weights quantized by the GPU kernel, one codebook, and their float32 dequantization."""
    g = torch.Generator(device=DEVICE).manual_seed(1000 * bits + n + 7 * k + num_experts)
    w = torch.randn(num_experts, n, k, generator=g, device=DEVICE) * torch.rand(
        num_experts, n, 1, generator=g, device=DEVICE).add(0.1)
    cb = fmt.make_codebook(None, bits).to(DEVICE)
    planes, scales, rs = torch.ops.kbit.quantize(w, cb)
    return (planes, scales, rs, cb), torch.ops.kbit.dequantize(planes, scales, rs, cb, k, torch.float32)


def expert_ids(rows: int, num_experts: int, seed: int) -> torch.Tensor:
    """Random ids that leave expert 1 without rows and put sentinels (-1, E, E + 7) on some rows."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, num_experts, (rows,), generator=g)
    ids[ids == 1] = 0
    ids[1], ids[3], ids[-1] = -1, num_experts, num_experts + 7
    return ids.to(DEVICE)


@pytest.mark.parametrize("rows", [65, 512, 4096], ids=lambda s: f"S{s}")
@pytest.mark.parametrize("shape", GROUPED_SHAPES, ids=lambda s: "E{}N{}K{}".format(*s))
@pytest.mark.parametrize("bits,dtype", table_cases("wgmma_ws_grouped"))
def test_grouped_mm_matches_reference(bits, dtype, shape, rows):
    """grouped_mm above GROUP_ROWS_ABOVE rows takes the grouped calls; each expert's rows against a float64
    product with its dequantized weight, rows of no expert zero."""
    num_experts, n, k = shape
    (planes, scales, rs, cb), wq = packed_experts(num_experts, n, k, bits)
    x = torch.randn(rows, k, device=DEVICE).to(dtype)
    ids = expert_ids(rows, num_experts, seed=rows + bits)
    out = torch.ops.kbit.grouped_mm(x, ids, planes, scales, rs, cb, k)
    assert out.shape == (rows, n) and out.dtype == dtype
    valid = (ids >= 0) & (ids < num_experts)
    assert not out[~valid].any(), "rows of expert ids outside [0, E) must be zero"
    for e in ids[valid].unique().tolist():
        sel = ids == e
        err = rel_err(out[sel], x[sel].double() @ wq[e].double().T)
        assert err < GROUPED_REL_TOL[dtype], f"expert {e} ({int(sel.sum())} rows): rel err {err:.2e}"


def test_grouped_mm_equals_the_grouped_gemv_on_the_same_rows(warp_specialized):
    """The same call through the grouped GEMV (the default kernel) and the grouped GEMM agree within the
    activation dtype's rounding; every id a sentinel gives zeros."""
    num_experts, n, k, rows = 16, 512, 1024, 300
    (planes, scales, rs, cb), _ = packed_experts(num_experts, n, k, 4)
    x = torch.randn(rows, k, device=DEVICE, dtype=torch.bfloat16)
    ids = expert_ids(rows, num_experts, seed=5)
    ws = torch.ops.kbit.grouped_mm(x, ids, planes, scales, rs, cb, k)
    warp_specialized.set_gemm_kernel(None)
    gemv = torch.ops.kbit.grouped_mm(x, ids, planes, scales, rs, cb, k)
    warp_specialized.set_gemm_kernel("wgmma_ws")
    assert rel_err(ws, gemv) < MM_REL_TOL[torch.bfloat16]
    tokens = x[::4].contiguous()  # x_repeat: the sort gathers row s from token s // 4
    assert torch.equal(torch.ops.kbit.grouped_mm(tokens, ids, planes, scales, rs, cb, k, None, None, None, 4),
                       torch.ops.kbit.grouped_mm(tokens.repeat_interleave(4, 0), ids, planes, scales, rs, cb, k))
    none = torch.full((rows,), -1, dtype=torch.int64, device=DEVICE)
    assert not torch.ops.kbit.grouped_mm(x, none, planes, scales, rs, cb, k).any()


def test_grouped_mm_cuda_graph_replay_equals_eager():
    num_experts, n, k, rows = 8, 768, 2048, 1024
    (planes, scales, rs, cb), _ = packed_experts(num_experts, n, k, 3)
    x = torch.randn(rows, k, device=DEVICE, dtype=torch.bfloat16)
    ids = expert_ids(rows, num_experts, seed=2)
    eager = torch.ops.kbit.grouped_mm(x, ids, planes, scales, rs, cb, k)
    graph, captured = capture_cuda_graph(lambda: torch.ops.kbit.grouped_mm(x, ids, planes, scales, rs, cb, k))
    ids.copy_(expert_ids(rows, num_experts, seed=3))  # new routing: the tile list is rebuilt on the device
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, torch.ops.kbit.grouped_mm(x, ids, planes, scales, rs, cb, k))
    assert not torch.equal(captured, eager)

"""GPU tests of the CUDA kbit kernels against the PyTorch reference (hf_kbit.format).

Run on the GPU machine with ``scripts/run_gpu_tests.sh`` (or ``pytest -m gpu tests/gpu``).
Packing (quantize) and dequantize are bit-exact; matmuls are compared against a float64
product of the reference weight with named tolerances.
"""

from __future__ import annotations

import copy
import functools
import os
from pathlib import Path

import pytest
import torch

import hf_kbit
from hf_kbit import _lib
from hf_kbit import format as fmt
from hf_kbit.eval.timing import capture_cuda_graph
from kernel_cases import bits_cases, table_cases

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not _lib.available(), reason="needs the compiled kbit CUDA library (libhf_kbit_cuda.so)"),
]

MS = (1, 2, 3, 4, 5, 8, 15, 16, 17, 32, 64, 65, 256, 1024)
# (N, K): odd sizes, partial tiles and blocks; (40, 8200) forces split-K in the GEMV.
MM_SHAPES = [(257, 515), (40, 8200), (1000, 333)]
QUANT_SHAPES = [(1, 1), (7, 31), (33, 257), (100, 1000), (3, 20, 300)]

# ||out - ref|| / ||ref|| against a float64 product of the reference weight: the output's
# rounding in the activation dtype, plus the weight's (GEMV and GEMM: codebook pairs and their
# block scaling in the activation dtype; dequantize + cuBLAS: the dequantized weight).
MM_REL_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
DEVICE = "cuda"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "non-finite output"
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


@functools.lru_cache(maxsize=None)
def packed_reference(n: int, k: int, bits: int, seed: int = 0):
    """Reference-packed weight (on the GPU) and its float32 dequantization."""
    g = torch.Generator().manual_seed(seed + 1000 * bits + n + 7 * k)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g).add(0.1)
    cb = fmt.make_codebook(None, bits)
    planes, scales, rs = fmt.quantize(w, cb)
    wq = fmt.dequantize(planes, scales, rs, cb, k, torch.float32)
    return tuple(t.to(DEVICE) for t in (planes, scales, rs, cb)), wq.to(DEVICE)


# ---------------------------------------------------------------------------- quantize


@pytest.mark.parametrize("shape", QUANT_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("bits,wdtype", table_cases("quantize"))
def test_quantize_bit_exact(bits, wdtype, shape):
    g = torch.Generator().manual_seed(bits * 100 + len(shape))
    w = (torch.randn(*shape, generator=g) * torch.rand(*shape[:-1], 1, generator=g).add(1e-3)).to(wdtype)
    w.view(-1)[0] = 0.0
    if w.shape[-2] > 2:
        w[..., 1, :] = 0.0  # an all-zero row: row scale 1.0
    cb = fmt.make_codebook(None, bits)
    ref = fmt.quantize(w, cb)
    got = torch.ops.kbit.quantize(w.to(DEVICE), cb.to(DEVICE))
    for name, r, o in zip(("planes", "block_scales", "row_scales"), ref, got):
        assert o.dtype == r.dtype and o.shape == r.shape, name
        assert torch.equal(o.cpu(), r), f"{name} differs from the reference"


def test_quantize_extreme_magnitudes():
    cb = fmt.make_codebook(None, 4)
    w = torch.randn(48, 640)
    w[0] *= 1e-30
    w[1] *= 1e30
    w[2, :5] = torch.tensor([1e-38, -3e38, 0.0, 1.0, -1.0])
    ref = fmt.quantize(w, cb)
    got = torch.ops.kbit.quantize(w.to(DEVICE), cb.to(DEVICE))
    for r, o in zip(ref, got):
        assert torch.equal(o.cpu(), r)


@pytest.mark.parametrize("bits", bits_cases("quantize"))
def test_quantize_float32_edges(bits):
    """Row scales clamped to ROW_SCALE_MAX (a weight at float32's max) and blocks whose ratio
    underflows to 0 (code raised to 1): bit-exact, and the GPU dequantize stays finite."""
    cb = fmt.make_codebook(None, bits)
    w = torch.randn(20, 300)
    w[0, 7] = torch.finfo(torch.float32).max
    w[1, :] = -torch.finfo(torch.float32).max / 2
    w[2, :32], w[2, 40] = 1e-44, 3e36
    w[3, :32], w[3, 64:96], w[3, 200] = 1e-40, 0.0, 1e4
    ref = fmt.quantize(w, cb)
    got = torch.ops.kbit.quantize(w.to(DEVICE), cb.to(DEVICE))
    for name, r, o in zip(("planes", "block_scales", "row_scales"), ref, got):
        assert torch.equal(o.cpu(), r), f"{name} differs from the reference"
    out = torch.ops.kbit.dequantize(*got, cb.to(DEVICE), 300, torch.float32)
    assert bool(torch.isfinite(out).all())
    assert torch.equal(out.cpu(), fmt.dequantize(*ref, cb, 300))


# ---------------------------------------------------------------------------- dequantize


@pytest.mark.parametrize("shape", [(257, 515), (16, 128), (5, 33)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("bits,dtype", table_cases("dequantize"))
def test_dequantize_bit_exact(bits, shape, dtype):
    n, k = shape
    (planes, scales, rs, cb), _ = packed_reference(n, k, bits)
    ref = fmt.dequantize(planes.cpu(), scales.cpu(), rs.cpu(), cb.cpu(), k, dtype)
    got = torch.ops.kbit.dequantize(planes, scales, rs, cb, k, dtype)
    assert got.dtype == dtype and got.shape == (n, k)
    assert torch.equal(got.cpu(), ref)


def test_dequantize_experts_per_expert_codebook():
    e, n, k, bits = 3, 20, 300, 3
    w = torch.randn(e, n, k)
    cbs = torch.stack([fmt.make_codebook("nf", bits), fmt.make_codebook("nf-sym", bits), fmt.make_codebook("nf", bits)])
    packed = [fmt.quantize(w[i], cbs[i]) for i in range(e)]
    planes, scales, rs = (torch.stack([p[j] for p in packed]) for j in range(3))
    ref = fmt.dequantize(planes, scales, rs, cbs, k, torch.bfloat16)
    got = torch.ops.kbit.dequantize(planes.cuda(), scales.cuda(), rs.cuda(), cbs.cuda(), k, torch.bfloat16)
    assert torch.equal(got.cpu(), ref)


# ---------------------------------------------------------------------------- mm


@pytest.mark.parametrize("m", MS, ids=lambda m: f"M{m}")
@pytest.mark.parametrize("shape", MM_SHAPES, ids=lambda s: f"N{s[0]}K{s[1]}")
@pytest.mark.parametrize("bits,dtype", table_cases("gemv"))
def test_mm_matches_reference(bits, dtype, shape, m):
    n, k = shape
    (planes, scales, rs, cb), wq = packed_reference(n, k, bits)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    out = torch.ops.kbit.mm(x, planes, scales, rs, cb, k)
    assert out.dtype == dtype and out.shape == (m, n)
    ref = x.double() @ wq.double().T
    assert rel_err(out, ref) < MM_REL_TOL[dtype]


PATH_MS = (1, 5, 16, 17, 33, 64, 65, 130, 300)
GEMV_MODES = {0: "one split or workspace split-K", 1: "cluster split-K", 2: "balanced",
              3: "balanced cluster split-K"}
# (N, K, M) whose GEMV plans on an H100 take each mode (kbit_gemv_plan), with partial row tiles,
# K tiles and blocks. Balanced: row tiles cut among a CTA's warps (4100x2040), warps' shares that
# cross row tiles (6100x4100), M = 4 and 16 (one and two mma token tiles), 80 KB of x per CTA
# (2048x5120 at M = 8), more than 16 row tiles per CTA, so that a warp's share holds a head
# segment, whole row tiles and a tail (42240x384), and 4 K splits through the workspace
# (17408x5120 at M = 16). Balanced cluster split-K: 6144x4096 at M = 16, 1024x4096 at M = 13,
# 14336x4100 at M = 13 (2 splits, the last with a partial K tile) and 40x16400 at M = 16 (8
# splits of 3 CTAs). Cluster split-K: the Llama-3-8B gate/up shape at M = 16 (x does not fit one
# CTA), and 2000x1000 / 300x700 (8 / 6 splits of one K tile). Workspace split-K: the Llama-3-8B
# down shape at M = 8, and x of 129 K tiles for 1000 rows at M = 16.
GEMV_PLAN_CASES = [(4100, 2040, 3), (6100, 4100, 1), (2048, 5120, 4), (5120, 2048, 16), (14336, 4096, 16),
                   (2048, 5120, 8), (42240, 384, 1), (17408, 5120, 16), (6144, 4096, 16), (1024, 4096, 13),
                   (14336, 4100, 13), (40, 16400, 16), (4096, 14336, 8), (1000, 16400, 16), (2000, 1000, 1),
                   (300, 700, 16)]


def gemv_plan(n: int, k: int, m: int) -> dict:
    import ctypes

    lib = _lib.load()
    vals = [ctypes.c_int() for _ in range(4)]
    rc = lib.kbit_gemv_plan(torch.cuda.current_device(), m, n, k, *(ctypes.byref(v) for v in vals))
    _lib.check(rc, "kbit_gemv_plan")
    return dict(zip(("splits", "chunk_kt", "grid", "mode"), (v.value for v in vals)))


def gpu_packed(n: int, k: int, bits: int, seed: int = 0):
    """A weight quantized by the GPU kernel (bit-exact with the reference: test_quantize_bit_exact)
    and its dequantization: the large shapes, whose reference quantization is slow on the CPU."""
    g = torch.Generator(device=DEVICE).manual_seed(seed + 1000 * bits + n + 7 * k)
    w = torch.randn(n, k, generator=g, device=DEVICE) * torch.rand(n, 1, generator=g, device=DEVICE).add(0.1)
    cb = fmt.make_codebook(None, bits).to(DEVICE)
    planes, scales, rs = torch.ops.kbit.quantize(w, cb)
    return (planes, scales, rs, cb), torch.ops.kbit.dequantize(planes, scales, rs, cb, k, torch.float32)


@pytest.mark.parametrize("case", GEMV_PLAN_CASES, ids=lambda c: f"N{c[0]}K{c[1]}M{c[2]}")
@pytest.mark.parametrize("bits,dtype", table_cases("gemv"))
def test_gemv_plan_modes_match_reference(bits, dtype, case):
    """Every GEMV plan mode (balanced, balanced cluster split-K, cluster split-K, workspace split-K)
    against the reference."""
    from hf_kbit.backends import cuda as backend

    n, k, m = case
    (planes, scales, rs, cb), wq = gpu_packed(n, k, bits)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    out = backend.run_path("gemv", x, planes, scales, rs, cb, k)
    assert out.shape == (m, n) and out.dtype == dtype
    assert rel_err(out, x.double() @ wq.double().T) < MM_REL_TOL[dtype], gemv_plan(n, k, m)


def test_gemv_plan_cases_cover_every_mode():
    """The cases above take all four modes on an sm_90 GPU (clusters and the shared-memory
    budget of the H100); elsewhere at least balanced and workspace plans."""
    modes = {gemv_plan(n, k, m)["mode"] for n, k, m in GEMV_PLAN_CASES}
    want = {0, 1, 2, 3} if torch.cuda.get_device_capability()[0] >= 9 else {0, 2}
    assert want <= modes, {GEMV_MODES[v] for v in modes}


def balanced_shares(n: int, plan: dict) -> list[tuple[int, int]]:
    """(first K tile within its row tile, items) of each warp of the first CTA of a balanced plan,
    as gemv_kernel computes them."""
    n_tiles, ctas = -(-n // 16), plan["grid"] // plan["splits"]
    rows = n_tiles // ctas + (n_tiles % ctas > 0)
    items = rows * plan["chunk_kt"]
    begin = [w * items // 16 for w in range(17)]
    return [(begin[w] % plan["chunk_kt"], begin[w + 1] - begin[w]) for w in range(16)]


def test_gemv_plan_cases_cover_balanced_variants():
    """Among the cases above: a balanced plan whose warp shares hold a head segment and a whole
    row tile after it (the head must survive that row tile), balanced plans with K splits through
    the workspace and through clusters."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the cases are sized for the SM count and shared memory of an sm_90 GPU")
    plan = gemv_plan(42240, 384, 1)
    assert plan["mode"] == 2 and plan["splits"] == 1, plan
    chunk = plan["chunk_kt"]
    assert any(start > 0 and items >= chunk - start + chunk for start, items in balanced_shares(42240, plan)), plan
    plans = {case: gemv_plan(*case) for case in GEMV_PLAN_CASES}
    assert any(p["mode"] == 2 and p["splits"] > 1 for p in plans.values()), plans
    assert sum(p["mode"] == 3 for p in plans.values()) >= 3, plans


def test_gemv_plans_keep_workspace_split_k():
    """Plans with more K splits than a cluster holds go through the workspace (and are tested above)."""
    plan = gemv_plan(1000, 16400, 16)
    assert plan["splits"] > 8 and plan["mode"] == 0, plan


@pytest.mark.parametrize("m", PATH_MS, ids=lambda m: f"M{m}")
@pytest.mark.parametrize("shape", MM_SHAPES + [(4100, 264)], ids=lambda s: f"N{s[0]}K{s[1]}")
@pytest.mark.parametrize("path,bits,dtype", [pytest.param(path, *case.values, id=f"{path}-{case.id}")
                                             for path in ("gemv", "gemm") for case in table_cases(path)])
def test_each_kernel_path_matches_reference(path, bits, dtype, shape, m):
    """Every kernel path at every M it can serve, whatever the dispatch picks (the crossovers
    move with measurements); (4100, 264): many row blocks, K % 8 == 0 (16-byte x copies)."""
    from hf_kbit.backends import cuda as backend

    if path == "gemv" and m > backend.GEMV_MAX_M:
        pytest.skip(f"the GEMV takes M <= {backend.GEMV_MAX_M}")
    n, k = shape
    (planes, scales, rs, cb), wq = packed_reference(n, k, bits)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    out = backend.run_path(path, x, planes, scales, rs, cb, k)
    assert out.shape == (m, n) and out.dtype == dtype
    assert rel_err(out, x.double() @ wq.double().T) < MM_REL_TOL[dtype]


def gemm_plan(n: int, k: int, m: int, bits: int = 4) -> dict:
    import ctypes

    lib = _lib.load()
    vals = [ctypes.c_int() for _ in range(4)]
    rc = lib.kbit_gemm_plan(torch.cuda.current_device(), m, n, k, bits, *(ctypes.byref(v) for v in vals))
    _lib.check(rc, "kbit_gemm_plan")
    return dict(zip(("wgmma", "block_m", "splits", "ctas"), (v.value for v in vals)))


@pytest.mark.parametrize("m, block_m", [(17, 64), (64, 64), (65, 128), (128, 128), (129, 256), (1024, 256)])
def test_gemm_plans_take_wgmma_on_sm90(m, block_m):
    """On an sm_90 GPU the GEMM path runs the wgmma kernel (and test_each_kernel_path covers
    it); elsewhere the mma.sync kernel."""
    plan = gemm_plan(4096, 4096, m)
    if torch.cuda.get_device_capability() == (9, 0):
        assert plan["wgmma"] == 1 and plan["block_m"] == block_m, plan
    else:
        assert plan["wgmma"] == 0, plan


def test_mma_gemm_kernel_matches_reference_when_forced():
    """HF_KBIT_GEMM_KERNEL=mma keeps the mma.sync GEMM (the only one before sm_90) on any GPU:
    a fresh process, since the library reads the variable once."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import torch
        from hf_kbit.backends import cuda as backend
        from tests.gpu.test_cuda_kernels import MM_REL_TOL, gemm_plan, packed_reference, rel_err
        for bits, dtype, (n, k), m in [(2, torch.bfloat16, (257, 515), 33), (3, torch.float16, (40, 8200), 64),
                                       (4, torch.bfloat16, (1000, 333), 130), (5, torch.bfloat16, (4100, 264), 17)]:
            assert gemm_plan(n, k, m, bits)["wgmma"] == 0
            (planes, scales, rs, cb), wq = packed_reference(n, k, bits)
            x = torch.randn(m, k, device="cuda").to(dtype)
            out = backend.run_path("gemm", x, planes, scales, rs, cb, k)
            err = rel_err(out, x.double() @ wq.double().T)
            assert err < MM_REL_TOL[dtype], (bits, dtype, n, k, m, err)
        print("ok")
    """)
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, HF_KBIT_GEMM_KERNEL="mma")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(root), str(root / "tests")) if p)
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout + res.stderr


def test_gemm_offset_x_and_packed_views():
    """x not 16-byte aligned (the GEMM's element-wise x copies) and packed tensors that are
    views at an odd offset (realigned) give the aligned result."""
    from hf_kbit.backends import cuda as backend

    n, k, m, bits = 300, 1024, 48, 4
    (planes, scales, rs, cb), wq = packed_reference(n, k, bits)
    x = torch.randn(m * k + 1, device=DEVICE, dtype=torch.bfloat16)[1:].view(m, k)
    aligned = backend.run_path("gemm", x.clone(), planes, scales, rs, cb, k)
    assert torch.equal(backend.run_path("gemm", x, planes, scales, rs, cb, k), aligned)
    flat = torch.cat([torch.zeros(1, dtype=torch.uint8, device=DEVICE), scales.flatten()])
    offset_scales = flat[1:].view(scales.shape)
    assert offset_scales.data_ptr() % 16 != 0
    assert torch.equal(backend.run_path("gemm", x, planes, offset_scales, rs, cb, k), aligned)
    assert rel_err(aligned, x.double() @ wq.double().T) < MM_REL_TOL[torch.bfloat16]


@pytest.mark.parametrize("m", [1, 16], ids=lambda m: f"M{m}")
def test_gemv_block_scales_off_16_byte_boundaries(m):
    """block_scales 4, 8 or 12 bytes past a 16-byte boundary (the C entry takes 4-byte aligned ones, and run_path
    passes the view as it is) give the aligned result bit for bit."""
    from hf_kbit.backends import cuda as backend

    n, k, bits = 1000, 4096, 4
    (planes, scales, rs, cb), wq = packed_reference(n, k, bits)
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    aligned = backend.run_path("gemv", x, planes, scales, rs, cb, k)
    assert rel_err(aligned, x.double() @ wq.double().T) < MM_REL_TOL[torch.bfloat16]
    for shift in (4, 8, 12):
        flat = torch.cat([torch.zeros(shift, dtype=torch.uint8, device=DEVICE), scales.flatten()])
        shifted = flat[shift:].view(scales.shape)
        assert shifted.data_ptr() % 16 == shift
        assert torch.equal(backend.run_path("gemv", x, planes, shifted, rs, cb, k), aligned), shift


@pytest.mark.parametrize("lead", [(2, 3), (1,), (4, 1, 2)], ids=str)
def test_mm_leading_dims_and_noncontiguous(lead):
    n, k, bits = 300, 700, 4
    (planes, scales, rs, cb), wq = packed_reference(n, k, bits)
    x = torch.randn(*lead, 2 * k, device=DEVICE, dtype=torch.bfloat16)[..., ::2]  # non-contiguous
    out = torch.ops.kbit.mm(x, planes, scales, rs, cb, k)
    assert out.shape == (*lead, n)
    assert torch.equal(out, torch.ops.kbit.mm(x.contiguous(), planes, scales, rs, cb, k))
    assert rel_err(out, x.double() @ wq.double().T) < MM_REL_TOL[torch.bfloat16]


def test_mm_float32_input():
    n, k = 129, 257
    (planes, scales, rs, cb), wq = packed_reference(n, k, 4)
    x = torch.randn(3, k, device=DEVICE)
    out = torch.ops.kbit.mm(x, planes, scales, rs, cb, k)
    assert out.dtype == torch.float32
    assert rel_err(out, x.double() @ wq.double().T) < 1e-5


def test_mm_rejects_bad_inputs_before_launch():
    n, k = 64, 256
    (planes, scales, rs, cb), _ = packed_reference(n, k, 4)
    with pytest.raises(RuntimeError, match="in_features"):
        torch.ops.kbit.mm(torch.randn(2, k + 1, device=DEVICE, dtype=torch.bfloat16), planes, scales, rs, cb, k)
    with pytest.raises(RuntimeError, match="x must be"):
        torch.ops.kbit.mm(torch.ones(2, k, device=DEVICE, dtype=torch.int32), planes, scales, rs, cb, k)
    with pytest.raises(RuntimeError, match="planes has shape"):
        torch.ops.kbit.mm(torch.randn(2, k, device=DEVICE, dtype=torch.bfloat16), planes[:, :1], scales, rs, cb, k)
    with pytest.raises(ValueError, match="row_scales is on cpu"):
        torch.ops.kbit.mm(torch.randn(2, k, device=DEVICE, dtype=torch.bfloat16), planes, scales, rs.cpu(), cb, k)


# ---------------------------------------------------------------------------- graphs, compile


@pytest.mark.parametrize("m", [1, 4, 32, 100], ids=lambda m: f"M{m}")
def test_cuda_graph_replay_equals_eager(m):
    n, k = 40, 8200  # split-K plans (GEMV at small M, GEMM at mid M)
    (planes, scales, rs, cb), _ = packed_reference(n, k, 3)
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    eager = torch.ops.kbit.mm(x, planes, scales, rs, cb, k)
    graph, captured = capture_cuda_graph(lambda: torch.ops.kbit.mm(x, planes, scales, rs, cb, k))
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, torch.ops.kbit.mm(x, planes, scales, rs, cb, k))
    assert not torch.equal(captured, eager)


@pytest.mark.parametrize("m", [1, 16, 64], ids=lambda m: f"M{m}")
def test_mm_right_after_the_kernels_that_write_its_operands(m):
    """On sm_90 the GEMVs and the wgmma GEMM's x rewrite are programmatic dependent launches:
    they read the packed weight before griddepcontrol.wait and x after it. Each round calls
    kbit::mm straight after the GPU quantize that wrote its weight (into memory that held the
    previous round's weight), then straight after the elementwise kernel that wrote its x."""
    n, k = 2048, 4096  # GEMV at M <= 16, wgmma GEMM at M = 64 (mma.sync GEMM off sm_90)
    cb = fmt.make_codebook(None, 4).to(DEVICE)
    x0 = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    for r in range(6):
        w = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16)
        x1 = x0 * (r + 1)
        planes, scales, rs = torch.ops.kbit.quantize(w, cb)
        after_quantize = torch.ops.kbit.mm(x1, planes, scales, rs, cb, k)
        x2 = x0 * -(r + 2)
        after_x = torch.ops.kbit.mm(x2, planes, scales, rs, cb, k)
        wq = torch.ops.kbit.dequantize(planes, scales, rs, cb, k, torch.float32).double()
        assert rel_err(after_quantize, x1.double() @ wq.T) < MM_REL_TOL[torch.bfloat16], f"round {r}"
        assert rel_err(after_x, x2.double() @ wq.T) < MM_REL_TOL[torch.bfloat16], f"round {r}"
        del planes, scales, rs, wq


def test_torch_compile_fullgraph_kbit_linear_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(300, 520), torch.nn.GELU(), torch.nn.Linear(520, 96)
    ).to(DEVICE, torch.bfloat16)
    qmodel = torch.nn.Sequential(
        hf_kbit.KbitLinear.from_linear(model[0], bits=4), torch.nn.GELU(), hf_kbit.KbitLinear.from_linear(model[2], bits=3)
    )
    compiled = torch.compile(qmodel, fullgraph=True)
    for m in (1, 7, 33):
        x = torch.randn(m, 300, device=DEVICE, dtype=torch.bfloat16)
        eager = qmodel(x)
        assert rel_err(compiled(x), eager) < 1e-2


@pytest.mark.parametrize("m", [1, 5, 16, 64, 300], ids=lambda m: f"M{m}")
def test_fused_projections_match_their_members(m):
    """q/k/v of Llama-3-8B's shapes fused (hf_kbit.fuse_projections): one launch, eager and compiled,
    each member's output as its own KbitLinear's (GEMV, GEMM and dequantize + cuBLAS paths by M)."""
    torch.manual_seed(0)
    layer = torch.nn.Module()
    for name, n in (("q_proj", 4096), ("k_proj", 1024), ("v_proj", 1024)):
        linear = torch.nn.Linear(4096, n, bias=name == "v_proj", device=DEVICE, dtype=torch.bfloat16)
        setattr(layer, name, hf_kbit.KbitLinear.from_linear(linear, bits=4, fitting="absmax"))
    members = copy.deepcopy(layer)
    assert hf_kbit.fuse_projections(layer) == ["qkv_proj"]
    launches = []
    layer.qkv_proj.register_forward_hook(lambda *_: launches.append(1))

    def qkv(mod, x):
        return mod.q_proj(x), mod.k_proj(x), mod.v_proj(x)

    compiled = torch.compile(qkv, fullgraph=True)
    x = torch.randn(m, 4096, device=DEVICE, dtype=torch.bfloat16)
    expected = qkv(members, x)
    for run in (qkv, compiled):
        for out, ref, name in zip(run(layer, x), expected, ("q", "k", "v")):
            assert out.shape == ref.shape and rel_err(out, ref) < MM_REL_TOL[torch.bfloat16], f"{name}_proj"
        if run is qkv:
            assert len(launches) == 1, "eager: one fused launch for q, k and v"


def test_kbit_linear_from_linear_quantizes_on_gpu_like_reference():
    """The absmax rule on the GPU is the kbit::quantize kernel: bit-exact with the reference."""
    lin = torch.nn.Linear(333, 77, dtype=torch.bfloat16)
    cpu = hf_kbit.KbitLinear.from_linear(lin, bits=5, fitting="absmax")
    gpu = hf_kbit.KbitLinear.from_linear(lin.to(DEVICE), bits=5, fitting="absmax")
    for name in ("planes", "block_scales", "row_scales", "codebook"):
        assert torch.equal(getattr(gpu, name).cpu(), getattr(cpu, name)), name


# ---------------------------------------------------------------------------- sanitizer smoke set


@pytest.mark.parametrize("bits", bits_cases("gemv"))
def test_smoke_all_kernels(bits):
    """Small representative set, also run under compute-sanitizer memcheck (run_gpu_tests.sh)."""
    n, k = 37, 1000
    w = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16)
    cb = fmt.make_codebook(None, bits).to(DEVICE)
    planes, scales, rs = torch.ops.kbit.quantize(w, cb)
    wq = torch.ops.kbit.dequantize(planes, scales, rs, cb, k, torch.float32)
    for m in (1, 3, 8, 9):
        x = torch.randn(m, k, device=DEVICE, dtype=torch.float16)
        out = torch.ops.kbit.mm(x, planes, scales, rs, cb, k)
        assert rel_err(out, x.double() @ wq.double().T) < MM_REL_TOL[torch.float16]
    torch.cuda.synchronize()


# ---------------------------------------------------------------------------- eager fast path


@pytest.mark.parametrize("m", [1, 3, 8, 16])
@pytest.mark.parametrize("bits", bits_cases("gemv"))
@pytest.mark.parametrize("shape", [(257, 515), (40, 8200)], ids=lambda s: "N%dK%d" % s)
def test_kbit_linear_eager_fast_path_equals_op(shape, bits, m):
    """KbitLinear.forward's eager fast path (cached call record) gives the op's result."""
    from hf_kbit.backends import cuda as backend

    n, k = shape
    lin = torch.nn.Linear(k, n, bias=True, device=DEVICE, dtype=torch.bfloat16)
    layer = hf_kbit.KbitLinear.from_linear(lin, bits=bits)
    x = torch.randn(2, m, k, device=DEVICE, dtype=torch.bfloat16)
    with torch.inference_mode():
        out = layer(x)
        ref = torch.ops.kbit.mm(x, layer.planes, layer.block_scales, layer.row_scales, layer.codebook, k) + layer.bias
    assert out.shape == (2, m, n) and out.dtype == torch.bfloat16
    assert torch.equal(out, ref)
    if backend.linear_fast is not None and 2 * m <= backend.GEMV_MAX_M:
        assert layer.__dict__.get("_kbit_fast"), "the eager fast path was not taken"


def test_kbit_linear_fast_path_follows_replaced_buffers():
    """A buffer replaced after the first call (new address) is picked up, not a stale pointer."""
    lin = torch.nn.Linear(300, 70, bias=False, device=DEVICE, dtype=torch.float16)
    layer = hf_kbit.KbitLinear.from_linear(lin, bits=4)
    x = torch.randn(1, 300, device=DEVICE, dtype=torch.float16)
    first = layer(x)
    other = hf_kbit.KbitLinear.from_linear(torch.nn.Linear(300, 70, bias=False, device=DEVICE, dtype=torch.float16), bits=4)
    for name in ("planes", "block_scales", "row_scales", "codebook"):
        setattr(layer, name, getattr(other, name).clone())
    second = layer(x)
    assert torch.equal(second, other(x))
    assert not torch.equal(first, second)


def test_kbit_linear_fast_path_autograd_input_uses_op():
    """x requiring grad (grad mode on) goes through the op, like before the fast path."""
    lin = torch.nn.Linear(256, 64, bias=False, device=DEVICE, dtype=torch.bfloat16)
    layer = hf_kbit.KbitLinear.from_linear(lin, bits=4)
    x = torch.randn(1, 256, device=DEVICE, dtype=torch.bfloat16)
    with torch.no_grad():
        expect = layer(x)
    xg = x.clone().requires_grad_(True)
    try:
        out = layer(xg)
    except RuntimeError:
        return  # the op has no autograd formula: it still fails the same way as before
    assert torch.equal(out.detach(), expect)


def test_kbit_linear_fast_path_workspace_growth_keeps_captured_graph():
    """The eager split-K workspace is shared per stream and grows for a larger plan; a graph
    captured with the smaller one still replays right after the growth."""
    from hf_kbit.backends import cuda as backend

    # 129 K tiles for 63 row tiles: workspace split-K plans at M = 8 and 16 on an H100
    # (GEMV_PLAN_CASES); the second needs twice the floats.
    small = hf_kbit.KbitLinear.from_linear(
        torch.nn.Linear(16400, 1000, bias=False, device=DEVICE, dtype=torch.bfloat16), bits=2)
    big = hf_kbit.KbitLinear.from_linear(
        torch.nn.Linear(16400, 1000, bias=False, device=DEVICE, dtype=torch.bfloat16), bits=2)
    x_small = torch.randn(8, 16400, device=DEVICE, dtype=torch.bfloat16)
    x_big = torch.randn(16, 16400, device=DEVICE, dtype=torch.bfloat16)
    plans = {m: gemv_plan(1000, 16400, m) for m in (8, 16)}
    assert all(p["splits"] > 1 and p["mode"] in (0, 2) for p in plans.values()), plans
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    key = (torch.device(DEVICE).index or 0, s.cuda_stream)
    with torch.cuda.stream(s), torch.inference_mode():
        small(x_small)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s), torch.inference_mode():
        captured = small(x_small)
    before = backend._stream_workspaces[key]
    (small_need,) = {e[6] for e in small.__dict__["_kbit_fast"].values()}
    with torch.cuda.stream(s), torch.inference_mode():
        got_big = big(x_big)
    (big_need,) = {e[6] for e in big.__dict__["_kbit_fast"].values()}
    assert 0 < small_need < big_need, "the shapes must give two split-K plans, the second larger"
    assert backend._stream_workspaces[key] is not before and backend._stream_workspaces[key].numel() >= big_need
    torch.cuda.current_stream().wait_stream(s)
    x_small.copy_(torch.randn_like(x_small))
    graph.replay()
    torch.cuda.synchronize()
    with torch.inference_mode():
        assert torch.equal(captured, small(x_small))
        assert torch.equal(got_big, torch.ops.kbit.mm(x_big, big.planes, big.block_scales, big.row_scales,
                                                      big.codebook, 16400))


def test_kbit_linear_fast_path_cuda_graph_capture():
    """The eager fast path is graph-safe: a captured KbitLinear replays on new inputs."""
    lin = torch.nn.Linear(8200, 40, bias=True, device=DEVICE, dtype=torch.bfloat16)  # split-K plan
    layer = hf_kbit.KbitLinear.from_linear(lin, bits=2)
    x = torch.randn(2, 8200, device=DEVICE, dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.inference_mode():
        layer(x)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.inference_mode():
        captured = layer(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    with torch.inference_mode():
        assert torch.equal(captured, layer(x))


# ---------------------------------------------------------------------------- the path planner


@pytest.mark.parametrize("bits,dtype", table_cases("gemv"))
def test_planner_follows_crossovers_json(bits, dtype):
    """kbit_mm_plan, the one planner, takes its paths from hf_kbit/backends/crossovers.json; float32
    x (no GEMV or GEMM in the kernel table) always dequantizes."""
    from hf_kbit.backends import crossovers
    from hf_kbit.backends import cuda as backend

    device = torch.cuda.current_device()
    gemm_kernel = backend.mm_plan(1, 4096, 4096, bits, device, dtype)[1]
    gemv_max_m, classes = crossovers.read()[gemm_kernel][bits]
    for n, k in [(14336, 4096), (5120, 2048), (512, 2048)]:
        gemm_max_m = next(m for w, m in classes if n * k >= w)
        for m in (1, gemv_max_m, gemv_max_m + 1, gemm_max_m, gemm_max_m + 1, 4096):
            path, kernel, ws = backend.mm_plan(m, n, k, bits, device, dtype)
            expected = "gemv" if m <= min(gemv_max_m, backend.GEMV_MAX_M) else "gemm" if m <= gemm_max_m else "dequant"
            assert (path, kernel) == (expected, gemm_kernel), (n, k, m)
            assert ws >= 0
        assert backend.mm_plan(1, n, k, bits, device, torch.float32)[0] == "dequant"

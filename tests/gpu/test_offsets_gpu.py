"""GPU tests of block records (int16 ``block_scales``: an E4M4 code and a signed offset code per block,
hf_kbit/format.py) on the CUDA backend: the block-records GEMV (csrc/gemv_kernel.cuh, kOffsets) against the
float32 reference (``format.dequantize`` then a float64 product), bit-exact with the uint8 GEMV where every offset
is zero, under CUDA-graph replay and on the eager fast path; and every other path (larger M, float32 x, the
prologues, a rotated layer, dequantize, grouped_mm, the gradient) on its fallback, which dequantizes the records
with the reference, against the same reference. No kernel that reads uint8 codes may be handed records.

Run on the GPU machine: ``python -m pytest -m gpu tests/gpu/test_offsets_gpu.py -q``.
"""

from __future__ import annotations

import ctypes
import functools

import pytest
import torch

from hf_kbit import _lib, _ops, rotation
from hf_kbit import format as fmt
from hf_kbit.eval.timing import capture_cuda_graph
from kernel_cases import table_cases
from test_bad_input import spy_library

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not _lib.available(), reason="needs the compiled kbit CUDA library (libhf_kbit_cuda.so)"),
]

DEVICE = "cuda"
PACKED = ("planes", "block_scales", "row_scales", "codebook")
# ||out - ref|| / ||ref|| against a float64 product of the reference weight (as tests/gpu/test_cuda_kernels.py's
# MM_REL_TOL): the output's rounding in the activation dtype and the decoded weight's (the GEMV: codebook pair
# * scale + offset, one fma rounded to the activation dtype; the fallback: the reference weight rounded once).
MM_REL_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}
# The reference's weight on the GPU against the CPU's (the same torch ops, each rounded once in float32): equal.
DEQUANT_EXACT = 0.0
# (N, K): odd sizes with partial row tiles, K tiles and blocks (4100 x 2000), split-K (40 x 8200), one tile, and
# fewer rows and columns than a tile.
SHAPES = [(4100, 2000), (257, 515), (40, 8200), (16, 128), (5, 33)]
GEMV_MS = tuple(range(1, 17))
# (N, K, M) whose GEMV plans take each mode (test_cuda_kernels.py's GEMV_PLAN_CASES: balanced, cluster split-K,
# balanced cluster split-K with a partial last K tile, workspace split-K, 8-split clusters): the kOffsets
# instantiations of every (abs table, balanced cluster) combination the host launches.
PLAN_CASES = [(4100, 2040, 3), (6100, 4100, 1), (14336, 4096, 16), (6144, 4096, 16), (14336, 4100, 13),
              (40, 16400, 16), (4096, 14336, 8), (1000, 16400, 16), (2000, 1000, 1), (300, 700, 16)]
# Library entries that read uint8 codes: none may be called on a layer with records.
CODE_READERS = ("kbit_gemv", "kbit_gemm", "kbit_dequantize", "kbit_gemv_prologue", "kbit_gemv_prepare",
                "kbit_grouped_gemv", "kbit_grouped_gemm")


def backend():
    from hf_kbit.backends import cuda

    return cuda


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "non-finite output"
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def random_offsets(shape, generator: torch.Generator) -> torch.Tensor:
    """Offset codes over all of [-OFFSET_MAX, OFFSET_MAX], a quarter of them zero, both ends present."""
    o = torch.randint(-fmt.OFFSET_MAX, fmt.OFFSET_MAX + 1, shape, generator=generator)
    o[torch.rand(shape, generator=generator) < 0.25] = 0
    flat = o.view(-1)
    flat[0], flat[-1] = -fmt.OFFSET_MAX, fmt.OFFSET_MAX
    if flat.numel() > 2:
        flat[1] = 0
    return o


@functools.lru_cache(maxsize=None)
def packed_records(n: int, k: int, bits: int, zero: bool = False, experts: int = 0):
    """``(planes, records, row_scales, codebook), codes, W``: a quantized random weight (the GPU quantize, bit-exact
    with the reference) whose uint8 codes are made block records with random offsets (``zero``: all zero), and W its
    float32 reference weight; ``experts`` > 0 stacks that many on a leading dim (one codebook)."""
    g = torch.Generator().manual_seed(1000 * bits + n + 7 * k + 31 * experts)
    shape = (experts, n, k) if experts else (n, k)
    w = torch.randn(*shape, generator=g) * torch.rand(*shape[:-1], 1, generator=g).add(0.1)
    cb = fmt.make_codebook(None, bits).to(DEVICE)
    planes, codes, rs = torch.ops.kbit.quantize(w.to(DEVICE), cb)
    offsets = torch.zeros(codes.shape, dtype=torch.int64) if zero else random_offsets(codes.shape, g)
    records = fmt.pack_records(codes, offsets.to(DEVICE))
    assert records.dtype == fmt.RECORD_DTYPE
    wq = fmt.dequantize(planes, records, rs, cb, k, torch.float32)
    return (planes, records, rs, cb), codes, wq


class RecordsLayer(torch.nn.Module):
    """The buffers the eager fast path reads (KbitLinear's names), holding block records."""

    def __init__(self, packed, k: int, signs=None):
        super().__init__()
        for name, t in zip(PACKED, packed):
            self.register_buffer(name, t)
        self.in_features = k
        self.rotation_signs = signs


@pytest.fixture
def spy():
    """Every kbit_* library call made in the test (test_bad_input's spy, the eager fast path's run included)."""
    with spy_library() as s:
        yield s


def assert_no_code_reader(spy) -> None:
    wrong = [c for c in spy.calls if c in CODE_READERS]
    assert not wrong, f"records were handed to kernels that read uint8 codes: {wrong}"


# ---------------------------------------------------------------------------- the block-records GEMV


@pytest.mark.parametrize("bits,dtype", table_cases("gemv"))
def test_offsets_gemv_serves_the_gemv_tiles(bits, dtype):
    """The library holds the block-records GEMV for both token tiles at every (bits, 16-bit dtype), none for
    float32 x."""
    be = backend()
    assert be.gemv_offsets_max_m(bits, dtype) == be.GEMV_MAX_M
    assert be.gemv_offsets_max_m(bits, torch.float32) == 0
    assert _lib.load().kbit_gemv_offsets_max_m(bits, 0) == 0


@pytest.mark.parametrize("m", GEMV_MS, ids=lambda m: f"M{m}")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"N{s[0]}K{s[1]}")
@pytest.mark.parametrize("bits,dtype", table_cases("gemv"))
def test_offsets_gemv_matches_reference(bits, dtype, shape, m, spy):
    n, k = shape
    packed, _, wq = packed_records(n, k, bits)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    out = torch.ops.kbit.mm(x, *packed, k)
    assert out.dtype == dtype and out.shape == (m, n)
    assert rel_err(out, x.double() @ wq.double().T) < MM_REL_TOL[dtype]
    assert "kbit_gemv_offsets" in spy.calls, "the block-records GEMV did not serve"
    assert_no_code_reader(spy)


@pytest.mark.parametrize("bits,dtype", [pytest.param(4, torch.bfloat16, id="k4-bf16"),
                                        pytest.param(5, torch.float16, id="k5-fp16"),
                                        pytest.param(2, torch.bfloat16, id="k2-bf16")])
@pytest.mark.parametrize("case", PLAN_CASES, ids=lambda c: "N{}K{}M{}".format(*c))
def test_offsets_gemv_every_plan_mode(case, bits, dtype):
    n, k, m = case
    packed, _, wq = packed_records(n, k, bits)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    out = backend().run_path("gemv", x, *packed, k)
    assert rel_err(out, x.double() @ wq.double().T) < MM_REL_TOL[dtype]


@pytest.mark.parametrize("m", GEMV_MS, ids=lambda m: f"M{m}")
@pytest.mark.parametrize("shape", [(4100, 2000), (40, 8200), (5, 33)], ids=lambda s: f"N{s[0]}K{s[1]}")
@pytest.mark.parametrize("bits,dtype", table_cases("gemv"))
def test_zero_offsets_equal_the_uint8_gemv(bits, dtype, shape, m):
    """Records whose offsets are all zero: bit for bit the uint8 GEMV's output (the same plan; the packed fma
    with a +0 offset rounds as the packed multiply, and a product's zero sign cannot reach the mma's float32
    sums, which start at +0)."""
    n, k = shape
    packed, codes, _ = packed_records(n, k, bits, zero=True)
    planes, records, rs, cb = packed
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    assert torch.equal(torch.ops.kbit.mm(x, *packed, k), torch.ops.kbit.mm(x, planes, codes, rs, cb, k))


@pytest.mark.parametrize("bits,m", [(3, 1), (5, 8), (4, 16), (2, 13)], ids=lambda v: str(v))
def test_offsets_gemv_cuda_graph_replay(bits, m):
    """A captured block-records mm replays on new x like an eager call (split-K and cluster plans included)."""
    for n, k in ((4100, 2000), (40, 8200)):
        packed, _, wq = packed_records(n, k, bits)
        x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
        graph, out = capture_cuda_graph(lambda: torch.ops.kbit.mm(x, *packed, k))
        for _ in range(2):
            x.copy_(torch.randn(m, k, device=DEVICE))
            graph.replay()
            torch.cuda.synchronize()
            eager = torch.ops.kbit.mm(x, *packed, k)
            assert torch.equal(out, eager)
            assert rel_err(out, x.double() @ wq.double().T) < MM_REL_TOL[torch.bfloat16]


@pytest.mark.parametrize("m", [1, 5, 16, 17], ids=lambda m: f"M{m}")
def test_eager_fast_path_on_records(m, spy):
    """The eager shortcut (register_eager_mm) prepares the block-records GEMV where it serves (M <= 16) and
    leaves larger M to the op."""
    be = backend()
    n, k = 1000, 4096
    packed, _, wq = packed_records(n, k, 4)
    layer = RecordsLayer(packed, k)
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    with torch.inference_mode():
        out = be.linear_fast(layer, x)
        if m > be.gemv_offsets_max_m(4, x.dtype):
            assert out is None
            return
        assert out is not None, "the fast path did not serve"
        assert torch.equal(out, torch.ops.kbit.mm(x, *packed, k))
    assert "kbit_gemv_prepare_offsets" in spy.calls and "kbit_gemv_run" in spy.calls
    assert_no_code_reader(spy)
    assert rel_err(out, x.double() @ wq.double().T) < MM_REL_TOL[torch.bfloat16]


def test_offsets_entries_refuse_what_they_do_not_serve():
    """The C entries refuse m beyond the block-records GEMV and float32 x, naming the limit, before a launch."""
    backend()  # declares the entries' argument types
    lib = _lib.load()
    ptr = ctypes.c_void_p(256)
    with pytest.raises(ValueError, match="1..16"):
        _lib.check(lib.kbit_gemv_offsets(0, None, ptr, 2, ptr, ptr, ptr, ptr, 4, 17, 16, 128, ptr, None, 0), "mm")
    with pytest.raises(ValueError, match="kernel=gemv, bits=4, dtype=float32"):
        _lib.check(lib.kbit_gemv_offsets(0, None, ptr, 0, ptr, ptr, ptr, ptr, 4, 1, 16, 128, ptr, None, 0), "mm")
    with pytest.raises(ValueError, match="2-byte aligned"):
        _lib.check(lib.kbit_gemv_offsets(0, None, ptr, 2, ptr, ctypes.c_void_p(257), ptr, ptr, 4, 1, 16, 128, ptr,
                                         None, 0), "mm")


# ---------------------------------------------------------------------------- the fallbacks


@pytest.mark.parametrize("m", [17, 300], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("bits,dtype", table_cases("gemv"))
def test_mm_beyond_the_gemv_falls_back(bits, dtype, m, spy):
    n, k = 4100, 2000
    packed, _, wq = packed_records(n, k, bits)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    out = torch.ops.kbit.mm(x, *packed, k)
    assert out.dtype == dtype and out.shape == (m, n)
    assert rel_err(out, x.double() @ wq.double().T) < MM_REL_TOL[dtype]
    assert_no_code_reader(spy)


@pytest.mark.parametrize("m", [1, 16, 300], ids=lambda m: f"M{m}")
def test_mm_float32_falls_back(m, spy):
    n, k = 257, 515
    packed, _, wq = packed_records(n, k, 3)
    x = torch.randn(m, k, device=DEVICE)
    out = torch.ops.kbit.mm(x, *packed, k)
    assert out.dtype == torch.float32
    assert rel_err(out, x.double() @ wq.double().T) < MM_REL_TOL[torch.float32]
    assert_no_code_reader(spy)


def test_forced_gemm_path_refuses_records():
    """run_path never hands records to the GEMM (benchmarks force paths)."""
    packed, _, _ = packed_records(257, 515, 4)
    x = torch.randn(64, 515, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="block records"):
        backend().run_path("gemm", x, *packed, 515)
    with pytest.raises(ValueError, match="block records"):
        backend().run_path("gemv", x, *packed, 515)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(257, 515), (5, 33)], ids=lambda s: f"N{s[0]}K{s[1]}")
def test_dequantize_falls_back_to_the_reference(shape, dtype, spy):
    n, k = shape
    packed, _, _ = packed_records(n, k, 4)
    got = torch.ops.kbit.dequantize(*packed, k, dtype)
    ref = fmt.dequantize(*(t.cpu() for t in packed), k, dtype)
    assert got.dtype == dtype and got.shape == (n, k)
    torch.testing.assert_close(got.cpu(), ref, atol=DEQUANT_EXACT, rtol=DEQUANT_EXACT)
    assert_no_code_reader(spy)


@pytest.mark.parametrize("m", [1, 8, 17], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("kind", ["rmsnorm", "add_rmsnorm", "silu_mul"])
def test_prologue_ops_fall_back(kind, m, spy):
    """The prologue ops run unfused on records (the GEMV with a prologue reads codes): the reference's
    prologue, then kbit::mm, which takes the block-records GEMV up to M = 16."""
    n, k, dtype = 1000, 2048, torch.bfloat16
    packed, _, wq = packed_records(n, k, 4)
    x = torch.randn(m, k, device=DEVICE, dtype=dtype)
    x2 = torch.randn(m, k, device=DEVICE, dtype=dtype)
    w = (torch.rand(k, device=DEVICE) + 0.5).to(dtype)
    eps = 1e-6
    if kind == "rmsnorm":
        out = torch.ops.kbit.mm_rmsnorm(x, w, eps, *packed, k)
        h = _ops.rms_norm(x, w, eps)
    elif kind == "add_rmsnorm":
        out, total = torch.ops.kbit.mm_add_rmsnorm(x, x2, w, eps, *packed, k)
        assert torch.equal(total, x + x2)
        h = _ops.rms_norm(x + x2, w, eps)
    else:
        out = torch.ops.kbit.mm_silu_mul(x, x2, *packed, k)
        h = _ops.silu_mul(x, x2)
    assert rel_err(out, h.double() @ wq.double().T) < MM_REL_TOL[dtype]
    assert_no_code_reader(spy)
    if m <= 16:
        assert "kbit_gemv_offsets" in spy.calls


@pytest.mark.parametrize("m", [1, 8, 300], ids=lambda m: f"M{m}")
def test_rotated_layer_with_records_falls_back(m, spy):
    """A rotated layer with records: the stored weight W' (dequantized by the reference) times x R (the standalone
    rotation kernel), at every M, and dequantize returns W' R^T."""
    n, k, dtype, seed = 1000, 2048, torch.bfloat16, 12345
    packed, _, wq = packed_records(n, k, 3)
    signs = rotation.sign_words(k, seed, DEVICE)
    x = torch.randn(m, k, device=DEVICE, dtype=dtype)
    out = torch.ops.kbit.mm(x, *packed, k, signs)
    xr = rotation.rotate(x, rotation.DEFAULT_BLOCK, seed).to(dtype)
    assert rel_err(out, xr.double() @ wq.double().T) < MM_REL_TOL[dtype]
    w = torch.ops.kbit.dequantize(*packed, k, torch.float32, signs)
    torch.testing.assert_close(w, rotation.unrotate(wq, rotation.DEFAULT_BLOCK, seed), atol=1e-6, rtol=1e-6)
    assert_no_code_reader(spy)


@pytest.mark.parametrize("s", [5, 100], ids=lambda s: f"S{s}")
def test_grouped_mm_falls_back(s, spy):
    e, n, k, dtype = 3, 300, 700, torch.bfloat16
    packed, _, wq = packed_records(n, k, 4, experts=e)
    x = torch.randn(s, k, device=DEVICE, dtype=dtype)
    ids = torch.randint(0, e, (s,), device=DEVICE)
    out = torch.ops.kbit.grouped_mm(x, ids, *packed, k)
    ref = torch.einsum("sk,snk->sn", x.double(), wq.double()[ids])
    assert rel_err(out, ref) < MM_REL_TOL[dtype]
    assert_no_code_reader(spy)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_grad_x_falls_back(dtype, spy):
    n, k = 1000, 2000
    packed, _, wq = packed_records(n, k, 5)
    grad = torch.randn(40, n, device=DEVICE, dtype=dtype)
    out = torch.ops.kbit.mm_grad_x(grad, *packed, k)
    assert out.dtype == dtype and out.shape == (40, k)
    assert rel_err(out, grad.double() @ wq.double()) < MM_REL_TOL[dtype]
    assert_no_code_reader(spy)

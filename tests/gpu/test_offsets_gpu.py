"""GPU tests of block records (int16 ``block_scales``: an E4M4 code and a signed offset code per block,
hf_kbit/format.py) on the CUDA backend. The kernels that read records (the kOffsets instantiations): the GEMV
(csrc/gemv_kernel.cuh), plain and with each prologue (kbit::mm_silu_mul, mm_rmsnorm, mm_add_rmsnorm), and the
sm_90a wgmma GEMM (csrc/wgmma_kernel.cuh) against the float32 reference (``format.dequantize`` then a float64
product), each bit-exact with its uint8 kernel where every offset is zero, under CUDA-graph replay, and where the
dispatch takes them; the dequantize kernel (csrc/dequantize_kernel.cuh) bit for bit against ``format.dequantize``.
The other paths (larger M, float32 x, the prologues beyond the GEMV, a rotated layer, the gradient: the dequantize
kernel and a matmul; grouped_mm and a rotated layer's dequantize: the reference, with a warning) against the same
reference. No kernel that reads uint8 codes may be handed records.

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


@pytest.mark.parametrize("m", [1, 16], ids=lambda m: f"M{m}")
def test_offsets_gemv_records_off_16_byte_boundaries(m):
    """Records 2 to 14 bytes past a 16-byte boundary (the C entry takes 2-byte aligned ones, and run_path passes
    the view as it is) give the aligned result bit for bit."""
    n, k, bits = 1000, 4096, 4
    (planes, records, rs, cb), _, wq = packed_records(n, k, bits)
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    aligned = backend().run_path("gemv", x, planes, records, rs, cb, k)
    assert rel_err(aligned, x.double() @ wq.double().T) < MM_REL_TOL[torch.bfloat16]
    for shift in range(2, 16, 2):
        flat = torch.cat([torch.zeros(shift // 2, dtype=records.dtype, device=DEVICE), records.flatten()])
        shifted = flat[shift // 2:].view(records.shape)
        assert shifted.data_ptr() % 16 == shift
        assert torch.equal(backend().run_path("gemv", x, planes, shifted, rs, cb, k), aligned), shift


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


# ---------------------------------------------------------------------------- the block-records GEMV with a prologue

PROLOGUES = ("silu_mul", "rmsnorm", "add_rmsnorm")
PROLOGUE_MS = (1, 5, 8, 16)
# (N, K): partial row tiles, K tiles and blocks, the norm's scalar pass (K % 256 != 0: 4100 x 2000); its vectorized
# pass (1024 x 4096); split-K (40 x 8200); fewer rows and columns than a tile, rows not 16-byte aligned (5 x 33).
PROLOGUE_SHAPES = [(4100, 2000), (1024, 4096), (40, 8200), (5, 33)]
EPS = 1e-5


def prologue_inputs(m: int, k: int, dtype: torch.dtype, seed: int):
    """``(a, b, norm_weight)``: a and b the strided halves of one ``[m, 2k]`` tensor (as a fused gate/up output is),
    the norm weight in [0.5, 1.5)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    wide = torch.randn(m, 2 * k, device=DEVICE, generator=g).to(dtype)
    w = (torch.rand(k, device=DEVICE, generator=g) + 0.5).to(dtype)
    return wide[:, :k], wide[:, k:], w


def run_prologue(kind: str, a, b, w, packed, k: int):
    """``(out, sum)`` of the op with prologue ``kind`` (sum: add_rmsnorm's a + b, else None)."""
    if kind == "silu_mul":
        return torch.ops.kbit.mm_silu_mul(a, b, *packed, k), None
    if kind == "rmsnorm":
        return torch.ops.kbit.mm_rmsnorm(a, w, EPS, *packed, k), None
    return torch.ops.kbit.mm_add_rmsnorm(a, b, w, EPS, *packed, k)


def prologue_reference(kind: str, a, b, w) -> torch.Tensor:
    """The reference prologue (hf_kbit._ops: its roundings in x's dtype), the x the product multiplies."""
    if kind == "silu_mul":
        return _ops.silu_mul(a, b)
    return _ops.rms_norm(a if kind == "rmsnorm" else a + b, w, EPS)


def check_prologue(kind, a, b, w, out, total, wq, dtype) -> None:
    """``out`` (and add_rmsnorm's ``total``) against the reference prologue times the reference weight."""
    assert out.dtype == dtype and out.shape == (a.shape[0], wq.shape[0])
    assert rel_err(out, prologue_reference(kind, a, b, w).double() @ wq.double().T) < MM_REL_TOL[dtype], kind
    if kind == "add_rmsnorm":
        assert torch.equal(total, a + b)


@pytest.mark.parametrize("m", PROLOGUE_MS, ids=lambda m: f"M{m}")
@pytest.mark.parametrize("shape", PROLOGUE_SHAPES, ids=lambda s: f"N{s[0]}K{s[1]}")
@pytest.mark.parametrize("kind", PROLOGUES)
@pytest.mark.parametrize("bits,dtype", table_cases("gemv"))
def test_prologue_gemv_on_records_matches_reference(bits, dtype, kind, shape, m, spy):
    """The prologue ops on records take the block-records GEMV with the prologue folded into its x staging
    (kbit_gemv_prologue_offsets), within MM_REL_TOL of the reference prologue times format.dequantize's weight."""
    n, k = shape
    packed, _, wq = packed_records(n, k, bits)
    a, b, w = prologue_inputs(m, k, dtype, n + k + m)
    out, total = run_prologue(kind, a, b, w, packed, k)
    check_prologue(kind, a, b, w, out, total, wq, dtype)
    assert "kbit_gemv_prologue_offsets" in spy.calls, "the block-records GEMV with a prologue did not serve"
    assert_no_code_reader(spy)


@pytest.mark.parametrize("kind", PROLOGUES)
@pytest.mark.parametrize("bits,dtype", [pytest.param(4, torch.bfloat16, id="k4-bf16"),
                                        pytest.param(5, torch.float16, id="k5-fp16"),
                                        pytest.param(2, torch.bfloat16, id="k2-bf16")])
@pytest.mark.parametrize("case", PLAN_CASES, ids=lambda c: "N{}K{}M{}".format(*c))
def test_prologue_gemv_on_records_every_plan_mode(case, bits, dtype, kind, spy):
    """Every GEMV plan mode (balanced, cluster and workspace split-K, balanced cluster) with a prologue on records:
    the kPrologue x kOffsets instantiations of every (abs table, balanced cluster) combination the host launches."""
    n, k, m = case
    packed, _, wq = packed_records(n, k, bits)
    a, b, w = prologue_inputs(m, k, dtype, n + k + m)
    out, total = run_prologue(kind, a, b, w, packed, k)
    check_prologue(kind, a, b, w, out, total, wq, dtype)
    assert "kbit_gemv_prologue_offsets" in spy.calls
    assert_no_code_reader(spy)


@pytest.mark.parametrize("m", PROLOGUE_MS, ids=lambda m: f"M{m}")
@pytest.mark.parametrize("shape", PROLOGUE_SHAPES, ids=lambda s: f"N{s[0]}K{s[1]}")
@pytest.mark.parametrize("kind", PROLOGUES)
@pytest.mark.parametrize("bits,dtype", table_cases("gemv"))
def test_zero_offsets_prologue_equal_the_uint8_prologue_gemv(bits, dtype, kind, shape, m, spy):
    """Records whose offsets are all zero: bit for bit the uint8 GEMV's output with the same prologue (the same plan
    and staging; the packed fma with a +0 offset rounds as the packed multiply)."""
    n, k = shape
    packed, codes, _ = packed_records(n, k, bits, zero=True)
    planes, _, rs, cb = packed
    a, b, w = prologue_inputs(m, k, dtype, n + k + m)
    out, total = run_prologue(kind, a, b, w, packed, k)
    out_codes, total_codes = run_prologue(kind, a, b, w, (planes, codes, rs, cb), k)
    assert "kbit_gemv_prologue_offsets" in spy.calls and "kbit_gemv_prologue" in spy.calls, "not both fused"
    assert torch.equal(out, out_codes)
    if kind == "add_rmsnorm":
        assert torch.equal(total, total_codes)


@pytest.mark.parametrize("m", [17, 64, 300], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("shape", [(1000, 2048), (4100, 2000)], ids=lambda s: f"N{s[0]}K{s[1]}")
@pytest.mark.parametrize("kind", PROLOGUES)
def test_prologue_ops_on_records_beyond_the_gemv_run_unfused(kind, shape, m, spy):
    """Beyond the block-records GEMV's M the prologue ops run unfused: the reference's prologue, then kbit::mm on
    records, which takes records_plan's path (the block-records wgmma GEMM where the planner takes the wgmma GEMM,
    else dequantize + matmul)."""
    (n, k), bits, dtype = shape, 4, torch.bfloat16
    packed, _, wq = packed_records(n, k, bits)
    a, b, w = prologue_inputs(m, k, dtype, n + k + m)
    out, total = run_prologue(kind, a, b, w, packed, k)
    check_prologue(kind, a, b, w, out, total, wq, dtype)
    assert "kbit_gemv_prologue_offsets" not in spy.calls
    path = backend().records_plan(m, n, k, bits, torch.cuda.current_device(), dtype)[0]
    assert path in ("gemm", "dequant") and PATH_ENTRIES[path] in spy.calls
    assert_no_code_reader(spy)


@pytest.mark.parametrize("kind", PROLOGUES)
@pytest.mark.parametrize("bits,m,dtype", [(4, 1, torch.bfloat16), (3, 5, torch.float16), (5, 8, torch.bfloat16),
                                          (2, 16, torch.float16)], ids=lambda v: str(v).replace("torch.", ""))
def test_prologue_gemv_on_records_cuda_graph_replay(bits, m, dtype, kind, spy):
    """A captured prologue op on records replays on new inputs like an eager call (split-K and cluster plans
    included), in both activation dtypes."""
    for n, k in ((4100, 2000), (40, 8200)):
        packed, _, wq = packed_records(n, k, bits)
        a, b, w = prologue_inputs(m, k, dtype, n + k + m)
        graph, (out, total) = capture_cuda_graph(lambda: run_prologue(kind, a, b, w, packed, k))
        for _ in range(2):
            a.copy_(torch.randn(m, k, device=DEVICE))
            b.copy_(torch.randn(m, k, device=DEVICE))
            graph.replay()
            torch.cuda.synchronize()
            eager, eager_total = run_prologue(kind, a, b, w, packed, k)
            assert torch.equal(out, eager)
            if kind == "add_rmsnorm":
                assert torch.equal(total, eager_total)
            check_prologue(kind, a, b, w, out, total, wq, dtype)
    assert "kbit_gemv_prologue_offsets" in spy.calls
    assert_no_code_reader(spy)


# ---------------------------------------------------------------------------- the GLU epilogue

# (N, K) of fused gate/up weights (N = 2 I, I % 16 == 0): Llama-3-8B's (28672 x 4096); pairs of row tiles not a
# multiple of the CTAs and a partial last K tile and block (2016 x 2000); one pair, one CTA (32 x 515); Qwen2.5-0.5B's
# (9728 x 896).
GLU_SHAPES = [(28672, 4096), (2016, 2000), (32, 515), (9728, 896)]
GLU_KINDS = ("rmsnorm", "add_rmsnorm")


def glu_inputs(m: int, k: int, dtype: torch.dtype, seed: int):
    """prologue_inputs with the norm weight in [0.05, 0.15): products of about 40 at most, so that silu(gate) * up
    stays within float16 (as a real model's activations do; there the unfused ops would overflow too)."""
    a, b, w = prologue_inputs(m, k, dtype, seed)
    return a, b, w / 10


def run_glu(kind: str, a, b, w, packed, k: int, glu: bool):
    if kind == "rmsnorm":
        return torch.ops.kbit.mm_rmsnorm(a, w, EPS, *packed, k, glu=glu), None
    return torch.ops.kbit.mm_add_rmsnorm(a, b, w, EPS, *packed, k, glu=glu)


@pytest.mark.parametrize("m", PROLOGUE_MS, ids=lambda m: f"M{m}")
@pytest.mark.parametrize("shape", GLU_SHAPES, ids=lambda s: f"N{s[0]}K{s[1]}")
@pytest.mark.parametrize("kind", GLU_KINDS)
@pytest.mark.parametrize("bits,dtype", table_cases("gemv"))
def test_glu_epilogue_matches_reference(bits, dtype, kind, shape, m, spy):
    """glu=True on records: silu(gate) * up of the fused gate/up product from the GEMV's GLU epilogue where
    glu_serves says so (its own plan), else from the product after the prologue GEMV, against silu_mul_halves of
    the plain prologue GEMV (itself held to the float64 reference above): they differ where the two plans' float32
    sums round to neighbouring values. At M = 1 every shape here is served on an sm_90 GPU (the pair table's
    absolute mode)."""
    n, k = shape
    packed, _, _ = packed_records(n, k, bits)
    a, b, w = glu_inputs(m, k, dtype, n + k + m)
    out, total = run_glu(kind, a, b, w, packed, k, glu=True)
    plain, _ = run_glu(kind, a, b, w, packed, k, glu=False)
    assert out.dtype == dtype and out.shape == (m, n // 2)
    assert rel_err(out, _ops.silu_mul_halves(plain)) < MM_REL_TOL[dtype]
    if kind == "add_rmsnorm":
        assert torch.equal(total, a + b)
    served = backend().glu_serves(m, n, k, bits, torch.cuda.current_device(), dtype)
    if m == 1 and torch.cuda.get_device_capability()[0] >= 9:
        assert served, "the GLU epilogue does not serve the decode's gate/up projection"
    assert "kbit_gemv_prologue_offsets" in spy.calls
    assert_no_code_reader(spy)


@pytest.mark.parametrize("m", [1, 3, 8], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("kind", GLU_KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_glu_epilogue_rounds_as_the_unfused_ops(dtype, kind, m):
    """With one nonzero weight per row (a scaled identity: every output a single product, the same bits in any
    plan and summation order) the GLU epilogue equals silu_mul_halves of the plain prologue GEMV bit for bit: the
    product rounded to the dtype, the SiLU in float32 rounded, times up rounded. Gate row i reads x_i and up row i
    x_{i + I}, so a wrong pairing of row tiles cannot pass."""
    k, inter, bits = 4096, 2048, 4
    eye = torch.eye(k) * torch.linspace(0.5, 2.0, k)[:, None]
    cb = fmt.make_codebook(None, bits).to(DEVICE)
    planes, codes, rs = torch.ops.kbit.quantize(eye.to(DEVICE), cb)
    records = fmt.pack_records(codes, torch.zeros_like(codes, dtype=torch.int64))
    packed = (planes, records, rs, cb)
    nonzero = (fmt.dequantize(*packed, k, torch.float32) != 0).sum(1)
    assert torch.equal(nonzero.cpu(), torch.ones(k, dtype=nonzero.dtype)), "not one nonzero per row"
    a, b, w = glu_inputs(m, k, dtype, m)
    assert backend().glu_serves(m, k, k, bits, torch.cuda.current_device(), dtype)
    out, _ = run_glu(kind, a, b, w, packed, k, glu=True)
    plain, _ = run_glu(kind, a, b, w, packed, k, glu=False)
    assert out.shape == (m, inter)
    assert torch.equal(out, _ops.silu_mul_halves(plain))


def test_glu_epilogue_cuda_graph_replay(spy):
    """A captured glu=True op replays on new inputs like an eager call."""
    (n, k), m, dtype = GLU_SHAPES[0], 1, torch.bfloat16
    packed, _, _ = packed_records(n, k, 4)
    a, b, w = glu_inputs(m, k, dtype, n + k + m)
    graph, (out, total) = capture_cuda_graph(lambda: run_glu("add_rmsnorm", a, b, w, packed, k, glu=True))
    for _ in range(2):
        a.copy_(torch.randn(m, k, device=DEVICE))
        graph.replay()
        torch.cuda.synchronize()
        eager, eager_total = run_glu("add_rmsnorm", a, b, w, packed, k, glu=True)
        assert torch.equal(out, eager) and torch.equal(total, eager_total)
        plain, _ = run_glu("add_rmsnorm", a, b, w, packed, k, glu=False)
        assert rel_err(out, _ops.silu_mul_halves(plain)) < MM_REL_TOL[dtype]


def test_glu_entry_refuses_what_it_does_not_serve():
    """The GLU flag on the prologue entries: uint8 codes, an out_features not a multiple of 32, and kbit_gemv_glu_serves
    for those and for M beyond the block-records GEMV."""
    cuda = backend()
    lib = _lib.load()
    ptr = ctypes.c_void_p(256)

    def call(entry, n=64):
        return getattr(lib, entry)(0, None, 2 | 16, ptr, 128, ptr, 128, ptr, 1e-5, None, 2, ptr, ptr, ptr, ptr, 4, 1,
                                   n, 128, ptr, None, 0, *(() if entry.endswith("offsets") else (None,)))

    with pytest.raises(ValueError, match="GLU epilogue takes unrotated block records .*, got uint8 codes, n=64"):
        _lib.check(call("kbit_gemv_prologue"), "mm_rmsnorm")
    with pytest.raises(ValueError, match="out_features a multiple of 32, got n=48"):
        _lib.check(call("kbit_gemv_prologue_offsets", n=48), "mm_rmsnorm")
    dev = torch.cuda.current_device()
    assert not cuda.glu_serves(1, 48, 128, 4, dev, torch.bfloat16)
    assert not cuda.glu_serves(17, 64, 128, 4, dev, torch.bfloat16)
    assert not cuda.glu_serves(1, 64, 128, 4, dev, torch.float32)


def test_prologue_offsets_entry_refuses_what_it_does_not_serve():
    """kbit_gemv_prologue_offsets refuses m beyond the block-records GEMV, float32 x, misaligned records and an
    unknown prologue, naming them, before a launch."""
    backend()  # declares the entries' argument types
    lib = _lib.load()
    ptr = ctypes.c_void_p(256)

    def call(prologue=1, dtype=2, records=ptr, m=1):
        return lib.kbit_gemv_prologue_offsets(0, None, prologue, ptr, 128, ptr, 128, None, 0.0, None, dtype, ptr,
                                              records, ptr, ptr, 4, m, 16, 128, ptr, None, 0)

    for kwargs, pattern in (({"m": 17}, "1..16"), ({"dtype": 0}, "kernel=gemv, bits=4, dtype=float32"),
                            ({"records": ctypes.c_void_p(257)}, "block_records must be 2-byte aligned"),
                            ({"prologue": 0}, "prologue must be 1")):
        with pytest.raises(ValueError, match=pattern):
            _lib.check(call(**kwargs), "mm_silu_mul")  # each call's error before the next one's


# ---------------------------------------------------------------------------- the block-records dequantize


def bits_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns (signed zeros and every ulp count), for bit-exact comparisons."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


@functools.lru_cache(maxsize=None)
def edited_records(n: int, k: int, bits: int, offsets: str, experts: int = 0):
    """packed_records' tensors with chosen offset codes: "random" (all of [-OFFSET_MAX, OFFSET_MAX], a quarter
    zero), "min" / "max" (every block -OFFSET_MAX / OFFSET_MAX) or "zero"; and about a tenth of the blocks' E4M4
    codes set to 0 (the elements are the offset alone, the codebook value times a zero scale) and as many to 255
    (the largest scale)."""
    (planes, records, rs, cb), codes, _ = packed_records(n, k, bits, experts=experts)
    g = torch.Generator().manual_seed(17 * n + k + bits)
    codes = codes.cpu().long()
    pick = torch.rand(codes.shape, generator=g)
    codes[pick < 0.1] = 0
    codes[pick > 0.9] = 255
    offsets_of = {"min": -fmt.OFFSET_MAX, "max": fmt.OFFSET_MAX, "zero": 0}
    o = random_offsets(codes.shape, g) if offsets == "random" else torch.full_like(codes, offsets_of[offsets])
    return planes, fmt.pack_records(codes, o).to(DEVICE), rs, cb


# (N, K): odd rows and columns (rows of odd K alternate 16-byte alignment, so stores take the element-wise path
# on every other row), K a multiple of 32 but not of 128 (a partial last K tile of whole blocks), a multiple of 8
# but not of 32 (a partial block), one tile, fewer rows and columns than a tile, and many K tiles per row.
DEQUANT_SHAPES = [(257, 515), (33, 4000), (100, 200), (16, 128), (5, 33), (40, 8200)]
OFFSET_KINDS = ("random", "min", "max", "zero")


@pytest.mark.parametrize("offsets", OFFSET_KINDS)
@pytest.mark.parametrize("shape", DEQUANT_SHAPES, ids=lambda s: f"N{s[0]}K{s[1]}")
@pytest.mark.parametrize("bits,dtype", table_cases("dequantize"))
def test_dequantize_records_bit_exact(bits, dtype, shape, offsets, spy):
    """The dequantize kernel on records is format.dequantize bit for bit (signed zeros included): the codebook
    value times the block scale, plus the offset times the row scale, each rounded in float32, then once to
    dtype."""
    n, k = shape
    packed = edited_records(n, k, bits, offsets)
    got = torch.ops.kbit.dequantize(*packed, k, dtype)
    ref = fmt.dequantize(*(t.cpu() for t in packed), k, dtype)
    assert got.dtype == dtype and got.shape == (n, k)
    assert torch.equal(bits_of(got.cpu()), bits_of(ref))
    assert "kbit_dequantize_records" in spy.calls, "the block-records dequantize did not serve"
    assert_no_code_reader(spy)


@pytest.mark.parametrize("per_expert_codebook", [False, True], ids=["shared-codebook", "per-expert-codebooks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dequantize_records_experts(dtype, per_expert_codebook, spy):
    """A stack of expert weights with records (a leading batch dim), with one codebook or one per expert."""
    e, n, k, bits = 3, 300, 700, 3
    planes, records, rs, cb = edited_records(n, k, bits, "random", experts=e)
    if per_expert_codebook:
        cb = torch.stack([fmt.make_codebook(name, bits) for name in ("nf", "nf-sym", "nf")]).to(DEVICE)
    got = torch.ops.kbit.dequantize(planes, records, rs, cb, k, dtype)
    ref = fmt.dequantize(planes.cpu(), records.cpu(), rs.cpu(), cb.cpu(), k, dtype)
    assert got.shape == (e, n, k)
    assert torch.equal(bits_of(got.cpu()), bits_of(ref))
    assert "kbit_dequantize_records" in spy.calls
    assert_no_code_reader(spy)


def test_dequantize_records_refuses_misaligned_records():
    """The C entry refuses int16 records at an odd address, naming them, before a launch."""
    backend()  # declares the entries' argument types
    lib = _lib.load()
    ptr = ctypes.c_void_p(256)
    with pytest.raises(ValueError, match="block_records must be 2-byte aligned"):
        _lib.check(lib.kbit_dequantize_records(0, None, ptr, ctypes.c_void_p(257), ptr, ptr, 0, 4, 1, 16, 128, ptr, 2),
                   "dequantize")


def test_dequantize_of_a_rotated_layer_with_records_warns_once():
    """dequantize with sign words on records (no kernel unrotates records; KbitConfig refuses the pair) takes the
    reference, W' R^T, and says so once."""
    be = backend()
    n, k, seed = 300, 512, 7
    packed, _, wq = packed_records(n, k, 4)
    signs = rotation.sign_words(k, seed, DEVICE)
    be._warn_records_fallback.cache_clear()
    with pytest.warns(UserWarning, match="block records"):
        w = torch.ops.kbit.dequantize(*packed, k, torch.float32, signs)
    torch.testing.assert_close(w, rotation.unrotate(wq, rotation.DEFAULT_BLOCK, seed), atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------------------- the block-records wgmma GEMM

# The M the planner gives the wgmma GEMM on large weights (crossovers.json: 16 < M <= 512), with both sides of each
# token-block size (NB = 1, 2, 4: 64, 128, 256 tokens) and partial blocks.
GEMM_MS = (17, 32, 64, 65, 128, 255, 256, 512)
# (N, K): odd sizes with partial row blocks (128 rows), K tiles and blocks (4100 x 2000, 257 x 515), split-K plans
# (40 x 8200: few CTAs), K not a multiple of 8 (300 x 33: x's element-wise loads in the x rewrite).
GEMM_SHAPES = [(4100, 2000), (257, 515), (40, 8200), (300, 33)]
# A weight of >= 16 M elements (crossovers.json's largest class: the wgmma GEMM up to M = 512), odd N and K.
LARGE = (4100, 4100)
PATH_ENTRIES = {"gemv": "kbit_gemv_offsets", "gemm": "kbit_gemm_offsets", "dequant": "kbit_dequantize_records"}


def require_wgmma_gemm() -> None:
    """Skips unless this GPU's GEMM is the wgmma GEMM (the one GEMM that reads records)."""
    be = backend()
    if not be.gemm_offsets_serves(64, 4096, 4096, 4, torch.cuda.current_device(), torch.bfloat16):
        pytest.skip("the block-records GEMM is the wgmma GEMM: needs an sm_90 GPU, the library's sm_90a code and the "
                    f"wgmma GEMM planned (this GPU plans the {be.gemm_kernel(torch.cuda.current_device())} GEMM)")


@pytest.mark.parametrize("m", GEMM_MS, ids=lambda m: f"M{m}")
@pytest.mark.parametrize("shape", GEMM_SHAPES, ids=lambda s: f"N{s[0]}K{s[1]}")
@pytest.mark.parametrize("bits,dtype", table_cases("wgmma_gemm"))
def test_offsets_gemm_matches_reference(bits, dtype, shape, m, spy):
    """The wgmma GEMM on records (forced: run_path "gemm", whatever the crossovers) against the float32 reference,
    with MM_REL_TOL (as tests/gpu/test_cuda_kernels.py holds the uint8 GEMM)."""
    require_wgmma_gemm()
    n, k = shape
    packed, _, wq = packed_records(n, k, bits)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    out = backend().run_path("gemm", x, *packed, k)
    assert out.dtype == dtype and out.shape == (m, n)
    assert rel_err(out, x.double() @ wq.double().T) < MM_REL_TOL[dtype]
    assert "kbit_gemm_offsets" in spy.calls, "the block-records GEMM did not serve"
    assert_no_code_reader(spy)


@pytest.mark.parametrize("m", GEMM_MS + (513,), ids=lambda m: f"M{m}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_mm_on_records_takes_the_wgmma_gemm_where_the_planner_does(dtype, m, spy):
    """kbit::mm on records beyond the GEMV: the block-records GEMM wherever the planner takes the wgmma GEMM for
    uint8 codes (a 16.8 M-element weight: M <= 512 with the shipped crossovers), else dequantize + matmul."""
    require_wgmma_gemm()
    be = backend()
    (n, k), bits = LARGE, 4
    packed, _, wq = packed_records(n, k, bits)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    out = torch.ops.kbit.mm(x, *packed, k)
    planned, gemm, _ = be.mm_plan(m, n, k, bits, torch.cuda.current_device(), dtype)
    path = be.records_plan(m, n, k, bits, torch.cuda.current_device(), dtype)[0]
    assert path == ("gemm" if planned == "gemm" and gemm == "wgmma" else "dequant"), (planned, gemm, path)
    assert PATH_ENTRIES[path] in spy.calls
    assert rel_err(out, x.double() @ wq.double().T) < MM_REL_TOL[dtype]
    assert_no_code_reader(spy)


@pytest.mark.parametrize("m", [17, 64, 200, 512], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("bits,dtype", table_cases("wgmma_gemm"))
def test_zero_offsets_equal_the_uint8_wgmma_gemm(bits, dtype, m):
    """Records whose offsets are all zero: bit for bit the uint8 wgmma GEMM's output (the same plan; the packed fma
    with a +0 offset rounds as the packed multiply, and a zero's sign cannot reach the float32 accumulators, which
    start at +0)."""
    require_wgmma_gemm()
    n, k = 4100, 2000
    packed, codes, _ = packed_records(n, k, bits, zero=True)
    planes, _, rs, cb = packed
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    be = backend()
    assert torch.equal(be.run_path("gemm", x, *packed, k), be.run_path("gemm", x, planes, codes, rs, cb, k))


@pytest.mark.parametrize("bits,m", [(3, 64), (4, 17), (5, 256), (2, 512)], ids=lambda v: str(v))
def test_offsets_gemm_cuda_graph_replay(bits, m):
    """A captured block-records GEMM replays on new x like an eager call (a split-K plan included)."""
    require_wgmma_gemm()
    be = backend()
    for n, k in ((4100, 2000), (40, 8200)):
        packed, _, wq = packed_records(n, k, bits)
        x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
        graph, out = capture_cuda_graph(lambda: be.run_path("gemm", x, *packed, k))
        for _ in range(2):
            x.copy_(torch.randn(m, k, device=DEVICE))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, be.run_path("gemm", x, *packed, k))
            assert rel_err(out, x.double() @ wq.double().T) < MM_REL_TOL[torch.bfloat16]


def test_offsets_gemm_entries_refuse_what_they_do_not_serve():
    """kbit_gemm_offsets refuses float32 x and misaligned records, naming them, before a launch;
    kbit_gemm_offsets_serves says no to float32 and to another planned GEMM kernel."""
    be = backend()  # declares the entries' argument types
    lib = _lib.load()
    ptr, dev = ctypes.c_void_p(256), torch.cuda.current_device()
    with pytest.raises(ValueError, match="kernel=wgmma_gemm, bits=4, dtype=float32"):
        _lib.check(lib.kbit_gemm_offsets(dev, None, ptr, 0, ptr, ptr, ptr, ptr, 4, 64, 16, 128, ptr, None, 0), "mm")
    with pytest.raises(ValueError, match="block_records 2-byte aligned"):
        _lib.check(lib.kbit_gemm_offsets(dev, None, ptr, 2, ptr, ctypes.c_void_p(257), ptr, ptr, 4, 64, 16, 128, ptr,
                                         None, 0), "mm")
    assert lib.kbit_gemm_offsets_serves(dev, 64, 4096, 4096, 4, 0) == 0
    try:
        be.set_gemm_kernel("mma")
        assert not be.gemm_offsets_serves(64, 4096, 4096, 4, dev, torch.bfloat16)
        with pytest.raises(ValueError, match="only the wgmma GEMM"):
            _lib.check(lib.kbit_gemm_offsets(dev, None, ptr, 2, ptr, ptr, ptr, ptr, 4, 64, 4096, 4096, ptr, None, 0),
                       "mm")
    finally:
        be.set_gemm_kernel(None)


@pytest.mark.parametrize("kernel", ["mma", "wgmma_ws"])
def test_records_under_another_gemm_kernel_dequantize(kernel, spy):
    """With another GEMM kernel planned (set_gemm_kernel), records beyond the GEMV dequantize + matmul, and a forced
    "gemm" path refuses them."""
    be = backend()
    (n, k), bits = LARGE, 4
    packed, _, wq = packed_records(n, k, bits)
    x = torch.randn(64, k, device=DEVICE, dtype=torch.bfloat16)
    try:
        be.set_gemm_kernel(kernel)
        out = torch.ops.kbit.mm(x, *packed, k)
        with pytest.raises(ValueError, match="block records"):
            be.run_path("gemm", x, *packed, k)
    finally:
        be.set_gemm_kernel(None)
    assert "kbit_dequantize_records" in spy.calls and "kbit_gemm_offsets" not in spy.calls
    assert rel_err(out, x.double() @ wq.double().T) < MM_REL_TOL[torch.bfloat16]
    assert_no_code_reader(spy)


# ---------------------------------------------------------------------------- beyond the GEMV and the GEMM


@pytest.mark.parametrize("m", [17, 300], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("bits,dtype", table_cases("gemv"))
def test_mm_beyond_the_gemv(bits, dtype, m, spy):
    """A 8.2 M-element weight: the wgmma GEMM on records at M = 17 on an sm_90a GPU (the planner's GEMM up to
    M = 128 there), dequantize + matmul at M = 300 (and at M = 17 on other GPUs)."""
    n, k = 4100, 2000
    packed, _, wq = packed_records(n, k, bits)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    out = torch.ops.kbit.mm(x, *packed, k)
    assert out.dtype == dtype and out.shape == (m, n)
    assert rel_err(out, x.double() @ wq.double().T) < MM_REL_TOL[dtype]
    path = backend().records_plan(m, n, k, bits, torch.cuda.current_device(), dtype)[0]
    assert path in ("gemm", "dequant") and PATH_ENTRIES[path] in spy.calls
    assert_no_code_reader(spy)


@pytest.mark.parametrize("m", [1, 16, 300], ids=lambda m: f"M{m}")
def test_mm_float32_dequantizes_with_the_kernel(m, spy):
    n, k = 257, 515
    packed, _, wq = packed_records(n, k, 3)
    x = torch.randn(m, k, device=DEVICE)
    out = torch.ops.kbit.mm(x, *packed, k)
    assert out.dtype == torch.float32
    assert rel_err(out, x.double() @ wq.double().T) < MM_REL_TOL[torch.float32]
    assert "kbit_dequantize_records" in spy.calls
    assert_no_code_reader(spy)


def test_forced_paths_refuse_records_where_no_kernel_serves():
    """run_path never hands records to a kernel that does not read them (benchmarks force paths): the GEMV beyond
    its M, and any GEMV or GEMM on a rotated layer."""
    n, k = 257, 512
    packed, _, _ = packed_records(n, k, 4)
    signs = rotation.sign_words(k, 5, DEVICE)
    x = torch.randn(64, k, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="block records"):
        backend().run_path("gemv", x, *packed, k)
    for path, rows in (("gemv", 4), ("gemm", 64)):
        with pytest.raises(ValueError, match="block records"):
            backend().run_path(path, x[:rows], *packed, k, None, signs)


@pytest.mark.parametrize("m", [1, 8, 300], ids=lambda m: f"M{m}")
def test_rotated_layer_with_records(m, spy):
    """A rotated layer with records (KbitConfig refuses the pair; the ops still serve it): the stored weight W'
    (the dequantize kernel) times x R (the standalone rotation kernel), at every M, and dequantize returns W' R^T
    (the reference: no kernel unrotates records)."""
    n, k, dtype, seed = 1000, 2048, torch.bfloat16, 12345
    packed, _, wq = packed_records(n, k, 3)
    signs = rotation.sign_words(k, seed, DEVICE)
    x = torch.randn(m, k, device=DEVICE, dtype=dtype)
    out = torch.ops.kbit.mm(x, *packed, k, signs)
    xr = rotation.rotate(x, rotation.DEFAULT_BLOCK, seed).to(dtype)
    assert rel_err(out, xr.double() @ wq.double().T) < MM_REL_TOL[dtype]
    w = torch.ops.kbit.dequantize(*packed, k, torch.float32, signs)
    torch.testing.assert_close(w, rotation.unrotate(wq, rotation.DEFAULT_BLOCK, seed), atol=1e-6, rtol=1e-6)
    assert "kbit_dequantize_records" in spy.calls
    assert_no_code_reader(spy)


# ---------------------------------------------------------------------------- the fallbacks


@pytest.mark.parametrize("s", [5, 100], ids=lambda s: f"S{s}")
def test_grouped_mm_falls_back(s, spy):
    """No grouped kernel reads records: the reference, with a warning (once per process)."""
    e, n, k, dtype = 3, 300, 700, torch.bfloat16
    packed, _, wq = packed_records(n, k, 4, experts=e)
    x = torch.randn(s, k, device=DEVICE, dtype=dtype)
    ids = torch.randint(0, e, (s,), device=DEVICE)
    backend()._warn_records_fallback.cache_clear()
    with pytest.warns(UserWarning, match="grouped_mm on a layer with block records"):
        out = torch.ops.kbit.grouped_mm(x, ids, *packed, k)
    ref = torch.einsum("sk,snk->sn", x.double(), wq.double()[ids])
    assert rel_err(out, ref) < MM_REL_TOL[dtype]
    assert_no_code_reader(spy)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_grad_x_dequantizes_with_the_kernel(dtype, spy):
    """dX = dY W: the dequantize kernel's weight in dY's dtype and one matmul (float32 dY takes the reference, as
    it does with uint8 codes)."""
    n, k = 1000, 2000
    packed, _, wq = packed_records(n, k, 5)
    grad = torch.randn(40, n, device=DEVICE, dtype=dtype)
    out = torch.ops.kbit.mm_grad_x(grad, *packed, k)
    assert out.dtype == dtype and out.shape == (40, k)
    assert rel_err(out, grad.double() @ wq.double()) < MM_REL_TOL[dtype]
    assert ("kbit_dequantize_records" in spy.calls) == (dtype != torch.float32)
    assert_no_code_reader(spy)

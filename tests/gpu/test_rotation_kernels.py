"""GPU tests of the kernels' side of rotation (issue 34 item 3, hf_kbit/rotation.py) against the PyTorch
reference: the standalone rotation kernel both ways, dequantize with the sign words, and every path of
kbit::mm (the GEMV both ways of rotating), its prologues, grouped_mm and the gradients on a rotated layer.

A rotated layer stores the quantized ``rotate(W)`` (``W R``, ``R = diag(s) B``, ``B`` = H8 / sqrt(8) on
8-element segments of K, K a multiple of 64); the kernels multiply ``x R`` rounded once to x's dtype, so the reference
of a matmul is ``rotate(x).to(dtype) @ W'^T`` with ``W'`` the rotated weight as stored, and that of
dequantize is ``unrotate(W')``.

Run on the GPU machine: ``python3 -m pytest -m gpu tests/gpu -q``.
"""

from __future__ import annotations

import ctypes
import functools

import pytest
import torch

from hf_kbit import _lib, rotation
from hf_kbit import format as fmt
from hf_kbit.eval.timing import capture_cuda_graph
from kernel_cases import table_cases

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not _lib.available(), reason="needs the compiled kbit CUDA library (libhf_kbit_cuda.so)"),
]

DEVICE = "cuda"
BLOCK = rotation.DEFAULT_BLOCK  # the kernels' Hadamard segment (8)
SEED = 12345  # not the default seed: the kernels know only the sign words
# ||out - ref|| / ||ref|| of a matmul against a float64 product of the rounded x R with the
# reference weight: the output's rounding and the weight's in the activation dtype (as
# tests/gpu/test_cuda_kernels.py's MM_REL_TOL; x R itself is rounded exactly as the reference's).
MM_REL_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def backend():
    from hf_kbit.backends import cuda

    return cuda


def sign_words(k: int, seed: int = SEED, device=DEVICE) -> torch.Tensor:
    """The kernels' sign words of ``rotation.signs(k, seed)``: int32 [k / 32], bit e % 32 of word e // 32
    set where s_e = -1 (built here independently of the backend's ``sign_words``)."""
    negative = (rotation.signs(k, seed) < 0).nonzero().flatten()
    words = torch.zeros(k // 32, dtype=torch.int64)
    words.index_add_(0, negative // 32, torch.ones_like(negative) << (negative % 32))
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).to(device)


def rotate_ref(x: torch.Tensor, seed: int = SEED) -> torch.Tensor:
    """``x R`` rounded once to x's dtype: the activation every rotated matmul multiplies."""
    return rotation.rotate(x, BLOCK, seed).to(x.dtype)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "non-finite output"
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


@functools.lru_cache(maxsize=None)
def rotated_packed(n: int, k: int, bits: int, seed: int = SEED, experts: int = 0):
    """A rotated layer on the GPU: ``((planes, block_scales, row_scales, codebook), W', signs)`` with
    ``W'`` the float32 dequantization of the stored (rotated) weight; ``experts`` > 0 stacks that many
    weights on a leading dim (one shared codebook). Quantized by the GPU kernel (bit-exact with the
    reference: test_cuda_kernels.py), the rotation by the reference."""
    g = torch.Generator().manual_seed(seed + 1000 * bits + n + 7 * k + 31 * experts)
    shape = (experts, n, k) if experts else (n, k)
    w = torch.randn(*shape, generator=g) * torch.rand(*shape[:-1], 1, generator=g).add(0.1)
    cb = fmt.make_codebook(None, bits).to(DEVICE)
    planes, scales, rs = torch.ops.kbit.quantize(rotation.rotate(w, BLOCK, seed).to(DEVICE), cb)
    wq = torch.ops.kbit.dequantize(planes, scales, rs, cb, k, torch.float32)
    return (planes, scales, rs, cb), wq, sign_words(k, seed)


def test_sign_words_helper_matches_the_library():
    assert torch.equal(sign_words(4096, 7), rotation.sign_words(4096, 7, DEVICE))


# ---------------------------------------------------------------------------- the standalone rotation


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m,k", [(1, 64), (3, 4096), (17, 192), (600, 576), (5, 14336)], ids=lambda v: str(v))
def test_rotate_kernel_bit_exact(dtype, m, k):
    """kbit_rotate: float32 in the reference's order, one rounding: bit-exact with rotate(x).to(dtype)."""
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    got = backend().rotate(x, sign_words(k))
    assert got.dtype == dtype and got.shape == (m, k)
    assert torch.equal(got, rotate_ref(x))


@pytest.mark.parametrize("offset", [0, 1], ids=["aligned-rows", "unaligned-rows"])
def test_rotate_kernel_strided_rows(offset):
    """Rows of a wider buffer (16-byte vector loads) and at an odd element offset (scalar loads)."""
    m, k = 9, 320
    wide = torch.randn(m, k + 64 + offset, device=DEVICE, dtype=torch.bfloat16)
    x = wide[:, offset:offset + k]
    assert not x.is_contiguous()
    assert torch.equal(backend().rotate(x, sign_words(k)), rotate_ref(x.contiguous()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m,k", [(1, 64), (3, 4096), (600, 576), (5, 14336)], ids=lambda v: str(v))
def test_unrotate_kernel_bit_exact(dtype, m, k):
    """kbit_rotate's inverse (y R^T: the transform, then the sign): bit-exact with unrotate(y).to(dtype),
    and the inverse of the rotation up to the two roundings."""
    y = torch.randn(m, k, device=DEVICE).to(dtype)
    got = backend().unrotate(y, sign_words(k))
    assert got.dtype == dtype and torch.equal(got, rotation.unrotate(y, BLOCK, SEED).to(dtype))
    back = backend().rotate(got, sign_words(k))
    assert rel_err(back, y) < MM_REL_TOL[dtype]


def test_rotation_refuses_bad_signs_before_launch():
    be = backend()
    x = torch.randn(2, 100, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="in_features % 64"):
        be.rotate(x, torch.zeros(3, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match=r"signs must be int32 \[in_features // 32\]"):
        be.rotate(torch.randn(2, 128, device=DEVICE), torch.zeros(3, dtype=torch.int32, device=DEVICE))
    # The C ABI checks K itself (rot_signs is never read before the check).
    lib = _lib.load()
    fake = ctypes.c_void_p(16)
    rc = lib.kbit_rotate(0, None, ctypes.c_void_p(16), 100, 2, 1, 100, fake, 0, ctypes.c_void_p(16))
    with pytest.raises(ValueError, match="in_features % 64 == 0"):
        _lib.check(rc, "rotate")
    rc = lib.kbit_rotate(0, None, ctypes.c_void_p(16), 128, 2, 1, 128, fake, 2, ctypes.c_void_p(16))
    with pytest.raises(ValueError, match="inverse must be 0"):
        _lib.check(rc, "rotate")


# ---------------------------------------------------------------------------- dequantize


@pytest.mark.parametrize("shape", [(257, 576), (16, 128), (5, 64), (33, 4160)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("bits,dtype", table_cases("dequantize"))
def test_dequantize_unrotates_bit_exact(bits, dtype, shape):
    """dequantize with the sign words returns W' R^T: the reference's float32 unrotate of the float32
    dequantization, rounded once to dtype, bit for bit (the same float32 operations in the same order).
    4160: a last K tile of one segment."""
    n, k = shape
    (planes, scales, rs, cb), wq, signs = rotated_packed(n, k, bits)
    ref = rotation.unrotate(wq, BLOCK, SEED).to(dtype)
    got = torch.ops.kbit.dequantize(planes, scales, rs, cb, k, dtype, signs)
    assert got.dtype == dtype and got.shape == (n, k)
    assert torch.equal(got, ref)


def test_dequantize_unrotates_experts():
    """A stacked [E, N, K] weight (MoE experts share K and so the rotation)."""
    e, n, k, bits = 3, 40, 320, 4
    (planes, scales, rs, cb), wq, signs = rotated_packed(n, k, bits, experts=e)
    got = torch.ops.kbit.dequantize(planes, scales, rs, cb, k, torch.bfloat16, signs)
    assert torch.equal(got, rotation.unrotate(wq, BLOCK, SEED).to(torch.bfloat16))


def test_dequantize_without_signs_is_unchanged():
    """signs=None: the stored weight as it is (today's kernel), bit-exact with the reference."""
    n, k, bits = 100, 640, 3
    (planes, scales, rs, cb), wq, _ = rotated_packed(n, k, bits)
    got = torch.ops.kbit.dequantize(planes, scales, rs, cb, k, torch.bfloat16, None)
    assert torch.equal(got, wq.to(torch.bfloat16))
    assert torch.equal(got, torch.ops.kbit.dequantize(planes, scales, rs, cb, k, torch.bfloat16))


# ---------------------------------------------------------------------------- mm: every path

ROT_MS = (1, 2, 4, 8, 16, 17, 64, 256, 600)
# (N, K), K % 64 == 0: odd N and partial row tiles, a last K tile of one segment (576, 8256: the
# zero half rotates to zeros), split-K GEMV plans (40 x 8256), many row blocks (4100 x 256).
ROT_SHAPES = [(257, 576), (40, 8256), (1000, 320), (4100, 256)]
ROT_PATHS = ("gemv", "gemm", "dequant")


def check_rotated_path(path, x, weights, wq, signs, k):
    """One kernel path on a rotated layer against the reference, and (GEMV, GEMM) bit for bit against
    the unrotated kernel on the reference's rounded x R: the staging rotates exactly as rotate()."""
    be = backend()
    out = be.run_path(path, x, *weights, k, None, signs)
    xr = rotate_ref(x)
    assert out.shape == (x.shape[0], wq.shape[0]) and out.dtype == x.dtype
    err = rel_err(out, xr.double() @ wq.double().T)
    assert err < MM_REL_TOL[x.dtype], (path, err)
    # Every path multiplies the stored W' by x R exactly as rotate() rounds it: the GEMV and GEMM staging
    # it, the standalone rotation before the GEMV, the GEMM or dequantize + cuBLAS.
    assert torch.equal(out, be.run_path(path, xr, *weights, k)), f"{path}: x R differs from rotate()'s"
    return out


@pytest.fixture(params=["staged", "standalone"])
def gemv_rotation(request):
    """Forces the rotated GEMV's way of rotating through its crossover (kbit_set_gemv_rotate_crossover):
    staged (where the rotated instantiation exists, M <= 8) or the standalone rotation first; the
    shipped crossovers are reloaded after."""
    be = backend()
    lib = _lib.load()
    for bits in (2, 3, 4, 5):
        lib.kbit_set_gemv_rotate_crossover(bits, be.GEMV_MAX_M if request.param == "staged" else 0)
    be.gemv_rotate_plan.cache_clear()
    yield request.param
    be.load_crossovers()


def test_rotated_gemv_plan_from_the_crossover():
    """The shipped crossover (crossovers.json, rotated_gemv): the GEMV stages x R up to its M and runs the
    standalone rotation first above it; a prologue stages wherever the rotated instantiation exists
    (M <= 8) and is refused beyond (unfused)."""
    from hf_kbit.backends import crossovers

    be = backend()
    for bits, max_m in crossovers.read_rotated().items():
        for m in (1, 2, 3, 8, 9, 16):
            want = "staged" if m <= min(max_m, 8) else "standalone"
            assert be.gemv_rotate_plan(m, bits, torch.bfloat16) == want, (bits, m)
            assert be.gemv_rotate_plan(m, bits, torch.float16, True) == ("staged" if m <= 8 else None), (bits, m)


@pytest.mark.parametrize("m", ROT_MS, ids=lambda m: f"M{m}")
@pytest.mark.parametrize("shape", ROT_SHAPES, ids=lambda s: f"N{s[0]}K{s[1]}")
@pytest.mark.parametrize("bits,dtype", table_cases("gemv"))
def test_rotated_mm_each_path(bits, dtype, shape, m):
    be = backend()
    n, k = shape
    weights, wq, signs = rotated_packed(n, k, bits)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    for path in ROT_PATHS:
        if path == "gemv" and m > be.GEMV_MAX_M:
            continue
        if path == "gemm" and be.gemm_workspace(x.device.index, m, n, k, bits, True) < 0:
            continue
        check_rotated_path(path, x, weights, wq, signs, k)
    # The planner's path (op: kbit::mm), through leading dims.
    out = torch.ops.kbit.mm(x.view(1, m, k), *weights, k, signs)
    assert out.shape == (1, m, n)
    assert rel_err(out[0], rotate_ref(x).double() @ wq.double().T) < MM_REL_TOL[dtype]


@pytest.mark.parametrize("m", [17, 64, 65, 256, 600], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("bits,dtype", table_cases("wgmma_gemm"))
def test_rotated_mm_large_weight_planner(bits, dtype, m):
    """A Llama-3-8B-sized weight, where the planner takes the GEMM (wgmma on sm_90: x R written in its
    x rewrite) at mid M and dequantize + cuBLAS beyond; every token block size (64, 128, 256)."""
    be = backend()
    n, k = 4096, 4096
    weights, wq, signs = rotated_packed(n, k, bits)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    path = be.mm_plan(m, n, k, bits, x.device.index, dtype, True)[0]
    out = torch.ops.kbit.mm(x, *weights, k, signs)
    assert rel_err(out, rotate_ref(x).double() @ wq.double().T) < MM_REL_TOL[dtype], path
    if path != "dequant":
        assert torch.equal(out, be.run_path(path, rotate_ref(x), *weights, k)), path


def test_rotated_mm_float32_x_dequantizes():
    """float32 x (no GEMV or GEMM in the table): the unrotated weight and x itself, float32 all through."""
    n, k = 129, 256
    weights, wq, signs = rotated_packed(n, k, 4)
    x = torch.randn(3, k, device=DEVICE)
    out = torch.ops.kbit.mm(x, *weights, k, signs)
    assert out.dtype == torch.float32
    assert rel_err(out, rotate_ref(x).double() @ wq.double().T) < MM_REL_TOL[torch.float32]


# (N, K, M) with K % 64 == 0 near test_cuda_kernels.GEMV_PLAN_CASES (their K rounded to whole
# segments): on an H100 they take every GEMV plan mode (test below), with partial row tiles and
# K tiles (4160, 8256, 16448, 704: a last K tile of one segment).
ROT_GEMV_PLAN_CASES = [(4100, 2048, 3), (6100, 4096, 1), (2048, 5120, 4), (5120, 2048, 16), (14336, 4096, 16),
                       (2048, 5120, 8), (42240, 384, 1), (17408, 5120, 16), (6144, 4096, 16), (1024, 4096, 13),
                       (14336, 4160, 13), (40, 16448, 16), (4096, 14336, 8), (1000, 16448, 16), (2000, 1024, 1),
                       (300, 704, 16), (4096, 4096, 1), (1024, 4096, 1), (4096, 14336, 1), (14336, 4096, 1)]


def gemv_plan(n: int, k: int, m: int) -> dict:
    lib = _lib.load()
    vals = [ctypes.c_int() for _ in range(4)]
    _lib.check(lib.kbit_gemv_plan(torch.cuda.current_device(), m, n, k, *(ctypes.byref(v) for v in vals)), "gemv_plan")
    return dict(zip(("splits", "chunk_kt", "grid", "mode"), (v.value for v in vals)))


def test_rotated_gemv_plan_cases_cover_every_mode():
    """The plan modes (0 one split / workspace split-K, 1 cluster split-K, 2 balanced, 3 balanced
    cluster) of the cases below, on this GPU: all four on sm_90, else at least 0 and 2."""
    modes = {gemv_plan(n, k, m)["mode"] for n, k, m in ROT_GEMV_PLAN_CASES}
    want = {0, 1, 2, 3} if torch.cuda.get_device_capability()[0] >= 9 else {0, 2}
    assert want <= modes, modes


@pytest.mark.parametrize("case", ROT_GEMV_PLAN_CASES, ids=lambda c: f"N{c[0]}K{c[1]}M{c[2]}")
@pytest.mark.parametrize("bits,dtype", table_cases("gemv"))
def test_rotated_gemv_every_plan_mode(bits, dtype, case, gemv_rotation):
    """Both ways of rotating (forced): the staged x R and the standalone rotation into the workspace's
    head (the split-K partials after it), each bit for bit as the unrotated GEMV on rotate()'s x R."""
    n, k, m = case
    weights, wq, signs = rotated_packed(n, k, bits)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    want = "staged" if gemv_rotation == "staged" and m <= 8 else "standalone"
    assert backend().gemv_rotate_plan(m, bits, dtype) == want
    check_rotated_path("gemv", x, weights, wq, signs, k)


def test_rotated_gemv_refusals():
    """The C ABI's rotated limits, named: a prologue beyond the rotated instantiations (only the staging
    sees its output) and rot_signs in the grouped GEMV's grouped mode (x R comes from kbit_rotate)."""
    lib = _lib.load()
    n, k = 64, 256
    (planes, scales, rs, cb), _, signs = rotated_packed(n, k, 4)
    x = torch.randn(16, 2 * k, device=DEVICE, dtype=torch.bfloat16)
    out = torch.empty(16, n, device=DEVICE, dtype=torch.bfloat16)
    ws = torch.empty(1 << 16, device=DEVICE)
    rc = lib.kbit_gemv_prologue(0, None, 1, x.data_ptr(), 2 * k, x[:, k:].data_ptr(), 2 * k, None, 0.0, None, 2,
                                planes.data_ptr(), scales.data_ptr(), rs.data_ptr(), cb.data_ptr(), 4, 16, n, k,
                                out.data_ptr(), ws.data_ptr(), ws.numel(), signs.data_ptr())
    with pytest.raises(ValueError, match="prologue takes m <= 8"):
        _lib.check(rc, "mm_silu_mul")
    e = 2
    (planes, scales, rs, cb), _, signs = rotated_packed(n, k, 4, experts=e)
    ids = torch.zeros(16, dtype=torch.int64, device=DEVICE)
    order, offsets = torch.arange(16, device=DEVICE), torch.tensor([0, 16, 16], device=DEVICE)
    rc = lib.kbit_grouped_gemv(0, None, x.data_ptr(), 2, ids.data_ptr(), order.data_ptr(), offsets.data_ptr(),
                               planes.data_ptr(), scales.data_ptr(), rs.data_ptr(), cb.data_ptr(), 4, 16, e, n, k,
                               out.data_ptr(), signs.data_ptr(), 1)
    with pytest.raises(ValueError, match="rot_signs takes per-row mode"):
        _lib.check(rc, "grouped_mm")


# ---------------------------------------------------------------------------- the GEMV's prologues

EPS = 1e-5
PROLOGUE_CASES = [(257, 576, 1), (40, 8256, 3), (1000, 320, 16), (6144, 4096, 1), (1024, 4096, 13),
                  (14336, 4096, 16), (4100, 2048, 3), (42240, 384, 1), (300, 256, 64)]  # M = 64: not the GEMV


def prologue_input(kind, a, b, w):
    """What the staging multiplies before the rotation, unfused (the references' roundings)."""
    from hf_kbit import _ops

    if kind == "silu_mul":
        return _ops.silu_mul(a, b)
    return _ops.rms_norm(a + b if kind == "add_rmsnorm" else a, w, EPS)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", ["silu_mul", "rmsnorm", "add_rmsnorm"])
@pytest.mark.parametrize("bits", [2, 3, 4, 5], ids=lambda b: f"k{b}")
@pytest.mark.parametrize("case", PROLOGUE_CASES, ids=lambda c: "x".join(map(str, c)))
def test_rotated_prologue_matches_the_unfused_ops(case, bits, kind, dtype):
    """The fused prologue rotates what it would stage (silu(g) * u, w * (a [+ b])); the norm's per-token
    rsqrt still scales the sums (it commutes with R) and add_rmsnorm's sum stays unrotated. M > 8:
    beyond the rotated instantiations, the unfused ops (the op's fallback)."""
    n, k, m = case
    weights, wq, signs = rotated_packed(n, k, bits)
    g = torch.Generator(device=DEVICE).manual_seed(n + k + m)
    wide = torch.randn(m, 2 * k, device=DEVICE, generator=g).to(dtype)  # a fused gate/up output: strided halves
    a, b = wide[:, :k], wide[:, k:]
    w = (torch.rand(k, device=DEVICE, generator=g) + 0.5).to(dtype)
    xin = prologue_input(kind, a, b, w)
    ref = torch.ops.kbit.mm(xin, *weights, k, signs)  # unfused
    if kind == "silu_mul":
        out = torch.ops.kbit.mm_silu_mul(a, b, *weights, k, signs)
    elif kind == "rmsnorm":
        out = torch.ops.kbit.mm_rmsnorm(a, w, EPS, *weights, k, signs)
    else:
        out, total = torch.ops.kbit.mm_add_rmsnorm(a, b, w, EPS, *weights, k, signs)
        torch.testing.assert_close(total, a + b, rtol=0, atol=0)
    assert out.shape == (m, n) and out.dtype == dtype
    assert rel_err(out, ref) < MM_REL_TOL[dtype], kind
    assert rel_err(out, rotate_ref(xin).double() @ wq.double().T) < MM_REL_TOL[dtype], kind


# ---------------------------------------------------------------------------- eager fast path, graphs


@pytest.mark.parametrize("m", [1, 3, 16], ids=lambda m: f"M{m}")
def test_eager_fast_path_reads_rotation_signs(m):
    """KbitLinear.forward's fast path (register_eager_mm) takes module.rotation_signs: the op's result,
    and a new record when the signs are replaced."""
    import hf_kbit

    be = backend()
    n, k = 1000, 4096
    weights, wq, signs = rotated_packed(n, k, 4)
    layer = hf_kbit.KbitLinear.from_linear(torch.nn.Linear(k, n, bias=False, device=DEVICE, dtype=torch.bfloat16),
                                           bits=4)
    for name, t in zip(("planes", "block_scales", "row_scales", "codebook"), weights):
        setattr(layer, name, t)
    layer.rotation_signs = signs
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    with torch.inference_mode():
        out = be.linear_fast(layer, x)
        assert out is not None, "the fast path did not serve"
        assert torch.equal(out, torch.ops.kbit.mm(x, *weights, k, signs))
        layer.rotation_signs = sign_words(k, SEED + 1)
        other = be.linear_fast(layer, x)
        assert torch.equal(other, torch.ops.kbit.mm(x, *weights, k, layer.rotation_signs))
        assert not torch.equal(other, out)
        layer.rotation_signs = None
        assert torch.equal(be.linear_fast(layer, x), torch.ops.kbit.mm(x, *weights, k))


@pytest.mark.parametrize("case", [(40, 8256, 1), (40, 8256, 4), (4096, 4096, 64), (4096, 4096, 300), (40, 8256, 300)],
                         ids=lambda c: "N{}K{}M{}".format(*c))
def test_rotated_mm_cuda_graph_replay(case):
    """A rotated mm captured in a CUDA graph replays on new x like an eager call: GEMV split-K plans at
    small M, the GEMM on the large weight at mid M (sm_90: the wgmma GEMM's x rewrite rotates),
    dequantize + cuBLAS on the small one."""
    n, k, m = case
    weights, _, signs = rotated_packed(n, k, 3)
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    eager = torch.ops.kbit.mm(x, *weights, k, signs)
    graph, captured = capture_cuda_graph(lambda: torch.ops.kbit.mm(x, *weights, k, signs))
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, torch.ops.kbit.mm(x, *weights, k, signs))
    assert not torch.equal(captured, eager)


# ---------------------------------------------------------------------------- grouped_mm (MoE)


def grouped_reference(x, ids, wq):
    """float64 rows of x R times their expert's rotated weight; rows of no expert are zeros."""
    xr = rotate_ref(x).double()
    out = torch.zeros(x.shape[0], wq.shape[1], dtype=torch.float64, device=x.device)
    for e in range(wq.shape[0]):
        rows = (ids == e).nonzero().flatten()
        out[rows] = xr[rows] @ wq[e].double().T
    return out


@pytest.mark.parametrize("s", [1, 7, 64, 65, 300], ids=lambda s: f"S{s}")  # per-row mode up to 64, grouped above
@pytest.mark.parametrize("bits,dtype", table_cases("grouped_gemv"))
def test_rotated_grouped_mm(bits, dtype, s):
    """Per-row and grouped modes stage x R (the experts' shared rotation), bit for bit as the unrotated
    kernel on the reference's x R; a row of no expert (id -1) stays zero."""
    e, n, k = 6, 200, 576
    weights, wq, signs = rotated_packed(n, k, bits, experts=e)
    g = torch.Generator(device=DEVICE).manual_seed(s + bits)
    x = torch.randn(s, k, device=DEVICE, generator=g).to(dtype)
    ids = torch.randint(0, e, (s,), device=DEVICE, generator=g)
    ids[0] = -1
    out = torch.ops.kbit.grouped_mm(x, ids, *weights, k, None, None, signs)
    assert out.shape == (s, n) and out.dtype == dtype
    assert rel_err(out, grouped_reference(x, ids, wq)) < MM_REL_TOL[dtype]
    assert torch.equal(out, torch.ops.kbit.grouped_mm(rotate_ref(x), ids, *weights, k))
    from hf_kbit import _ops

    order, offsets = _ops.expert_offsets(ids, e)  # the routing an experts layer hands over
    assert torch.equal(out, torch.ops.kbit.grouped_mm(x, ids, *weights, k, order, offsets, signs))
    if s % 7 == 0:  # the tokens once for their 7 rows each (an experts layer's x_repeat = top-k)
        tokens = x[::7].contiguous()
        expected = torch.ops.kbit.grouped_mm(tokens.repeat_interleave(7, 0), ids, *weights, k, None, None, signs)
        assert torch.equal(torch.ops.kbit.grouped_mm(tokens, ids, *weights, k, None, None, signs, 7), expected)


@pytest.mark.parametrize("s", [1, 7, 64, 65, 300], ids=lambda s: f"S{s}")
@pytest.mark.parametrize("bits,dtype", table_cases("grouped_gemv"))
def test_rotated_grouped_mm_silu_mul(bits, dtype, s):
    """Rotated experts' down projection of a gated gate_up output: per-row mode stages silu(gate) * up, then
    rotates it; grouped mode runs the unfused ops (x R must exist before the grouping). Both bit for bit as the
    unfused ops."""
    from hf_kbit import _ops

    e, n, k = 6, 200, 576
    weights, _, signs = rotated_packed(n, k, bits, experts=e)
    g = torch.Generator(device=DEVICE).manual_seed(s + bits)
    gate_up = torch.randn(s, 2 * k, device=DEVICE, generator=g).to(dtype)
    ids = torch.randint(0, e, (s,), device=DEVICE, generator=g)
    ids[0] = -1
    expected = torch.ops.kbit.grouped_mm(torch.ops.kbit.silu_glu(gate_up), ids, *weights, k, None, None, signs)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(torch.ops.kbit.grouped_mm_silu_mul(gate, up, ids, *weights, k, None, None, signs), expected)
    order, offsets = _ops.expert_offsets(ids, e)
    assert torch.equal(torch.ops.kbit.grouped_mm_silu_mul(gate, up, ids, *weights, k, order, offsets, signs),
                       expected)


def test_rotated_grouped_mm_reference_fallbacks():
    """float32 x and per-expert codebooks take the reference, on x R (the standalone rotation)."""
    e, n, k, bits = 3, 64, 320, 4
    weights, wq, signs = rotated_packed(n, k, bits, experts=e)
    ids = torch.tensor([0, 2, 1, 2, -1], device=DEVICE)
    x = torch.randn(5, k, device=DEVICE)
    out = torch.ops.kbit.grouped_mm(x, ids, *weights, k, None, None, signs)
    assert out.dtype == torch.float32
    assert rel_err(out, grouped_reference(x, ids, wq)) < MM_REL_TOL[torch.float32]
    planes, scales, rs, cb = weights
    per_expert = cb.expand(e, -1).contiguous()
    xb = x.to(torch.bfloat16)
    out = torch.ops.kbit.grouped_mm(xb, ids, planes, scales, rs, per_expert, k, None, None, signs)
    assert rel_err(out, grouped_reference(xb, ids, wq)) < MM_REL_TOL[torch.bfloat16]


# ---------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_rotated_grad_x_unrotates_the_product(dtype):
    """dX = dY W = (dY W') R^T: the stored weight's product unrotated by the standalone kernel, the
    gradient of x -> (x R) @ W'^T."""
    n, k = 300, 640
    weights, wq, signs = rotated_packed(n, k, 3)
    w = rotation.unrotate(wq, BLOCK, SEED)
    grad = torch.randn(2, 5, n, device=DEVICE).to(dtype)
    out = torch.ops.kbit.mm_grad_x(grad, *weights, k, signs)
    assert out.shape == (2, 5, k) and out.dtype == dtype
    assert rel_err(out, grad.double() @ w.double()) < MM_REL_TOL[dtype]
    # (dY W') R^T: the stored weight's product (the unrotated layer's gradient), unrotated once.
    stored = torch.ops.kbit.mm_grad_x(grad, *weights, k)
    assert torch.equal(out, rotation.unrotate(stored, BLOCK, SEED).to(dtype))
    e = 4
    weights, wq, signs = rotated_packed(n, k, 3, experts=e)
    w = rotation.unrotate(wq, BLOCK, SEED)
    ids = torch.tensor([3, 0, 0, 2, -1, 3], device=DEVICE)
    grad = torch.randn(6, n, device=DEVICE).to(dtype)
    out = torch.ops.kbit.grouped_mm_grad_x(grad, ids, *weights, k, None, None, signs)
    stored = torch.ops.kbit.grouped_mm_grad_x(grad, ids, *weights, k)
    assert torch.equal(out, rotation.unrotate(stored, BLOCK, SEED).to(dtype))
    ref = torch.zeros(6, k, dtype=torch.float64, device=DEVICE)
    for r, i in enumerate(ids.tolist()):
        if i >= 0:
            ref[r] = grad[r].double() @ w[i].double()
    assert rel_err(out, ref) < MM_REL_TOL[dtype]


def test_rotated_mma_gemm_when_forced():
    """HF_KBIT_GEMM_KERNEL=mma keeps the mma.sync GEMM (GPUs before sm_90) on any GPU: x R from the
    standalone rotation into its workspace, then the GEMM, bit for bit as the GEMM on the reference's
    x R. A fresh process: the library reads the variable once."""
    import os
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    script = textwrap.dedent("""
        import torch
        from hf_kbit.backends import cuda as backend
        from test_rotation_kernels import MM_REL_TOL, rel_err, rotate_ref, rotated_packed
        for bits, dtype, (n, k), m in [(2, torch.bfloat16, (257, 576), 33), (3, torch.float16, (40, 8256), 64),
                                       (4, torch.bfloat16, (1000, 320), 130), (5, torch.float16, (4100, 256), 17),
                                       (4, torch.bfloat16, (4096, 4096), 256)]:
            assert backend.mm_plan(m, n, k, bits, 0, dtype, True)[1] == "mma"
            weights, wq, signs = rotated_packed(n, k, bits)
            x = torch.randn(m, k, device="cuda").to(dtype)
            out = backend.run_path("gemm", x, *weights, k, None, signs)
            err = rel_err(out, rotate_ref(x).double() @ wq.double().T)
            assert err < MM_REL_TOL[dtype], (bits, dtype, n, k, m, err)
            assert torch.equal(out, backend.run_path("gemm", rotate_ref(x), *weights, k)), (bits, n, k, m)
            assert backend._mm_cuda(x, *weights, k, signs).shape == (m, n)
        print("ok")
    """)
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, HF_KBIT_GEMM_KERNEL="mma")
    paths = (env.get("PYTHONPATH"), str(root), str(root / "tests"), str(root / "tests" / "gpu"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout + res.stderr

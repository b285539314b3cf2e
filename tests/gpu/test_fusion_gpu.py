"""GPU tests of the GEMV prologues (kbit::mm_silu_mul / mm_rmsnorm / mm_add_rmsnorm on CUDA) against the
unfused ops: the same plans as the plain GEMV (one split, cluster and workspace split-K, balanced)."""

from __future__ import annotations

import pytest
import torch

from hf_kbit import _lib, _ops
from hf_kbit.eval.timing import capture_cuda_graph

from test_cuda_kernels import GEMV_MODES, GEMV_PLAN_CASES, MM_REL_TOL, gemv_plan, packed_reference, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not _lib.available(), reason="needs the compiled kbit CUDA library (libhf_kbit_cuda.so)"),
]
DEVICE = "cuda"
EPS = 1e-5
# The norm's per-token scale multiplies the GEMV's sums instead of x: another rounding of x (one
# bf16 / fp16 rounding less, one more), inside the matmul tolerance.
# Rows of whole warps of 8-element vectors take the vectorized norm pass: all of it loaded before the
# staging (6144x4096 M=1), or the rest looped after it (M=13); the others its scalar loop.
CASES = [(257, 515, 1), (40, 8200, 3), (1000, 333, 16), (6144, 4096, 1), (1024, 4096, 13), *GEMV_PLAN_CASES[:6]]


def reference(kind, a, b, w, weights, k):
    if kind == "silu_mul":
        x = _ops.silu_mul(a, b)
    elif kind == "rmsnorm":
        x = _ops.rms_norm(a, w, EPS)
    else:
        x = _ops.rms_norm(a + b, w, EPS)
    planes, scales, rs, cb = weights
    return torch.ops.kbit.mm(x, planes, scales, rs, cb, k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", ["silu_mul", "rmsnorm", "add_rmsnorm"])
@pytest.mark.parametrize("bits", [2, 4, 5], ids=lambda b: f"k{b}")
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_prologue_matches_the_unfused_ops(case, bits, kind, dtype):
    n, k, m = case
    weights, _ = packed_reference(n, k, bits)
    g = torch.Generator(device=DEVICE).manual_seed(n + k + m)
    wide = torch.randn(m, 2 * k, device=DEVICE, generator=g).to(dtype)  # a fused gate/up output: strided halves
    a, b = wide[:, :k], wide[:, k:]
    w = (torch.rand(k, device=DEVICE, generator=g) + 0.5).to(dtype)
    ref = reference(kind, a, b, w, weights, k)
    if kind == "silu_mul":
        out = torch.ops.kbit.mm_silu_mul(a, b, *weights, k)
    elif kind == "rmsnorm":
        out = torch.ops.kbit.mm_rmsnorm(a, w, EPS, *weights, k)
    else:
        out, total = torch.ops.kbit.mm_add_rmsnorm(a, b, w, EPS, *weights, k)
        torch.testing.assert_close(total, a + b, rtol=0, atol=0)
    assert out.shape == (m, n) and out.dtype == dtype
    assert rel_err(out, ref) < MM_REL_TOL[dtype], kind


# (N, K, M) forced into every plan mode (kbit_set_gemv_plan): Llama-3-8B's down projection and fused q/k/v at M = 1,
# and partial row and K tiles at two token tiles.
FORCED_CASES = [(4096, 14336, 1), (6144, 4096, 1), (1000, 4100, 13)]


@pytest.mark.parametrize("mode", sorted(GEMV_MODES), ids=lambda v: f"mode{v}")
@pytest.mark.parametrize("kind", ["silu_mul", "add_rmsnorm"])
@pytest.mark.parametrize("case", FORCED_CASES, ids=lambda c: "x".join(map(str, c)))
def test_prologue_under_every_plan_mode(case, kind, mode):
    """Each prologue in each plan mode the problem has (kbit_set_gemv_plan), against the unfused ops."""
    from hf_kbit.backends import cuda as backend

    n, k, m = case
    bits, dtype = 4, torch.bfloat16
    weights, _ = packed_reference(n, k, bits)
    g = torch.Generator(device=DEVICE).manual_seed(n + k + m)
    a, b = torch.randn(2, m, k, device=DEVICE, generator=g).to(dtype)
    w = (torch.rand(k, device=DEVICE, generator=g) + 0.5).to(dtype)
    ref = reference(kind, a, b, w, weights, k)
    backend.set_gemv_plan(mode)
    try:
        plan = gemv_plan(n, k, m)
        if plan["splits"] == 0:
            pytest.skip(f"no {GEMV_MODES[mode]} plan for this problem")
        assert plan["mode"] == mode, plan
        if kind == "silu_mul":
            out = torch.ops.kbit.mm_silu_mul(a, b, *weights, k)
        else:
            out, _ = torch.ops.kbit.mm_add_rmsnorm(a, b, w, EPS, *weights, k)
    finally:
        backend.set_gemv_plan(None)
    assert rel_err(out, ref) < MM_REL_TOL[dtype], plan


def test_float32_norm_weight_takes_the_reference():
    # A norm weight kept in float32 makes the normalized x float32: the kernel reads x's dtype, so the
    # reference runs (and its result is the unfused ops' float32 matmul).
    n, k, m = 1024, 4096, 1
    weights, _ = packed_reference(n, k, 4)
    a, b = (torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    w = torch.rand(k, device=DEVICE) + 0.5
    out, total = torch.ops.kbit.mm_add_rmsnorm(a, b, w, EPS, *weights, k)
    ref = reference("add_rmsnorm", a, b, w, weights, k)
    assert out.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(total, a + b, rtol=0, atol=0)


@pytest.mark.parametrize("case", [(6144, 4096, 1), (1024, 4096, 13), (257, 515, 3)], ids=lambda c: "x".join(map(str, c)))
def test_norm_prologue_is_deterministic(case):
    # The norm's sums of squares meet in a fixed order: repeated calls give the same bits.
    n, k, m = case
    weights, _ = packed_reference(n, k, 4)
    a, b = (torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    w = torch.rand(k, device=DEVICE, dtype=torch.bfloat16) + 0.5
    first = torch.ops.kbit.mm_add_rmsnorm(a, b, w, EPS, *weights, k)[0]
    for _ in range(20):
        assert torch.equal(torch.ops.kbit.mm_add_rmsnorm(a, b, w, EPS, *weights, k)[0], first)


def test_prologue_replays_in_a_cuda_graph():
    n, k, m = 4096, 4096, 1
    weights, _ = packed_reference(n, k, 4)
    a, b = (torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    w = torch.ones(k, device=DEVICE, dtype=torch.bfloat16)
    run = lambda: torch.ops.kbit.mm_add_rmsnorm(a, b, w, EPS, *weights, k)  # noqa: E731
    eager = run()
    graph, captured = capture_cuda_graph(run)
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, eager):
        torch.testing.assert_close(got, want, rtol=0, atol=0)

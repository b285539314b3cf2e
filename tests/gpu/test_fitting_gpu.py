"""The "fit" quantizer (hf_kbit.fitting) on CUDA against the same code on the CPU.

Both run the same PyTorch operations; CUDA's reductions round in another order, so a block whose
two best scale codes have errors within rounding of each other may pick the other one, and the
Lloyd-fitted codebook may differ in its last bits. The test bounds both: the codebooks agree to
CODEBOOK_ATOL, at most MAX_DIFFERENT_BLOCKS of the blocks differ, and the weight's reconstruction
error differs by at most ERROR_RTOL.
"""

from __future__ import annotations

import pytest
import torch

from hf_kbit import format as fmt
from hf_kbit.nn.linear import quantize_layer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CODEBOOK_ATOL = 1e-5
MAX_DIFFERENT_BLOCKS = 1e-3  # fraction of blocks whose code or indices differ
ERROR_RTOL = 1e-4


def _weight(n: int, k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g).add(0.5)
    w[torch.rand(n, k, generator=g) < 1e-3] *= 8  # outliers, as real layers have
    return w.to(torch.bfloat16)


@pytest.mark.parametrize("bits", [2, 3, 4, 5], ids=lambda b: f"k{b}")
def test_fit_on_cuda_matches_cpu_up_to_ties(bits):
    w = _weight(1024, 2048)
    cpu = quantize_layer(w, bits)
    gpu = [t.cpu() for t in quantize_layer(w.cuda(), bits)]
    torch.testing.assert_close(gpu[3], cpu[3], rtol=0, atol=CODEBOOK_ATOL)
    assert torch.equal(gpu[2], cpu[2]), "row scales are exact on both"
    planes_differ = (gpu[0] != cpu[0]).any(-3)  # per (tile row, tile block) word
    codes_differ = gpu[1] != cpu[1]
    different = (planes_differ | codes_differ).float().mean().item()
    assert different <= MAX_DIFFERENT_BLOCKS, f"{different:.2e} of the blocks differ"
    errors = [
        float((fmt.dequantize(*q[:3], q[3], w.shape[1]) - w.float()).square().sum()) for q in (cpu, gpu)
    ]
    assert abs(errors[1] - errors[0]) <= ERROR_RTOL * errors[0], errors

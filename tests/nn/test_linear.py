"""KbitLinear: edge shapes (the model-level behaviour is covered end to end in tests/test_quantizer.py)."""

import pytest
import torch
from torch import nn

from hf_kbit import KbitLinear

EMPTY_SHAPES = [(0, 8), (8, 0), (0, 0)]


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")  # nn.Linear's own init
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("in_features, out_features", EMPTY_SHAPES, ids=[f"in{i}-out{o}" for i, o in EMPTY_SHAPES])
def test_zero_sized_linear_works_like_nn_linear(in_features, out_features, bias, dtype):
    """An empty product is zeros (plus the bias), as nn.Linear gives."""
    linear = nn.Linear(in_features, out_features, bias=bias, dtype=dtype)
    if bias:
        nn.init.normal_(linear.bias)
    kbit = KbitLinear.from_linear(linear, bits=4)
    x = torch.randn(2, 3, in_features, dtype=dtype)
    out = kbit(x)
    assert out.shape == (2, 3, out_features) and out.dtype == dtype
    torch.testing.assert_close(out, linear(x), rtol=0, atol=0)
    back = kbit.to_linear(dtype)
    assert back.weight.shape == (out_features, in_features)
    torch.testing.assert_close(back(x), linear(x), rtol=0, atol=0)

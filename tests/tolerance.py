"""Comparison with a tolerance relative to the expected tensor's largest magnitude, shared by the op tests."""

from __future__ import annotations

import torch


def close_rel(actual: torch.Tensor, expected: torch.Tensor, atol: float) -> None:
    """``actual`` (any float dtype) equals ``expected`` (float64) within ``atol`` x ``max |expected|``."""
    scale = expected.abs().max().item() or 1.0
    torch.testing.assert_close(actual.double(), expected, atol=atol * scale, rtol=0)

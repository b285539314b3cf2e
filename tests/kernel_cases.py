"""Test parametrizations read from the kernel table (hf_kbit/kernel_table.py), so a kernel entry
added or removed there is tested, or no longer tested, without editing the tests."""

from __future__ import annotations

import pytest
import torch

from hf_kbit import kernel_table

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def table_cases(kernel: str) -> list:
    """``(bits, torch dtype)`` of every table entry of ``kernel``, as pytest params with ids like ``k4-bf16``."""
    return [pytest.param(b, TORCH_DTYPES[d], id=f"k{b}-{SHORT[d]}") for k, b, d in kernel_table.TABLE if k == kernel]


def bits_cases(kernel: str) -> list:
    """The bit widths of ``kernel``, as pytest params with ids like ``k4``."""
    return [pytest.param(b, id=f"k{b}") for b in kernel_table.bits_of(kernel)]

"""Kernel policy of ``kbit::decode_attention``'s Triton implementation (triton_kernels.py): which
tensors it takes and how it splits the keys. Plain torch, so it is testable without Triton."""

from __future__ import annotations

import math

import torch

# Keys per tensor-core dot and slice granularity of the kernel.
BLOCK_N = 64
# Slice programs per SM the split aims at: about 256 programs on an H100 (two per SM) were fastest
# across batch 1-8 and 2-16 K cached tokens.
PROGRAMS_PER_SM = 2
# Largest query group (query heads per key/value head, padded to a power of two >= 16) the kernel takes.
MAX_GROUP = 64


def kernel_supports(query, key, value, attention_mask, group: int) -> bool:
    """Whether the kernels take these tensors (dtypes, group size, contiguous head dims)."""
    half = (torch.float16, torch.bfloat16)
    return (
        query.dtype in half and key.dtype == query.dtype and value.dtype == query.dtype
        and _padded_group(group) <= MAX_GROUP and query.shape[-1] <= 256 and value.shape[-1] <= 256
        and query.stride(-1) == 1 and key.stride(-1) == 1 and value.stride(-1) == 1
        and (attention_mask is None or attention_mask.dtype == torch.bool or attention_mask.dtype.is_floating_point)
    )


def _padded_group(group: int) -> int:
    return max(16, 1 << (group - 1).bit_length())


def plan_splits(batch: int, kv_heads: int, kv_len: int, sm_count: int) -> int:
    """Key slices per (batch, key/value head): about ``PROGRAMS_PER_SM`` programs per SM, at least one
    block of keys each."""
    blocks = max(1, math.ceil(kv_len / BLOCK_N))
    return min(blocks, max(1, PROGRAMS_PER_SM * sm_count // (batch * kv_heads)))

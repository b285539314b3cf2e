"""Single-token attention for grouped-query models without ``repeat_kv``.

transformers' ``sdpa`` attention hands a compiled decode step's grouped-query attention to
``scaled_dot_product_attention`` after ``repeat_kv`` has copied each key/value head once per query
head it serves: at batch 1 on an H100 that copy is one of the largest non-GEMM kernels of a
Llama-3-8B decode step (docs/kernels.md). Decoding one token, the query heads of a key/value head
share its keys, values and mask row, so they can be served as one (group x head_dim) query block
against the unrepeated cache. This module registers that as an attention implementation::

    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="kbit_decode")
    model.set_attn_implementation("kbit_decode")  # or on a loaded model

Single-token calls (decode) take it; everything else (prefill, dropout, soft-capping, sinks,
position biases, per-head masks) runs transformers' ``sdpa`` unchanged, and masks are built as for
``sdpa``. On CUDA with Triton the decode runs ``kbit::decode_attention``: one program per (batch,
key/value head, slice of the keys) computes its query group's softmax-weighted values with an online
softmax in float32 (tensor-core dots), and a second kernel merges the slices, one program per query
row (deterministic); on sm_90+ both are programmatic dependent launches, as the kbit GEMV is.
Elsewhere it is ``scaled_dot_product_attention`` on the packed query, which is
also the reference the GPU tests hold the kernel to. Nothing here depends on kbit weights: bf16
models take it as well, which is how the benchmarks compare like with like.
"""

from __future__ import annotations

import functools
import importlib.util
import math

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

ATTN_IMPLEMENTATION = "kbit_decode"
# Keys per tensor-core dot and slice granularity of the kernel.
BLOCK_N = 64
# Slice programs per SM the split aims at. Swept on an H100 (Llama-3-8B heads, cold L2, us per call,
# slices: time): 1 x 16384 keys 16: 31.5, 32: 22.1, 64: 27.6; 1 x 4096 16: 11.1, 32: 10.4, 64: 11.3;
# 8 x 8192 2: 106, 4: 68, 8: 84; 8 x 2048 2: 30, 4: 22, 8: 27 -- best at ~256 programs, two per SM.
PROGRAMS_PER_SM = 2
# Largest query group (query heads per key/value head, padded to a power of two >= 16) the kernel takes.
MAX_GROUP = 64
# Attention keywords whose effect the packed path does not reproduce: those calls run ``sdpa``.
_UNSUPPORTED_KWARGS = ("softcap", "s_aux", "sinks", "position_bias")
_HAS_TRITON = importlib.util.find_spec("triton") is not None


def packed_group(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, **kwargs) -> int | None:
    """Query heads per key/value head if this call can run packed, else None (the call takes ``sdpa``)."""
    if query.dim() != 4 or query.shape[2] != 1 or dropout:
        return None
    if kwargs.get("output_attentions") or any(kwargs.get(name) is not None for name in _UNSUPPORTED_KWARGS):
        return None
    b, hq, _, d = query.shape
    if key.shape[0] != b or key.shape[1] == 0 or hq % key.shape[1] or key.shape[-1] != d:
        return None
    if value.shape[:3] != key.shape[:3]:
        return None
    if attention_mask is not None and (
        attention_mask.dim() != 4 or attention_mask.shape[1] != 1 or attention_mask.shape[2] != 1
        or attention_mask.shape[0] not in (1, b) or attention_mask.shape[-1] != key.shape[2]
    ):
        return None  # a per-head or per-row mask, or one cut to another length: sdpa handles it
    return hq // key.shape[1]


def packed_sdpa(query, key, value, attention_mask, scale: float) -> torch.Tensor:
    """The reference: ``scaled_dot_product_attention`` with each key/value head's query heads as its
    query rows. query (b, hq, 1, d), key/value (b, hkv, n, d*), mask None or (b | 1, 1, 1, n) ->
    (b, 1, hq, dv), the layout transformers' attention functions return."""
    b, hq, _, d = query.shape
    hkv = key.shape[1]
    q = query.reshape(b, hkv, hq // hkv, d)
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=attention_mask, scale=scale)
    return out.reshape(b, 1, hq, value.shape[-1])


def decode_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                             scaling: float | None = None, **kwargs):
    """transformers attention function (``attn_implementation="kbit_decode"``): see the module doc."""
    group = packed_group(query, key, value, attention_mask, dropout, **kwargs)
    if group is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if query.is_cuda and _HAS_TRITON and kernel_supports(query, key, value, attention_mask, group):
        return torch.ops.kbit.decode_attention(query, key, value, attention_mask, scale), None
    return packed_sdpa(query, key, value, attention_mask, scale), None


def kernel_supports(query, key, value, attention_mask, group: int) -> bool:
    """Whether ``kbit::decode_attention`` takes these tensors (dtypes, group size, contiguous head dims)."""
    half = (torch.float16, torch.bfloat16)
    return (
        query.dtype in half and key.dtype == query.dtype and value.dtype == query.dtype
        and _padded_group(group) <= MAX_GROUP and query.shape[-1] <= 256 and value.shape[-1] <= 256
        and query.stride(-1) == 1 and key.stride(-1) == 1 and value.stride(-1) == 1
        and (attention_mask is None or attention_mask.dtype == torch.bool or attention_mask.dtype.is_floating_point)
    )


def register() -> None:
    """Register ``"kbit_decode"`` with transformers' attention and attention-mask interfaces (masks as for sdpa)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, decode_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def _padded_group(group: int) -> int:
    return max(16, 1 << (group - 1).bit_length())


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def _pdl_supported(index: int) -> bool:
    """Programmatic dependent launch (griddepcontrol): sm_90 and later."""
    return torch.cuda.get_device_capability(index)[0] >= 9


def plan_splits(batch: int, kv_heads: int, kv_len: int, sm_count: int) -> int:
    """Key slices per (batch, key/value head): about ``PROGRAMS_PER_SM`` programs per SM, at least one
    block of keys each."""
    blocks = max(1, math.ceil(kv_len / BLOCK_N))
    return min(blocks, max(1, PROGRAMS_PER_SM * sm_count // (batch * kv_heads)))


if _HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _pdl_wait(PDL: tl.constexpr):
        # A programmatic dependent launch (sm_90+) starts while the kernel before it finishes: wait for that
        # kernel's grid (its writes included) before reading anything, then let the next kernel launch, so
        # its prologue overlaps this one. Triggering only after the wait keeps the kernels before this one
        # complete by the time the next one starts (inductor's PDL kernels read older buffers before their
        # own wait; the kbit GEMV reads only its weight).
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def _decode_attention_slice_kernel(
        q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr, part_ptr, stats_ptr,
        q_sb, q_sh, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn, m_sb, m_sn,
        kv_heads, kv_len, slice_len, qk_scale,
        GROUP: tl.constexpr, GROUP_P: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr,
        DV: tl.constexpr, DV_P: tl.constexpr, BLOCK: tl.constexpr, MASK: tl.constexpr, ONE_SLICE: tl.constexpr,
        PDL: tl.constexpr,
    ):
        # One (batch, key/value head, key slice): the group's rows of softmax(q k^T * scale + mask) v, as
        # float32 sums with their running max and denominator (log2 domain), or the normalized output
        # when the keys are not sliced. MASK: 0 none, 1 boolean (True attends), 2 additive. PDL: launched
        # as a programmatic dependent (_pdl_wait).
        _pdl_wait(PDL)
        bh = tl.program_id(0)
        s = tl.program_id(1)
        b = bh // kv_heads
        h = bh % kv_heads
        rows = tl.arange(0, GROUP_P)
        dq = tl.arange(0, D_P)
        dv = tl.arange(0, DV_P)
        row_ok = rows < GROUP
        q = tl.load(q_ptr + b * q_sb + (h * GROUP + rows)[:, None] * q_sh + dq[None, :],
                    mask=row_ok[:, None] & (dq[None, :] < D), other=0.0)
        start = s * slice_len
        end = tl.minimum(start + slice_len, kv_len)
        m_i = tl.full([GROUP_P], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_P], tl.float32)
        acc = tl.zeros([GROUP_P, DV_P], tl.float32)
        k_base = k_ptr + b * k_sb + h * k_sh
        v_base = v_ptr + b * v_sb + h * v_sh
        for n0 in range(start, end, BLOCK):
            cols = n0 + tl.arange(0, BLOCK)
            live = cols < end
            if MASK == 1:
                live = live & (tl.load(mask_ptr + b * m_sb + cols * m_sn, mask=live, other=0) != 0)
            k = tl.load(k_base + cols[:, None] * k_sn + dq[None, :], mask=live[:, None] & (dq[None, :] < D),
                        other=0.0)
            scores = (tl.dot(q, tl.trans(k)) * qk_scale).to(tl.float32)  # a compiled call passes the scale as fp64
            if MASK == 2:
                add = tl.load(mask_ptr + b * m_sb + cols * m_sn, mask=live, other=0.0).to(tl.float32)
                scores += add * 1.4426950408889634
            scores = tl.where(live[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            m_base = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing live yet stay at zero
            alpha = tl.exp2(m_i - m_base)
            p = tl.exp2(scores - m_base[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + cols[:, None] * v_sn + dv[None, :], mask=live[:, None] & (dv[None, :] < DV),
                        other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        if ONE_SLICE:
            out = acc / l_i[:, None]
            tl.store(out_ptr + (b * kv_heads * GROUP + h * GROUP + rows)[:, None] * DV + dv[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dv[None, :] < DV))
        else:  # partials at [(batch, key/value head), slice, query row]
            slot = (bh * tl.num_programs(1) + s) * GROUP + rows
            tl.store(part_ptr + slot[:, None] * DV_P + dv[None, :], acc, mask=row_ok[:, None])
            tl.store(stats_ptr + slot * 2, m_i, mask=row_ok)
            tl.store(stats_ptr + slot * 2 + 1, l_i, mask=row_ok)

    @triton.jit
    def _decode_attention_merge_kernel(part_ptr, stats_ptr, out_ptr, slices,
                                       GROUP: tl.constexpr, DV: tl.constexpr, DV_P: tl.constexpr,
                                       SLICES_P: tl.constexpr, PDL: tl.constexpr):
        # One query row (batch, query head), all its slices at once: their sums rescaled to the common max
        # and added. The row's index is also its output row's.
        _pdl_wait(PDL)
        row = tl.program_id(0)
        bh = row // GROUP
        s = tl.arange(0, SLICES_P)
        dv = tl.arange(0, DV_P)
        live = s < slices
        slot = (bh * slices + s) * GROUP + row % GROUP
        m = tl.load(stats_ptr + slot * 2, mask=live, other=float("-inf"))
        w = tl.where(live, tl.exp2(m - tl.max(m, 0)), 0.0)
        l_sum = tl.sum(w * tl.load(stats_ptr + slot * 2 + 1, mask=live, other=0.0), 0)
        acc = tl.load(part_ptr + slot[:, None] * DV_P + dv[None, :], mask=live[:, None], other=0.0)
        out = tl.sum(w[:, None] * acc, 0) / l_sum
        tl.store(out_ptr + row * DV + dv, out.to(out_ptr.dtype.element_ty), mask=dv < DV)

    @torch.library.custom_op("kbit::decode_attention", mutates_args=())
    def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         mask: torch.Tensor | None, scale: float, slices: int = 0) -> torch.Tensor:
        """Single-token grouped-query attention: query (b, hq, 1, d), key (b, hkv, n, d), value
        (b, hkv, n, dv), mask None or (b | 1, 1, 1, n) boolean (True attends) or additive -> (b, 1, hq, dv).
        ``slices``: key slices per (batch, key/value head); 0 picks enough to fill the GPU (``plan_splits``).

        An opaque op that launches its Triton kernels itself, so that on sm_90+ they are programmatic
        dependent launches (inductor launches a ``triton_op``'s kernels without that attribute): each
        kernel's launch and setup overlap the kernel before it, and the next kernel's (the output
        projection's GEMV) overlap it."""
        b, hq, _, d = query.shape
        hkv, n, dv = key.shape[1], key.shape[2], value.shape[-1]
        group = hq // hkv
        if slices <= 0:
            slices = plan_splits(b, hkv, n, _sm_count(query.device.index or 0))
        slice_len = math.ceil(math.ceil(n / slices) / BLOCK_N) * BLOCK_N
        slices = max(1, math.ceil(n / slice_len))
        group_p, dv_p = _padded_group(group), triton.next_power_of_2(dv)
        out = query.new_empty((b, 1, hq, dv))
        if mask is None:
            mask_kind, mask_arg, m_sb, m_sn = 0, query, 0, 0
        else:
            mask_kind = 1 if mask.dtype == torch.bool else 2
            mask_arg, m_sb, m_sn = mask, (mask.stride(0) if mask.shape[0] > 1 else 0), mask.stride(3)
        if slices == 1:
            part = stats = out  # not read: the one slice writes the output
        else:
            part = query.new_empty((b * hkv * slices * group, dv_p), dtype=torch.float32)
            stats = query.new_empty((b * hkv * slices * group, 2), dtype=torch.float32)
        pdl = _pdl_supported(query.device.index or 0)
        with torch.cuda.device(query.device):  # Triton launches on the current device's current stream
            _decode_attention_slice_kernel[(b * hkv, slices)](
                query, key, value, mask_arg, out, part, stats,
                query.stride(0), query.stride(1), key.stride(0), key.stride(1), key.stride(2),
                value.stride(0), value.stride(1), value.stride(2), m_sb, m_sn,
                hkv, n, slice_len, scale * 1.4426950408889634,
                GROUP=group, GROUP_P=group_p, D=d, D_P=triton.next_power_of_2(d), DV=dv, DV_P=dv_p,
                BLOCK=BLOCK_N, MASK=mask_kind, ONE_SLICE=slices == 1, PDL=pdl, num_warps=4, launch_pdl=pdl,
            )
            if slices > 1:
                _decode_attention_merge_kernel[(b * hq,)](
                    part, stats, out, slices, GROUP=group, DV=dv, DV_P=dv_p,
                    SLICES_P=triton.next_power_of_2(slices), PDL=pdl, num_warps=4, launch_pdl=pdl,
                )
        return out

    @decode_attention.register_fake
    def _(query, key, value, mask, scale, slices=0):
        return query.new_empty((query.shape[0], 1, query.shape[1], value.shape[-1]))

"""The ``kbit`` torch.library ops: one schema and fake (meta) impl each, implemented per backend.

The default implementation (``CompositeExplicitAutograd``, any device) is the pure-PyTorch
reference (:mod:`hf_kbit.format` for the weight ops); it is what the tests trust.

Rotation (format v3): every op that reads a packed weight takes ``signs`` last (``Tensor? signs=None``):
the layer's sign words (int32 ``[in_features / 32]``, :func:`hf_kbit.rotation.sign_words`) when its packed
weight holds ``W R`` rather than ``W``. The ops then still compute in the original basis: the mm-like ops
rotate their staged activation (after the prologue, for the prologue ops) in float32 and round it once to
its dtype, then multiply by the packed weight; ``dequantize`` and the ``grad_x`` ops turn their result
back (``@ R^T``, float32, one rounding). ``signs=None`` is the unrotated format, unchanged. A backend
registers a faster kernel for its dispatch key (``hf_kbit/backends/``: ``cuda.py``, the
compiled library, ``triton_kernels.py``, decode attention, and ``triton_moe.py``, the MoE layer's ops, for
``CUDA``), which then takes precedence on tensors of that device. Ops never know about transformers.
"""

from __future__ import annotations

import torch

from . import format as fmt
from . import rotation

_lib = torch.library.Library("kbit", "DEF")

_lib.define("quantize(Tensor weight, Tensor codebook) -> (Tensor planes, Tensor block_scales, Tensor row_scales)")
_lib.define(
    "dequantize(Tensor planes, Tensor block_scales, Tensor row_scales, Tensor codebook, SymInt in_features, "
    "ScalarType dtype, Tensor? signs=None) -> Tensor"
)
_lib.define(
    "mm(Tensor x, Tensor planes, Tensor block_scales, Tensor row_scales, Tensor codebook, SymInt in_features, "
    "Tensor? signs=None) -> Tensor"
)
_lib.define(
    "grouped_mm(Tensor x, Tensor expert_ids, Tensor planes, Tensor block_scales, Tensor row_scales, "
    "Tensor codebook, SymInt in_features, Tensor? order=None, Tensor? offsets=None, Tensor? signs=None, "
    "int x_repeat=1) -> Tensor"
)

_lib.define(
    "grouped_mm_silu_mul(Tensor gate, Tensor up, Tensor expert_ids, Tensor planes, Tensor block_scales, "
    "Tensor row_scales, Tensor codebook, SymInt in_features, Tensor? order=None, Tensor? offsets=None, "
    "Tensor? signs=None) -> Tensor"
)

# By device type: rows (token, expert pairs) above which an experts layer groups its rows by
# expert once (expert_offsets) and hands the routing to both of its grouped_mm calls. A backend
# whose grouped_mm serves few rows each on its own (no sort) registers its threshold with its
# implementation (register_group_rows_above); elsewhere the layer always groups, as the reference
# sorts anyway.
GROUP_ROWS_ABOVE: dict[str, int] = {}

# An eager shortcut past the dispatcher for a module's kbit::mm, registered by a backend
# (register_eager_mm): ``(module, x) -> out``, or None where the op must serve. The module only
# keys the shortcut's per-layer cache.
eager_mm = None


def register_group_rows_above(device_type: str, rows: int) -> None:
    GROUP_ROWS_ABOVE[device_type] = rows


def register_eager_mm(fn) -> None:
    global eager_mm
    eager_mm = fn


def _bits(planes: torch.Tensor) -> int:
    return planes.shape[-3]


def _check_packed(planes, block_scales, row_scales, codebook, in_features) -> None:
    """Shape/dtype agreement of the four packed tensors; raises before any compute or launch."""
    torch._check(planes.dtype == torch.int32, lambda: f"planes must be int32, got {planes.dtype}")
    torch._check(
        block_scales.dtype in (torch.uint8, fmt.RECORD_DTYPE),
        lambda: f"block_scales must be uint8 (E4M4 codes) or int16 (block records), got {block_scales.dtype}",
    )
    torch._check(row_scales.dtype == torch.float32, lambda: f"row_scales must be float32, got {row_scales.dtype}")
    torch._check(codebook.dtype == torch.float32, lambda: f"codebook must be float32, got {codebook.dtype}")
    bits = _bits(planes)
    torch._check(bits in fmt.SUPPORTED_BITS, lambda: f"planes.shape[-3] (bits) must be in {fmt.SUPPORTED_BITS}")
    n = row_scales.shape[-1]
    expected = fmt.packed_shapes(n, in_features, bits)
    lead = tuple(row_scales.shape[:-1])
    for name, t in (("planes", planes), ("block_scales", block_scales)):
        torch._check(
            tuple(t.shape) == lead + expected[name],
            lambda: f"{name} has shape {tuple(t.shape)}, expected {lead + expected[name]} for "
            f"out_features={n}, in_features={in_features}, bits={bits}",
        )
    torch._check(
        codebook.shape[-1] == 1 << bits,
        lambda: f"codebook has {codebook.shape[-1]} entries, expected {1 << bits} for bits={bits}",
    )


def _check_signs(signs, in_features, planes) -> None:
    """A rotated layer's sign words: int32 ``[in_features / 32]`` on the packed weight's device, in_features a
    multiple of :data:`hf_kbit.format.ROTATION_MULTIPLE`."""
    if signs is None:
        return
    torch._check(signs.dtype == torch.int32, lambda: f"signs must be int32 sign words, got {signs.dtype}")
    torch._check(
        in_features % fmt.ROTATION_MULTIPLE == 0,
        lambda: f"signs: a rotated layer needs in_features a multiple of {fmt.ROTATION_MULTIPLE}, got {in_features}",
    )
    torch._check(
        tuple(signs.shape) == fmt.rotation_signs_shape(in_features),
        lambda: f"signs must be [{in_features // rotation.WORD_BITS}] (in_features / 32) for in_features="
        f"{in_features}, got shape {tuple(signs.shape)}",
    )
    torch._check(
        signs.device == planes.device,
        lambda: f"signs must be on the packed weight's device {planes.device}, got {signs.device}",
    )


def _rotated(x: torch.Tensor, signs) -> torch.Tensor:
    """The activation ``x`` in the packed weight's basis: ``x R`` (float32 math, one rounding to x's dtype)."""
    return x if signs is None else rotation.rotate_words(x, signs)


def _unrotated(y: torch.Tensor, signs, dtype: torch.dtype) -> torch.Tensor:
    """``y`` (a float result in the packed weight's basis) back in the original basis, in ``dtype``: ``y R^T``."""
    return (y if signs is None else rotation.unrotate_words(y, signs)).to(dtype)


# ---------------------------------------------------------------------------- quantize


@torch.library.impl(_lib, "quantize", "CompositeExplicitAutograd")
def _quantize_ref(weight: torch.Tensor, codebook: torch.Tensor):
    return fmt.quantize(weight, codebook)


@torch.library.register_fake("kbit::quantize")
def _quantize_fake(weight, codebook):
    bits = int(codebook.shape[-1]).bit_length() - 1
    *lead, n, k = weight.shape
    shapes = fmt.packed_shapes(n, k, bits)
    return (
        weight.new_empty((*lead, *shapes["planes"]), dtype=torch.int32),
        weight.new_empty((*lead, *shapes["block_scales"]), dtype=torch.uint8),
        weight.new_empty((*lead, n), dtype=torch.float32),
    )


# ---------------------------------------------------------------------------- dequantize


@torch.library.impl(_lib, "dequantize", "CompositeExplicitAutograd")
def _dequantize_ref(planes, block_scales, row_scales, codebook, in_features, dtype, signs=None):
    """The weight ``[..., N, K]`` in ``dtype``, in the original basis (a rotated one unrotated in float32)."""
    _check_packed(planes, block_scales, row_scales, codebook, in_features)
    _check_signs(signs, in_features, planes)
    if signs is None:
        return fmt.dequantize(planes, block_scales, row_scales, codebook, in_features, dtype)
    w = fmt.dequantize(planes, block_scales, row_scales, codebook, in_features, torch.float32)
    return _unrotated(w, signs, dtype)


@torch.library.register_fake("kbit::dequantize")
def _dequantize_fake(planes, block_scales, row_scales, codebook, in_features, dtype, signs=None):
    _check_packed(planes, block_scales, row_scales, codebook, in_features)
    _check_signs(signs, in_features, planes)
    return planes.new_empty((*row_scales.shape, in_features), dtype=dtype)


# ---------------------------------------------------------------------------- mm


def _check_mm_input(x: torch.Tensor, in_features) -> None:
    torch._check(
        x.dtype in (torch.bfloat16, torch.float16, torch.float32),
        lambda: f"x must be bfloat16, float16 or float32, got {x.dtype}",
    )
    torch._check(
        x.shape[-1] == in_features,
        lambda: f"x has {x.shape[-1]} features in its last dim, the layer expects in_features={in_features}",
    )


@torch.library.impl(_lib, "mm", "CompositeExplicitAutograd")
def _mm_ref(x, planes, block_scales, row_scales, codebook, in_features, signs=None):
    """``x [..., K] @ W.T -> [..., N]`` in x's dtype, accumulating in float32 (rotated: ``(x R) @ (W R).T``)."""
    _check_mm_input(x, in_features)
    _check_packed(planes, block_scales, row_scales, codebook, in_features)
    _check_signs(signs, in_features, planes)
    w = fmt.dequantize(planes, block_scales, row_scales, codebook, in_features, torch.float32)
    return (_rotated(x, signs).float() @ w.T).to(x.dtype)


@torch.library.register_fake("kbit::mm")
def _mm_fake(x, planes, block_scales, row_scales, codebook, in_features, signs=None):
    _check_mm_input(x, in_features)
    _check_packed(planes, block_scales, row_scales, codebook, in_features)
    _check_signs(signs, in_features, planes)
    return x.new_empty((*x.shape[:-1], row_scales.shape[-1]))


# ---------------------------------------------------------------------------- mm with its input's last op

# What inductor would otherwise run as a kernel of its own right before a kbit projection (hf_kbit.fusion
# rewrites compiled graphs to these). The references reproduce the roundings of the unfused ops (those of
# transformers' RMSNorm and SiLU-gated MLPs), so a rewrite changes no result beyond float32 summation
# order; a backend may fold the prologue into its kernel's x staging. ``glu=True`` (the norm ops) adds what
# follows a gated MLP's fused gate/up projection: the weight's first half of rows is the gate projection, its
# second half the up projection, and the op returns ``silu_mul(gate, up)`` ([..., out_features / 2]).
_lib.define(
    "mm_rmsnorm(Tensor x, Tensor norm_weight, float eps, Tensor planes, Tensor block_scales, Tensor row_scales, "
    "Tensor codebook, SymInt in_features, Tensor? signs=None, bool glu=False) -> Tensor"
)
_lib.define(
    "mm_add_rmsnorm(Tensor x, Tensor residual, Tensor norm_weight, float eps, Tensor planes, Tensor block_scales, "
    "Tensor row_scales, Tensor codebook, SymInt in_features, Tensor? signs=None, bool glu=False) -> (Tensor, Tensor)"
)
_lib.define(
    "mm_silu_mul(Tensor gate, Tensor up, Tensor planes, Tensor block_scales, Tensor row_scales, Tensor codebook, "
    "SymInt in_features, Tensor? signs=None) -> Tensor"
)


def rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalized in float32, rounded to h's dtype, then times ``weight``."""
    f = h.float()
    return weight * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``act(gate) * up`` of a SiLU-gated MLP: SiLU in float32, rounded to gate's dtype, times ``up``."""
    return torch.nn.functional.silu(gate.float()).to(gate.dtype) * up


def silu_mul_halves(y: torch.Tensor) -> torch.Tensor:
    """``silu_mul(gate, up)`` of a fused gate/up output ``y = [gate, up]`` (halves of its last dim)."""
    gate, up = y.chunk(2, dim=-1)
    return silu_mul(gate, up)


def _check_glu(row_scales: torch.Tensor) -> None:
    torch._check(
        row_scales.shape[-1] % 2 == 0,
        lambda: f"glu=True takes a fused gate/up weight of an even out_features, got {row_scales.shape[-1]}",
    )


def _check_prologue(name: str, x: torch.Tensor, other: torch.Tensor) -> None:
    torch._check(
        other.shape == x.shape and other.dtype == x.dtype,
        lambda: f"{name} must match x ({x.dtype} {tuple(x.shape)}), got {other.dtype} {tuple(other.shape)}",
    )


def _check_norm_weight(norm_weight: torch.Tensor, in_features) -> None:
    torch._check(
        norm_weight.dim() == 1 and norm_weight.shape[0] == in_features,
        lambda: f"norm_weight must be [{in_features}], got {tuple(norm_weight.shape)}",
    )


def _glu_fake(out: torch.Tensor, glu: bool) -> torch.Tensor:
    return out.new_empty((*out.shape[:-1], out.shape[-1] // 2)) if glu else out


@torch.library.impl(_lib, "mm_rmsnorm", "CompositeExplicitAutograd")
def _mm_rmsnorm_ref(x, norm_weight, eps, planes, block_scales, row_scales, codebook, in_features, signs=None,
                    glu=False):
    """``rms_norm(x, norm_weight, eps) @ W.T`` (``glu``: then :func:`silu_mul_halves`)."""
    _check_norm_weight(norm_weight, in_features)
    if glu:
        _check_glu(row_scales)
    h = rms_norm(x, norm_weight, eps)
    out = torch.ops.kbit.mm(h, planes, block_scales, row_scales, codebook, in_features, signs)
    return silu_mul_halves(out) if glu else out


@torch.library.register_fake("kbit::mm_rmsnorm")
def _mm_rmsnorm_fake(x, norm_weight, eps, planes, block_scales, row_scales, codebook, in_features, signs=None,
                     glu=False):
    _check_norm_weight(norm_weight, in_features)
    if glu:
        _check_glu(row_scales)
    return _glu_fake(_mm_fake(x, planes, block_scales, row_scales, codebook, in_features, signs), glu)


@torch.library.impl(_lib, "mm_add_rmsnorm", "CompositeExplicitAutograd")
def _mm_add_rmsnorm_ref(x, residual, norm_weight, eps, planes, block_scales, row_scales, codebook, in_features,
                        signs=None, glu=False):
    """``(rms_norm(x + residual, norm_weight, eps) @ W.T, x + residual)``: the sum goes on as the residual
    (``glu``: the product then goes through :func:`silu_mul_halves`)."""
    _check_prologue("residual", x, residual)
    _check_norm_weight(norm_weight, in_features)
    if glu:
        _check_glu(row_scales)
    total = x + residual
    h = rms_norm(total, norm_weight, eps)
    out = torch.ops.kbit.mm(h, planes, block_scales, row_scales, codebook, in_features, signs)
    return (silu_mul_halves(out) if glu else out), total


@torch.library.register_fake("kbit::mm_add_rmsnorm")
def _mm_add_rmsnorm_fake(x, residual, norm_weight, eps, planes, block_scales, row_scales, codebook, in_features,
                         signs=None, glu=False):
    _check_prologue("residual", x, residual)
    _check_norm_weight(norm_weight, in_features)
    if glu:
        _check_glu(row_scales)
    out = _mm_fake(x, planes, block_scales, row_scales, codebook, in_features, signs)
    return _glu_fake(out, glu), torch.empty_like(x)


@torch.library.impl(_lib, "mm_silu_mul", "CompositeExplicitAutograd")
def _mm_silu_mul_ref(gate, up, planes, block_scales, row_scales, codebook, in_features, signs=None):
    """``silu_mul(gate, up) @ W.T``."""
    _check_prologue("up", gate, up)
    return torch.ops.kbit.mm(silu_mul(gate, up), planes, block_scales, row_scales, codebook, in_features, signs)


@torch.library.register_fake("kbit::mm_silu_mul")
def _mm_silu_mul_fake(gate, up, planes, block_scales, row_scales, codebook, in_features, signs=None):
    _check_prologue("up", gate, up)
    return _mm_fake(gate, planes, block_scales, row_scales, codebook, in_features, signs)


# ---------------------------------------------------------------------------- decode_attention

_lib.define(
    "decode_attention(Tensor query, Tensor key, Tensor value, Tensor? mask, float scale, int slices=0) -> Tensor"
)


def packed_sdpa(query, key, value, mask, scale: float) -> torch.Tensor:
    """``scaled_dot_product_attention`` with each key/value head's query heads as its query rows.
    query (b, hq, 1, d), key/value (b, hkv, n, d*), mask None or (b | 1, 1, 1, n) -> (b, 1, hq, dv), the
    layout transformers' attention functions return."""
    b, hq, _, d = query.shape
    hkv = key.shape[1]
    q = query.reshape(b, hkv, hq // hkv, d)
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scale)
    return out.reshape(b, 1, hq, value.shape[-1])


@torch.library.impl(_lib, "decode_attention", "CompositeExplicitAutograd")
def _decode_attention_ref(query, key, value, mask, scale, slices=0):
    """Single-token grouped-query attention without ``repeat_kv`` (hf_kbit.attention): query (b, hq, 1, d),
    key (b, hkv, n, d), value (b, hkv, n, dv), mask None or (b | 1, 1, 1, n) boolean (True attends) or
    additive -> (b, 1, hq, dv). ``slices``: key slices per (batch, key/value head) for a kernel that
    splits the keys (0: its choice); the result does not depend on it."""
    return packed_sdpa(query, key, value, mask, scale)


@torch.library.register_fake("kbit::decode_attention")
def _decode_attention_fake(query, key, value, mask, scale, slices=0):
    return query.new_empty((query.shape[0], 1, query.shape[1], value.shape[-1]))


# ---------------------------------------------------------------------------- softmax_topk

_lib.define(
    "softmax_topk(Tensor logits, int k, bool renormalize, bool cast=False) -> (Tensor weights, Tensor indices)"
)


def _check_router_logits(name: str, logits, k: int, groups: int = 1) -> None:
    if logits.dim() != 2 or not 1 <= k <= logits.shape[-1] or groups < 1 or logits.shape[-1] % groups:
        raise ValueError(f"{name}: logits must be [T, E] with 1 <= k <= E and E a multiple of groups, got shape "
                         f"{tuple(logits.shape)}, k={k}, groups={groups}")


@torch.library.impl(_lib, "softmax_topk", "CompositeExplicitAutograd")
def _softmax_topk_ref(logits, k, renormalize, cast=False):
    """The routing of softmax-top-k MoE routers (hf_kbit.nn.routing): ``logits [T, E]`` -> ``weights [T, k]``
    (largest first) and int64 ``indices [T, k]``: the float32 softmax over the experts, its ``k`` largest
    probabilities, divided by their sum when ``renormalize``; float32, or rounded once to the logits' dtype when
    ``cast``. Equal probabilities may come in either order (torch.topk's)."""
    _check_router_logits("softmax_topk", logits, k)
    probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
    weights, indices = torch.topk(probs, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights.to(logits.dtype) if cast else weights), indices


@torch.library.register_fake("kbit::softmax_topk")
def _softmax_topk_fake(logits, k, renormalize, cast=False):
    shape = (logits.shape[0], k)
    dtype = logits.dtype if cast else torch.float32
    return logits.new_empty(shape, dtype=dtype), logits.new_empty(shape, dtype=torch.int64)


_lib.define(
    "router_softmax_topk(Tensor x, Tensor weight, int k, bool renormalize, bool cast=False) "
    "-> (Tensor logits, Tensor weights, Tensor indices)"
)


@torch.library.impl(_lib, "router_softmax_topk", "CompositeExplicitAutograd")
def _router_softmax_topk_ref(x, weight, k, renormalize, cast=False):
    """A softmax-top-k router whole: ``logits = x weight^T`` (``x [T, H]``, ``weight [E, H]``, the logits in x's
    dtype, as ``F.linear``), then :func:`_softmax_topk_ref` of those logits -> ``(logits, weights, indices)``."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"router_softmax_topk: x must be [T, H] and weight [E, H], got shapes {tuple(x.shape)} "
                         f"and {tuple(weight.shape)}")
    logits = torch.nn.functional.linear(x, weight)
    return (logits, *_softmax_topk_ref(logits, k, renormalize, cast))


@torch.library.register_fake("kbit::router_softmax_topk")
def _router_softmax_topk_fake(x, weight, k, renormalize, cast=False):
    logits = x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.result_type(x, weight))
    return (logits, *_softmax_topk_fake(logits, k, renormalize, cast))


_lib.define(
    "sigmoid_group_topk(Tensor logits, Tensor bias, int k, int groups, int topk_groups, bool renormalize, "
    "float scale) -> (Tensor weights, Tensor indices)"
)
_lib.define("topk_softmax(Tensor logits, int k) -> (Tensor weights, Tensor indices)")


@torch.library.impl(_lib, "sigmoid_group_topk", "CompositeExplicitAutograd")
def _sigmoid_group_topk_ref(logits, bias, k, groups, topk_groups, renormalize, scale):
    """The routing of DeepSeek-V3's and GLM-4 MoE's routers: ``scores = sigmoid(logits)``; experts are chosen by
    ``scores + bias`` among the ``topk_groups`` groups (of ``E / groups`` consecutive experts) whose two best such
    scores sum highest; ``weights [T, k]`` are their plain scores, divided by their sum (+ 1e-20) when
    ``renormalize``, times ``scale``; int64 ``indices [T, k]``. The order of the k pairs, and which of equal scores
    wins, is the implementation's (torch.topk's unsorted order here)."""
    _check_router_logits("sigmoid_group_topk", logits, k, groups)
    num_tokens, experts = logits.shape
    scores = logits.sigmoid()
    choice = scores + bias
    group_scores = choice.view(num_tokens, groups, experts // groups).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_groups, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, groups, experts // groups).reshape(-1, experts)
    choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    indices = torch.topk(choice, k=k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, indices)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, indices


@torch.library.register_fake("kbit::sigmoid_group_topk")
def _sigmoid_group_topk_fake(logits, bias, k, groups, topk_groups, renormalize, scale):
    shape = (logits.shape[0], k)
    return logits.new_empty(shape), logits.new_empty(shape, dtype=torch.int64)


@torch.library.impl(_lib, "topk_softmax", "CompositeExplicitAutograd")
def _topk_softmax_ref(logits, k):
    """GPT-OSS's routing: the ``k`` largest logits (largest first, int64 ``indices``) and the softmax over those
    k, in the logits' dtype."""
    _check_router_logits("topk_softmax", logits, k)
    values, indices = torch.topk(logits, k, dim=-1)
    return torch.nn.functional.softmax(values, dim=1, dtype=values.dtype), indices


@torch.library.register_fake("kbit::topk_softmax")
def _topk_softmax_fake(logits, k):
    shape = (logits.shape[0], k)
    return logits.new_empty(shape), logits.new_empty(shape, dtype=torch.int64)


# ---------------------------------------------------------------------------- experts layer

# The elementwise work of an experts layer around its two grouped products (hf_kbit.nn.experts), one op each, so
# that a backend can serve each in one launch (eager, the torch ops take two to six).
_lib.define("silu_glu(Tensor gate_up) -> Tensor")
_lib.define("experts_combine(Tensor y, Tensor expert_ids, Tensor weights, int num_experts) -> Tensor")


@torch.library.impl(_lib, "silu_glu", "CompositeExplicitAutograd")
def _silu_glu_ref(gate_up):
    """``silu(gate) * up`` of ``gate_up [S, 2I]`` (gate first, then up: the experts' layout) -> ``[S, I]``, as a
    SiLU ``act_fn`` computes it: the SiLU rounded to the input's dtype, then the product rounded."""
    if gate_up.dim() != 2 or gate_up.shape[-1] % 2:
        raise ValueError(f"silu_glu: gate_up must be [S, 2I], got shape {tuple(gate_up.shape)}")
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@torch.library.register_fake("kbit::silu_glu")
def _silu_glu_fake(gate_up):
    return gate_up.new_empty((gate_up.shape[0], gate_up.shape[-1] // 2))


def _check_combine(y, expert_ids, weights) -> None:
    torch._check(
        y.dim() == 2 and weights.dim() == 2 and expert_ids.dim() == 1
        and expert_ids.shape[0] == y.shape[0] == weights.shape[0] * weights.shape[1],
        lambda: "experts_combine: need y [T*k, N], expert_ids [T*k] and weights [T, k], got "
        f"{tuple(y.shape)}, {tuple(expert_ids.shape)} and {tuple(weights.shape)}",
    )


@torch.library.impl(_lib, "experts_combine", "CompositeExplicitAutograd")
def _experts_combine_ref(y, expert_ids, weights, num_experts):
    """Each token's weighted sum of its k experts' outputs: ``out[t] = sum_j w[t, j] y[t k + j]`` -> ``[T, N]`` in
    y's dtype. Pairs whose id lies outside ``[0, num_experts)`` (expert-parallel sentinels) weigh 0; each weight is
    rounded to y's dtype and the sum accumulates in float32 (a batched matmul)."""
    _check_combine(y, expert_ids, weights)
    num_tokens, top_k = weights.shape
    valid = (expert_ids >= 0) & (expert_ids < num_experts)
    w = torch.where(valid, weights.reshape(-1), 0).to(y.dtype)
    return torch.bmm(w.view(num_tokens, 1, top_k), y.view(num_tokens, top_k, -1)).view(num_tokens, -1)


@torch.library.register_fake("kbit::experts_combine")
def _experts_combine_fake(y, expert_ids, weights, num_experts):
    _check_combine(y, expert_ids, weights)
    return y.new_empty((weights.shape[0], y.shape[1]))


# ---------------------------------------------------------------------------- grouped_mm


_lib.define("expert_offsets(Tensor expert_ids, int num_experts) -> (Tensor order, Tensor offsets)")


def expert_offsets(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing on the device, without a host sync: ``(order, offsets)``.

    ``order [S]`` (int64) lists the rows grouped by expert (stable); the rows of expert ``e``
    are ``order[offsets[e]:offsets[e + 1]]``, ``offsets [E + 1]`` int64. Ids outside
    ``[0, E)`` (expert-parallel sentinels) sort outside ``[offsets[0], offsets[E])`` and
    belong to no expert (their order there is the implementation's). Sizes depend only on ``S`` and ``E``,
    so a CUDA kernel can take both as device tensors inside a CUDA graph or a ``fullgraph`` compile.
    ``torch.ops.kbit.expert_offsets``: one Triton launch on CUDA for up to ``EXPERT_OFFSETS_MAX_ROWS`` rows.
    """
    return torch.ops.kbit.expert_offsets(expert_ids, num_experts)


@torch.library.impl(_lib, "expert_offsets", "CompositeExplicitAutograd")
def _expert_offsets_ref(expert_ids, num_experts):
    """A stable sort of the ids and a search of each expert's first row in it."""
    ids = expert_ids.long()
    sorted_ids, order = torch.sort(ids, stable=True)
    bounds = torch.arange(num_experts + 1, device=ids.device, dtype=torch.int64)
    return order, torch.searchsorted(sorted_ids, bounds)


@torch.library.register_fake("kbit::expert_offsets")
def _expert_offsets_fake(expert_ids, num_experts):
    return (expert_ids.new_empty(expert_ids.shape, dtype=torch.int64),
            expert_ids.new_empty((num_experts + 1,), dtype=torch.int64))


def _check_grouped(x, expert_ids, row_scales, codebook, x_repeat: int = 1) -> None:
    torch._check(x.dim() == 2, lambda: f"x must be [S / x_repeat, K], got shape {tuple(x.shape)}")
    torch._check(
        isinstance(x_repeat, int) and x_repeat >= 1, lambda: f"x_repeat must be an int >= 1, got {x_repeat!r}"
    )
    torch._check(
        expert_ids.dim() == 1 and expert_ids.shape[0] == x.shape[0] * x_repeat,
        lambda: f"expert_ids must be [S] = [{x.shape[0]} rows of x * x_repeat {x_repeat}], got shape "
        f"{tuple(expert_ids.shape)}",
    )
    torch._check(
        expert_ids.dtype in (torch.int32, torch.int64),
        lambda: f"expert_ids must be int32 or int64, got {expert_ids.dtype}",
    )
    torch._check(
        row_scales.dim() == 2,
        lambda: f"grouped_mm needs packed tensors with one leading expert dim, row_scales is {tuple(row_scales.shape)}",
    )
    torch._check(
        codebook.dim() == 1 or tuple(codebook.shape[:-1]) == tuple(row_scales.shape[:1]),
        lambda: f"codebook must be [L] or [E, L] with E={row_scales.shape[0]}, got {tuple(codebook.shape)}",
    )


def _check_routing(expert_ids, order, offsets, num_experts) -> None:
    torch._check(
        (order is None) == (offsets is None), lambda: "give both order and offsets (expert_offsets) or neither"
    )
    if order is None:
        return
    torch._check(
        tuple(order.shape) == tuple(expert_ids.shape) and order.dtype == torch.int64,
        lambda: f"order must be int64 {tuple(expert_ids.shape)}, got {order.dtype} {tuple(order.shape)}",
    )
    torch._check(
        tuple(offsets.shape) == (num_experts + 1,) and offsets.dtype == torch.int64,
        lambda: f"offsets must be int64 [{num_experts + 1}], got {offsets.dtype} {tuple(offsets.shape)}",
    )


def _expert_groups(expert_ids, order, offsets, planes, block_scales, row_scales, codebook):
    """``(rows, packed)`` for each expert that has rows, in expert order: the indices of its rows (by
    :func:`expert_offsets`, computed here unless given) and its packed tensors ``(planes, block_scales,
    row_scales, codebook)``. Reading the group sizes is a host sync."""
    num_experts = row_scales.shape[0]
    if order is None:
        order, offsets = expert_offsets(expert_ids, num_experts)
    bounds = offsets.tolist()
    for e in range(num_experts):
        if bounds[e] == bounds[e + 1]:
            continue
        cb = codebook if codebook.dim() == 1 else codebook[e]
        yield order[bounds[e] : bounds[e + 1]], (planes[e], block_scales[e], row_scales[e], cb)


@torch.library.impl(_lib, "grouped_mm", "CompositeExplicitAutograd")
def _grouped_mm_ref(x, expert_ids, planes, block_scales, row_scales, codebook, in_features, order=None, offsets=None,
                    signs=None, x_repeat=1):
    """Row ``s`` of ``x [S, K]`` times expert ``expert_ids[s]``'s weight: ``[S, N]`` in x's dtype.

    Packed tensors carry one leading expert dim ``E``; codebook is ``[E, L]`` or ``[L]``.
    Rows whose id lies outside ``[0, E)`` come out as zeros. Accumulates in float32.

    ``order``/``offsets``: :func:`expert_offsets` of ``expert_ids``, when the caller already has
    them (an experts layer sorts once for its two projections). ``signs``: the projection's sign words (all its
    experts share them, as they share x): x is rotated once, before the grouping. ``x_repeat``: x holds
    ``S / x_repeat`` rows and row ``s`` of the problem reads x row ``s // x_repeat``, as if x were
    ``x.repeat_interleave(x_repeat, 0)`` (an experts layer's tokens, each for its top-k rows), without the copy.

    Reference: rows grouped by :func:`expert_offsets`, one expert's weight dequantized at a
    time (never ``[S, N, K]``). Reading the group sizes to slice is a host sync here; a
    device kernel consumes ``offsets`` on the device instead.
    """
    _check_mm_input(x, in_features)
    _check_packed(planes, block_scales, row_scales, codebook, in_features)
    _check_grouped(x, expert_ids, row_scales, codebook, x_repeat)
    _check_routing(expert_ids, order, offsets, row_scales.shape[0])
    _check_signs(signs, in_features, planes)
    x = _rotated(x, signs)
    if x_repeat > 1:
        x = x.repeat_interleave(x_repeat, 0)
    out = torch.zeros(x.shape[0], row_scales.shape[-1], dtype=torch.float32, device=x.device)
    for rows, packed in _expert_groups(expert_ids, order, offsets, planes, block_scales, row_scales, codebook):
        w = fmt.dequantize(*packed, in_features, torch.float32)
        out[rows] = x[rows].float() @ w.T
    return out.to(x.dtype)


@torch.library.register_fake("kbit::grouped_mm")
def _grouped_mm_fake(x, expert_ids, planes, block_scales, row_scales, codebook, in_features, order=None, offsets=None,
                     signs=None, x_repeat=1):
    _check_mm_input(x, in_features)
    _check_packed(planes, block_scales, row_scales, codebook, in_features)
    _check_grouped(x, expert_ids, row_scales, codebook, x_repeat)
    _check_routing(expert_ids, order, offsets, row_scales.shape[0])
    _check_signs(signs, in_features, planes)
    return x.new_empty((expert_ids.shape[0], row_scales.shape[-1]))


@torch.library.impl(_lib, "grouped_mm_silu_mul", "CompositeExplicitAutograd")
def _grouped_mm_silu_mul_ref(gate, up, expert_ids, planes, block_scales, row_scales, codebook, in_features,
                             order=None, offsets=None, signs=None):
    """``grouped_mm(silu_mul(gate, up), ...)``: an experts layer's down projection of its gated gate_up output
    (``gate``, ``up``: the two halves, ``[S, I]`` each). Inference only: the op has no backward (an experts layer
    under gradients gates with its own ops and calls ``grouped_mm``)."""
    _check_prologue("up", gate, up)
    return torch.ops.kbit.grouped_mm(silu_mul(gate, up), expert_ids, planes, block_scales, row_scales, codebook,
                                     in_features, order, offsets, signs)


@torch.library.register_fake("kbit::grouped_mm_silu_mul")
def _grouped_mm_silu_mul_fake(gate, up, expert_ids, planes, block_scales, row_scales, codebook, in_features,
                              order=None, offsets=None, signs=None):
    _check_prologue("up", gate, up)
    return _grouped_mm_fake(gate, expert_ids, planes, block_scales, row_scales, codebook, in_features, order, offsets,
                            signs)


# ---------------------------------------------------------------------------- gradients

# Training: gradients flow to the activations only. The packed tensors are buffers (int planes and
# scale codes, float32 row scales and codebook) and never take a gradient; adapters (LoRA) train
# beside the frozen kbit weight. dX = dY @ W has its own ops, so a backend can serve it with what is
# fastest at training shapes (CUDA: dequantize + cuBLAS) and compiled backward graphs see one
# opaque op with a fake impl.
_lib.define(
    "mm_grad_x(Tensor grad, Tensor planes, Tensor block_scales, Tensor row_scales, Tensor codebook, "
    "SymInt in_features, Tensor? signs=None) -> Tensor"
)
_lib.define(
    "grouped_mm_grad_x(Tensor grad, Tensor expert_ids, Tensor planes, Tensor block_scales, Tensor row_scales, "
    "Tensor codebook, SymInt in_features, Tensor? order=None, Tensor? offsets=None, Tensor? signs=None) -> Tensor"
)


def _check_grad_input(grad: torch.Tensor, row_scales: torch.Tensor) -> None:
    torch._check(
        grad.dtype in (torch.bfloat16, torch.float16, torch.float32),
        lambda: f"grad must be bfloat16, float16 or float32, got {grad.dtype}",
    )
    torch._check(
        grad.shape[-1] == row_scales.shape[-1],
        lambda: f"grad has {grad.shape[-1]} features in its last dim, the weight has out_features="
        f"{row_scales.shape[-1]}",
    )


@torch.library.impl(_lib, "mm_grad_x", "CompositeExplicitAutograd")
def _mm_grad_x_ref(grad, planes, block_scales, row_scales, codebook, in_features, signs=None):
    """``grad [..., N] @ W -> [..., K]`` in grad's dtype, accumulating in float32: the gradient of
    :func:`_mm_ref` with respect to x (rotated: ``(grad @ (W R)) R^T``, unrotated in float32)."""
    _check_grad_input(grad, row_scales)
    _check_packed(planes, block_scales, row_scales, codebook, in_features)
    _check_signs(signs, in_features, planes)
    w = fmt.dequantize(planes, block_scales, row_scales, codebook, in_features, torch.float32)
    return _unrotated(grad.float() @ w, signs, grad.dtype)


@torch.library.register_fake("kbit::mm_grad_x")
def _mm_grad_x_fake(grad, planes, block_scales, row_scales, codebook, in_features, signs=None):
    _check_grad_input(grad, row_scales)
    _check_packed(planes, block_scales, row_scales, codebook, in_features)
    _check_signs(signs, in_features, planes)
    return grad.new_empty((*grad.shape[:-1], in_features))


@torch.library.impl(_lib, "grouped_mm_grad_x", "CompositeExplicitAutograd")
def _grouped_mm_grad_x_ref(grad, expert_ids, planes, block_scales, row_scales, codebook, in_features, order=None,
                           offsets=None, signs=None):
    """Row ``s`` of ``grad [S, N]`` times expert ``expert_ids[s]``'s weight ``[N, K]``: ``[S, K]``, the
    gradient of :func:`_grouped_mm_ref` with respect to x (zeros for rows of no expert)."""
    return _grouped_grad_x(grad, expert_ids, planes, block_scales, row_scales, codebook, in_features, order, offsets,
                           torch.float32, signs)


def _grouped_grad_x(grad, expert_ids, planes, block_scales, row_scales, codebook, in_features, order, offsets,
                    compute_dtype: torch.dtype, signs=None) -> torch.Tensor:
    """The grouped gradient, one expert's weight dequantized at a time in ``compute_dtype`` (a host sync,
    as in the forward reference), rows unrotated (``signs``) in ``compute_dtype`` before the one rounding."""
    _check_grad_input(grad, row_scales)
    _check_packed(planes, block_scales, row_scales, codebook, in_features)
    _check_grouped(grad.new_empty((grad.shape[0], in_features)), expert_ids, row_scales, codebook)
    _check_routing(expert_ids, order, offsets, row_scales.shape[0])
    _check_signs(signs, in_features, planes)
    out = torch.zeros(grad.shape[0], in_features, dtype=compute_dtype, device=grad.device)
    for rows, packed in _expert_groups(expert_ids, order, offsets, planes, block_scales, row_scales, codebook):
        w = torch.ops.kbit.dequantize(*packed, in_features, compute_dtype)
        out[rows] = grad[rows].to(compute_dtype) @ w
    return _unrotated(out, signs, grad.dtype)


@torch.library.register_fake("kbit::grouped_mm_grad_x")
def _grouped_mm_grad_x_fake(grad, expert_ids, planes, block_scales, row_scales, codebook, in_features, order=None,
                            offsets=None, signs=None):
    _check_grad_input(grad, row_scales)
    _check_packed(planes, block_scales, row_scales, codebook, in_features)
    _check_grouped(grad.new_empty((grad.shape[0], in_features)), expert_ids, row_scales, codebook)
    _check_routing(expert_ids, order, offsets, row_scales.shape[0])
    _check_signs(signs, in_features, planes)
    return grad.new_empty((grad.shape[0], in_features))


def _mm_setup_context(ctx, inputs, output):
    _, planes, block_scales, row_scales, codebook, in_features, signs = inputs
    ctx.save_for_backward(planes, block_scales, row_scales, codebook, signs)
    ctx.in_features = in_features


def _mm_backward(ctx, grad):
    grad_x = None
    if ctx.needs_input_grad[0]:
        planes, block_scales, row_scales, codebook, signs = ctx.saved_tensors
        grad_x = torch.ops.kbit.mm_grad_x(grad, planes, block_scales, row_scales, codebook, ctx.in_features, signs)
    return grad_x, None, None, None, None, None, None


def _grouped_mm_setup_context(ctx, inputs, output):
    _, expert_ids, planes, block_scales, row_scales, codebook, in_features, order, offsets, signs, x_repeat = inputs
    ctx.save_for_backward(expert_ids, planes, block_scales, row_scales, codebook, order, offsets, signs)
    ctx.in_features, ctx.x_repeat = in_features, x_repeat


def _grouped_mm_backward(ctx, grad):
    grad_x = None
    if ctx.needs_input_grad[0]:
        expert_ids, planes, block_scales, row_scales, codebook, order, offsets, signs = ctx.saved_tensors
        grad_x = torch.ops.kbit.grouped_mm_grad_x(
            grad, expert_ids, planes, block_scales, row_scales, codebook, ctx.in_features, order, offsets, signs
        )
        if ctx.x_repeat > 1:  # each x row fed x_repeat rows of the problem
            grad_x = grad_x.unflatten(0, (-1, ctx.x_repeat)).sum(1)
    return grad_x, None, None, None, None, None, None, None, None, None, None


torch.library.register_autograd("kbit::mm", _mm_backward, setup_context=_mm_setup_context)
torch.library.register_autograd("kbit::grouped_mm", _grouped_mm_backward, setup_context=_grouped_mm_setup_context)


# ---------------------------------------------------------------------------- eager training

# The registered autograd above serves compiled graphs, which need one opaque op with a fake impl. In eager
# mode its torch.library wrapper (defaults filled, metadata built, a second dispatch) costs about 100 us of host
# time per call on an H100's host, and gradient checkpointing packs and unpacks its saved packed tensors through
# Python hooks; a batch-1 LoRA step is launch-bound, so that host time is step time. KbitMatmul is the same
# gradient as a plain autograd.Function: the packed tensors are frozen buffers, kept on ctx, never saved; a
# backend may register its implementations for it to call past the dispatcher (register_eager_train).
_eager_train: dict[str, tuple] = {}


def register_eager_train(device_type: str, mm, mm_grad_x) -> None:
    """``mm`` and ``mm_grad_x``: a backend's implementations of ``kbit::mm`` and ``kbit::mm_grad_x`` for tensors
    of ``device_type`` (same arguments as the ops), which :class:`KbitMatmul` calls directly."""
    _eager_train[device_type] = (mm, mm_grad_x)


class KbitMatmul(torch.autograd.Function):
    """``kbit::mm`` with its gradient for x (``kbit::mm_grad_x``), for eager training (see above)."""

    @staticmethod
    def forward(ctx, x, planes, block_scales, row_scales, codebook, in_features, signs=None):
        ctx.packed = (planes, block_scales, row_scales, codebook, in_features, signs)
        impl = _eager_train.get(x.device.type)
        mm = impl[0] if impl is not None else torch.ops.kbit.mm.default
        return mm(x, planes, block_scales, row_scales, codebook, in_features, signs)

    @staticmethod
    def backward(ctx, grad):
        impl = _eager_train.get(grad.device.type)
        mm_grad_x = impl[1] if impl is not None else torch.ops.kbit.mm_grad_x.default
        return mm_grad_x(grad, *ctx.packed), None, None, None, None, None, None

"""Which layers a quantization rotates (``KbitConfig.rotation``), and the basis ``"auto"`` keeps.

The format (v3, :mod:`hf_kbit.format`) lets a layer store ``W R`` (:mod:`hf_kbit.rotation`, segments of 8 along K)
with its sign words. The quantizers decide per group of weights that read the same input and so must turn
it the same way: siblings fused into one launch (q/k/v, gate/up; :func:`hf_kbit.nn.fused.codebook_siblings`)
and all experts of one fused MoE projection. Whatever the choice, each group's weights are quantized by the
same quantizer (fitting, calibration), on ``W R`` instead of ``W``.

- ``False``: nothing rotates (format v1).
- ``True``: every group whose in_features is a multiple of 64 (:func:`hf_kbit.format.rotatable`) rotates.
- ``"auto"``: such a group is quantized both ways, data-free, and keeps the rotated one only when it lowers
  the group's relative weight reconstruction error, summed over its members and measured in the original
  basis: ``sum_i ||W_i - Q_i||^2 / ||W_i||^2`` (``Q_i``: the reconstruction turned back by ``R^T``; a fused
  experts projection is one member, its experts stacked). Ties keep the unrotated weight.
- ``"inputs"``: the input projections rotate (as ``True``), the output projections do not (as ``False``). An
  output projection writes the residual stream: its module name ends in one of :data:`OUTPUT_PROJECTIONS`
  (attention's ``o_proj``, the MLP's and the fused experts' ``down_proj``, ...). Every other layer of a decoder
  reads a normalised hidden state (q/k/v, gate/up, the experts' gate_up; DeepSeek's q_a/q_b/kv_a/kv_b). At
  k = 3 it is the setting measured better than HQQ 3-bit on both offline models (docs/format.md#rotation).
  :func:`for_weights` resolves it to ``True`` or ``False`` per group before anything is quantized.

The sums are float64, one per weight (one per expert for stacked experts, so that quantizing the experts in
chunks of any size gives the same sums and the same choice). CPU and CUDA rotate and quantize to the same
bytes; their sums may differ in the last bits (reduction order), which could only flip a choice at a tie
within ~1e-15.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from . import format as fmt
from . import rotation

ROTATIONS = (False, True, "auto", "inputs")  # KbitConfig.rotation
# The last name component of the layers that write the residual stream, which rotation="inputs" leaves unrotated.
OUTPUT_PROJECTIONS = frozenset({"o_proj", "down_proj", "out_proj", "dense", "c_proj", "w2", "wo", "dense_4h_to_h"})
U64 = 1 << 64

Packed = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # planes, block_scales, row_scales, codebook


def check_rotation(value, field: str = "KbitConfig.rotation") -> None:
    """Raise ValueError unless ``value`` is one of :data:`ROTATIONS` (``1``/``0`` are not ``True``/``False``)."""
    if not any(value is r or (isinstance(value, str) and value == r) for r in ROTATIONS):
        raise ValueError(f"{field} must be one of {ROTATIONS}, got {value!r}")


def check_seed(value, field: str = "KbitConfig.rotation_seed") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < U64:
        raise ValueError(f"{field} must be an int in [0, 2**64), got {value!r}")


def is_output_projection(name: str) -> bool:
    """Whether the module (or its tensor: ``<module>.weight``, ``<experts>.down_proj``) ``name`` is an output
    projection (:data:`OUTPUT_PROJECTIONS`)."""
    parts = name.split(".")
    if len(parts) > 1 and parts[-1] == "weight":
        parts = parts[:-1]
    return parts[-1] in OUTPUT_PROJECTIONS


def for_weights(rotation_choice, names: Sequence[str]) -> bool | str:
    """The rotation a group of weights named ``names`` (siblings; an experts projection) is quantized under:
    ``rotation_choice`` itself, except ``"inputs"``, which is False when one of them is an output projection
    (:func:`is_output_projection`; siblings are all or none) and True otherwise."""
    check_rotation(rotation_choice, "rotation")
    if not isinstance(rotation_choice, str) or rotation_choice != "inputs":
        return rotation_choice
    return not any(is_output_projection(name) for name in names)


def layer_words(k: int, rotation_choice, seed: int, device=None) -> torch.Tensor | None:
    """The sign words a weight with ``k`` columns is tried with under ``rotation_choice`` (True or "auto"; "inputs"
    is resolved by :func:`for_weights` first): int32
    ``[k / 32]`` on ``device``; None when ``rotation_choice`` is False or ``k`` is not a multiple of 64."""
    check_rotation(rotation_choice, "rotation")
    if isinstance(rotation_choice, str) and rotation_choice == "inputs":
        raise ValueError('rotation="inputs" depends on the layer: resolve it with for_weights(rotation, names) first')
    if rotation_choice is False or not fmt.rotatable(k):
        return None
    return rotation.sign_words(k, seed, device)


def rotate_weight(weight: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """``weight [..., N, K] @ R`` in float32 (float64 stays float64): what the quantizer packs for a rotated layer."""
    w = weight if weight.dtype == torch.float64 else weight.float()
    return rotation.rotate_words(w, words.to(w.device))


def reconstruction(packed: Packed, k: int, words: torch.Tensor | None) -> torch.Tensor:
    """The float32 weight ``[..., N, K]`` that ``packed`` (format tensors, experts stacked on leading dims, one
    codebook) decodes to, in the original basis (turned back by ``R^T`` when ``words`` is given)."""
    w = fmt.dequantize(*packed, k)
    return w if words is None else rotation.unrotate_words(w, words.to(w.device))


def error_sums(weight: torch.Tensor, packed: Packed, words: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(||W - Q||^2, ||W||^2)`` in float64, one pair per leading index (per expert: ``[E]`` each) or a 0-d pair
    for a 2-D weight; ``Q`` in the original basis (:func:`reconstruction`). Each weight (expert) is summed on its
    own, so the sums do not depend on how many are quantized at once."""
    q = reconstruction(packed, weight.shape[-1], words)
    w = weight.to(q.dtype)
    lead = w.shape[:-2]
    w2, q2 = w.reshape(-1, *w.shape[-2:]), q.reshape(-1, *q.shape[-2:])
    err = torch.stack([(a - b).square().sum(dtype=torch.float64) for a, b in zip(w2, q2)]) if w2.shape[0] else \
        torch.zeros(0, dtype=torch.float64, device=w.device)
    norm = torch.stack([a.square().sum(dtype=torch.float64) for a in w2]) if w2.shape[0] else err
    return err.reshape(lead), norm.reshape(lead)


def relative_error(err: torch.Tensor, norm: torch.Tensor) -> float:
    """``sum(err) / sum(norm)`` of one member's :func:`error_sums` (0 for an all-zero weight)."""
    total = float(norm.sum())
    return float(err.sum()) / total if total > 0 else 0.0


def choose(
    weights: Sequence[torch.Tensor],
    rotation_choice,
    seed: int,
    quantize: Callable[[list[torch.Tensor]], list[Packed]],
) -> tuple[list[Packed], torch.Tensor | None]:
    """Quantize a group of weights ``[..., N, K]`` of one K (``quantize`` maps the group's weights, in whichever
    basis, to their format tensors) in the basis ``rotation_choice`` picks: ``(packed, words)``, words None for
    the unrotated basis. Module docstring for the rule."""
    words = layer_words(weights[0].shape[-1], rotation_choice, seed, weights[0].device)
    if words is None:
        return quantize(list(weights)), None
    rotated = quantize([rotate_weight(w, words) for w in weights])
    if rotation_choice is True:
        return rotated, words
    plain = quantize(list(weights))
    return (rotated, words) if prefers_rotated(weights, plain, rotated, words) else (plain, None)


def decide(
    weights: Sequence[torch.Tensor],
    rotation_choice,
    seed: int,
    quantize: Callable[[list[torch.Tensor]], list[Packed]],
) -> torch.Tensor | None:
    """The sign words of :func:`choose` (None: unrotated) for a quantizer that then quantizes the group itself (with
    data): only ``"auto"`` on a rotatable K quantizes, both ways, with ``quantize``."""
    words = layer_words(weights[0].shape[-1], rotation_choice, seed, weights[0].device)
    if words is None or rotation_choice is True:
        return words
    rotated = quantize([rotate_weight(w, words) for w in weights])
    return words if prefers_rotated(weights, quantize(list(weights)), rotated, words) else None


def rotate_hessian(hessian: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """``R^T H R`` of a Hessian ``H = X^T X / n`` ``[..., K, K]`` (float32): the Hessian of the rotated inputs ``X R``."""
    h = hessian if hessian.dtype == torch.float64 else hessian.float()
    once = rotation.rotate_words(h, words.to(h.device))  # H R
    return rotation.rotate_words(once.transpose(-1, -2).contiguous(), words.to(h.device))  # (H R)^T R = R^T H R


def prefers_rotated(weights: Sequence[torch.Tensor], plain: Sequence[Packed], rotated: Sequence[Packed],
                    words: torch.Tensor) -> bool:
    """Whether the rotated quantization of ``weights`` has the lower summed relative error (module docstring)."""
    def total(packed, signs):
        return sum(relative_error(*error_sums(w, p, signs)) for w, p in zip(weights, packed))

    return keeps_rotated(total(rotated, words), total(plain, None))


def keeps_rotated(rotated_error: float, plain_error: float) -> bool:
    """The rule of ``"auto"`` on a group's summed relative errors: rotated only when strictly lower."""
    return rotated_error < plain_error

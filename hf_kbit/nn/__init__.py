"""kbit modules: they own packed tensors and call torch.ops.kbit; they never call ctypes."""

from .experts import KbitExperts, quantize_experts, replace_experts_with_kbit
from .fused import KbitFusedProjections, fuse_projections, unfuse_projections
from .linear import KbitLinear, quantize_layer, quantize_weight
from .replace import quantize_model, replace_kbit_with_linear, replace_linear_with_kbit

__all__ = [
    "KbitExperts",
    "KbitFusedProjections",
    "KbitLinear",
    "fuse_projections",
    "quantize_experts",
    "quantize_model",
    "quantize_layer",
    "quantize_weight",
    "replace_experts_with_kbit",
    "replace_kbit_with_linear",
    "replace_linear_with_kbit",
    "unfuse_projections",
]

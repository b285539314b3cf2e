"""kbit modules: they own packed tensors and call torch.ops.kbit; they never call ctypes."""

from .linear import KbitLinear, quantize_weight
from .replace import quantize_model, replace_kbit_with_linear, replace_linear_with_kbit

__all__ = ["KbitLinear", "quantize_model", "quantize_weight", "replace_kbit_with_linear", "replace_linear_with_kbit"]

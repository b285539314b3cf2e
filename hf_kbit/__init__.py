"""hf_kbit: k-bit (2-5 bit) codebook weight quantization for Hugging Face transformers.

``import hf_kbit`` registers ``quant_method="kbit"`` with transformers (an installed
hf-kbit also registers itself when transformers loads its quantizers, without the import).
"""

from . import _ops  # noqa: F401  (defines torch.ops.kbit.*)
from . import _lib
from ._register import register
from .config import KbitConfig
from .format import FORMAT_VERSION, SUPPORTED_BITS
from .nn import KbitExperts, KbitLinear, quantize_experts
from .nn import quantize_model as _quantize_linears

__version__ = "0.1.0"


def quantize_model(model, config: KbitConfig | None = None, modules_to_not_convert: list[str] | None = None):
    """Quantize a model already in memory (outside ``from_pretrained``), in place; returns it.

    Every ``nn.Linear`` becomes a :class:`KbitLinear` and every fused MoE experts module
    (transformers v5 ``*.experts`` with 3-D ``gate_up_proj`` / ``down_proj``) a
    :class:`KbitExperts`, as quantize-on-load does. ``modules_to_not_convert`` (default:
    ``config.modules_to_not_convert``, else nothing) lists modules to keep in full precision;
    unlike ``from_pretrained`` there is no default skip of the LM head here.
    """
    config = config or KbitConfig()
    _quantize_linears(model, config, modules_to_not_convert)
    return quantize_experts(model, config, modules_to_not_convert)


register()

if _lib.available():  # CUDA kernels for kbit ops on CUDA tensors (else the PyTorch reference)
    from .backends import cuda as _cuda_backend  # noqa: F401

__all__ = [
    "FORMAT_VERSION",
    "SUPPORTED_BITS",
    "KbitConfig",
    "KbitExperts",
    "KbitLinear",
    "quantize_model",
    "register",
]

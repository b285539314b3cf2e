"""hf_kbit: k-bit (2-5 bit) codebook weight quantization for Hugging Face transformers.

``import hf_kbit`` registers ``quant_method="kbit"`` with transformers and the single-token
grouped-query attention ``attn_implementation="kbit_decode"`` (hf_kbit.attention). An installed
hf-kbit also does this without the import: its ``.pth`` hook (python/_hf_kbit_autoload.py) imports
hf_kbit the first time transformers looks either up.
"""

from . import _ops  # noqa: F401  (defines torch.ops.kbit.*)
from . import attention, backends
from ._register import register
from .config import KbitConfig
from .format import FORMAT_VERSION, SUPPORTED_BITS
from .nn import KbitExperts, KbitLinear, fuse_projections, quantize_model, unfuse_projections

__version__ = "0.1.0"

register()
attention.register()  # attn_implementation="kbit_decode"

backends.load()  # kernels for kbit ops on CUDA tensors (else the PyTorch references)

__all__ = [
    "FORMAT_VERSION",
    "SUPPORTED_BITS",
    "KbitConfig",
    "KbitExperts",
    "KbitLinear",
    "fuse_projections",
    "quantize_model",
    "register",
    "unfuse_projections",
]

"""Registration of quant_method "kbit" with transformers (idempotent)."""

from __future__ import annotations


def register() -> None:
    from transformers.quantizers import auto

    from .config import QUANT_METHOD, KbitConfig
    from .quantizer import KbitHfQuantizer

    registered = auto.AUTO_QUANTIZATION_CONFIG_MAPPING.get(QUANT_METHOD)
    if registered is KbitConfig and auto.AUTO_QUANTIZER_MAPPING.get(QUANT_METHOD) is KbitHfQuantizer:
        return
    if registered is not None and registered.__module__ != KbitConfig.__module__:
        raise RuntimeError(f"quant_method {QUANT_METHOD!r} is already registered by {registered.__module__}")
    if registered is None:
        auto.register_quantization_config(QUANT_METHOD)(KbitConfig)
        auto.register_quantizer(QUANT_METHOD)(KbitHfQuantizer)
    else:  # a reload of hf_kbit: replace our own earlier classes
        auto.AUTO_QUANTIZATION_CONFIG_MAPPING[QUANT_METHOD] = KbitConfig
        auto.AUTO_QUANTIZER_MAPPING[QUANT_METHOD] = KbitHfQuantizer

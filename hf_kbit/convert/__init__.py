"""Checkpoint conversion: a Hugging Face model (folder, Hub repo or GGUF file) -> a kbit checkpoint.

The conversion streams: one planned output tensor is read, quantized and added to the current
output shard at a time, so only its sources and one output shard are in memory. Which weights
are quantized, and with how many bits, is decided by the quantizer itself
(:class:`~hf_kbit.quantizer.KbitHfQuantizer`) applied to the model's skeleton on the meta device;
checkpoint keys are mapped onto the model with transformers' own conversion mapping (renamings,
and the merge of per-expert MoE keys into fused ``experts.gate_up_proj`` / ``down_proj``), so the
output is bit-identical to quantize-on-load
(``from_pretrained(src, quantization_config=cfg).save_pretrained(out)``) with the same config.
Fused MoE expert tensors are built and quantized a few experts at a time. Calibration
(``KbitConfig.calibration_data``) runs the model, so then the model is loaded whole instead, calibrated
and quantized as quantize-on-load does it, and its tensors written (same bytes again).

Output is written into a hidden temporary folder next to ``out`` and renamed into place only
when complete (:mod:`hf_kbit._paths`: the rename never replaces what it was not asked to);
``config.json`` is the last file written there, so an interrupted run never leaves a folder that
looks loadable.

Modules, by role: ``sources`` (folder, Hub repo or GGUF file; the architecture config.json names),
``plan`` (what a conversion will do) and ``planner`` (making that plan), ``writing`` (quantizing
into output shards), ``check`` (the opt-in perplexity check) and ``run`` (:func:`convert`, which
ties them together). Everything public is importable from ``hf_kbit.convert``.
"""

from .._paths import ConversionError, OutputConflictError, check_output, source_paths
from ..hub import format_bytes
from .check import DEFAULT_EVAL_TEXT, measure_perplexity
from .plan import ConversionPlan, KeyRule, PlanContext, TensorPlan
from .planner import DTYPES, plan_conversion
from .run import COPIED_FILE_PATTERNS, ConversionResult, OutputWriteError, command_line, convert, parse_size
from .sources import HUB_ALLOW_PATTERNS, resolve_source
from .writing import output_config

__all__ = [
    "COPIED_FILE_PATTERNS",
    "DEFAULT_EVAL_TEXT",
    "DTYPES",
    "HUB_ALLOW_PATTERNS",
    "ConversionError",
    "ConversionPlan",
    "ConversionResult",
    "KeyRule",
    "OutputConflictError",
    "OutputWriteError",
    "PlanContext",
    "TensorPlan",
    "check_output",
    "command_line",
    "convert",
    "format_bytes",
    "measure_perplexity",
    "output_config",
    "parse_size",
    "plan_conversion",
    "resolve_source",
    "source_paths",
]

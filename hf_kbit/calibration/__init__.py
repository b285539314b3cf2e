"""Calibration: activation-aware choice of format v1's free parts from a small text sample.

Data-free fitting (:mod:`hf_kbit.fitting`) lowers the weight-space error ``||W - Q||^2``. What a layer's
output sees is ``||(W - Q) X||^2`` for its inputs ``X``, i.e. ``tr((W - Q) H (W - Q)^T)`` with
``H = X^T X / tokens``. Calibration lowers that, the way GPTQ does, inside format v1:

- The **row scales** follow the format's rule, and the **codebook** is the one quantization without data would
  choose (:func:`hf_kbit.fitting.group_codebook`: fitted on the original weight, or on the stacked weights of
  siblings that share a codebook so that they can still run fused). Both are fixed before the columns run.
- **Columns in K order** (:func:`gptq_quantize`). Each column's indices are the nearest codebook level to
  ``w / scale`` of its block; the column's error, divided by the diagonal of the upper Cholesky factor of
  ``H^-1``, is pushed onto the columns not yet quantized (``W[:, j:] -= err * U[i, j:]``). Updates within a
  lazy batch of ``lazy_columns`` columns are immediate; the rest of the matrix gets one matmul per batch.
- **Block codes when the block is first reached**: at the block's first column, its 32 (already updated)
  weights choose their E4M4 code by :func:`hf_kbit.fitting.search_block_codes`'s rule (least squared
  error over the window of codes around the absmax code), as GPTQ with group-wise scales does without
  act-order. The indices that follow may then differ from the nearest level of the original weight: the
  format allows any index.
- **Block offsets** (``CalibrationSettings.block_offsets``, ``KbitConfig.block_offsets``; format v4): at the
  same moment each block first takes its offset by the data-free rule (:func:`hf_kbit.fitting.offset_blocks`) from
  its updated weights; the code search and the indices then see the weights less the offset. The codebook is
  the data-free one fitted with offsets. Fused MoE experts keep uint8 scales.

With ``H`` diagonal nothing propagates, and the bytes equal :func:`hf_kbit.fitting.quantize_fitted`'s with
the same codebook and code window (tested).

:func:`calibrate_model` runs this over a model the way GPTQ does: decoder layer by decoder layer, each
layer's Linears collecting ``H`` from inputs that come through the already quantized layers before it, then
quantized, written back (dequantized) into the model, and the layer run again to give the next one its
inputs. A tqdm bar counts the Linears. Siblings (q/k/v, gate/up) read the same input, so they get the same
``H``, computed once, and run as one weight, their rows stacked (one column loop for the group). Fused MoE
experts (``calibrate_model(experts=...)``) collect one ``H`` per expert from the tokens routed to it, and are
quantized stacked, a few experts at a time (:func:`calibrate_experts`).

Cost: one forward of the calibration tokens per decoder layer (twice: once with hooks), ``H`` in float32 on the
model's device (``K x K`` per distinct input), and a Python loop over columns whose steps are whole-row tensor
operations on the device, with one matmul per lazy batch for the rest of the matrix: no host synchronisation
per column (the E4M4 table is cached per device).

The package, by role: :mod:`.gptq` (one weight or a group of siblings with their Hessians), :mod:`.moe` (fused
MoE experts: their Hessians per expert and their stacked quantization), :mod:`.text` (calibration tokens) and
:mod:`.model` (a model, decoder layer by decoder layer).
"""

from __future__ import annotations

from .gptq import (
    DEFAULT_DAMP,
    DEFAULT_LAZY_COLUMNS,
    CalibrationSettings,
    calibrate_group,
    calibrate_quantize,
    gptq_quantize,
    inverse_cholesky,
)
from .model import calibrate_model, decoder_layers
from .moe import calibrate_experts
from .text import calibration_batches, config_batches

__all__ = [
    "DEFAULT_DAMP",
    "DEFAULT_LAZY_COLUMNS",
    "CalibrationSettings",
    "calibrate_experts",
    "calibrate_group",
    "calibrate_model",
    "calibrate_quantize",
    "calibration_batches",
    "config_batches",
    "decoder_layers",
    "gptq_quantize",
    "inverse_cholesky",
]

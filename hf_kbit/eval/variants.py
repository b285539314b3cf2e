"""What one evaluated variant is, and the model it loads as.

A variant spec is ``METHOD[BITS][:KEY=VALUE]...``; a list of them is comma-separated (commas inside
``[...]``, ``{...}`` or quotes belong to a value):

- ``bf16``: the checkpoint as it is, computed in the run's dtype.
- ``kbit<k>``: quantized on load with ``KbitConfig(bits=k, **options)``. Every option goes to KbitConfig
  unchanged (``kbit3:codebook=nf``, ``kbit4:fitting=absmax``, ``kbit3:rotation=auto``,
  ``kbit4:rotation=true:rotation_seed=1``), so new config fields need no change here; KbitConfig validates them.
  The summary counts the weights stored rotated (``rotated_weights``) and their sign words in bits/weight. ``lm_head_bits=h`` also quantizes the LM
  head, at k = h (variant ``kbit<k>-head<h>``).
- ``hqq<b>``, ``rtn<b>``, ``nf4``: anchors (hf_kbit.eval.anchors), fake-quantized Linears; option
  ``group_size`` (the NF4 block size for ``nf4``).
- ``kbitfit<k>``: the kbit format fitted by hf_kbit.fitting, fake-quantized the same way; options
  ``codes_below``, ``codes_above``, ``lloyd_iters``, and ``offsets`` (1, the default as ``KbitConfig``'s: an offset
  per block, format v4; 0: none, format v1; hf_kbit.eval.anchors).
- ``kbitcal<k>``: the kbit format calibrated by hf_kbit.calibration (GPTQ-style error feedback with the fitted
  codebook and block scales, decoder layer by decoder layer; q/k/v and gate/up share a codebook as
  quantize-on-load with ``KbitConfig(calibration_data=...)`` gives them), fake-quantized the same way. Calibration text:
  the last ``samples`` x ``seq_len`` tokens of ``corpus`` (default: the evaluated corpus, from the part after
  the evaluated prefix, so calibration and evaluation never share text; another corpus: its end). Options
  ``samples`` (128), ``seq_len`` (2048), ``corpus``, ``damp``, ``batch_size`` (sequences per calibration
  forward, 8) and kbitfit's (``offsets=1``, the default: block offsets chosen as the error feedback reaches each
  block; ``offsets=0``: none).

A value is read as JSON when it parses (``false``, ``64``, ``[-1, 0, 1]``, ``"x"``), else as a string.
``name=...`` sets the label; the default label is the spec as written.

The anchors quantize exactly the Linears that kbit's quantize-on-load quantizes with its default
``modules_to_not_convert`` (every Linear of the decoder blocks; the LM head, tied modules and the
embeddings stay as they are): :func:`quantizable_linears`.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .anchors import ANCHOR_BITS, ANCHORS, DEFAULT_GROUP_SIZE, KBIT_OPTIONS, Anchor

METHODS = ("bf16", "kbit", *ANCHORS, "kbitcal")
# kbitcal's options besides kbitfit's (KBIT_OPTIONS["kbitfit"]), with their defaults: GPTQ's customary 128 x 2048
# tokens.
CAL_OPTIONS = {"samples": 128, "seq_len": 2048, "corpus": None, "damp": 0.01, "batch_size": 8,
               "weighted_codebook": False, "weighted_codes": False}
LM_HEAD = "lm_head"  # the output projection's module name in transformers' causal LMs
_SPEC = re.compile(r"(?P<method>bf16|[a-z]+)(?P<bits>\d*)")


@dataclass
class VariantSpec:
    """One variant: ``method`` in METHODS, ``bits`` (None for bf16), ``options`` (KbitConfig fields for kbit,
    ``group_size`` for anchors), ``lm_head_bits`` (kbit only: quantize the LM head too, at that k)."""

    name: str
    method: str
    bits: int | None = None
    options: dict[str, Any] = field(default_factory=dict)
    lm_head_bits: int | None = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"variant {self.name!r}: method must be one of {METHODS}, got {self.method!r}")
        if self.method == "bf16":
            if self.bits is not None or self.options or self.lm_head_bits is not None:
                raise ValueError(f"variant {self.name!r}: bf16 takes no bits and no options")
        elif self.method == "kbit":
            try:
                self.kbit_config()  # KbitConfig validates bits and every option, naming the field
            except (TypeError, ValueError) as e:
                raise ValueError(f"variant {self.name!r}: {e}") from None
        else:
            if self.lm_head_bits is not None:
                raise ValueError(f"variant {self.name!r}: lm_head_bits applies to kbit variants only")
            if self.method == "kbitcal":
                allowed = {*KBIT_OPTIONS["kbitfit"], *CAL_OPTIONS}
            else:
                allowed = set(KBIT_OPTIONS.get(self.method, ("group_size",)))
            unknown = sorted(set(self.options) - allowed)
            if unknown:
                raise ValueError(f"variant {self.name!r}: unknown option(s) {unknown}; {self.method} takes {sorted(allowed)}")
            try:
                self.anchor()  # validates bits and group_size
            except ValueError as e:
                raise ValueError(f"variant {self.name!r}: {e}") from None
            if self.method == "kbitcal":
                self._check_calibration_options()

    def _check_calibration_options(self):
        from hf_kbit.calibration import CalibrationSettings

        for key in ("samples", "seq_len", "batch_size"):
            value = self.options.get(key, CAL_OPTIONS[key])
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"variant {self.name!r}: {key} must be a positive int, got {value!r}")
        try:
            CalibrationSettings(**{key: self.options.get(key, CAL_OPTIONS[key])
                                   for key in ("damp", "weighted_codebook", "weighted_codes")})
        except (TypeError, ValueError) as e:
            raise ValueError(f"variant {self.name!r}: {e}") from None

    def kbit_config(self):
        import hf_kbit

        if self.method != "kbit":
            raise ValueError(f"variant {self.name!r} is not a kbit variant")
        options = dict(self.options)
        if self.lm_head_bits is not None:
            clash = sorted({"modules_to_not_convert", "module_bits"} & set(options))
            if clash:
                raise ValueError(f"variant {self.name!r}: lm_head_bits sets {clash} itself; give one or the other")
            options.update(modules_to_not_convert=[], module_bits={f"^{LM_HEAD}$": self.lm_head_bits})
        return hf_kbit.KbitConfig(bits=self.bits, **options)

    def anchor(self) -> Anchor:
        if self.method == "kbitcal":  # its data-free part, and the checks of bits and fit options
            fit = tuple(sorted((k, v) for k, v in self.options.items() if k in KBIT_OPTIONS["kbitfit"]))
            return Anchor("kbitfit", self.bits, DEFAULT_GROUP_SIZE["kbitfit"], fit)
        if self.method in KBIT_OPTIONS:
            return Anchor(self.method, self.bits, DEFAULT_GROUP_SIZE[self.method], tuple(sorted(self.options.items())))
        return Anchor(self.method, self.bits, self.options.get("group_size", DEFAULT_GROUP_SIZE[self.method]))

    def to_json(self) -> dict[str, Any]:
        return {"variant": self.name, "method": self.method, "bits": self.bits, "options": dict(self.options),
                "lm_head_bits": self.lm_head_bits}


def _split_top(text: str, sep: str) -> list[str]:
    """Split on ``sep`` outside brackets, braces and double quotes."""
    parts, depth, quoted, start = [], 0, False, 0
    for i, ch in enumerate(text):
        if ch == '"':
            quoted = not quoted
        elif not quoted and ch in "[{":
            depth += 1
        elif not quoted and ch in "]}":
            depth -= 1
        elif not quoted and depth == 0 and ch == sep:
            parts.append(text[start:i])
            start = i + 1
    if depth or quoted:
        raise ValueError(f"unbalanced brackets or quotes in {text!r}")
    return [*parts, text[start:]]


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_variant(text: str) -> VariantSpec:
    """``kbit3:codebook=nf`` -> VariantSpec (module docstring); ValueError naming the spec when malformed."""
    head, *pairs = _split_top(text.strip(), ":")
    match = _SPEC.fullmatch(head)
    if not match or match["method"] not in METHODS:
        raise ValueError(f"variant {text!r}: expected METHOD[BITS][:KEY=VALUE]..., METHOD one of {METHODS} "
                         f"(e.g. bf16, kbit4, kbit3:codebook=nf, hqq4, rtn3:group_size=64, nf4)")
    method, bits = match["method"], int(match["bits"]) if match["bits"] else None
    if method != "bf16" and bits is None:
        allowed = ANCHOR_BITS.get(method, "2, 3, 4, 5")
        raise ValueError(f"variant {text!r}: {method} needs its bits, e.g. {method}4 (bits in {allowed})")
    options: dict[str, Any] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"variant {text!r}: option {pair!r} is not KEY=VALUE")
        options[key.strip()] = _value(value.strip())
    name = str(options.pop("name", text.strip()))
    head_bits = options.pop("lm_head_bits", None)
    return VariantSpec(name, method, bits, options, head_bits)


def parse_variants(text: str) -> list[VariantSpec]:
    """``--variants bf16,kbit4,hqq4`` -> specs; labels must be unique."""
    specs = [parse_variant(part) for part in _split_top(text, ",") if part.strip()]
    if not specs:
        raise ValueError(f"--variants: no variant in {text!r}")
    names = [s.name for s in specs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"--variants: duplicate variant(s) {dupes}; give one a label with :name=...")
    return specs


def bits_variants(bits: list[int], lm_head_bits: list[int] = (), bf16: bool = True) -> list[VariantSpec]:
    """The variants of ``--bits`` / ``--lm-head-bits``: bf16, then per k ``kbit<k>`` and its ``kbit<k>-head<h>``."""
    specs = [VariantSpec("bf16", "bf16")] if bf16 else []
    for k in bits:
        specs.append(VariantSpec(f"kbit{k}", "kbit", k))
        specs += [VariantSpec(f"kbit{k}-head{h}", "kbit", k, lm_head_bits=h) for h in lm_head_bits]
    return specs


# ----------------------------------------------------------------------------- which Linears


def quantizable_linears(model) -> list[str]:
    """Names of the nn.Linear modules that kbit's quantize-on-load converts by default, in model order.

    The same rule as KbitHfQuantizer with ``modules_to_not_convert=None``: transformers' default skips (the
    output embedding, tied weights, the last module) plus ``_keep_in_fp32_modules`` and tied modules.
    """
    from torch import nn
    from transformers.quantizers.base import HfQuantizer

    from hf_kbit.nn.selection import should_convert, tied_modules

    skip = HfQuantizer.get_modules_to_not_convert(
        model, None, getattr(model, "_keep_in_fp32_modules", None), add_default_skips=True
    ) + tied_modules(model)
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and should_convert(name, skip)]


def _names_sha256(names: list[str]) -> str:
    return hashlib.sha256("\n".join(sorted(names)).encode()).hexdigest()


class WeightError:
    """Pooled weight SQNR over many matrices: 10 log10(sum ||W||^2 / sum ||W - W_hat||^2), in float64."""

    def __init__(self):
        self.signal, self.noise = 0.0, 0.0

    def add(self, weight, approx) -> None:
        import torch

        w = weight.float()
        self.signal += float(w.square().sum(dtype=torch.float64))
        self.noise += float((approx.float() - w).square().sum(dtype=torch.float64))

    def sqnr_db(self) -> float | None:
        if self.noise == 0:
            return math.inf if self.signal else None
        return 10 * math.log10(self.signal / self.noise)


def reference_weights(folder: Path) -> dict[str, Any]:
    """The checkpoint's weight of every quantizable Linear and of an untied LM head (CPU, its own dtype): what
    the kbit variants' weight SQNR compares to."""
    from torch import nn
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype="auto")
    names = quantizable_linears(model)
    head = model.get_output_embeddings()
    if isinstance(head, nn.Linear) and head.weight is not model.get_input_embeddings().weight:
        names.append(next(n for n, m in model.named_modules() if m is head))
    return {name: model.get_submodule(name).weight.detach() for name in names}


def _stored_bits(module) -> int:
    """Bits of a kbit module's format tensors (``packed_shapes()``; the dtypes its own ``packed_dtypes()`` where it
    has one, int16 block records included, else by the names' format tensor; a rotated weight's sign words too)."""
    from hf_kbit import format as fmt

    dtypes = {**fmt.PACKED_DTYPES, fmt.ROTATION_SIGNS: fmt.ROTATION_SIGNS_DTYPE}
    own = module.packed_dtypes() if hasattr(module, "packed_dtypes") else {}

    def dtype(name: str):
        return own.get(name) or next(d for t, d in dtypes.items() if name.endswith(t))

    return sum(8 * math.prod(shape) * dtype(name).itemsize for name, shape in module.packed_shapes().items())


def kbit_summary(model) -> dict[str, Any]:
    """Storage of a kbit model: average bits/weight of its quantized weights (every KbitLinear and every
    KbitExperts, all format metadata included), share of parameters quantized, which modules they are, and how many
    are stored rotated or with block records; whether v and o were turned per head."""
    from hf_kbit.nn import KbitExperts, KbitLinear

    quantized_elems, quantized_bits, names, rotated, records = 0, 0, [], 0, 0
    for name, module in model.named_modules():
        if isinstance(module, KbitLinear):
            quantized_elems += module.out_features * module.in_features
            rotated += module.rotated
            records += module.block_offsets
        elif isinstance(module, KbitExperts):
            quantized_elems += module.num_experts * sum(
                math.prod(module.layout.linear_shape(p)) for p in module.bits)
            rotated += sum(module.rotated.values())
        else:
            continue
        quantized_bits += _stored_bits(module)
        names.append(name)
    total = quantized_elems + sum(p.numel() for p in model.parameters())
    qc = getattr(model.config, "quantization_config", None)
    turned = qc.get("head_rotation", False) if isinstance(qc, dict) else getattr(qc, "head_rotation", False)
    return {
        "quantized_params": quantized_elems,
        "quantized_fraction": quantized_elems / total if total else 0.0,
        "bits_per_weight": quantized_bits / quantized_elems if quantized_elems else None,
        "quantized_modules": len(names),
        "quantized_modules_sha256": _names_sha256(names),
        "rotated_weights": rotated,  # KbitLinears and experts projections stored rotated (format v3)
        "block_records_weights": records,  # KbitLinears with block offsets (format v4; experts keep uint8 scales)
        "head_rotation": bool(turned),  # v_proj and o_proj turned per attention head (docs/format.md#head-rotation)
    }


def kbit_weight_sqnr(model, reference: dict[str, Any]) -> float | None:
    """Pooled SQNR of every KbitLinear's dequantized weight against ``reference`` (reference_weights), turned per
    head as the model's v and o are when it was quantized with ``head_rotation``."""
    import torch

    from hf_kbit import head_rotation
    from hf_kbit.nn import KbitLinear

    config = getattr(model.config, "quantization_config", None)
    turned = getattr(config, "head_rotation", False) or (isinstance(config, dict) and config.get("head_rotation"))
    roles = {"v_proj": "v", "o_proj": "o"}
    error = WeightError()
    for name, module in model.named_modules():
        if isinstance(module, KbitLinear):
            if name not in reference:
                return None
            approx = module.dequantize_weight(torch.float32)
            want = reference[name].to(approx.device)
            attention, _, proj = name.rpartition(".")
            if turned and proj in roles:
                want = head_rotation.turn(want.float(), roles[proj], model.get_submodule(attention).head_dim)
            error.add(want, approx)
    return error.sqnr_db()


def _rewritten_summary(model, names: list[str], elems: int, bits: float, stored: float,
                       error: WeightError) -> dict[str, Any]:
    """The storage summary of a model whose Linears ``names`` were rewritten in place (anchors, kbitcal):
    ``bits`` and ``stored`` are bits summed over their ``elems`` weights, ``error`` their pooled weight error."""
    total = sum(p.numel() for p in model.parameters())
    return {
        "bits_per_weight": bits / elems if elems else None,
        "stored_bits_per_weight": stored / elems if elems else None,
        "quantized_params": elems,
        "quantized_fraction": elems / total if total else 0.0,
        "quantized_modules": len(names),
        "quantized_modules_sha256": _names_sha256(names),
        "weight_sqnr_db": error.sqnr_db(),
    }


def apply_anchor(model, anchor: Anchor) -> dict[str, Any]:
    """Replace the weight of every quantizable Linear by ``anchor``'s reconstruction, in place (on its device).

    Returns the storage summary (bits/weight averaged over the quantized weights; ``stored_bits_per_weight``
    as the format's own packing holds them) and the pooled weight SQNR against the weights as loaded.
    """
    import torch

    names = quantizable_linears(model)
    error, elems, bits, stored = WeightError(), 0, 0.0, 0.0
    with torch.no_grad():
        for name in names:
            weight = model.get_submodule(name).weight
            approx, stored_bits = anchor.fake_quantize(weight.data)
            error.add(weight.data, approx)
            n, k = weight.shape
            elems += n * k
            bits += anchor.bits_per_weight(n, k) * n * k
            stored += stored_bits * n * k
            weight.data.copy_(approx.to(weight.dtype))
    return {**_rewritten_summary(model, names, elems, bits, stored, error), "anchor": anchor.describe()}


def calibration_tokens(folder: Path, spec: VariantSpec, evaluated: tuple[Any, int] | None):
    """``(batches, facts)``: kbitcal's calibration token batches and what identifies them (JSON-ready).

    Calibration text is the end of ``spec``'s ``corpus``: of the evaluated corpus (the default) only the part
    after its first ``chars`` characters, which the scoring reads, so no calibration token is scored.
    """
    from transformers import AutoTokenizer

    from hf_kbit.calibration import calibration_batches

    from .corpus import load_corpus

    options = {**CAL_OPTIONS, **spec.options}
    if options["corpus"] is None:
        if evaluated is None:
            raise ValueError(f"variant {spec.name!r}: kbitcal calibrates on the evaluated corpus (after the evaluated "
                             "part) by default and needs it; or give corpus=<name or file>")
        corpus, chars = evaluated
        text, where = corpus.text[chars:], f"after the first {chars} characters (the evaluated part)"
    else:
        corpus = load_corpus(str(options["corpus"]))
        text, where = corpus.text, "anywhere"
        if evaluated is not None and evaluated[0].text == corpus.text:
            text, where = corpus.text[evaluated[1]:], f"after the first {evaluated[1]} characters (the evaluated part)"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    try:
        batches = calibration_batches(tokenizer, text, options["samples"], options["seq_len"], options["batch_size"])
    except ValueError as e:
        raise ValueError(f"variant {spec.name!r}: {e} (calibration text: {corpus.name}, {where})") from None
    import torch

    ids = torch.cat(batches).reshape(-1)
    facts = {"corpus": corpus.name, "text": f"the last {ids.numel()} tokens of the corpus, {where}",
             "samples": options["samples"], "seq_len": options["seq_len"],
             "tokens_sha256": hashlib.sha256(ids.numpy().tobytes()).hexdigest()}
    return batches, facts


def apply_calibration(model, folder: Path, spec: VariantSpec, evaluated: tuple[Any, int] | None) -> dict[str, Any]:
    """kbitcal: calibrate the quantizable Linears of ``model`` in place (hf_kbit.calibration.calibrate_model), on
    the model's device; the summary of :func:`apply_anchor`, plus what the calibration read and its seconds."""
    import torch

    from hf_kbit import calibration
    from hf_kbit import format as fmt
    from hf_kbit.nn.fused import codebook_siblings

    start = time.perf_counter()
    batches, facts = calibration_tokens(folder, spec, evaluated)
    options = {**CAL_OPTIONS, **spec.options}
    fit = spec.anchor().fit_settings()  # kbitfit's settings and offsets under kbitcal's options
    settings = calibration.CalibrationSettings(damp=options["damp"], fit=fit, weighted_codebook=options["weighted_codebook"],
                                               weighted_codes=options["weighted_codes"])
    names = quantizable_linears(model)
    error, elems = WeightError(), 0

    def measure(name, linear, packed):
        nonlocal elems
        *tensors, signs = packed  # kbitcal does not rotate: signs is None
        error.add(linear.weight.data, fmt.dequantize(*tensors, linear.in_features))
        elems += linear.weight.numel()

    # Siblings (q/k/v, gate/up) share one codebook, as quantize-on-load with calibration_data gives them.
    siblings = codebook_siblings({name: (model.get_submodule(name).in_features, spec.bits) for name in names})
    groups = list(dict.fromkeys(siblings.values()))
    calibration.calibrate_model(model, batches, spec.bits, names, settings, on_quantized=measure, groups=groups)
    if next(model.parameters()).device.type == "cuda":
        torch.cuda.synchronize()
    bits = sum(fmt.bits_per_weight(*model.get_submodule(n).weight.shape, spec.bits, offsets=fit.offsets)
               * model.get_submodule(n).weight.numel() for n in names)
    version = fmt.OFFSETS_VERSION if fit.offsets else 1
    return {
        **_rewritten_summary(model, names, elems, bits, bits, error),
        "anchor": (f"kbit format v{version}, k = {spec.bits}, calibrated by hf_kbit.calibration (GPTQ error feedback, damp "
                   f"{settings.damp}, codebook and code window of {fit}, weighted codebook "
                   f"{settings.weighted_codebook}, weighted codes {settings.weighted_codes}), dequantized: bits/weight "
                   "as format.bits_per_weight"),
        "calibration": facts,
        "calibration_seconds": round(time.perf_counter() - start, 2),
    }


# ----------------------------------------------------------------------------- loading


def load_variant(folder: Path, spec: VariantSpec, device: str, dtype, dequantize_on_cpu: bool = True,
                 attention: str = "sdpa", reference: dict[str, Any] | None = None,
                 evaluated: tuple[Any, int] | None = None):
    """``(model, info)``: the model of ``folder`` as ``spec`` says, on ``device``, computing in ``dtype``.

    bf16 and anchors load the checkpoint as it is (anchors then rewrite the quantizable Linears' weights on
    ``device``); kbit quantizes on load. On CPU the kbit forward is the pure-PyTorch reference, which
    dequantizes every weight on every call; ``dequantize_on_cpu`` swaps each KbitLinear for an ``nn.Linear``
    holding exactly its dequantized weight (same numbers, much faster). On CUDA the kbit kernels run.
    ``reference`` (reference_weights): with it, kbit variants report their weight SQNR too. ``info`` holds
    the spec, bits/weight with all metadata, the share of parameters quantized, the weight SQNR and
    ``load_seconds`` (loading plus quantizing). ``evaluated``: ``(corpus, chars)``, the corpus being scored and
    how many of its leading characters the scoring reads; kbitcal variants calibrate on the rest of it (or on
    another corpus) and need it.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from hf_kbit.nn import KbitLinear

    start = time.perf_counter()
    kwargs: dict[str, Any] = {"dtype": dtype}
    if attention != "default":  # "default": none named, as a user who names none loads (kbit: KbitConfig's)
        kwargs["attn_implementation"] = attention
    if spec.method == "kbit":
        kwargs["quantization_config"] = spec.kbit_config()
    if device.startswith("cuda"):
        # Load straight onto the GPU: kbit then quantizes on load with its CUDA kernel (bit-identical to the CPU).
        kwargs["device_map"] = device
    model = AutoModelForCausalLM.from_pretrained(folder, **kwargs).to(device)
    model.eval()
    info: dict[str, Any] = {**spec.to_json(), "kbit_forward": None, "weight_sqnr_db": None}
    if spec.method == "bf16":
        info.update({"bits_per_weight": 16.0, "quantized_fraction": 0.0, "quantized_params": 0})
    elif spec.method == "kbit":
        if spec.lm_head_bits is not None:
            head = model.get_output_embeddings()
            if not isinstance(head, KbitLinear):
                raise ValueError(f"--lm-head-bits: the LM head of {folder} is tied to its input embedding, and kbit "
                                 f"keeps a tied LM head in full precision (quantizing it would store the matrix twice)")
            if head.bits != spec.lm_head_bits:
                raise ValueError(f"--lm-head-bits: the LM head of {folder} is not the module {LM_HEAD!r}")
        info.update(kbit_summary(model))
        if reference is not None:
            info["weight_sqnr_db"] = kbit_weight_sqnr(model, reference)
        info["kbit_forward"] = "kernel" if device.startswith("cuda") else "reference"
        if dequantize_on_cpu and not device.startswith("cuda"):
            model.dequantize(dtype=dtype)
            info["kbit_forward"] = "dequantized-to-nn.Linear"
    elif spec.method == "kbitcal":
        info.update(apply_calibration(model, folder, spec, evaluated))
    else:
        info.update(apply_anchor(model, spec.anchor()))
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    info["load_seconds"] = round(time.perf_counter() - start, 2)
    torch.manual_seed(0)
    return model, info

"""KbitConfig: the one place a kbit quantization is described, validated once, JSON round-trip."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

try:
    from re import _parser as _re_parser
except ImportError:  # Python 3.10
    import sre_parse as _re_parser

from transformers.utils.quantization_config import QuantizationConfigMixin

from . import format as fmt
from .fitting import FITTINGS
from .rotation_policy import check_rotation, check_seed

QUANT_METHOD = "kbit"

# Calibration (KbitConfig.calibration_data): GPTQ-style error feedback (hf_kbit.calibration) on this many tokens by
# default, GPTQ's usual 128 sequences of 2048.
CALIBRATION_METHOD = "gptq"
CALIBRATION_DEFAULTS = {"calibration_samples": 128, "calibration_seq_len": 2048}

# Facts of format v1 written into every config so that a reader needs nothing else.
_FORMAT_FACTS = {
    "block_size": fmt.BLOCK_SIZE,
    "tile_n": fmt.TILE_N,
    "tile_k": fmt.TILE_K,
    "scale_format": "e4m4+row_f32",
}

# Patterns come from config.json, i.e. from whoever published the checkpoint, and Python's
# backtracking matcher has no time limit: "(.*)*#" runs for hours on one module name. So a pattern
# must have a structure whose matching cost is bounded (check_pattern; the worst patterns that pass
# take about 2 ms on a 100-character module name on one CPU core, common ones microseconds).
MAX_PATTERN_LENGTH = 256
MAX_PATTERNS = 1024  # entries per field
_NAME_LENGTH = 64  # a long module name: the scale of the cost estimate
MAX_PATTERN_PATHS = 1 << 14  # backtracking paths from one start position: two free repeats (.*) and a '?'
MAX_PATTERN_ALTERNATIVES = 1 << 8  # of those, paths through alternations (a|b), which cost ~10x a repeat's
MAX_CONFIG_PATHS = 1 << 15  # summed over all patterns of a config
_REPEATS = ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT")


class KbitConfig(QuantizationConfigMixin):
    """Configuration of k-bit codebook weight quantization.

    Args:
        bits: bits per weight index, one of 2, 3, 4, 5.
        codebook: ``"nf"`` (normal-float levels with an exact zero), ``"nf-sym"``
            (equiprobable normal-float levels), a list of ``2**bits`` increasing values in
            [-1, 1], or ``None`` for the measured default of each k.
        modules_to_not_convert: modules kept in full precision, with everything below them:
            dotted prefixes (``model.layers.0``), name components (``lm_head``,
            ``shared_expert``) or full-name regexes (held to the bounds of ``module_bits``'
            patterns). ``None`` keeps the output embedding (LM head) and tied weights
            unquantized; an explicit list replaces that default, but a module whose weight is
            tied to another's (an LM head sharing the input embedding) stays unquantized either way.
        module_bits: ``{regex: bits}``; a Linear/experts module whose full name matches a
            pattern (``re.search``, first match wins) uses those bits instead of ``bits``.
            Patterns must match in bounded time: at most 256 characters, no repeat containing
            another repeat, an alternation or a backreference (``(a+)*``, ``(ab|c)+``), and few
            enough repeats and alternatives (:func:`check_pattern`).
        fitting: how quantization chooses each layer's block scale codes and codebook:
            ``"fit"`` searches each block's code for the least squared error and fits the
            codebook to the layer (Lloyd iterations started from ``codebook``; an explicit list
            of values is kept as given); ``"absmax"`` rounds each block's absmax up and uses
            ``codebook`` as is. ``None`` takes the measured default of each k
            (:data:`hf_kbit.fitting.DEFAULT_FITTING`). Inference costs the same either way.
        rotation: store weights rotated along K (format v3): ``W R`` with ``R`` the seeded block Hadamard of
            :mod:`hf_kbit.rotation` (segments of 8), quantized as above, and the kernels turn the activations
            to match (``x R``), so outputs are unchanged up to quantization. ``False`` (default): never; ``True``:
            every quantized weight whose in_features is a multiple of 64 (the others stay unrotated); ``"inputs"``:
            those of the input projections only, every layer but the output projections that write the residual
            stream (``o_proj``, ``down_proj``, the experts' ``down_proj``, ...: ``rotation_policy.OUTPUT_PROJECTIONS``),
            at k = 3 the setting measured better than HQQ 3-bit on both offline models (docs/format.md#rotation);
            ``"auto"``:
            per group of weights that read one input (q/k/v, gate/up, all experts of a projection) where it
            lowers the group's relative weight error, decided data-free (:mod:`hf_kbit.rotation_policy`). With
            calibration, GPTQ then runs on the rotated weights with the rotated inputs' Hessian. A rotation costs
            the kernels a transform of their input (docs/kernels.md).
        rotation_seed: the seed of the rotation's signs (an int in [0, 2**64), default 0); the sign words are
            stored with each rotated layer.
        head_rotation: turn v_proj's output and o_proj's input per attention head by one orthogonal matrix before
            quantizing (:mod:`hf_kbit.head_rotation`): the model computes the same function, its v and o weights
            quantize with less loss, and nothing changes at inference (format v1 tensors, the same kernels).
            ``dequantize()`` turns them back. Only for attention classes where it is exact (Llama, Mistral,
            Mixtral, Qwen2, Qwen3 and their MoE variants); ``True`` on others is refused. ``None`` (default): on at
            k <= 4, data-free, without ``rotation`` and without block offsets (``block_offsets=False`` or
            ``fitting="absmax"``), where the model's attention allows it, off otherwise
            (:func:`hf_kbit.head_rotation.resolve`; measured in docs/format.md#head-rotation); a quantized model's
            config (``model.config.quantization_config``) records what was done.
        block_offsets: give each block of 32 of the Linear layers an offset as well as a scale (format v4: int16
            block records, :mod:`hf_kbit.format`): a block is centred on its midrange before the codebook and scale
            are chosen (at k = 5 only where that lowers its error, :func:`hf_kbit.fitting.offset_blocks`), which suits
            weights whose blocks are not centred on zero (zero-point formats such as GGUF Q4_1 and HQQ store one
            too). 8 more bits per block (+0.25 bits/weight). With ``calibration_data`` each block's offset is chosen
            as the error feedback reaches the block (:mod:`hf_kbit.calibration`); fused MoE experts keep plain scales
            either way. ``None`` (default): on, except with ``rotation`` or ``fitting="absmax"``
            (:meth:`resolved_block_offsets`; no kernel reads records rotated, and absmax is the format's plain
            rule); with them k = 3 and 4 measure below HQQ 3- and 4-bit g64 at equal bits on both offline models'
            prose (a tie at k = 4 on Qwen's code) and k = 5 within 1% of bf16 (docs/format.md#block-offsets).
            The CUDA GEMV (with or without the fused prologues), the sm_90a GEMM and the dequantize kernel read
            the records; a decode call costs 2-5% more than on uint8 scales (docs/kernels.md). ``False``: uint8
            scales, format v1/v3. A quantized model's config records what was done; a pre-quantized checkpoint
            without the field has none.
        format_version: version of the packed format; a checkpoint newer than this library
            is refused. ``None``: 1, which quantization raises to 3 once a layer is stored rotated and to 4 once
            one holds block records.
        fuse_projections: after loading, run sibling projections that read the same input
            (``q_proj``/``k_proj``/``v_proj``, ``gate_proj``/``up_proj``) as one kbit launch
            each (:func:`hf_kbit.nn.fuse_projections`); a runtime choice, the checkpoint's
            tensors are the same either way.
        calibration_data: text to calibrate on (quantize-on-load and ``kbit-convert`` only): the text itself
            (a ``str``), several texts (a list of ``str``, joined by blank lines), or a UTF-8 text file (a
            ``pathlib.Path``, or a one-line ``str`` naming an existing file). The Linears and fused MoE experts
            of the decoder layers are then quantized decoder layer by decoder layer with GPTQ-style error
            feedback (:mod:`hf_kbit.calibration`) on the last ``calibration_samples x calibration_seq_len``
            tokens of the text (each expert on the tokens routed to it), with the codebooks and fitting that
            quantization without data would use. The model is loaded unquantized first (on its device), so
            this needs memory for the unquantized model. Inference costs the same either way. ``None``: data-free.
            Not saved: the checkpoint records only ``calibration`` (method and token counts).
        calibration_samples: sequences of calibration tokens (default 128).
        calibration_seq_len: tokens per sequence (default 2048).
        calibration_tokenizer: the tokenizer that turns ``calibration_data`` into tokens: a tokenizer, or a
            Hub repo id or folder to load one from; ``None``: the model's own (its folder or repo). Not saved.
        calibration: what a calibrated checkpoint records (``{"method": "gptq", "samples", "seq_len",
            "tokens"}``), read from its config.json; set from the other calibration fields, never by hand.
        fusion_pass: ``generate()``'s compile of the decode step (static cache, CUDA) runs
            :func:`hf_kbit.fusion.compile_config`: hf_kbit's fusion pass (RMSNorm and SiLU-mul into the
            kbit GEMVs of single-token steps), inductor's combo kernels and, on sm_90+, PDL. Set as the
            model's default compile config after loading (:func:`hf_kbit.fusion.use_as_default`); a
            ``compile_config`` passed to ``generate()`` or set in the model's ``generation_config`` takes
            precedence. ``False`` leaves transformers' default. A runtime choice, like ``fuse_projections``.
        decode_attention: attend with :mod:`hf_kbit.attention`'s ``attn_implementation="kbit_decode"`` where the
            model would run transformers' ``sdpa``: single-token (decode) calls serve each key/value head's query
            heads at once without copying the cache per query head, everything else is ``sdpa`` unchanged. Set after
            loading when ``from_pretrained`` was given no ``attn_implementation`` (one given is kept), and by
            :func:`hf_kbit.quantize_model` on a model that attends with ``sdpa``
            (:func:`hf_kbit.attention.use_as_default`). ``False`` leaves the model's attention. A runtime choice.
    """

    def __init__(
        self,
        bits: int = 4,
        codebook: str | list[float] | None = None,
        modules_to_not_convert: list[str] | None = None,
        module_bits: dict[str, int] | None = None,
        fitting: str | None = None,
        format_version: int | None = None,
        fuse_projections: bool = True,
        calibration_data: str | os.PathLike | list[str] | None = None,
        calibration_samples: int | None = None,
        calibration_seq_len: int | None = None,
        calibration_tokenizer: Any = None,
        calibration: dict[str, Any] | None = None,
        fusion_pass: bool = True,
        decode_attention: bool = True,
        rotation: bool | str = False,
        rotation_seed: int = 0,
        head_rotation: bool | None = None,
        block_offsets: bool | None = None,
        **kwargs: Any,
    ):
        self.quant_method = QUANT_METHOD
        self.bits = bits
        self.codebook = list(codebook) if isinstance(codebook, tuple) else codebook
        self.modules_to_not_convert = modules_to_not_convert
        self.module_bits = dict(module_bits) if module_bits else {}
        self.fitting = fitting
        self.format_version = 1 if format_version is None else format_version
        self.fuse_projections = fuse_projections
        self.calibration_data = calibration_data
        self.calibration_samples = calibration_samples
        self.calibration_seq_len = calibration_seq_len
        self.calibration_tokenizer = calibration_tokenizer
        self.calibration = calibration
        self.fusion_pass = fusion_pass
        self.decode_attention = decode_attention
        self.rotation = rotation
        self.rotation_seed = rotation_seed
        self.head_rotation = head_rotation
        self.block_offsets = block_offsets
        kwargs.pop("quant_method", None)
        for key, value in _FORMAT_FACTS.items():
            if kwargs.pop(key, value) != value:
                raise ValueError(f"KbitConfig: {key}={value!r} is fixed by format v{fmt.FORMAT_VERSION}")
        if kwargs:
            raise TypeError(f"KbitConfig got unexpected field(s) {sorted(kwargs)}; known fields: {self._fields()}")
        self.post_init()

    @staticmethod
    def _fields() -> list[str]:
        return ["bits", "codebook", "modules_to_not_convert", "module_bits", "fitting", "format_version", "fuse_projections",
                "calibration_data", "calibration_samples", "calibration_seq_len", "calibration_tokenizer", "calibration", "fusion_pass",
                "decode_attention", "rotation", "rotation_seed", "head_rotation", "block_offsets"]

    def post_init(self) -> None:
        """Validate every field; errors name the field, the expectation and the value."""
        _check_bits("bits", self.bits)
        if not isinstance(self.module_bits, dict):
            raise TypeError(f"KbitConfig.module_bits must be a dict {{regex: bits}}, got {type(self.module_bits)}")
        if len(self.module_bits) > MAX_PATTERNS:
            raise ValueError(f"KbitConfig.module_bits has {len(self.module_bits)} patterns, at most {MAX_PATTERNS}")
        paths = 0
        for pattern, bits in self.module_bits.items():
            _check_bits(f"module_bits[{pattern!r}]", bits)
            paths += check_pattern(pattern, "KbitConfig.module_bits key")
        all_bits = {self.bits, *self.module_bits.values()}
        if self.codebook is None or isinstance(self.codebook, str):
            if self.codebook is not None and self.codebook not in fmt.CODEBOOKS:
                raise ValueError(
                    f"KbitConfig.codebook must be one of {fmt.CODEBOOKS}, a list of values or None, got {self.codebook!r}"
                )
        elif isinstance(self.codebook, list):
            if len(all_bits) != 1:
                raise ValueError("KbitConfig.codebook as explicit values needs one bits for all modules (no module_bits)")
            fmt.make_codebook(self.codebook, self.bits, "KbitConfig.codebook")  # validates
        else:
            raise TypeError(f"KbitConfig.codebook must be a str, a list of floats or None, got {type(self.codebook)}")
        if self.modules_to_not_convert is not None and not (
            isinstance(self.modules_to_not_convert, list) and all(isinstance(m, str) for m in self.modules_to_not_convert)
        ):
            raise TypeError(
                f"KbitConfig.modules_to_not_convert must be a list of module names, got {self.modules_to_not_convert!r}"
            )
        if self.modules_to_not_convert is not None:
            if len(self.modules_to_not_convert) > MAX_PATTERNS:
                raise ValueError(
                    f"KbitConfig.modules_to_not_convert has {len(self.modules_to_not_convert)} entries, "
                    f"at most {MAX_PATTERNS}"
                )
            for entry in self.modules_to_not_convert:
                paths += check_pattern(entry, "KbitConfig.modules_to_not_convert entry")
        if paths > MAX_CONFIG_PATHS:
            raise ValueError(
                f"KbitConfig: the patterns of module_bits and modules_to_not_convert together cost {paths} "
                f"backtracking paths per match, at most {MAX_CONFIG_PATHS}; use fewer or simpler patterns"
            )
        if self.fitting is not None and self.fitting not in FITTINGS:
            raise ValueError(f"KbitConfig.fitting must be one of {FITTINGS} or None, got {self.fitting!r}")
        for field in ("fuse_projections", "fusion_pass", "decode_attention"):
            if not isinstance(getattr(self, field), bool):
                raise TypeError(f"KbitConfig.{field} must be a bool, got {getattr(self, field)!r}")
        for field in ("head_rotation", "block_offsets"):
            if getattr(self, field) is not None and not isinstance(getattr(self, field), bool):
                raise TypeError(f"KbitConfig.{field} must be a bool or None, got {getattr(self, field)!r}")
        check_rotation(self.rotation)
        check_seed(self.rotation_seed)
        if self.rotation is False and self.rotation_seed != 0:
            raise ValueError(f"KbitConfig.rotation_seed={self.rotation_seed!r} has no effect with rotation=False; pass "
                             "rotation=True, 'inputs' or 'auto' (or drop rotation_seed)")
        if not isinstance(self.format_version, int) or isinstance(self.format_version, bool) or self.format_version < 1:
            raise ValueError(f"KbitConfig.format_version must be a positive int, got {self.format_version!r}")
        if self.format_version in fmt.UNREADABLE_VERSIONS:
            raise ValueError(
                f"This checkpoint uses kbit format v{self.format_version} "
                f"({fmt.UNREADABLE_VERSIONS[self.format_version]}); this hf-kbit writes and reads v{fmt.FORMAT_VERSION}. "
                "Convert the source model again (`kbit-convert ... --rotation on`, or KbitConfig(rotation=True) on load)."
            )
        if self.format_version > fmt.FORMAT_VERSION:
            raise ValueError(
                f"This checkpoint uses kbit format v{self.format_version}; this hf-kbit reads up to "
                f"v{fmt.FORMAT_VERSION}. Upgrade: `pip install -U hf-kbit`."
            )
        self._check_calibration()

    def _check_calibration(self) -> None:
        data = self.calibration_data
        if data is None:
            given = [name for name in ("calibration_samples", "calibration_seq_len", "calibration_tokenizer")
                     if getattr(self, name) is not None]
            if given:
                raise ValueError(f"KbitConfig.{given[0]} was given without calibration_data; pass the text to "
                                 "calibrate on as calibration_data (or drop it)")
            if self.calibration is not None:
                _check_calibration_record(self.calibration)
            return
        if self.calibration is not None:
            raise ValueError("KbitConfig.calibration is the record a calibrated checkpoint keeps; it is set from "
                             f"calibration_data and must not be passed with it, got {self.calibration!r}")
        if isinstance(data, os.PathLike):
            if not os.path.isfile(data):
                raise ValueError(f"KbitConfig.calibration_data: expected a UTF-8 text file, got {os.fspath(data)!r}, "
                                 "which is not a file")
        elif isinstance(data, list):
            if not data or not all(isinstance(t, str) for t in data):
                raise TypeError("KbitConfig.calibration_data as a list must be a non-empty list of str, got "
                                f"{_describe(data)}")
        elif not isinstance(data, str):
            raise TypeError("KbitConfig.calibration_data must be a str (the text, or a file name), a list of str or "
                            f"a pathlib.Path, got {_describe(data)}")
        if isinstance(data, (str, list)) and not "".join(data).strip():
            raise ValueError("KbitConfig.calibration_data is empty (only whitespace); pass the text to calibrate on")
        for name in ("calibration_samples", "calibration_seq_len"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"KbitConfig.{name} must be a positive int (or None for "
                                 f"{CALIBRATION_DEFAULTS[name]}), got {value!r}")
        tokenizer = self.calibration_tokenizer
        if tokenizer is not None and not (isinstance(tokenizer, str) and tokenizer.strip()) and not callable(tokenizer):
            raise TypeError("KbitConfig.calibration_tokenizer must be a tokenizer, a Hub repo id or folder (str), or "
                            f"None for the model's own, got {_describe(tokenizer)}")

    @property
    def calibrates(self) -> bool:
        """Whether quantization with this config calibrates (``calibration_data`` is set)."""
        return self.calibration_data is not None

    def calibration_shape(self) -> tuple[int, int]:
        """``(samples, seq_len)`` of the calibration tokens (the defaults where None)."""
        samples = self.calibration_samples or CALIBRATION_DEFAULTS["calibration_samples"]
        return samples, self.calibration_seq_len or CALIBRATION_DEFAULTS["calibration_seq_len"]

    def calibration_text(self) -> str:
        """The text of ``calibration_data``: read from its file, or joined from its list."""
        data = self.calibration_data
        if isinstance(data, list):
            return "\n\n".join(data)
        path = data if isinstance(data, os.PathLike) else _as_file_name(data)
        if path is None:
            return data
        try:
            return Path(path).read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"KbitConfig.calibration_data: {os.fspath(path)!r} is not UTF-8 text ({e})") from None
        except OSError as e:
            raise ValueError(f"KbitConfig.calibration_data: cannot read {os.fspath(path)!r} ({e})") from None

    def calibration_record(self) -> dict[str, Any] | None:
        """What a checkpoint quantized with this config records about its calibration (None: data-free)."""
        if not self.calibrates:
            return self.calibration
        samples, seq_len = self.calibration_shape()
        return {"method": CALIBRATION_METHOD, "samples": samples, "seq_len": seq_len, "tokens": samples * seq_len}

    def resolved_block_offsets(self, pre_quantized: bool = False) -> bool:
        """Whether quantization with this config gives blocks offsets: ``block_offsets`` ``True`` or ``False`` as
        given; ``None``: on unless ``rotation`` is on (no kernel reads block records rotated) or ``fitting`` is
        ``"absmax"`` (the format's plain rule). A pre-quantized checkpoint without the field has none: ``None`` is
        ``False`` there."""
        if self.block_offsets is not None or pre_quantized:
            return bool(self.block_offsets)
        return self.rotation is False and self.fitting != "absmax"

    def bits_for(self, module_name: str) -> int:
        """Bits of the module called ``module_name`` (``module_bits`` first, then ``bits``)."""
        for pattern, bits in self.module_bits.items():
            if re.search(pattern, module_name):
                return bits
        return self.bits

    def to_dict(self) -> dict[str, Any]:
        return {
            "quant_method": QUANT_METHOD,
            "bits": self.bits,
            "codebook": self.codebook,
            "modules_to_not_convert": self.modules_to_not_convert,
            "module_bits": dict(self.module_bits),
            "fitting": self.fitting,
            "format_version": self.format_version,
            "fuse_projections": self.fuse_projections,
            # Runtime choices off their default only, so checkpoints stay readable by versions without the field.
            **({"fusion_pass": False} if not self.fusion_pass else {}),
            **({"decode_attention": False} if not self.decode_attention else {}),
            # Only a calibrated checkpoint has the field, so data-free ones stay readable by earlier versions.
            **({"calibration": record} if (record := self.calibration_record()) is not None else {}),
            # Rotation off its default only: checkpoints without it stay readable by versions without the fields.
            **({"rotation": self.rotation} if self.rotation is not False else {}),
            **({"rotation_seed": self.rotation_seed} if self.rotation_seed != 0 else {}),
            **({"head_rotation": True} if self.head_rotation else {}),
            **({"block_offsets": True} if self.block_offsets else {}),
            **_FORMAT_FACTS,
        }

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KbitConfig) and self.to_dict() == other.to_dict()


def check_pattern(pattern: Any, field: str = "pattern") -> int:
    """Raise ValueError unless ``pattern`` is a regex that matches module names in bounded time;
    returns its cost estimate (:func:`_match_paths`). ``field`` names it in errors."""
    if not isinstance(pattern, str):
        raise TypeError(f"{field} must be a str, got {type(pattern).__name__} {pattern!r}")
    if len(pattern) > MAX_PATTERN_LENGTH:
        raise ValueError(f"{field} {pattern[:40]!r}... has {len(pattern)} characters, at most {MAX_PATTERN_LENGTH}")
    try:
        re.compile(pattern)
        parsed = _re_parser.parse(pattern)
    except (re.error, OverflowError, RecursionError) as e:
        raise ValueError(f"{field} {pattern!r} is not a valid regex: {e}") from None
    paths, alternatives = _match_paths(parsed, pattern, field)
    if paths > MAX_PATTERN_PATHS or alternatives > MAX_PATTERN_ALTERNATIVES:
        raise ValueError(
            f"{field} {pattern!r} may backtrack through {paths} paths per match ({alternatives} through "
            f"alternations), at most {MAX_PATTERN_PATHS} ({MAX_PATTERN_ALTERNATIVES}); use fewer repeats "
            "(*, +, {m,n}) and alternatives (|)"
        )
    return paths


def _match_paths(items, pattern: str, field: str) -> tuple[int, int]:
    """Upper bounds on the paths a backtracking matcher tries from one start position on a name of
    ``_NAME_LENGTH`` characters, all and those through alternations: a repeat tries up to that many
    counts, an alternation each alternative, a sequence every combination. Sound because no repeat
    may hold another repeat, an alternation or a backreference (refused here): those are what make
    the count exponential in the name's length."""
    paths = alternatives = 1
    for op, av in items:
        name = op.name
        if name in _REPEATS and av[1] > 1:
            _refuse_backtracking_in_repeat(av[2], pattern, field)
            paths *= min(av[1], _NAME_LENGTH) + 1
            continue
        if name in _REPEATS:  # at most once: matched or skipped
            sub, sub_alternatives = _match_paths(av[2], pattern, field)
            paths, alternatives = paths * (sub + 1), alternatives * sub_alternatives
        elif name in ("SUBPATTERN", "ATOMIC_GROUP", "ASSERT", "ASSERT_NOT", "GROUPREF_EXISTS", "BRANCH"):
            if name == "GROUPREF_EXISTS":
                branches = [av[1], av[2] or []]
            elif name == "BRANCH":
                branches = av[1]
            else:
                branches = [av if name == "ATOMIC_GROUP" else av[-1]]
            counts = [_match_paths(branch, pattern, field) for branch in branches]
            sub = sum(c[0] for c in counts)
            sub_alternatives = sum(c[1] for c in counts) if len(branches) > 1 else counts[0][1]
            paths, alternatives = paths * sub, alternatives * sub_alternatives
    return paths, alternatives


def _refuse_backtracking_in_repeat(items, pattern: str, field: str) -> None:
    for op, av in items:
        name = op.name
        what = {"BRANCH": "an alternation (|)", "GROUPREF": "a backreference", "GROUPREF_EXISTS": "a conditional"}
        what.update(dict.fromkeys(_REPEATS, "another repeat"))
        if name in what:
            raise ValueError(
                f"{field} {pattern!r} has a repeat (*, +, {{m,n}}) containing {what[name]}, which can backtrack "
                "for hours; rewrite it without nesting (e.g. '.*' instead of '(.*)*')"
            )
        if name in ("SUBPATTERN", "ASSERT", "ASSERT_NOT"):
            _refuse_backtracking_in_repeat(av[-1], pattern, field)
        elif name == "ATOMIC_GROUP":
            _refuse_backtracking_in_repeat(av, pattern, field)


def _check_calibration_record(record: Any) -> None:
    """A ``calibration`` record read from a checkpoint's config.json: its keys and their values."""
    keys = {"method", "samples", "seq_len", "tokens"}
    if not isinstance(record, dict) or set(record) != keys:
        raise ValueError(f"KbitConfig.calibration must be a dict with keys {sorted(keys)}, got {record!r}")
    if record["method"] != CALIBRATION_METHOD:
        raise ValueError(f"KbitConfig.calibration['method'] must be {CALIBRATION_METHOD!r}, got {record['method']!r}")
    for key in ("samples", "seq_len", "tokens"):
        value = record[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"KbitConfig.calibration[{key!r}] must be a positive int, got {value!r}")


def _as_file_name(text: str) -> str | None:
    """``text`` if it names an existing file (one line, short), else None: then it is the text itself."""
    if len(text) > 4096 or "\n" in text or "\0" in text or not text.strip():
        return None
    return text if os.path.isfile(os.path.expanduser(text)) else None


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"[:200]


def _check_bits(field: str, bits: Any) -> None:
    if not isinstance(bits, int) or isinstance(bits, bool) or bits not in fmt.SUPPORTED_BITS:
        raise ValueError(f"KbitConfig.{field} must be one of {fmt.SUPPORTED_BITS}, got {bits!r}")

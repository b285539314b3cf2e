"""``kbit-convert``: a thin command-line shell over :func:`hf_kbit.convert.convert`.

Everything is parsed and validated before any model, GPU or network is touched; heavy
imports happen inside :func:`main` after that.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from .kernel_table import SUPPORTED_BITS  # checked again by KbitConfig

EPILOG = """\
examples:
  kbit-convert ./my-model --bits 4 --out ./my-model-kbit4
  kbit-convert org/model --revision main --bits 3 --module-bits 'mlp\\.down_proj=4' --out ./model-kbit3
  kbit-convert model.gguf --bits 4 --dtype bfloat16 --out ./model-kbit4
  kbit-convert ./my-model --bits 3 --calibration-data corpus.txt --out ./my-model-kbit3-cal
  kbit-convert ./my-model --bits 3 --rotation auto --out ./my-model-kbit3-rot
  kbit-convert ./my-model --bits 4 --out ./my-model-kbit4 --eval --push-to-hub me/my-model-kbit4 --private
  kbit-convert ./my-model-kbit4 --push-to-hub me/my-model-kbit4      (push an existing kbit folder again)

The Hub token comes from huggingface_hub's usual sources (HF_TOKEN or `hf auth login`); it is never printed.
"""

DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")
FITTING_CHOICES = ("absmax", "fit")  # hf_kbit.fitting.FITTINGS (a test checks), listed so --help needs no torch import
# --rotation's words for KbitConfig.rotation (hf_kbit.rotation_policy.ROTATIONS; a test checks)
ROTATION_CHOICES = {"off": False, "on": True, "auto": "auto", "inputs": "inputs"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kbit-convert",
        description="Convert a Hugging Face model to a k-bit (kbit) checkpoint, streaming shard by shard.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "model",
        help="input: a local model folder (config.json + *.safetensors), a .gguf file, or a Hub repo id "
        "(org/name). A folder that is already a kbit checkpoint is only pushed (with --push-to-hub).",
    )
    p.add_argument("--out", type=Path, help="output folder (required unless pushing an existing kbit folder)")
    q = p.add_argument_group("quantization")
    q.add_argument("--bits", type=int, default=4, choices=SUPPORTED_BITS, help="bits per weight index (default: 4)")
    q.add_argument(
        "--codebook",
        default=None,
        help="'nf' (normal-float with an exact zero), 'nf-sym' (equiprobable normal-float), or a JSON list of "
        "2**bits increasing values in [-1, 1] (default: the measured default of each k)",
    )
    q.add_argument(
        "--fitting",
        default=None,
        choices=FITTING_CHOICES,
        help="'fit': block scale codes chosen by least squared error and a codebook fitted to each layer; "
        "'absmax': block absmax rounded up and the codebook as given (default: the measured default of each k, "
        "'fit' today); inference costs the same either way",
    )
    q.add_argument(
        "--rotation",
        default="off",
        choices=tuple(ROTATION_CHOICES),
        help="store weights rotated along K by a seeded block Hadamard (format v3; the kernels turn the activations "
        "to match): 'on' every weight whose in_features is a multiple of 64, 'inputs' those of the input "
        "projections (not o_proj/down_proj; at k = 3 measured below HQQ 3-bit on both offline models), 'auto' where "
        "it lowers the weight error (decided per group of weights reading one input), 'off' never (default)",
    )
    q.add_argument("--rotation-seed", type=int, default=None, metavar="SEED",
                   help="seed of the rotation's signs, an int in [0, 2**64) (default: 0; needs a --rotation but off)")
    q.add_argument("--head-rotation", nargs="?", const="on", default=None, choices=("on", "off"),
                   help="turn v_proj's output and o_proj's input per attention head before quantizing: the same "
                   "model, less quantization loss, no inference cost (Llama, Mistral, Mixtral, Qwen2/3 and MoE). "
                   "Default: on at k <= 4 without block offsets, --rotation or --calibration-data where the model "
                   "allows it; '--head-rotation' alone is 'on'")
    q.add_argument("--block-offsets", nargs="?", const="on", default=None, choices=("on", "off"),
                   help="give each block of 32 of the Linear weights an offset as well as a scale (format v4, 8 more "
                   "bits per block: +0.25 bits/weight; k = 3 and 4 measure below HQQ 3- and 4-bit at it); with "
                   "--calibration-data too; fused MoE experts keep plain scales. Default: on without --rotation or "
                   "--fitting absmax; 'off' for format v1's uint8 scales (2-5%% faster decode calls); "
                   "'--block-offsets' alone is 'on'")
    q.add_argument(
        "--module-bits",
        action="append",
        default=[],
        metavar="REGEX=BITS",
        help="per-module bits: modules whose full name matches REGEX (re.search, first match wins) use BITS; "
        "repeatable, e.g. --module-bits 'mlp\\.down_proj=5'. Fused MoE experts match as "
        "'<experts module>.gate_up_proj' and '.down_proj', e.g. 'experts\\.down_proj=5'",
    )
    q.add_argument(
        "--skip-modules",
        nargs="*",
        default=None,
        metavar="NAME",
        help="module names (or name suffixes/regexes) kept in full precision, e.g. lm_head experts "
        "shared_expert; replaces the default (lm_head and tied embeddings); with no names, every Linear is "
        "quantized, the LM head too (e.g. with --module-bits '^lm_head$=5'); an LM head tied to the input "
        "embedding stays full precision either way",
    )
    q.add_argument(
        "--calibration-data",
        type=Path,
        default=None,
        metavar="FILE",
        help="calibrate on this UTF-8 text file: the decoder layers' Linears are quantized layer by layer with "
        "GPTQ-style error feedback on the last SAMPLES x SEQ_LEN tokens of it (MoE experts: each on the tokens routed "
        "to it). "
        "The model is then loaded whole, unquantized, on --device instead of streamed. Same inference cost",
    )
    q.add_argument("--calibration-samples", type=int, default=None, metavar="SAMPLES",
                   help="sequences of calibration tokens (default: 128)")
    q.add_argument("--calibration-seq-len", type=int, default=None, metavar="SEQ_LEN",
                   help="tokens per calibration sequence (default: 2048)")
    q.add_argument("--calibration-tokenizer", default=None, metavar="NAME_OR_FOLDER",
                   help="tokenizer for --calibration-data (default: the model's own)")
    q.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPE_CHOICES,
        help="dtype of unquantized tensors and of weights before quantization (default: auto, as from_pretrained)",
    )
    q.add_argument("--device", default="auto", help="where to quantize: auto (cuda when present), cpu, cuda, cuda:N")
    io = p.add_argument_group("input and output")
    io.add_argument("--revision", default=None, help="branch, tag or commit of a Hub input repo")
    io.add_argument("--max-shard-size", default="5GB", help="output shard size limit, e.g. 5GB, 500MB (default: 5GB)")
    io.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a non-empty --out: only the folder there now, once the new output is complete (never the "
        "source, the current folder, home or a folder holding them)",
    )
    io.add_argument("--dry-run", action="store_true", help="print what would be produced (size, bits/weight) and exit")
    io.add_argument("--no-progress", action="store_true", help="no progress bars")
    ev = p.add_argument_group("model card and evaluation")
    ev.add_argument(
        "--eval",
        action="store_true",
        help="measure perplexity of the source and the converted model on a short text and record it in the card "
        "(loads both models whole)",
    )
    ev.add_argument("--eval-text", type=Path, default=None, help="text file for --eval (default: a short built-in passage)")
    ev.add_argument("--eval-tokens", type=int, default=512, help="tokens of the text used by --eval (default: 512)")
    ev.add_argument("--base-model", default=None, help="Hub repo id of the base model, for the card (default: a Hub input)")
    hub = p.add_argument_group("push to the Hub")
    hub.add_argument("--push-to-hub", metavar="REPO", default=None, help="push the output to this Hub repo (org/name)")
    hub.add_argument("--private", action="store_true", help="create the Hub repo private")
    hub.add_argument("--push-revision", metavar="BRANCH", default=None, help="branch to push to (created if missing)")
    hub.add_argument("--commit-message", default=None, help="commit message of the push")
    return p


_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


def _parse_module_bits(parser, items: Sequence[str]) -> dict[str, int]:
    module_bits = {}
    for item in items:
        pattern, sep, bits = item.rpartition("=")
        if not sep or not pattern or not bits.strip().isdigit():
            parser.error(f"--module-bits expects REGEX=BITS, got {item!r}")
        if int(bits) not in SUPPORTED_BITS:
            parser.error(f"--module-bits {item!r}: bits must be one of {SUPPORTED_BITS}")
        from .config import check_pattern  # KbitConfig's bounds on patterns, checked before any work

        try:
            check_pattern(pattern, f"--module-bits {item!r}: the regex")
        except (TypeError, ValueError) as e:
            parser.error(str(e))
        module_bits[pattern] = int(bits)
    return module_bits


def _parse_codebook(parser, value: str | None):
    if value is None or not value.lstrip().startswith("["):
        return value
    try:
        values = json.loads(value)
    except ValueError as e:
        parser.error(f"--codebook: not a JSON list of numbers ({e})")
    if not isinstance(values, list) or not all(isinstance(v, (int, float)) for v in values):
        parser.error("--codebook: expected a JSON list of numbers")
    return [float(v) for v in values]


def _is_kbit_folder(path: Path) -> bool:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    quantization = config.get("quantization_config") if isinstance(config, dict) else None
    return isinstance(quantization, dict) and quantization.get("quant_method") == "kbit"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)

    # ---- validate everything before touching a model, the GPU or the network
    push_only = Path(args.model).is_dir() and _is_kbit_folder(Path(args.model))
    if push_only:
        if args.out is not None:
            parser.error(f"{args.model} is already a kbit checkpoint; to push it again, drop --out")
        if not args.push_to_hub:
            parser.error(f"{args.model} is already a kbit checkpoint; nothing to convert (use --push-to-hub to push it)")
    elif args.out is None and not args.dry_run:
        parser.error("--out is required")
    if args.push_to_hub and not _REPO_ID.match(args.push_to_hub):
        parser.error(f"--push-to-hub expects a repo id like 'org/name', got {args.push_to_hub!r}")
    if args.dry_run and args.push_to_hub:
        parser.error("--dry-run writes nothing, so there is nothing to push; drop one of them")
    if (args.private or args.push_revision or args.commit_message) and not args.push_to_hub:
        parser.error("--private, --push-revision and --commit-message need --push-to-hub")
    if args.eval_text is not None and not args.eval_text.is_file():
        parser.error(f"--eval-text {args.eval_text}: no such file")
    if args.eval_text is not None and not args.eval:
        parser.error("--eval-text needs --eval")
    if args.eval_tokens < 2:
        parser.error("--eval-tokens must be at least 2")
    calibration = ("--calibration-samples", "--calibration-seq-len", "--calibration-tokenizer")
    if args.calibration_data is None:
        given = [flag for flag in calibration if getattr(args, flag[2:].replace("-", "_")) is not None]
        if given:
            parser.error(f"{given[0]} needs --calibration-data")
    elif not args.calibration_data.is_file():
        parser.error(f"--calibration-data {args.calibration_data}: no such file")
    for flag in calibration[:2]:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and value < 1:
            parser.error(f"{flag} must be a positive number, got {value}")
    if args.rotation_seed is not None and args.rotation == "off":
        parser.error("--rotation-seed needs --rotation on, inputs or auto")
    module_bits = _parse_module_bits(parser, args.module_bits)
    codebook = _parse_codebook(parser, args.codebook)
    if args.push_to_hub:
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        try:
            validate_repo_id(args.push_to_hub)
        except HFValidationError as e:
            parser.error(f"--push-to-hub {args.push_to_hub!r}: not a valid Hub repo id ({e})")

    from . import hub
    from .config import KbitConfig
    from .convert import ConversionError, check_output, command_line, convert, parse_size, source_paths

    _redact_log_records(hub.redact)

    if push_only:
        return _push(hub, Path(args.model), args)
    try:
        config = KbitConfig(
            bits=args.bits,
            codebook=codebook,
            modules_to_not_convert=args.skip_modules,
            module_bits=module_bits,
            fitting=args.fitting,
            calibration_data=args.calibration_data,
            calibration_samples=args.calibration_samples,
            calibration_seq_len=args.calibration_seq_len,
            calibration_tokenizer=args.calibration_tokenizer,
            rotation=ROTATION_CHOICES[args.rotation],
            rotation_seed=args.rotation_seed or 0,
            head_rotation=None if args.head_rotation is None else args.head_rotation == "on",
            block_offsets=None if args.block_offsets is None else args.block_offsets == "on",
        )
        parse_size(args.max_shard_size)
        if not args.dry_run:
            check_output(args.out, args.overwrite, source_paths(args.model))
    except (ValueError, TypeError) as e:
        parser.error(str(e))

    try:
        result = convert(
            args.model,
            args.out if args.out is not None else Path("."),
            config,
            revision=args.revision,
            dtype=args.dtype,
            device=args.device,
            max_shard_size=args.max_shard_size,
            overwrite=args.overwrite,
            dry_run=args.dry_run,
            eval=args.eval,
            eval_text=args.eval_text.read_text() if args.eval_text else None,
            eval_max_tokens=args.eval_tokens,
            base_model=args.base_model,
            repo_id=args.push_to_hub,
            command=command_line(argv),
            progress=not args.no_progress,
        )
    except ConversionError as e:
        print(f"kbit-convert: error: {_one_line(hub.redact(str(e)))}", file=sys.stderr)
        return 2
    except OSError as e:  # the environment, not the input: a full disk, a failing device, permissions
        print(f"kbit-convert: error: {_one_line(hub.redact(str(e)))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("kbit-convert: interrupted; no output was written", file=sys.stderr)
        return 130

    if args.dry_run:
        print(result.describe())
        return 0
    stats = result.stats
    experts = stats["quantized_expert_tensors"]
    print(f"wrote {result.out}: {stats['quantized_tensors']} tensors quantized"
          + (f" ({experts} of them fused MoE expert tensors)" if experts else "")
          + f", {stats['shards']} shard(s), "
          f"{stats['size_before_bytes'] / 1e6:.2f} MB -> {stats['size_after_bytes'] / 1e6:.2f} MB")
    if result.eval:
        print(f"perplexity ({result.eval['tokens']} tokens): source {result.eval['base_perplexity']:.3f}, "
              f"kbit {result.eval['kbit_perplexity']:.3f}")
    print(f"fastest decoding: {hub.FAST_DECODING}")
    if args.skip_modules is None:  # the default kept the LM head in full precision
        print(f"LM head: kept in full precision; {hub.FAST_LM_HEAD}")
    plain = args.rotation == "off" and stats["format_version"] == 1  # neither rotation nor block offsets
    if plain and any(bits <= 3 for bits in stats["quantized_by_bits"]):
        print(f"k <= 3, unrotated, without block offsets: {hub.LOW_BIT_LEVERS}")
    if args.push_to_hub:
        return _push(hub, result.out, args)
    return 0


def _redact_log_records(redact) -> None:
    """Log records of every library (huggingface_hub logs request URLs at debug level) pass through ``redact``:
    no credentials of HF_ENDPOINT and no token in this process's logs."""
    make_record = logging.getLogRecordFactory()
    if getattr(make_record, "kbit_redacts", False):
        return

    def redacted_record(*args, **kwargs):
        record = make_record(*args, **kwargs)
        record.msg, record.args = redact(record.getMessage()), None
        if record.exc_info:
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
        return record

    redacted_record.kbit_redacts = True
    logging.setLogRecordFactory(redacted_record)


def _one_line(message: str) -> str:
    """Messages quoting other libraries may span lines; an error is one line."""
    return " ".join(message.split())


def _push(hub, folder: Path, args) -> int:
    try:
        url = hub.push_to_hub(
            folder,
            args.push_to_hub,
            private=args.private or None,
            revision=args.push_revision,
            commit_message=args.commit_message,
        )
    except hub.PushError as e:
        print(f"kbit-convert: error: {e}", file=sys.stderr)
        return 3
    print(f"pushed {folder} to {args.push_to_hub}: {hub.redact(url)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

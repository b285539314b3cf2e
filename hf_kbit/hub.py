"""Model cards and pushing a converted checkpoint to the Hugging Face Hub.

The card shows only numbers measured during the conversion (sizes of the written files,
bits per weight of the written tensors, the optional perplexity check) or passed in by the
caller as measured; a field without a measurement is left out, never estimated.
"""

from __future__ import annotations

import platform
import re
import shlex
from pathlib import Path
from typing import Any

from . import format as fmt

TEMPLATE_NAME = "kbit_model_card.md"
# Packaged copy first, then the repository's model_cards/ (source checkouts).
_TEMPLATE_DIRS = (Path(__file__).parent / "model_cards", Path(__file__).resolve().parent.parent / "model_cards")


def format_bytes(nbytes: int) -> str:
    """A size for people: ``1.50 GB`` (powers of 1000)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if nbytes < 1000 or unit == "TB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1000
    raise AssertionError


class PushError(RuntimeError):
    """Pushing to the Hub failed; the local output is intact and the message says how to retry."""


_URL_USERINFO = re.compile(r"(?<=://)[^/@\s]+@")


def redact(text: str, token: str | None = None) -> str:
    """``text`` with the ``user:password@`` part of URLs (e.g. in HF_ENDPOINT) and the Hub token replaced by ``***``."""
    from huggingface_hub.utils import get_token

    text = _URL_USERINFO.sub("***@", text)
    for secret in (token, get_token()):
        if secret:
            text = text.replace(secret, "***")
    return text


# What a user writes for the fastest decoding, the choice that is the user's (kbit-convert prints it, the card shows
# it): a static cache, whose compile runs hf-kbit's fusion pass by default. The decode attention is a default too
# (KbitConfig.decode_attention) unless from_pretrained names another attn_implementation.
FAST_DECODING = ('model.generate(..., cache_implementation="static"); the model attends with "kbit_decode" unless '
                 'from_pretrained names another attn_implementation')
FAST_LM_HEAD = ("--skip-modules with no names quantizes the LM head too (faster decoding, some perplexity; "
                "--module-bits '^lm_head$=5' keeps more of it)")
# The accuracy choices at low k (kbit-convert prints them when it wrote k <= 3 tensors unrotated and without block
# offsets: --fitting absmax or --block-offsets off).
LOW_BIT_LEVERS = ("block offsets (the default with the fitted rule: --fitting fit, --block-offsets on) or --rotation "
                  "inputs: at k = 3 each measured below HQQ 3-bit's perplexity on both offline models, for 2-5% of "
                  "decode speed (docs/format.md#block-offsets, #rotation)")


def template_path() -> Path:
    for folder in _TEMPLATE_DIRS:
        if (folder / TEMPLATE_NAME).is_file():
            return folder / TEMPLATE_NAME
    raise FileNotFoundError(f"model card template {TEMPLATE_NAME} not found in {[str(d) for d in _TEMPLATE_DIRS]}")


def library_versions() -> dict[str, str]:
    import huggingface_hub
    import safetensors
    import torch
    import transformers

    from . import __version__

    return {
        "hf-kbit": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "huggingface_hub": huggingface_hub.__version__,
        "safetensors": safetensors.__version__,
        "python": platform.python_version(),
    }


def render_card(
    *,
    plan,
    stats: dict[str, Any],
    source_info: dict[str, Any],
    base_model: str | None,
    command: str,
    eval: dict[str, Any] | None = None,
    speed: dict[str, str] | None = None,
    repo_id: str | None = None,
):
    """The model card (``huggingface_hub.ModelCard``) of a converted checkpoint."""
    from huggingface_hub import ModelCard, ModelCardData

    cfg = plan.kbit_config
    bits_values = sorted(stats["quantized_by_bits"])
    tags = ["kbit", "quantized", *(f"{b}-bit" for b in bits_values)]
    card_data = ModelCardData(
        base_model=base_model,
        base_model_relation="quantized" if base_model else None,
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=tags,
    )
    source_note = None
    if source_info.get("kind") == "gguf":
        source_note = (
            f"converted from the GGUF file `{source_info['name']}`. Its weights were already quantized to a GGUF "
            "grid; they were dequantized and then quantized again, so the errors of both quantizations add up."
        )
        gguf_size = format_bytes(source_info["gguf_bytes"])
        size_before_label = f"GGUF dequantized; the .gguf file is {gguf_size}"
    else:
        size_before_label = "source checkpoint"
    n_kept = stats["tensors"] - stats["quantized_tensors"]
    # MoE: the fused expert weights are quantized too (they are not nn.Linear; routers are kept).
    weights = "Linear and MoE expert weights" if stats.get("quantized_expert_tensors") else "Linear weights"
    others = f"all tensors other than {weights}"
    skipped = ["lm_head / tied embeddings"] if cfg.modules_to_not_convert is None else cfg.modules_to_not_convert
    kept = f"{', '.join(skipped)} and {others}" if skipped else others

    def tensors(n: int) -> str:
        return f"{n} tensor{'s' if n != 1 else ''}"

    bits_summary = ", ".join(f"{b} ({tensors(n)})" for b, n in stats["quantized_by_bits"].items()) or "none"
    if cfg.module_bits:
        bits_summary += " — per-module bits: " + ", ".join(f"`{p}` -> {b}" for p, b in cfg.module_bits.items())
    bpw = stats.get("bits_per_quantized_weight")
    return ModelCard.from_template(
        card_data,
        template_path=str(template_path()),
        model_name=source_info.get("name", "model"),
        base_model_link=base_model,
        bits=cfg.bits,
        quantized_weights=weights,
        levels=", ".join(str(1 << b) for b in bits_values) or str(1 << cfg.bits),
        codebook=_codebook_name(cfg),
        source_note=source_note,
        bits_summary=bits_summary,
        bits_per_weight=f"{bpw:.3f}" if bpw is not None else "n/a (nothing quantized)",
        quantized_tensors=stats["quantized_tensors"],
        total_tensors=stats["tensors"],
        dtype=stats["dtype"],
        kept_summary=f"{tensors(n_kept)}: {kept}",
        size_before=format_bytes(stats["size_before_bytes"]),
        size_before_label=size_before_label,
        size_after=format_bytes(stats["size_after_bytes"]),
        format_version=stats.get("format_version", cfg.format_version),
        calibration=_calibration_summary(cfg),
        rotation=_rotation_summary(cfg, stats),
        block_offsets=("an 8-bit offset per block of 32 of the Linear weights (int16 block records; fused MoE experts "
                       "keep plain scales)" if cfg.block_offsets else "none"),
        command=command,
        repo_id=repo_id or "path/to/this/folder",
        eval=eval,
        speed=speed,
        versions=library_versions(),
    )


def _calibration_summary(cfg) -> str:
    record = cfg.calibration_record()
    if record is None:
        return "none (data-free)"
    return (f"GPTQ-style error feedback (hf_kbit.calibration) on {record['tokens']:,} tokens of calibration text "
            f"({record['samples']} sequences of {record['seq_len']})")


def _rotation_summary(cfg, stats: dict) -> str:
    if not cfg.head_rotation:
        return _k_rotation_summary(cfg, stats)
    along_k = "none along K" if cfg.rotation is False else _k_rotation_summary(cfg, stats)
    return f"{along_k}; v_proj and o_proj turned per attention head (exact, no inference cost)"


def _k_rotation_summary(cfg, stats: dict) -> str:
    if cfg.rotation is False:
        return "none"
    rotated = stats.get("rotated_tensors", 0)
    how = {True: "every quantized tensor whose", "auto": "chosen per weight group (auto) among tensors whose",
           "inputs": "every input projection (not the output projections o/down) whose"}[cfg.rotation]
    return (f"seeded block Hadamard along K (block {fmt.ROTATION_BLOCK}, seed {cfg.rotation_seed}), {how} in_features "
            f"is a multiple of {fmt.ROTATION_MULTIPLE}: {rotated} of {stats['quantized_tensors']} tensors are stored "
            "rotated (the kernels turn the activations to match)")


def _codebook_name(cfg) -> str:
    if isinstance(cfg.codebook, list):
        return "custom codebook stored with each layer"
    name = cfg.codebook or fmt.DEFAULT_CODEBOOK[cfg.bits]
    return {"nf": "normal-float levels with an exact zero", "nf-sym": "equiprobable normal-float levels"}.get(name, name)


def retry_command(
    folder: str | Path, repo_id: str, private: bool | None, revision: str | None, message: str | None
) -> str:
    """The command that pushes an already converted folder again."""
    argv = ["kbit-convert", str(folder), "--push-to-hub", repo_id]
    if private:
        argv.append("--private")
    if revision:
        argv += ["--push-revision", revision]
    if message:
        argv += ["--commit-message", message]
    return shlex.join(argv)


def push_to_hub(
    folder: str | Path,
    repo_id: str,
    *,
    private: bool | None = None,
    revision: str | None = None,
    commit_message: str | None = None,
    token: str | None = None,
) -> str:
    """Create ``repo_id`` (if needed) and upload ``folder`` to it; returns the commit URL.

    The token comes from huggingface_hub's usual sources (``HF_TOKEN``, ``hf auth login``)
    unless given; it is never printed or put in an error message, nor are credentials in the endpoint URL.
    On failure raises
    :class:`PushError` naming the cause and the command that retries the push.
    """
    from huggingface_hub import HfApi, constants

    folder = Path(folder)
    api = HfApi(token=token)
    message = commit_message or f"Upload kbit checkpoint ({folder.name})"
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True, repo_type="model")
        info = api.upload_folder(
            repo_id=repo_id, folder_path=folder, revision=revision, commit_message=message, repo_type="model"
        )
    except Exception as e:  # noqa: BLE001 -- any failure keeps the local output; the message says how to retry
        cause = redact(f"{type(e).__name__}: {e}", token)
        raise PushError(
            f"pushing {folder} to {repo_id} on {redact(constants.ENDPOINT)} failed ({cause.splitlines()[0]}).\n"
            f"The converted checkpoint is kept in {folder}. Retry the push with:\n"
            f"  {retry_command(folder, repo_id, private, revision, commit_message)}"
        ) from None
    return redact(str(info.commit_url if hasattr(info, "commit_url") else info), token)

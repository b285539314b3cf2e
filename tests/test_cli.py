"""kbit-convert: a thin shell over hf_kbit.convert; every option documented; clear errors."""

from __future__ import annotations

import json

import pytest
import torch

from hf_kbit import cli

from convert_helpers import TOKEN, dead_endpoint, llama_fp32, moe_checkpoint  # noqa: F401


def run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def run_exit(capsys, *argv):
    """argparse errors exit with status 2 and print to stderr."""
    with pytest.raises(SystemExit) as e:
        cli.main([str(a) for a in argv])
    return e.value.code, capsys.readouterr().err


def test_help_documents_every_option(capsys):
    code, err = run_exit(capsys, "--help")
    assert code == 0
    text = capsys.readouterr().out if not err else err
    parser = cli.build_parser()
    help_text = parser.format_help()
    for action in parser._actions:
        for option in action.option_strings:
            assert option in help_text, option
        assert action.help, f"{action.dest} has no help"
    assert "HF_TOKEN" in help_text  # where the token comes from
    del text


def test_listed_choices_are_the_librarys():
    """The CLI lists bits and fittings without importing torch; they must be the library's."""
    from hf_kbit import fitting
    from hf_kbit import format as fmt

    assert cli.SUPPORTED_BITS == fmt.SUPPORTED_BITS and cli.FITTING_CHOICES == fitting.FITTINGS
    from hf_kbit import rotation_policy

    assert list(cli.ROTATION_CHOICES.values()) == list(rotation_policy.ROTATIONS)


def test_convert_with_rotation(capsys, llama_fp32, tmp_path):
    """--rotation on --rotation-seed S: config.json records both and format v3 (every Linear but down_proj has
    in_features 64), the card says how many tensors are rotated."""
    out = tmp_path / "out"
    code, stdout, _ = run(capsys, llama_fp32, "--bits", "3", "--out", out, "--no-progress", "--rotation", "on",
                          "--rotation-seed", "5")
    assert code == 0, stdout
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["rotation"] is True and qc["rotation_seed"] == 5 and qc["format_version"] == 3
    card = (out / "README.md").read_text()
    assert "| Rotation | seeded block Hadamard along K (block 8, seed 5)" in card and "--rotation on" in card
    assert "k <= 3, unrotated" not in stdout


@pytest.mark.parametrize(("flags", "turned"), [
    (["--bits", "4", "--head-rotation"], True),
    (["--bits", "4", "--block-offsets", "off"], True),  # the default at k <= 4 without block offsets
    (["--bits", "4"], False),  # with them (the default) it measured worse
    (["--bits", "4", "--head-rotation", "off"], False),
    (["--bits", "5"], False),
    (["--bits", "3", "--rotation", "inputs"], False),  # with rotation along K the default leaves v and o
])
def test_head_rotation_flag(capsys, llama_fp32, tmp_path, flags, turned):
    out = tmp_path / "out"
    code, stdout, _ = run(capsys, llama_fp32, *flags, "--out", out, "--no-progress")
    assert code == 0, stdout
    assert json.loads((out / "config.json").read_text())["quantization_config"].get("head_rotation", False) is turned
    card = (out / "README.md").read_text()
    assert ("| Rotation | none along K; v_proj and o_proj turned per attention head" in card) is turned


def test_convert_gives_block_offsets_by_default(capsys, llama_fp32, tmp_path):
    """Without --block-offsets the fitted rule writes block records (format v4), and no k <= 3 hint is printed;
    --block-offsets off writes format v1 and prints it."""
    code, stdout, _ = run(capsys, llama_fp32, "--bits", "3", "--out", tmp_path / "on", "--no-progress")
    assert code == 0, stdout
    qc = json.loads((tmp_path / "on" / "config.json").read_text())["quantization_config"]
    assert qc["block_offsets"] is True and qc["format_version"] == 4 and "k <= 3" not in stdout
    assert "| Block offsets | an 8-bit offset per block of 32" in (tmp_path / "on" / "README.md").read_text()
    code, stdout, _ = run(capsys, llama_fp32, "--bits", "3", "--out", tmp_path / "off", "--no-progress",
                          "--block-offsets", "off")
    assert code == 0, stdout
    qc = json.loads((tmp_path / "off" / "config.json").read_text())["quantization_config"]
    assert "block_offsets" not in qc and qc["format_version"] == 1
    assert "k <= 3, unrotated, without block offsets" in stdout


def test_convert_end_to_end(capsys, llama_fp32, tmp_path):
    out = tmp_path / "out"
    code, stdout, _ = run(capsys, llama_fp32, "--bits", "3", "--module-bits", r"mlp\.down_proj=5", "--out", out,
                          "--max-shard-size", "50KB", "--no-progress", "--fitting", "absmax")
    assert code == 0, stdout
    assert "wrote" in stdout
    # one line each for the user's choices: the decode attention (card too) and the LM head kept in bf16 by default
    assert 'fastest decoding: model.generate(..., cache_implementation="static")' in stdout
    assert "LM head: kept in full precision; --skip-modules with no names quantizes" in stdout
    # the accuracy choices, since absmax gives no block offsets
    assert "k <= 3, unrotated, without block offsets: block offsets (the default with the fitted rule" in stdout
    assert "attends with hf-kbit's `kbit_decode`" in (out / "README.md").read_text()
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["bits"] == 3 and qc["module_bits"] == {r"mlp\.down_proj": 5} and qc["fitting"] == "absmax"
    card = (out / "README.md").read_text()
    assert r"kbit-convert" in card and "--module-bits" in card  # the exact command
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.model.layers[0].mlp.down_proj.bits == 5 and model.model.layers[0].mlp.up_proj.bits == 3
    assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


def test_convert_with_calibration(capsys, llama_fp32, tmp_path):
    """--calibration-data FILE: the card and config.json say calibrated, on how many tokens."""
    out = tmp_path / "out"
    code, stdout, _ = run(capsys, llama_fp32, "--bits", "3", "--out", out, "--no-progress", "--calibration-data",
                          __file__, "--calibration-samples", "2", "--calibration-seq-len", "32")
    assert code == 0, stdout
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["calibration"] == {"method": "gptq", "samples": 2, "seq_len": 32, "tokens": 64}
    card = (out / "README.md").read_text()
    assert "on 64 tokens of calibration text" in card and "--calibration-data" in card


def test_skip_modules_without_names_quantizes_the_lm_head_too(capsys, llama_fp32, tmp_path):
    out = tmp_path / "out"
    code, stdout, _ = run(capsys, llama_fp32, "--bits", "4", "--skip-modules", "--module-bits", "^lm_head$=5",
                          "--out", out, "--no-progress")
    assert code == 0, stdout
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["modules_to_not_convert"] == [] and qc["module_bits"] == {"^lm_head$": 5}
    card = (out / "README.md").read_text()
    assert "| 4 (14 tensors), 5 (1 tensor) — per-module bits: `^lm_head$` -> 5 |" in card
    assert "tensors: all tensors other than Linear weights |" in card  # nothing named as skipped
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.lm_head.bits == 5 and model.model.layers[0].mlp.up_proj.bits == 4
    assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


def test_dry_run(capsys, llama_fp32, tmp_path):
    code, stdout, _ = run(capsys, llama_fp32, "--bits", "4", "--dry-run")
    assert code == 0
    assert "bits/weight" in stdout and "->" in stdout
    assert list(tmp_path.iterdir()) == []


def test_moe_dry_run_and_convert(capsys, moe_checkpoint, tmp_path):
    """Per-expert Mixtral checkpoint (w1/w2/w3 under block_sparse_moe): module bits reach the experts."""
    src = moe_checkpoint("mixtral", "per-expert")
    bits = ["--bits", "3", "--module-bits", r"experts\.down_proj=5"]
    code, stdout, _ = run(capsys, src, *bits, "--dry-run")
    assert code == 0
    assert "MoE experts:   4 quantized tensors are fused expert weights (8 experts each, " in stdout
    assert "10 at 3 bits, 2 at 5 bits" in stdout and "bits/weight" in stdout
    out = tmp_path / "out"
    code, stdout, _ = run(capsys, src, *bits, "--out", out, "--no-progress")
    assert code == 0 and "12 tensors quantized (4 of them fused MoE expert tensors)" in stdout
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.model.layers[1].mlp.experts.bits == {"gate_up_proj": 3, "down_proj": 5}
    assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()
    code, stdout, _ = run(capsys, src, "--skip-modules", "lm_head", "experts", "--dry-run")
    assert code == 0 and "MoE experts" not in stdout and "8 at 4 bits" in stdout


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--bits", "6", "--out", "X"], "invalid choice: 6"),
        (["--bits", "4"], "--out is required"),
        (["--module-bits", "down_proj", "--out", "X"], "REGEX=BITS"),
        (["--module-bits", "down_proj=7", "--out", "X"], "bits must be one of"),
        (["--module-bits", "(=4", "--out", "X"], "not a valid regex"),
        (["--module-bits", "(.*)*#=4", "--out", "X"], "containing another repeat"),
        (["--codebook", "[0.1, oops]", "--out", "X"], "--codebook"),
        (["--codebook", "bogus", "--out", "X"], "codebook must be one of"),
        (["--fitting", "gptq", "--out", "X"], "invalid choice: 'gptq'"),
        (["--push-to-hub", "not a repo", "--out", "X"], "repo id"),
        (["--private", "--out", "X"], "need --push-to-hub"),
        (["--max-shard-size", "huge", "--out", "X"], "max_shard_size"),
        (["--dry-run", "--push-to-hub", "a/b"], "nothing to push"),
        (["--calibration-samples", "8", "--out", "X"], "--calibration-samples needs --calibration-data"),
        (["--calibration-data", "X", "--out", "X"], "no such file"),
        (["--calibration-data", __file__, "--calibration-seq-len", "0", "--out", "X"], "--calibration-seq-len must"),
        (["--rotation", "yes", "--out", "X"], "invalid choice: 'yes'"),
        (["--rotation-seed", "3", "--out", "X"], "--rotation-seed needs --rotation on, inputs or auto"),
        (["--rotation", "auto", "--rotation-seed", "-1", "--out", "X"], "rotation_seed must be an int in [0, 2**64)"),
    ],
    ids=["bits", "no-out", "module-bits-form", "module-bits-value", "module-bits-regex", "module-bits-backtracking",
         "codebook-json",
         "codebook-name", "fitting", "repo-id", "private-alone", "shard-size", "dry-run-push",
         "calibration-samples-alone", "calibration-data-missing", "calibration-seq-len", "rotation",
         "rotation-seed-alone", "rotation-seed-negative"],
)
def test_bad_arguments(capsys, llama_fp32, tmp_path, argv, message):
    argv = [str(tmp_path / a) if a == "X" else a for a in argv]
    code, err = run_exit(capsys, llama_fp32, *argv)
    assert code == 2
    assert message in err
    assert not (tmp_path / "X").exists()


def test_missing_folder(capsys, tmp_path):
    code, _, err = run(capsys, tmp_path / "nope", "--out", tmp_path / "out")
    assert code == 2 and "no such folder" in err


def test_non_empty_output(capsys, llama_fp32, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("x")
    code, err = run_exit(capsys, llama_fp32, "--out", tmp_path / "out")
    assert code == 2 and "--overwrite" in err


def test_unreachable_hub_input(capsys, dead_endpoint, tmp_path):
    code, _, err = run(capsys, "someorg/somemodel", "--out", tmp_path / "out")
    assert code == 2
    assert "could not be reached" in err and dead_endpoint in err
    assert TOKEN not in err
    assert not (tmp_path / "out").exists()


def test_failed_push_keeps_output_and_says_how_to_retry(capsys, llama_fp32, dead_endpoint, tmp_path):
    out = tmp_path / "out"
    code, stdout, err = run(capsys, llama_fp32, "--out", out, "--push-to-hub", "me/tiny", "--private",
                            "--push-revision", "v1", "--no-progress")
    assert code == 3
    assert (out / "config.json").is_file()  # the local output is kept, complete
    assert f"kept in {out}" in err
    assert f"kbit-convert {out} --push-to-hub me/tiny --private --push-revision v1" in err
    assert TOKEN not in stdout + err


def test_push_only_needs_push_target(capsys, llama_fp32, tmp_path):
    out = tmp_path / "out"
    assert run(capsys, llama_fp32, "--out", out, "--no-progress")[0] == 0
    code, err = run_exit(capsys, out)
    assert code == 2 and "already a kbit checkpoint" in err


# ---------------------------------------------------------------------------- one-line errors, never a traceback


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("kbit-convert: error: "), err
    return lines[0]


def copy_of(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_nan_weight_names_the_tensor(capsys, llama_fp32, tmp_path):
    from safetensors.torch import load_file, save_file

    src = copy_of(llama_fp32, tmp_path / "src")
    key = "model.layers.1.self_attn.q_proj.weight"
    shard = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"][key]
    tensors = load_file(src / shard)
    tensors[key][3, 5] = float("nan")
    save_file(tensors, src / shard, metadata={"format": "pt"})
    code, _, err = run(capsys, src, "--out", tmp_path / "out", "--no-progress")
    line = one_line(err)
    assert code == 2 and key in line and shard in line and "NaN" in line and "--skip-modules" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_truncated_source_names_the_file(capsys, llama_fp32, tmp_path):
    src = copy_of(llama_fp32, tmp_path / "src")
    shard = sorted(src.glob("model-*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    code, _, err = run(capsys, src, "--out", tmp_path / "out", "--no-progress")
    line = one_line(err)
    assert code == 2 and shard.name in line and "truncated" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.mark.parametrize("edit, message", [
    (lambda c: '{"model_type": "llama", ', "is not valid JSON"),
    (lambda c: "[1, 2]", "holds a JSON list, expected an object"),
    (lambda c: json.dumps({**c, "hidden_size": "big"}), "transformers cannot read it"),
    (lambda c: json.dumps({**c, "architectures": ["pipeline"]}), "not a transformers model class"),
], ids=["not-json", "not-object", "bad-field", "not-a-model-class"])
def test_broken_config_json(capsys, llama_fp32, tmp_path, edit, message):
    src = copy_of(llama_fp32, tmp_path / "src")
    (src / "config.json").write_text(edit(json.loads((src / "config.json").read_text())))
    code, _, err = run(capsys, src, "--out", tmp_path / "out", "--no-progress")
    line = one_line(err)
    assert code == 2 and "config.json" in line and message in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_full_disk_is_reported_and_the_partial_output_removed(capsys, llama_fp32, tmp_path, monkeypatch):
    import errno

    import safetensors.torch

    def full(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\0" * 100)
        raise OSError(errno.ENOSPC, "No space left on device", str(filename))

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    code, _, err = run(capsys, llama_fp32, "--out", tmp_path / "out", "--no-progress")
    line = one_line(err)
    assert code not in (0, 2)
    assert "no space left" in line and str(tmp_path) in line and "removed" in line
    assert list(tmp_path.iterdir()) == []


def test_invalid_hub_repo_ids(capsys, llama_fp32, tmp_path):
    code, _, err = run(capsys, "org/na..me", "--out", tmp_path / "out")
    line = one_line(err)
    assert code == 2 and "org/na..me" in line and "repo id" in line
    code, err = run_exit(capsys, llama_fp32, "--out", tmp_path / "out", "--push-to-hub", "me/bad..name")
    assert code == 2 and "--push-to-hub" in err and "bad..name" in err
    assert list(tmp_path.iterdir()) == []


def test_overwrite_of_the_current_folder_is_refused(capsys, llama_fp32, tmp_path, monkeypatch):
    import shutil

    shutil.copytree(llama_fp32, tmp_path / "model")
    monkeypatch.chdir(tmp_path)
    code, err = run_exit(capsys, "./model", "--out", ".", "--overwrite")
    assert code == 2 and "current folder" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_credentials_in_the_endpoint_are_never_printed(capsys, caplog, dead_endpoint, tmp_path, monkeypatch):
    import logging

    from huggingface_hub import constants

    url = dead_endpoint.replace("http://", "http://someone:s3cretpass@")
    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.setattr(logging, "_logRecordFactory", logging.getLogRecordFactory())  # the CLI installs its own
    with caplog.at_level(logging.DEBUG, logger="huggingface_hub"):  # huggingface_hub logs request URLs at debug
        code, stdout, err = run(capsys, "someorg/somemodel", "--out", tmp_path / "out")
    assert code == 2 and "could not be reached" in err
    redacted = dead_endpoint.replace("http://", "http://***@")
    assert redacted in err and any(redacted in r.getMessage() for r in caplog.records)
    assert "s3cretpass" not in stdout + err + caplog.text and TOKEN not in stdout + err + caplog.text

"""Push to and pull from a Hub-compatible server on 127.0.0.1 (tests/hub_server.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import hf_kbit
from hf_kbit import cli, hub
from hf_kbit.convert import convert

from convert_helpers import TOKEN, dead_endpoint, hub as hub_server, llama_fp32, subprocess_env  # noqa: F401


def logits(folder, ids):
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(folder)(ids).logits


def test_push_pull_load_same_logits(llama_fp32, hub_server, tmp_path, capsys):
    from huggingface_hub import HfApi, snapshot_download

    out = convert(llama_fp32, tmp_path / "out", hf_kbit.KbitConfig(bits=4), repo_id="me/tiny-kbit4", progress=False).out
    url = hub.push_to_hub(out, "me/tiny-kbit4", private=True, revision="v1", commit_message="kbit 4-bit")
    assert url.startswith(hub_server.url)

    repo = hub_server.repos["me/tiny-kbit4"]
    assert repo.private and repo.messages[repo.branches["v1"]] == "kbit 4-bit"
    assert all(a == f"Bearer {TOKEN}" for a in hub_server.auth_headers) and hub_server.auth_headers
    assert "me/tiny-kbit4" in hub_server.validated_cards[-1]  # the card's usage snippet names the repo

    info = HfApi().model_info("me/tiny-kbit4", revision="v1")
    assert info.sha == repo.branches["v1"]
    assert {s.rfilename for s in info.siblings} >= {"config.json", "README.md", "model.safetensors"}

    pulled = snapshot_download("me/tiny-kbit4", revision="v1", cache_dir=hub_server.cache)
    ids = torch.tensor([[1, 7, 3, 40, 41]])
    torch.testing.assert_close(logits(pulled, ids), logits(out, ids), rtol=0, atol=0)
    captured = capsys.readouterr()
    assert TOKEN not in captured.out + captured.err


def test_push_twice_updates_branch(llama_fp32, hub_server, tmp_path):
    out = convert(llama_fp32, tmp_path / "out", progress=False).out
    hub.push_to_hub(out, "me/twice")
    first = hub_server.repos["me/twice"].branches["main"]
    (out / "README.md").write_text((out / "README.md").read_text() + "\nedited\n")
    hub.push_to_hub(out, "me/twice", commit_message="edit card")
    repo = hub_server.repos["me/twice"]
    assert repo.branches["main"] != first and repo.messages[repo.branches["main"]] == "edit card"


def test_wrong_token_is_reported_not_printed(llama_fp32, hub_server, tmp_path, monkeypatch):
    out = convert(llama_fp32, tmp_path / "out", progress=False).out
    monkeypatch.setenv("HF_TOKEN", "hf_WRONGwrongwrong")
    with pytest.raises(hub.PushError) as e:
        hub.push_to_hub(out, "me/denied")
    assert "401" in str(e.value) and "hf_WRONGwrongwrong" not in str(e.value)
    assert (out / "config.json").is_file()


def test_push_failure_keeps_output(llama_fp32, dead_endpoint, tmp_path):
    out = convert(llama_fp32, tmp_path / "out", progress=False).out
    with pytest.raises(hub.PushError, match="kept in") as e:
        hub.push_to_hub(out, "me/x", commit_message="hello world")
    assert "--commit-message 'hello world'" in str(e.value)
    assert TOKEN not in str(e.value)
    assert (out / "config.json").is_file()


def test_cli_retry_push_of_existing_folder(llama_fp32, hub_server, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main([str(llama_fp32), "--out", str(out), "--no-progress"]) == 0
    assert cli.main([str(out), "--push-to-hub", "me/retry"]) == 0
    assert "config.json" in hub_server.repos["me/retry"].commits[hub_server.repos["me/retry"].branches["main"]]
    assert TOKEN not in capsys.readouterr().out


def test_hub_input_with_revision(llama_fp32, hub_server, tmp_path):
    """A Hub repo id as input: fetched with snapshot_download at a revision, then converted."""
    hub.push_to_hub(llama_fp32, "org/tiny-llama", revision="dev", commit_message="source")
    ref = convert(llama_fp32, tmp_path / "ref", progress=False).out
    got = convert("org/tiny-llama", tmp_path / "got", revision="dev", progress=False)
    assert "base_model: org/tiny-llama" in (got.out / "README.md").read_text()
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(logits(got.out, ids), logits(ref, ids), rtol=0, atol=0)
    with pytest.raises(hf_kbit.convert.ConversionError, match="revision 'nope' not found"):
        convert("org/tiny-llama", tmp_path / "bad", revision="nope", progress=False)
    with pytest.raises(hf_kbit.convert.ConversionError, match="no such repo"):
        convert("org/missing", tmp_path / "bad", progress=False)


def test_cli_convert_push_pull_in_fresh_processes(llama_fp32, hub_server, tmp_path):
    """The installed-command path: kbit-convert in a child process with HF_ENDPOINT/HF_TOKEN from the environment."""
    out = tmp_path / "out"
    env = subprocess_env(hub_server.url, tmp_path / "hf-home")
    proc = subprocess.run(
        [sys.executable, "-m", "hf_kbit.cli", str(llama_fp32), "--bits", "4", "--out", str(out), "--no-progress",
         "--push-to-hub", "me/cli-kbit4", "--commit-message", "from the CLI"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert TOKEN not in proc.stdout + proc.stderr
    pull = (
        "import sys, torch, hf_kbit; from transformers import AutoModelForCausalLM as M;"
        "m = M.from_pretrained('me/cli-kbit4');"
        "torch.save(m(torch.tensor([[1, 2, 3, 4]])).logits, sys.argv[1])"
    )
    proc = subprocess.run([sys.executable, "-c", pull, str(tmp_path / "logits.pt")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    pulled = torch.load(tmp_path / "logits.pt")
    torch.testing.assert_close(pulled, logits(out, torch.tensor([[1, 2, 3, 4]])), rtol=0, atol=0)
    commit = hub_server.repos["me/cli-kbit4"].branches["main"]
    assert hub_server.repos["me/cli-kbit4"].messages[commit] == "from the CLI"
    card = hub_server.repos["me/cli-kbit4"].commits[commit]["README.md"].decode()
    assert "--push-to-hub me/cli-kbit4" in card and json.dumps(TOKEN)[1:-1] not in card


def test_hub_index_cannot_read_or_push_local_files(llama_fp32, hub_server, tmp_path, capsys):
    """A repo whose index maps every key to an absolute local path: nothing outside the snapshot is read or pushed."""
    import shutil

    from safetensors.torch import load_file, save_file

    secret = tmp_path / "secret"
    secret.mkdir()
    tensors = {}
    for f in llama_fp32.glob("*.safetensors"):
        tensors.update(load_file(f))
    save_file(tensors, secret / "weights.safetensors", metadata={"format": "pt"})
    evil = tmp_path / "evil"
    shutil.copytree(llama_fp32, evil, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file({"unused": torch.zeros(1)}, evil / "model-00001-of-00001.safetensors", metadata={"format": "pt"})
    index = json.loads((evil / "model.safetensors.index.json").read_text())
    index["weight_map"] = dict.fromkeys(tensors, str(secret / "weights.safetensors"))
    (evil / "model.safetensors.index.json").write_text(json.dumps(index))
    hub.push_to_hub(evil, "org/evil")
    capsys.readouterr()
    code = cli.main(["org/evil", "--out", str(tmp_path / "out"), "--no-progress", "--push-to-hub", "me/leak"])
    err = capsys.readouterr().err
    assert code == 2 and "expected a file name relative" in err, err
    assert "me/leak" not in hub_server.repos and not (tmp_path / "out").exists()


def test_hub_file_name_that_huggingface_hub_refuses(llama_fp32, hub_server, tmp_path, capsys):
    hub.push_to_hub(llama_fp32, "org/odd")
    repo = hub_server.repos["org/odd"]
    repo.commits[repo.branches["main"]]["sub/../../escape.safetensors"] = b"x"
    capsys.readouterr()
    code = cli.main(["org/odd", "--out", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and "Fetching" not in line]
    assert code == 2 and len(lines) == 1 and "org/odd" in lines[0] and "escape.safetensors" in lines[0], err
    assert not (tmp_path / "out").exists()


def test_push_error_hides_endpoint_credentials(llama_fp32, dead_endpoint, tmp_path, monkeypatch):
    from huggingface_hub import constants

    url = dead_endpoint.replace("http://", "http://someone:s3cretpass@")
    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setenv("HF_ENDPOINT", url)
    out = convert(llama_fp32, tmp_path / "out", progress=False).out
    with pytest.raises(hub.PushError) as e:
        hub.push_to_hub(out, "me/x")
    assert "s3cretpass" not in str(e.value) and TOKEN not in str(e.value)
    assert dead_endpoint.replace("http://", "http://***@") in str(e.value)

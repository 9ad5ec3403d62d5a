"""A Hugging Face hub id as the model: found in a real cache layout (built here, checked by huggingface_hub
itself), never downloaded; a missing id says how to get it; a path on disk always wins."""

from __future__ import annotations

import hashlib
import os
import shutil

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.cli import main
from nanoserve.errors import CheckpointError
from nanoserve.model.hub import hub_cache_dir, looks_like_repo_id, resolve_repo_id

REPO = "TinyOrg/Tiny-Llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def write_cache(cache, repo_id: str, checkpoint) -> os.PathLike:
    """The layout huggingface_hub writes: content-addressed blobs, a snapshot of links, refs/main: commit."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in os.listdir(checkpoint):
        data = (checkpoint / f).read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / f).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, tiny_checkpoint, monkeypatch):
    cache = tmp_path / "hub"
    snapshot = write_cache(cache, REPO, tiny_checkpoint("llama"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache, snapshot


def test_the_layout_built_here_is_one_huggingface_hub_reads(hub_cache):
    huggingface_hub = pytest.importorskip("huggingface_hub")
    cache, snapshot = hub_cache
    theirs = huggingface_hub.snapshot_download(REPO, cache_dir=cache, local_files_only=True)
    assert os.path.samefile(theirs, snapshot)
    assert resolve_repo_id(REPO) == snapshot


def test_a_cached_hub_id_loads_and_generates_as_the_directory_does(hub_cache, tiny_checkpoint):
    params = SamplingParams(temperature=0, max_tokens=8)
    by_id = LLM(model=REPO, max_model_len=128, kv_cache_gib=0.01)
    by_path = LLM(model=str(tiny_checkpoint("llama")), max_model_len=128, kv_cache_gib=0.01)
    assert by_id.engine.runner.loaded.name == REPO  # what the server lists in /v1/models, as vLLM does
    assert (by_id.generate(["Once upon a time"], params)[0].outputs[0].text
            == by_path.generate(["Once upon a time"], params)[0].outputs[0].text)


def test_the_cli_takes_a_hub_id(hub_cache, capsys):
    assert main(["generate", "Hello", "--model", REPO, "--max-tokens", "3", "--max-model-len", "64",
                 "--kv-cache-gib", "0.01"]) == 0
    assert "3 tokens" in capsys.readouterr().err


def test_hf_home_and_the_default_locations(tmp_path, monkeypatch):
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert hub_cache_dir() == tmp_path / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert hub_cache_dir() == tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert hub_cache_dir() == tmp_path / "elsewhere"


def test_a_hub_id_under_hf_home_resolves(tmp_path, tiny_checkpoint, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    snapshot = write_cache(tmp_path / "hf" / "hub", REPO, tiny_checkpoint("llama"))
    assert resolve_repo_id(REPO) == snapshot


def test_an_id_not_in_the_cache_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(CheckpointError) as e:
        LLM(model="SomeOrg/Not-Here", max_model_len=64, kv_cache_gib=0.01)
    message = str(e.value)
    assert "not in the local cache" in message and str(tmp_path / "empty") in message
    assert "`hf download SomeOrg/Not-Here`" in message
    assert "huggingface-cli download SomeOrg/Not-Here" in message
    assert "never downloads" in message and "local checkpoint" in message


def test_a_ref_naming_a_missing_snapshot_is_refused(hub_cache):
    cache, snapshot = hub_cache
    shutil.rmtree(snapshot)
    with pytest.raises(CheckpointError, match="cache entry for TinyOrg/Tiny-Llama is broken"):
        resolve_repo_id(REPO)


def test_a_path_on_disk_wins_over_the_same_hub_id(hub_cache, tiny_checkpoint, tmp_path, monkeypatch):
    work = tmp_path / "work"
    shutil.copytree(tiny_checkpoint("qwen2"), work / REPO)  # same name, another model
    monkeypatch.chdir(work)
    llm = LLM(model=REPO, max_model_len=64, kv_cache_gib=0.01)
    assert llm.engine.runner.loaded.config.attention_bias  # the qwen2 directory, not the cached llama


@pytest.mark.parametrize("text, expected", [
    ("HuggingFaceTB/SmolLM2-135M-Instruct", True), ("gpt2", True), ("Org/name.v2_x", True),
    ("/abs/path", False), ("./rel", False), ("../up/x", False), ("a/b/c", False), ("Org/..", False),
    ("Org--x/y", False), ("", False),
])
def test_what_counts_as_a_hub_id(text, expected):
    assert looks_like_repo_id(text) is expected

# Harness root conftest (replaces vLLM's tests/conftest.py, which builds vLLM engines and HF models).
# - tokenizers: every get_tokenizer(<hub id>) / AutoTokenizer.from_pretrained(<hub id>) returns the tokenizer of
#   nanoserve's embedded default model (SmolLM2-135M-Instruct), extracted to $HARNESS_TOKENIZER_DIR by run.sh
#   (no hub access here; the server tokenizes with that same tokenizer, so client/server agree)
# - `server`/`client` fixtures for the Responses test files that lost theirs in vLLM 0.33 (see report)
# - records, per test, the vLLM features its server had to drop (junit property `dropped_features`)
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest

TOKENIZER_DIR = os.environ.get("HARNESS_TOKENIZER_DIR", "/work/vllm-harness/tokenizer")


def _patch_tokenizers():
    import transformers
    import vllm.tokenizers as vt

    orig = vt.get_tokenizer

    def get_tokenizer(tokenizer_name, *args, **kwargs):
        if not os.path.isdir(str(tokenizer_name)) or str(tokenizer_name) != TOKENIZER_DIR:
            kwargs.pop("revision", None)
            kwargs.pop("tokenizer_mode", None)
            tokenizer_name = TOKENIZER_DIR
        return orig(tokenizer_name, *args, **kwargs)

    vt.get_tokenizer = get_tokenizer
    try:
        import vllm.tokenizers.registry as reg
        reg.get_tokenizer = get_tokenizer
    except Exception:
        pass

    orig_auto = transformers.AutoTokenizer.from_pretrained.__func__

    def from_pretrained(cls, name, *args, **kwargs):
        if not os.path.isdir(str(name)):
            name = TOKENIZER_DIR
            kwargs.pop("revision", None)
        return orig_auto(cls, name, *args, **kwargs)

    transformers.AutoTokenizer.from_pretrained = classmethod(from_pretrained)


_patch_tokenizers()


def _fake_hub_dir(repo_id) -> str:
    d = os.path.join("/tmp/harness-fake-hub", str(repo_id).replace("/", "--"))
    os.makedirs(d, exist_ok=True)
    return d


def _patch_hub_downloads():
    """No hub access: a download (LoRA adapter, config for dummy weights) returns an empty local folder, so the
    module's server still starts (its LoRA flags are dropped by the shim and recorded as a needed feature); only
    tests that use the adapter then fail, and those are classified 'needs vLLM feature LoRA'."""
    import vllm.transformers_utils.repo_utils as ru

    class _NoHub:
        def snapshot_download(self, repo_id=None, *a, **k):
            return _fake_hub_dir(repo_id or (a[0] if a else "unknown"))

        def __getattr__(self, name):
            def f(*a, **k):
                pytest.skip(f"harness: needs a Hugging Face hub call ({name}); out of scope")
            return f

    ru.hf_api = lambda *a, **k: _NoHub()
    import vllm.model_executor.model_loader.weight_utils as wu

    wu.download_weights_from_hf = lambda model_name_or_path, *a, **k: _fake_hub_dir(model_name_or_path)


_patch_hub_downloads()


def _patch_model_config():
    """Some tests build vllm.config.ModelConfig(model=<hub id>) only to read get_vocab_size(); that needs the
    hub. Answer with the served model's vocabulary (SmolLM2: 49152) instead."""
    import vllm.config as vc

    Real = vc.ModelConfig

    class HarnessModelConfig(Real):
        def __init__(self, model=None, **kw):
            object.__setattr__(self, "model", model)

        def get_vocab_size(self):
            return 49152

    vc.ModelConfig = HarnessModelConfig


_patch_model_config()

from tests.utils import RemoteOpenAIServer  # noqa: E402


class LocalAssetServer:
    """Stub: vLLM's serves local image assets for multimodal tests (out of scope)."""

    def __init__(self, *a, **k):
        pytest.skip("harness: multimodal asset server not provided (multimodal is out of scope)")


class _NoAssets:
    def url_for(self, *a, **k):
        pytest.skip("harness: multimodal asset server not provided (multimodal is out of scope)")

    def get_image_asset(self, *a, **k):
        self.url_for()


@pytest.fixture(scope="session")
def local_asset_server():
    # only the multimodal variants read it; text variants must still run
    return _NoAssets()


def pytest_addoption(parser):
    parser.addoption("--optional", action="store_true", default=False, help="run optional test")


def pytest_configure(config):
    for m in ["skip_global_cleanup", "optional", "core_model", "cpu_model", "cpu_test", "distributed",
              "skip_v1", "slow_test", "split", "timeout"]:
        config.addinivalue_line("markers", f"{m}: vLLM marker")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--optional"):
        return
    skip_optional = pytest.mark.skip(reason="need --optional option to run")
    for item in items:
        if "optional" in item.keywords:
            item.add_marker(skip_optional)


# --- classification support -----------------------------------------------------------------------------------
_live: dict[int, list[str]] = {}
_started_in_test: list[list[str]] = []

_orig_init = RemoteOpenAIServer.__init__
_orig_shutdown = RemoteOpenAIServer._shutdown


def _init(self, *a, **k):
    try:
        _orig_init(self, *a, **k)
    finally:
        feats = list(getattr(self, "features", []))
        if getattr(self, "proc", None) is not None:
            _live[id(self)] = feats
        _started_in_test.append(feats)


def _shutdown(self):
    _live.pop(id(self), None)
    _orig_shutdown(self)


RemoteOpenAIServer.__init__ = _init
RemoteOpenAIServer._shutdown = _shutdown


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _started_in_test.clear()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    yield
    if call.when in ("setup", "call"):
        feats = sorted({f for fs in list(_live.values()) + _started_in_test for f in fs})
        if feats and not any(k == "dropped_features" for k, _ in item.user_properties):
            item.user_properties.append(("dropped_features", "; ".join(feats)))

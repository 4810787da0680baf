"""Shared fixtures: tiny random Llama models with a character tokenizer (no weights needed),
stand-in backends with fixed Markov distributions, and services on loopback."""

from __future__ import annotations

import gc
import os
import string

# gRPC's fork handlers off, before grpc loads: this process hosts gRPC servers and channels (services in
# process, an OTLP receiver) while it starts children (ray.init's GCS, the CLI), and a fork with another
# thread inside gRPC can crash the child before its exec (clean-clone CI: ray.init timed out waiting on a
# GCS server that died in ev_epoll1_linux.cc "next_worker->state == KICKED"). Every child here execs at once.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import pytest
import torch

from cli import options
from specdec.runtime.backend import HFBackend
from specdec.weights.models import ModelSpec

# The suite is a process of its own, as a command is: $SPECDEC_CACHE (CI sets it) and $SPECDEC_FUSE
# applied as the CLI applies them (the library reads no environment).
options.apply_environment()

CHARS = string.ascii_lowercase + string.digits + " .,!?\n"
JSON_CHARS = CHARS + '{}[]":-_\\'  # enough for JSON (structured output's tests)
SPECIALS = ["<unk>", "<s>", "</s>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def make_tokenizer(extra_tokens: int = 0, chars: str = CHARS):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + list(chars))}
    for i in range(extra_tokens):
        vocab[f"<x{i}>"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_model(
    path, seed: int, extra_tokens: int = 0, layers: int = 2, like=None, noise=0.0, chars: str = CHARS
) -> str:
    """A randomly initialised Llama with a character tokenizer, saved to `path`.

    With `like` (a model path), a copy of that model with Gaussian noise of relative size
    `noise` on every weight: a draft that agrees with it often, but not always.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = make_tokenizer(extra_tokens, chars)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # Larger logits make near-ties (which the block-vs-single-token numerics could flip) rare.
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
        if like is not None:
            model.load_state_dict(LlamaForCausalLM.from_pretrained(like).state_dict())
            for w in model.parameters():
                w.add_(noise * w.std() * torch.randn_like(w))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Paths of three tiny models: target, a different draft, and one with another vocab."""
    root = tmp_path_factory.mktemp("tiny")
    target = make_tiny_model(root / "target", seed=0)
    return {
        "target": target,
        "draft": make_tiny_model(root / "draft", seed=1, like=target, noise=0.5),
        "other_vocab": make_tiny_model(root / "other", seed=2, extra_tokens=5),
    }


@pytest.fixture(scope="session")
def tiny_backends(tiny_models):
    return {
        "target": HFBackend(ModelSpec(tiny_models["target"], "cpu", "float32")),
        "draft": HFBackend(ModelSpec(tiny_models["draft"], "cpu", "float32")),
    }


# Test modules that hold a machine-wide resource run on one pytest-xdist worker, one after another
# (`make test` runs two workers, --dist loadgroup): network namespaces and nftables rules. Every other
# module is a group of its own (its module-scoped fixtures set up once, on one worker). The modules
# that start a local Ray cluster are marked `ray_cluster`, and `make test` runs them after the others,
# in one process: beside another worker's test, Ray Serve's pairs took the 24 GiB machine to Ray's
# memory monitor, which killed them (clean-clone CI, 2026-11-30). The tests that hold a llama.cpp context
# of a real model (marked big_memory; real_model implies it) run one after another on one worker too: a
# context allocates its KV whole at start (the F32 target's 16 streams ~3.3 GB, the Q8_0 draft's ~1.8 GB),
# and two such tests at once took the machine to the kernel's OOM killer (clean-clone CI, 2026-11-30:
# two default pipelines beside a worker of 7.8 GB). The groups need pytest 8 (pyproject pins it): under
# pytest 9.2, xdist 3.8 writes a test's group to an attribute pytest no longer reads (Node._nodeid).
SHARED = {"netns": ("test_hung_peers.py", "test_two_hosts.py")}
GROUP = {module: group for group, modules in SHARED.items() for module in modules}
RAY_CLUSTER = ("test_ray.py", "test_ray_cli.py", "test_ray_serve.py", "test_telemetry.py")


@pytest.fixture
def draft_awaited(monkeypatch):
    """Greedy, invariant and adaptive rounds wait for the draft's session to open, as a Leviathan
    sample's at a fixed k do: they go without drafts meanwhile (orchestrator.sessions: _waits_for_draft),
    and with in-process stand-ins a 200-token greedy answer ended in 15 ms, before a loaded CI worker ran
    the draft's open at all (no draft token: stops 78 and 84). For the tests that assert drafts were
    proposed."""
    _rounds_wait_for_draft(monkeypatch, lambda loop: not loop._draft_was_lost)


@pytest.fixture
def draft_always_awaited(monkeypatch):
    """draft_awaited, and after the draft's session was lost too: the rounds wait for the session
    it re-opens, for the tests that assert speculation resumed."""
    _rounds_wait_for_draft(monkeypatch, lambda loop: True)


def _rounds_wait_for_draft(monkeypatch, waits) -> None:
    """A loop's rounds wait for its draft's open where waits(loop) (orchestrator.sessions: _waits_for_draft)."""
    from orchestrator.sessions import GenerationSessions

    monkeypatch.setattr(GenerationSessions, "_waits_for_draft", property(waits))


def pytest_addoption(parser):
    parser.addoption(
        "--late-draft",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="delay every in-process generation's draft OpenSession this long (the other tasks run "
        "meanwhile), as a loaded CI worker can: a test that asserts drafts were proposed must then "
        "use draft_awaited (docs/testing.md)",
    )


@pytest.fixture(autouse=True)
def _late_draft(request, monkeypatch):
    """--late-draft: the draft's open comes that late (none by default)."""
    delay = request.config.getoption("--late-draft")
    if not delay:
        return
    import time

    from orchestrator import scheduler
    from orchestrator.sessions import GenerationSessions

    opened = GenerationSessions._open

    def late(loop, side, *args, **kwargs):
        if side is loop.draft:
            scheduler.offload(time.sleep, delay)
        return opened(loop, side, *args, **kwargs)

    monkeypatch.setattr(GenerationSessions, "_open", late)


@pytest.fixture(scope="module", autouse=True)
def _collect_after_module():
    """Free what a module's fixtures left in reference cycles (a backend, a llama.cpp context) before
    the worker's next module allocates its own."""
    yield
    gc.collect()


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects, and before xdist reads the groups
def pytest_collection_modifyitems(items):
    """A test on the real default model is slow too: `-m "not slow"` (make test-quick) leaves it out.
    Each test gets its module's xdist group (SHARED above)."""
    for item in items:
        if item.get_closest_marker("real_model") and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("real_model"):
            item.add_marker(pytest.mark.big_memory)
        module = item.path.name
        group = "big_memory" if item.get_closest_marker("big_memory") else GROUP.get(module, module)
        item.add_marker(pytest.mark.xdist_group(group))
        if module in RAY_CLUSTER:
            item.add_marker(pytest.mark.ray_cluster)

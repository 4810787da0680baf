"""Every architecture the torch backend serves computes what the model computes, on every path that
serves it; any other is refused when it loads (specdec.runtime.architectures).

Tiny random checkpoints of each family, its features switched on (tests/checkpoints.py: sliding
windows shorter than the prompts, Gemma 2/3's alternating sliding and full layers, q/k/v biases,
soft-capping, q/k norms, partial rotary, MoE routers, parallel attention and MLP, embedding and
logit scales, learned absolute positions):
- the backend, every family: the logits of a chain (a prefill chunk, verify blocks, a rollback and
  a different continuation), of a ragged batch packed and padded, of a draft tree (each node its
  path's), and of the static backend's forwards (specdec.runtime.graphs, eager on a CPU) equal the model's
  own forward of each whole sequence, and greedy decoding equals its `generate`;
- the three services on loopback (the draft a noisy copy of the target), the issue's matrix:
  greedy text equal to the target's own `generate`, token for token, with chains, with draft
  trees, and with two concurrent sessions of different lengths; and each family again with tied
  embeddings on raw text prompts (the build of issue 61's Qwen2 report), from the first token;
- refusals: an architecture not verified, ALiBi, layers the slot cache cannot hold, each a clear
  FailedPrecondition naming the architecture and the reason.
The sampling law on a non-Llama architecture, and vocabularies, are in tests/test_vocabulary.py.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from specdec.errors import FailedPrecondition
from specdec.limits import SessionLimits
from specdec.runtime import architectures
from specdec.runtime.backend import HFBackend
from specdec.runtime.engine import SessionEngine
from specdec.runtime.graphs import Buckets, GraphBackend
from specdec.v1 import orchestrator_pb2
from specdec.weights.models import ModelSpec
from tests.checkpoints import CONFIGS, WINDOW, tiny_checkpoint
from tests.harness import pipeline

pytestmark = pytest.mark.slow  # the architecture matrix

# The matrix, through the services; the backend test covers every family.
MATRIX = [
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "gemma", "gemma2", "gemma3_text",
    "phi3", "olmo2", "gpt_neox", "gpt2", "falcon", "starcoder2", "granite",
]  # fmt: skip
SEQUENCES = [
    [1, 10, 7, 14, 14, 17, 39, 20, 21, 5, 33, 8, 12, 30, 11, 9, 25, 4, 18, 27, 6, 40],
    [1, 22, 3, 19, 31, 16, 9, 28],
    [1, 35, 13, 24, 5],
]
PROMPTS = [SEQUENCES[0][:14], SEQUENCES[1]]  # 14 and 8 tokens: both past the window
NEW_TOKENS = 20
LIMITS = SessionLimits(max_sessions=4)  # a draft profiles its steps of 1-4 sessions at start, not 1-16


def test_every_family_has_a_tiny_config():
    assert set(architectures.FAMILIES) == set(CONFIGS)
    assert all(len(p) > WINDOW for p in PROMPTS)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("architectures")


def reference(path):
    """The model as transformers loads it, untouched by the backend: what the backend must equal."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def own_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def own_greedy(model, prompt: list[int], n: int = NEW_TOKENS, stop: bool = True) -> list[int]:
    """The model's own greedy continuation; `stop`: up to its EOS, as a generation ends (without it)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    out = out[0, len(prompt) :].tolist()
    eos = model.generation_config.eos_token_id
    return out[: out.index(eos)] if stop and eos in out else out


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, atol=1e-4 * (1 + float(want.abs().max())), rtol=1e-4)


def static_backend(path) -> GraphBackend:
    backend = GraphBackend(ModelSpec(path, "cpu", "float32"), Buckets(batches=(4,), widths=(8,), lengths=(32,)))
    backend.prepare(SessionLimits(max_sessions=4, max_kv_tokens=4 * 64))
    return backend


@pytest.mark.parametrize("kind", sorted(architectures.FAMILIES))
def test_forwards_equal_the_models_own(root, kind):
    path = tiny_checkpoint(root / f"{kind}-alone", kind)
    model, memo = reference(path), {}

    def own(tokens: list[int]) -> torch.Tensor:  # a causal model: a prefix's logits are the whole's
        if tuple(tokens) not in memo:
            memo[tuple(tokens)] = own_logits(model, tokens)
        return memo[tuple(tokens)]

    eager = HFBackend(ModelSpec(path, "cpu", "float32"))
    assert eager.packed == architectures.FAMILIES[kind].packed  # the packed path runs where the table says
    chain, other = SEQUENCES[0], SEQUENCES[0][:15] + [3, 4, 5, 6, 7]
    tokens, parents = [20, 21, 22, 23, 24, 25], [-1, -1, 0, 0, 2, 1]
    for backend in (eager, static_backend(path)):
        # a chain: a prefill chunk, a verify block, one token, a rollback and another continuation
        slot = backend.new_cache()
        backend.forward(slot, chain[:12], 1)
        close(backend.forward(slot, chain[12:16], 4), own(chain)[12:16])
        close(backend.forward(slot, chain[16:17], 1), own(chain)[16:17])
        backend.crop(slot, 15)
        close(backend.forward(slot, other[15:], 3), own(other)[-3:])
        backend.release(slot)
        # a ragged batch: prefills of different lengths, then blocks of different widths, packed and padded
        packs = backend.packed
        for packed in (False, True) if packs else (False,):
            backend.packed = packed
            slots = [backend.new_cache() for _ in SEQUENCES]
            for step in [(0, 10, 2), (0, 5, 1), (0, 2, 2)], [(10, 14, 3), (5, 6, 1), (2, 5, 3)]:
                items = [(s, seq[a:z], n) for s, seq, (a, z, n) in zip(slots, SEQUENCES, step, strict=True)]
                for got, seq, (_, z, n) in zip(backend.forward_batch(items), SEQUENCES, step, strict=True):
                    close(got, own(seq)[z - n : z])
            for s in slots:
                backend.release(s)
        backend.packed = packs
        # a draft tree: each node sees the chain and its ancestors, at its depth's position
        engine = SessionEngine(backend, "target")
        engine.open("t", chain[:14])

        def verify(session, engine=engine):
            logits = yield engine.forward_tree(session, tokens, parents)
            return logits

        got = engine.call("t", None, verify)
        engine.close("t")
        engine.stop()
        for node in range(-1, len(tokens)):
            path_tokens, at = [], node
            while at >= 0:
                path_tokens.insert(0, tokens[at])
                at = parents[at]
            close(got[node + 1 : node + 2], own(chain[:14] + path_tokens)[-1:])
    # greedy decoding over the slot cache is the model's own generate
    slot, prompt = eager.new_cache(), PROMPTS[0]
    logits, out = eager.forward(slot, prompt, 1), []
    for _ in range(NEW_TOKENS):
        out.append(int(logits[0].argmax()))
        logits = eager.forward(slot, out[-1:], 1)
    assert out == own_greedy(model, prompt, stop=False)


def request(prompt, **speculation) -> orchestrator_pb2.GenerateRequest:
    return orchestrator_pb2.GenerateRequest(
        token_ids=orchestrator_pb2.TokenIds(ids=prompt),
        max_new_tokens=NEW_TOKENS,
        speculation=orchestrator_pb2.SpeculationParams(**speculation),
    )


@pytest.mark.parametrize("kind", MATRIX)
def test_greedy_through_the_services_equals_generate(root, kind):
    """Chains, draft trees and two concurrent sessions of different lengths, one set of services."""
    target = tiny_checkpoint(root / f"{kind}-target", kind)
    draft = tiny_checkpoint(root / f"{kind}-draft", kind, seed=1, like=target)
    want = [own_greedy(reference(target), p) for p in PROMPTS]
    spec = ModelSpec(target, "cpu", "float32")
    with pipeline(HFBackend(ModelSpec(draft, "cpu", "float32")), HFBackend(spec), limits=LIMITS) as p:

        def generate(prompt, **speculation) -> list[int]:
            return list(p.orchestrator.Generate(request(prompt, **speculation), timeout=120).token_ids)

        chains = [generate(prompt, lookahead=4) for prompt in PROMPTS]
        trees = [generate(prompt, lookahead=3, tree_nodes=6) for prompt in PROMPTS]
        with ThreadPoolExecutor(2) as pool:
            together = list(pool.map(lambda prompt: generate(prompt, lookahead=3), PROMPTS))
        assert chains == want, "chains"
        assert trees == want, "trees"
        assert together == want, "batched"
        assert p.sessions_freed_within(5)


RAW = ["hello world", "ab", "the cat sat on the mat"]  # text prompts, tokenised by the orchestrator
# The build issue 61 reported a first token off on: 2 layers, hidden 64, 4 heads, 2 KV heads.
SHAPES = {"qwen2": {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2}}


@pytest.mark.parametrize("kind", MATRIX)
def test_tied_embeddings_on_raw_prompts_equal_generate_from_the_first_token(root, kind):
    """Each family of the matrix built as a user's small checkpoint often is (tied input and output
    embeddings, the output rows scaled, the character tokenizer), on raw text prompts: the prompt's
    tokens as the tokenizer gives them, and greedy equal to `generate` from the first token, with
    chains, draft trees and speculation off."""
    from transformers import AutoTokenizer

    target = tiny_checkpoint(root / f"{kind}-tied-target", kind, tie_word_embeddings=True, **SHAPES.get(kind, {}))
    draft = tiny_checkpoint(root / f"{kind}-tied-draft", kind, seed=1, like=target)
    tokenizer, model = AutoTokenizer.from_pretrained(target), reference(target)
    assert model.config.tie_word_embeddings
    want = [own_greedy(model, tokenizer(text)["input_ids"]) for text in RAW]
    with pipeline(
        HFBackend(ModelSpec(draft, "cpu", "float32")), HFBackend(ModelSpec(target, "cpu", "float32")), limits=LIMITS
    ) as p:
        for speculation in ({"lookahead": 4}, {"lookahead": 3, "tree_nodes": 6}, {"disabled": True}):
            got = [
                p.orchestrator.Generate(
                    orchestrator_pb2.GenerateRequest(
                        prompt=text,
                        chat_template=False,
                        max_new_tokens=NEW_TOKENS,
                        speculation=orchestrator_pb2.SpeculationParams(**speculation),
                    ),
                    timeout=120,
                )
                for text in RAW
            ]
            assert [r.stats.prompt_tokens for r in got] == [len(tokenizer(t)["input_ids"]) for t in RAW]
            assert [list(r.token_ids) for r in got] == want, speculation


def refusal(tmp_path, kind: str, **overrides) -> str:
    path = tiny_checkpoint(tmp_path / kind, kind, **overrides)
    with pytest.raises(FailedPrecondition) as err:
        HFBackend(ModelSpec(path, "cpu", "float32"))
    return err.value.message


def test_what_the_backend_cannot_serve_exactly_is_refused_naming_it(tmp_path):
    message = refusal(tmp_path, "bloom", n_embed=32, n_layer=2, n_head=4)  # ALiBi, and not verified
    assert "'bloom'" in message and "verified" in message
    message = refusal(tmp_path, "falcon", alibi=True)
    assert "'falcon'" in message and "ALiBi" in message
    message = refusal(tmp_path, "qwen3_next", layer_types=["linear_attention", "full_attention"])
    assert "'qwen3_next'" in message and "linear_attention" in message

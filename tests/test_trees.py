"""Draft trees: the draft proposes a tree, the target verifies it in one forward, exactly.

- the transformers backend's tree forward gives each node the logits of its own root path run as
  a plain chain, and after a commit the cache holds the accepted path as if it had been fed alone;
- a target without tree attention (llama.cpp's, ChainsOnly here) scores a tree chain by chain,
  only the chains the rule walks into: one forward while the walk stays on the spine, each row
  its path's; every test of the rule below runs against both kinds of target;
- the draft's tree is a spine with runners-up, at most the budget, parents before children;
- greedy: a tree generation is token for token the target alone's, for the model and n-gram
  drafters and several budgets and depths (stand-ins), and for the tiny models over gRPC;
- sampling: the output law through the loop and through the three services is the target's
  (chi-square, T = 0.7 with top-k and top-p, budgets that branch at several depths), and a
  deliberately wrong residual fails the same test; the invariant rule with trees still gives the
  target alone's seeded text;
- both services end with no session and no KV held.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from draft_service.drafters import MODEL, NGRAM
from orchestrator.loop import LoopConfig, SpeculativeLoop
from orchestrator.trees import EXPLORE_ROUNDS, REVISIT, PairTrees, TreeChoice
from specdec.decoding import rule
from specdec.decoding.sampling import SamplingParams
from specdec.limits import SessionLimits
from specdec.runtime.backend import HFBackend
from specdec.runtime.engine import SessionEngine
from specdec.runtime.graphs import Buckets, GraphBackend
from specdec.v1 import model_pb2, orchestrator_pb2, orchestrator_pb2_grpc
from specdec.weights.models import ModelSpec
from target_service import scorer
from tests.harness import pipeline
from tests.standins import ChainsOnly, random_markov
from tests.stats import counts_chisquare, markov_chisquare, transition_counts
from tests.test_loop import kernel_after_transform
from tests.test_overlap import near
from tests.test_rule import wrong_tree_walk
from tests.test_seeds import SUPPORT, TokenizedMarkov, pair, run_all

SAMPLING = SamplingParams(temperature=0.7, top_k=8, top_p=0.95)


def eager_or_static(path: str, static: bool) -> HFBackend:
    """The eager backend, or the static one (specdec.runtime.graphs: its forwards eager on a CPU, captured on CUDA)."""
    if not static:
        return HFBackend(ModelSpec(path, "cpu", "float32"))
    backend = GraphBackend(ModelSpec(path, "cpu", "float32"), Buckets(batches=(1, 2), widths=(4, 8), lengths=(32,)))
    backend.prepare(SessionLimits(max_sessions=2, max_kv_tokens=2 * 64))
    return backend


def in_session(engine: SessionEngine, prefix: list[int], request):
    """One worker request in a session opened on `prefix` for it, closed after."""
    engine.open("s", prefix)
    try:
        return engine.call("s", None, request)
    finally:
        engine.close("s")


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_a_tree_forward_gives_each_node_its_paths_logits(tiny_models, static):
    backend = eager_or_static(tiny_models["target"], static)
    prefix = [1, 10, 7, 14, 14]
    tokens, parents = [20, 21, 22, 23, 24, 25], [-1, -1, 0, 0, 2, 1]
    engine = SessionEngine(backend, "target")

    def run(request):
        return in_session(engine, prefix, request)

    def tree(session):
        logits = yield engine.forward_tree(session, tokens, parents)
        return logits

    def path_logits(node: int) -> torch.Tensor:  # after the node's path (-1: the prefix) fed as a chain
        path, at = [], node
        while at >= 0:
            path.insert(0, tokens[at])
            at = parents[at]

        def chain(session):
            logits = yield engine.forward(session, path, 1)
            return logits

        return run(chain)[0]

    got = run(tree)  # [7, vocab]: after the prefix, then after each node
    for node in range(-1, len(tokens)):
        torch.testing.assert_close(got[node + 1], path_logits(node), atol=1e-4, rtol=1e-4)

    # A commit keeps the accepted path (root -> 1 -> 5), compacted: the next step's logits are as if
    # the path had been fed as a chain.
    def commit_then_step(session):
        yield engine.forward_tree(session, tokens, parents)
        engine.commit(session, [tokens[1], tokens[5], 30])
        assert session.cached == [*prefix, tokens[1], tokens[5]] and session.tree is None
        logits = yield engine.forward(session, [], 1)
        return logits

    def plain(session):
        engine.commit(session, [tokens[1], tokens[5], 30])
        logits = yield engine.forward(session, [], 1)
        return logits

    torch.testing.assert_close(run(commit_then_step), run(plain), atol=1e-4, rtol=1e-4)
    assert engine.open_sessions == 0 and engine.kv.held == 0
    if static:  # every forward ran static (a tree's mask and rotary positions as the graphs' inputs)
        assert sum(backend.built.hits.values()) > 0 and backend.builds_after_ready == 0

    # A draft grows the same tree a depth at a time (engine.extend_tree): each node's logits are its path's.
    def grown(session):
        yield engine.forward(session, [], 1)
        logits = yield engine.extend_tree(session, tokens[:2], parents[:2])
        logits2 = yield engine.extend_tree(session, tokens[2:4] + tokens[5:], [0, 0, 1])
        logits3 = yield engine.extend_tree(session, tokens[4:5], [2])
        return torch.cat([logits, logits2[:2], logits3, logits2[2:]])

    for node, row in enumerate(run(grown)):
        torch.testing.assert_close(row, path_logits(node), atol=1e-4, rtol=1e-4)
    assert engine.open_sessions == 0 and engine.kv.held == 0


def test_a_tree_by_chains_scores_only_the_chains_its_walk_enters(tiny_models):
    """A target without tree attention: the spine in one forward while the greedy walk stays on it;
    a walk that leaves it at a runner-up scores that runner-up's own chain after its ancestors;
    each row is its path's; the cache holds the walked path, for the next commit to keep."""
    backend = ChainsOnly(HFBackend(ModelSpec(tiny_models["target"], "cpu", "float32")))
    engine = SessionEngine(backend, "target")
    prefix = [1, 10, 7, 14, 14]

    def run(request):
        return in_session(engine, prefix, request)

    def chain(path):
        def request(session):
            logits = yield engine.forward(session, path, len(path) + 1)
            return logits.clone()

        return run(request)

    greedy = []  # the target's own greedy continuation
    for _ in range(4):
        greedy.append(int(chain(greedy)[-1].argmax()))
    wrong = next(t for t in range(3, 30) if t not in greedy)

    def score(tokens, parents):
        forwards = []

        def request(session):
            scores = yield from counted(scorer.score_tree(engine, session, tokens, parents, SamplingParams()), forwards)
            return scores, list(session.cached)

        (scores, cached) = run(request)
        return scores, cached, forwards

    # the spine is the target's text: one forward; its rows are the spine's, fed as a chain
    tokens, parents = [greedy[0], wrong, greedy[1], wrong, greedy[2]], [-1, -1, 0, 0, 2]
    scores, cached, forwards = score(tokens, parents)
    assert len(forwards) == 1 and cached == prefix + [greedy[0], greedy[1], greedy[2]]
    assert rule.tree_greedy_path(parents, tokens, scores.argmax) == [0, 2, 4]
    assert scores.argmax[5] == greedy[3]
    # the spine starts wrong, the root's runner-up is right: its chain (runner-up, its first child) next
    tokens, parents = [wrong, greedy[0], greedy[1], wrong], [-1, -1, 1, 2]
    scores, cached, forwards = score(tokens, parents)
    assert len(forwards) == 2 and cached == prefix + [greedy[0], greedy[1], wrong]
    path = rule.tree_greedy_path(parents, tokens, scores.argmax)
    assert path == [1, 2] and scores.argmax[3] == greedy[2]  # the round commits greedy[:3]

    def rows(session):  # the rows scored, each its path's fed as a chain
        def decide(_rows):  # no walk: reads no row, so the spine's chain alone is scored
            return None

        logits, scored, _, _ = yield from scorer.tree_rows(engine, session, tokens, parents, lambda out, _: out, decide)
        return logits.clone(), scored

    logits, scored = run(rows)
    assert scored == {0, 1}  # the root's row and the row after the spine's only node
    torch.testing.assert_close(logits[0], chain([])[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[1], chain([wrong])[-1], atol=1e-4, rtol=1e-4)
    assert not logits[2:].any()
    assert engine.open_sessions == 0 and engine.kv.held == 0


def counted(request, forwards: list):
    """A worker request that records the forwards it yields."""
    result = None
    try:
        forward = request.send(None)
        while True:
            forwards.append(forward)
            forward = request.send((yield forward))
    except StopIteration as stop:
        result = stop.value
    return result


GREEDY = SamplingParams()


def generate(draft, target, n: int, sampling=GREEDY, seed: int = 3, **config):
    loop = SpeculativeLoop(draft, target, [0, 1, 2], LoopConfig(sampling, n, seed=seed, **config))
    for _ in loop.rounds():
        pass
    return loop.generated, loop.stats


VERIFY = ["attention", "chains"]  # how the target scores a tree: in one forward, or chain by chain


def verified(target, verify: str):
    """An in-process target service (tests.test_seeds.pair) whose backend scores trees as `verify` says."""
    if verify == "chains":
        target.servicer.engine.backend = ChainsOnly(target.servicer.engine.backend)
    return target


@pytest.mark.parametrize("verify", VERIFY)
@pytest.mark.parametrize("drafter", [MODEL, NGRAM], ids=["model", "ngram"])
@pytest.mark.usefixtures("draft_awaited")
def test_greedy_trees_equal_the_target_alone(drafter, verify):
    target_probs = random_markov(12, 31, alpha=0.3)
    draft, target = pair(target_probs, near(target_probs, 32), drafter)
    target = verified(target, verify)
    plain, _ = generate(draft, target, 200, speculate=False)
    for depth, nodes in [(4, 8), (8, 4), (3, 12), (6, 6)]:
        out, stats = generate(draft, target, 200, lookahead=depth, tree_nodes=nodes)
        assert out == plain and stats.draft_tokens > 0, (depth, nodes)
        assert stats.accepted_tokens <= stats.rounds * depth
    assert draft.servicer.engine.open_sessions == 0 == target.servicer.engine.open_sessions


def test_the_draft_proposes_a_spine_with_runners_up():
    target_probs = random_markov(12, 41, alpha=0.8)  # flat rows: runners-up are worth a place
    draft, _ = pair(target_probs, target_probs)
    engine = draft.servicer.engine
    engine.open("s", [0, 1, 2])
    request = model_pb2.ProposeRequest(session=model_pb2.SessionRef(session_id="s", expected_length=3), k=4)
    request.tree_nodes = 9
    tree = draft.Propose(request)
    parents = list(tree.parent_ids)
    assert 1 < len(tree.token_ids) <= 9 and len(parents) == len(tree.token_ids)
    assert all(-1 <= p < i for i, p in enumerate(parents))
    children = rule.tree_children(parents)
    assert max(len(c) for c in children.values()) > 1  # it branched
    assert len(children) > 1  # and went deeper than one level
    engine.close("s")


@pytest.mark.slow
@pytest.mark.parametrize("verify", VERIFY)
def test_the_law_through_the_loop_is_the_targets(verify):
    target_probs, draft_probs = random_markov(6, 51), random_markov(6, 52)
    draft, target = pair(target_probs, draft_probs)
    target = verified(target, verify)
    tokens, stats = generate(draft, target, 8_000, SAMPLING, lookahead=3, tree_nodes=6)
    assert markov_chisquare([2, *tokens], kernel_after_transform(target_probs, SAMPLING)) > 1e-3
    assert 0 < stats.accepted_tokens < stats.draft_tokens


def chains_through_the_services(target_kernel, draft_kernel, tokens: int) -> np.ndarray:
    with pipeline(TokenizedMarkov(draft_kernel), TokenizedMarkov(target_kernel)) as p:
        requests = [
            orchestrator_pb2.GenerateRequest(
                token_ids=orchestrator_pb2.TokenIds(ids=[SUPPORT[0]]),
                sampling=model_pb2.SamplingParams(temperature=0.7, top_k=4, top_p=0.9),
                seed=200 + i,
                max_new_tokens=tokens,
                speculation=orchestrator_pb2.SpeculationParams(lookahead=3, tree_nodes=6),
            )
            for i in range(8)
        ]
        outputs = run_all(p.addresses["orchestrator"], requests)
        assert p.sessions_freed_within(5)
        stub = orchestrator_pb2_grpc.OrchestratorStub
        assert stub  # the services answered every request
    index = {t: i for i, t in enumerate(SUPPORT)}
    return transition_counts([[0, *(index[t] for t in out)] for out in outputs], len(SUPPORT))


def support_kernel(kernel) -> np.ndarray:
    return kernel_after_transform(kernel, SamplingParams(temperature=0.7, top_k=4, top_p=0.9))


@pytest.fixture(scope="module")
def kernels():
    return random_markov(len(SUPPORT), 81), random_markov(len(SUPPORT), 82)


@pytest.mark.slow
def test_the_law_through_the_services_is_the_targets(kernels):
    target_kernel, draft_kernel = kernels
    counts = chains_through_the_services(target_kernel, draft_kernel, 1000)
    assert counts_chisquare(counts, support_kernel(target_kernel)) > 1e-3
    assert counts_chisquare(counts, support_kernel(draft_kernel)) < 1e-3


@pytest.mark.slow
def test_a_wrong_residual_through_the_services_fails_the_same_test(kernels, monkeypatch):
    monkeypatch.setattr(rule, "tree_walk", wrong_tree_walk)  # the target service runs in this process
    target_kernel, draft_kernel = kernels
    counts = chains_through_the_services(target_kernel, draft_kernel, 1000)
    assert counts_chisquare(counts, support_kernel(target_kernel)) < 1e-3


@pytest.mark.usefixtures("draft_awaited")
@pytest.mark.parametrize("verify", VERIFY)
def test_the_invariant_rule_with_trees_gives_the_target_alones_text(verify):
    target_probs = random_markov(12, 61, alpha=0.3)
    draft, target = pair(target_probs, near(target_probs, 62))
    target = verified(target, verify)
    alone, _ = generate(draft, target, 300, SAMPLING, seed=5, speculate=False, rule="invariant")
    for depth, nodes in [(4, 8), (2, 6)]:
        out, stats = generate(draft, target, 300, SAMPLING, seed=5, lookahead=depth, tree_nodes=nodes, rule="invariant")
        assert out == alone and 0 < stats.accepted_tokens < stats.draft_tokens


def request(prompt, **speculation) -> orchestrator_pb2.GenerateRequest:
    return orchestrator_pb2.GenerateRequest(
        token_ids=orchestrator_pb2.TokenIds(ids=prompt),
        max_new_tokens=40,
        speculation=orchestrator_pb2.SpeculationParams(**speculation),
    )


@pytest.mark.parametrize("verify", VERIFY)
def test_greedy_trees_over_grpc_on_the_tiny_models(tiny_backends, verify):
    prompts = [[1, 10, 7, 14, 14, 17, 39], [1, 20, 21, 22], [1, 5]]
    target = tiny_backends["target"] if verify == "attention" else ChainsOnly(tiny_backends["target"])
    with pipeline(tiny_backends["draft"], target) as p:
        address = p.addresses["orchestrator"]
        alone = run_all(address, [request(ids, disabled=True) for ids in prompts])
        for depth, nodes in [(4, 8), (6, 3)]:
            trees = run_all(address, [request(ids, lookahead=depth, tree_nodes=nodes) for ids in prompts])
            assert trees == alone, (depth, nodes)
        assert p.sessions_freed_within(5)
        assert p.target.Describe(model_pb2.DescribeRequest()).kv_tokens == 0


def test_an_adaptive_generation_takes_a_tree_only_while_trees_measure_faster():
    choice = TreeChoice()
    picks = []
    for _ in range(2 * EXPLORE_ROUNDS):  # both kinds are measured first, alternately
        tree = choice.tree(greedy=True)
        picks.append(tree)
        choice.update(True, tree, tokens=3 if tree else 5, seconds=1.0)  # chains commit more a second
    assert picks.count(True) == picks.count(False) == EXPLORE_ROUNDS
    later = []
    for _ in range(4 * REVISIT):
        tree = choice.tree(greedy=True)
        later.append(tree)
        choice.update(True, tree, tokens=3 if tree else 5, seconds=1.0)
    assert 0 < later.count(True) <= 5  # the losing kind only as a revisit
    for _ in range(40):  # trees get faster (another text): they win it back
        tree = choice.tree(greedy=True)
        choice.update(True, tree, tokens=9 if tree else 5, seconds=1.0)
    assert sum(choice.tree(greedy=True) for _ in range(10)) >= 9
    assert choice.tree(greedy=False)  # sampled rounds are measured apart, from scratch


@pytest.mark.usefixtures("draft_awaited")
def test_adaptive_with_trees_stays_exact_and_uses_both_kinds():
    target_probs = random_markov(12, 71, alpha=0.3)
    draft, target = pair(target_probs, near(target_probs, 72))
    plain, _ = generate(draft, target, 300, speculate=False)
    trees = PairTrees()
    loop = SpeculativeLoop(
        draft, target, [0, 1, 2], LoopConfig(GREEDY, 300, lookahead=6, adaptive=True, tree_nodes=8), trees=trees
    )
    for _ in loop.rounds():
        pass
    assert loop.generated == plain
    seen = trees.choice._rounds
    assert seen.get((True, True), 0) > 0 and seen.get((True, False), 0) > 0

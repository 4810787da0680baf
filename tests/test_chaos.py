"""`specdec chaos` on tiny random models, under either sampling rule, with chains and with draft
trees: 8 concurrent streams (greedy and seeded sampling) while the draft and the target are
killed with SIGKILL 10 times (4 under trees); nothing is lost, duplicated or changed, no session is left
and no service grew. Plus the checks' own logic on hand-made streams, so a broken stream is known
to fail them."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from bench import chaos
from cli import main as cli


# Ten kills under Leviathan with chains; four under the invariant rule with trees; two of each fault
# under Leviathan: kills, stops (SIGSTOP for seconds: a host that hangs), the link holding its
# packets, the link slowed (each kill costs a process start: CI's time).
@pytest.mark.slow
@pytest.mark.parametrize(
    "rule,tree,kills,faults",
    [("leviathan", 0, 10, "kill"), ("invariant", 6, 4, "kill"), ("leviathan", 0, 8, "kill,stop,drop,slow")],
)
def test_streams_survive_repeated_faults_of_both_services(tiny_models, capsys, rule, tree, kills, faults):
    code = cli.main(
        ["chaos", "--target-model", tiny_models["target"], "--draft-model", tiny_models["draft"]]
        + ["--target-dtype", "float32", "--draft-dtype", "float32", "--streams", "8", "--kills", str(kills)]
        + ["--max-tokens", "48", "--duration", "600", "--seed", "3", "--json", "--rule", rule, "--tree", str(tree)]
        + ["--faults", faults]
    )
    result = json.loads(capsys.readouterr().out)
    print(chaos.text(result))
    assert code == 0 and result["ok"], chaos.text(result)
    kinds = faults.split(",")
    assert result["kills"] + result["stops"] == kills
    assert result["faults_by_kind"] == {kind: kills // len(kinds) for kind in kinds}
    killed = Counter(victim for victim, _, fault, _ in chaos.kill_schedule(chaos.ChaosConfig(
        kills=kills, seed=3, faults=tuple(faults.split(",")))) if fault == "kill")  # fmt: skip
    assert result["kills_by_service"] == dict(killed) == result["restarts_by_service"]
    assert set(result["stops_by_service"]) <= {"draft", "target"}
    assert result["faults"]["requests"] >= result["reference"]["requests"] == 24
    assert result["sessions_reopened"] > 0  # kills met generations in flight, which went on
    assert result["open_sessions_after"] == {"draft": 0, "target": 0}


def test_the_schedule_and_requests_follow_the_seed():
    config = chaos.ChaosConfig(kills=7, seed=5)
    assert chaos.kill_schedule(config) == chaos.kill_schedule(config)
    assert chaos.kill_schedule(config) != chaos.kill_schedule(chaos.ChaosConfig(kills=7, seed=6))
    victims = [v for v, *_ in chaos.kill_schedule(config)]
    assert sorted(victims) == ["draft"] * 4 + ["target"] * 3
    requests = [r for stream in chaos.make_requests(config) for r in stream]
    assert len(requests) == 24 and len({r.prompt for r in requests}) == len(chaos.PROMPTS)
    sampled = [r for r in requests if r.sampling.temperature > 0]
    assert len(sampled) == 12 and all(r.seed for r in sampled)  # seeded, so reproducible
    assert len({r.max_new_tokens for r in requests}) > 1


def outcome(ids, text="", finish="length", malformed=None):
    return chaos.Outcome(0, 0, 1.0, tuple(ids), text, finish, None, malformed)


def test_a_stream_that_lost_repeated_or_changed_tokens_fails():
    reference = outcome([1, 2, 3, 4], "abcd")
    assert outcome([1, 2, 3, 4], "abcd").same_as(reference) is None
    assert outcome([1, 2, 3], "abc").same_as(reference) == "lost tokens: 3 of 4"
    assert outcome([1, 2, 3, 4, 4], "abcdd").same_as(reference) == "duplicated tokens: 5 for 4"
    assert outcome([1, 2, 9, 4], "ab?d").same_as(reference) == "changed at token 2"
    assert outcome([1, 2, 3, 4], "abcd", "stop").same_as(reference) == "same tokens, different text or finish reason"
    assert outcome([1, 2, 3, 4], "abcd", malformed="2 final chunks").same_as(reference) == "2 final chunks"

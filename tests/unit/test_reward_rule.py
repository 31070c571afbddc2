"""`dataset.reward`: a verifier that writes several rewards trains on the declared key or weighted mean; without
a declaration such a trial has no reward (and says what to declare), never a guessed one."""

import pytest

from grpoflow.config import RewardRule, parse_run_config
from grpoflow.errors import ConfigError
from grpoflow.rollout.outcome import verifier_reward

TWO = {"tests": 1.0, "style": 0.25}


def _rule(reward):
    return parse_run_config({"run_id": "r", "dataset": {"reward": reward}}).dataset.reward_rule()


def test_several_rewards_without_a_rule_have_none_and_say_what_to_set():
    value, why = verifier_reward(TWO)
    assert value is None
    assert why.startswith("reward.json has keys ['style', 'tests'] but no `reward`: set dataset.reward")


def test_a_declared_key_or_weighted_mean_scores_them():
    assert verifier_reward(TWO, _rule("style")) == (0.25, None)
    assert verifier_reward(TWO, _rule({"tests": 3, "style": 1})) == (pytest.approx((3 * 1.0 + 0.25) / 4), None)
    # a declared key decides even beside `reward`
    assert verifier_reward({**TWO, "reward": 0.0}, _rule("tests")) == (1.0, None)
    assert _rule({"b": 1, "a": 2}) == RewardRule(weights=(("a", 2), ("b", 1)))
    assert _rule(None) is None


def test_a_rule_the_verifier_does_not_meet_is_no_reward():
    assert verifier_reward(TWO, _rule("accuracy")) == (
        None,
        "reward.json has keys ['style', 'tests'], not dataset.reward `accuracy`",
    )
    value, why = verifier_reward(TWO, _rule({"tests": 1, "speed": 1}))
    assert value is None and "not ['speed'] of dataset.reward" in why


@pytest.mark.parametrize("bad", ["", {}, {"a": -1}, {"a": 0}])
def test_bad_rules_are_refused_naming_the_field(bad):
    with pytest.raises(ConfigError, match="dataset.reward"):
        _rule(bad)

"""SpillPolicy: the marks past which the pairs count as saturated, and the burst length."""

from distserve.spill_policy import SpillPolicy


def test_each_side_is_past_its_mark_at_the_mark_and_never_with_zero():
    policy = SpillPolicy(prefill_tokens=256, decode_running=32)
    assert policy.saturated_sides(255, 31) == frozenset()
    assert policy.saturated_sides(256, 31) == {"prefill"}
    assert policy.saturated_sides(0, 32) == {"decode"}
    assert SpillPolicy(0, 0).saturated_sides(10**6, 10**6) == frozenset()


def test_a_burst_is_a_queue_of_burst_tokens_and_never_with_zero():
    assert not SpillPolicy(burst_tokens=4096).is_burst(4095)
    assert SpillPolicy(burst_tokens=4096).is_burst(4096)
    assert not SpillPolicy(burst_tokens=0).is_burst(10**9)


def test_the_routers_environment_sets_every_figure_and_leaves_the_rest():
    policy = SpillPolicy.from_env({"DISTSERVE_ROUTER_SPILL_BURST_TOKENS": "8192",
                                   "DISTSERVE_ROUTER_SPILL_PREFILL_TOKENS": "512", "OTHER": "1"})
    assert policy == SpillPolicy(prefill_tokens=512, decode_running=SpillPolicy.decode_running, burst_tokens=8192)

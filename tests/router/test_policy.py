"""The routing decision on its own (router/policy.py, router/prefix.py), like decide.py's."""

from __future__ import annotations

from collections import Counter

from preheat.router.policy import Balance, choose, ranking
from preheat.router.prefix import SeenKeys, request_key

PODS = {"chat-a": 0, "chat-b": 0, "chat-c": 0}


def chat(system: str, *turns: str) -> dict:
    messages = [{"role": "system", "content": system}]
    for i, t in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
    return {"model": "m", "messages": messages}


def test_every_turn_of_a_conversation_has_the_key_of_its_first_turn():
    first = request_key(chat("You are S.", "hi"), 4096)
    later = request_key(chat("You are S.", "hi", "hello!", "and now?"), 4096)
    other = request_key(chat("You are S.", "bye"), 4096)
    assert first == later and first != other
    assert request_key({"model": "m", "prompt": "abc" * 10}, 8) == "m\x1dabcabcab"
    assert request_key({"model": "m"}, 10) is None and request_key([1], 10) is None
    parts = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}
    assert request_key(parts, 99) == request_key({"model": "m", "messages": [
        {"role": "user", "content": "x"}]}, 99)


def test_a_key_goes_to_its_top_ranked_pod_and_every_router_ranks_alike():
    key = request_key(chat("sys", "q1"), 4096)
    c = choose(PODS, key)
    assert c is not None and c.reason == "affinity" and c.pod == ranking(key, PODS)[0]
    # Another router (another dict order, no shared state) makes the same choice.
    assert choose(dict(reversed(list(PODS.items()))), key).pod == c.pod


def test_keys_spread_over_pods_and_a_leaving_pod_moves_only_its_own_keys():
    keys = [request_key(chat(f"system {i}", "q"), 4096) for i in range(300)]
    before = {k: choose(PODS, k).pod for k in keys}
    spread = Counter(before.values())
    assert set(spread) == set(PODS) and min(spread.values()) > 60, spread
    after = {k: choose({"chat-a": 0, "chat-b": 0}, k).pod for k in keys}
    moved = [k for k in keys if after[k] != before[k]]
    assert moved and all(before[k] == "chat-c" for k in moved)


def test_a_busy_prefix_pod_spills_to_the_second_ranked_pod_not_a_random_one():
    key = request_key(chat("hot", "q"), 4096)
    first, second, third = ranking(key, PODS)
    load = {first: 5, second: 0, third: 0}  # cap = 1.5 * 6/3 + 2 = 5: 5 + 1 > 5
    c = choose(load, key, Balance(1.5, 2))
    assert (c.pod, c.preferred, c.reason) == (second, first, "spill")
    load = {first: 4, second: 0, third: 0}  # 4 + 1 <= 1.5 * 5/3 + 2 = 4.5? no: spill
    assert choose(load, key, Balance(1.5, 2)).pod == second
    load = {first: 3, second: 0, third: 0}  # 4 <= 1.5 * 4/3 + 2 = 4: stays
    assert choose(load, key, Balance(1.5, 2)).reason == "affinity"
    # A looser bar keeps it where its prefix is.
    assert choose({first: 5, second: 0, third: 0}, key, Balance(3.0, 2)).pod == first


def test_a_retry_excludes_the_pods_tried_and_runs_out():
    key = request_key(chat("sys", "q"), 4096)
    order = ranking(key, PODS)
    assert choose(PODS, key, exclude={order[0]}).pod == order[1]
    assert choose(PODS, key, exclude=set(PODS)) is None
    assert choose({}, key) is None


def test_a_request_without_a_key_goes_to_the_least_loaded_pod():
    c = choose({"chat-a": 2, "chat-b": 1, "chat-c": 1}, None)
    assert (c.pod, c.reason, c.preferred) == ("chat-b", "least-loaded", None)


def test_with_balanced_load_no_pod_takes_far_more_than_its_share():
    """Many hot keys at once: bounded load keeps every pod near the mean."""
    load = dict(PODS)
    keys = [request_key(chat("shared", f"q{i % 4}"), 4096) for i in range(60)]
    for k in keys:
        load[choose(load, k).pod] += 1
    mean = sum(load.values()) / len(load)
    assert max(load.values()) <= 1.5 * mean + 2, load


def test_seen_keys_forget_the_oldest_beyond_their_bound():
    seen = SeenKeys(per_pod=2)
    for k in ("a", "b", "c"):
        seen.add("p", k)
    assert not seen.holds("p", "a") and seen.holds("p", "c")
    seen.forget("p")
    assert not seen.holds("p", "c")

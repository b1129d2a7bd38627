"""Routing requests over vLLM replicas from token ids alone (no server), where replicas run, and the config
that asks for them."""

from __future__ import annotations

import pytest

from artrl.config import VLLMConfig
from artrl.local.engine.vllm.launch import cpu_process_env
from artrl.local.engine.vllm.router import ReplicaRouter
from artrl.local.engine.vllm.server import replica_placement

BOTH = (0, 1)


def serve(router: ReplicaRouter, prompt: list[int], completion: list[int], eligible=BOTH) -> int:
    route = router.route(prompt, 1, eligible)
    router.done(route, [completion])
    return route.replica


def test_a_continuation_goes_to_the_replica_that_served_its_previous_turn():
    router = ReplicaRouter(2, max_entries=100)
    turn1 = [1, 2, 3, 4]
    first = serve(router, turn1, [5, 6])
    other = serve(router, [9, 9, 9], [7])  # a new conversation: the other replica (both idle, taken in turn)
    assert other != first
    turn2 = [*turn1, 5, 6, 10, 11]  # the previous call's prompt + sampled ids + a tool result
    for _ in range(3):  # ... and again, whatever the load: the prefix cache is there
        router.route([42], 4, [first])  # load `first` with work that is never done
        assert router.route(turn2, 1, BOTH).replica == first
    turn3 = [*turn2, 12, 13, 14]
    assert serve(router, turn2, [12, 13]) == first
    assert serve(router, turn3, [1]) == first
    # a prompt that only shares a part of a served sequence (an edited history) is a new conversation
    router2 = ReplicaRouter(2, max_entries=100)
    a = serve(router2, [1, 2, 3], [4])
    assert router2.route([1, 2, 3, 5, 6], 1, BOTH).replica != a


def test_new_conversations_go_to_the_least_loaded_replica():
    router = ReplicaRouter(3, max_entries=100)
    routes = [router.route([7, i], 1, (0, 1, 2)) for i in range(6)]
    assert sorted(r.replica for r in routes) == [0, 0, 1, 1, 2, 2]  # spread evenly
    big = router.route([8], 5, (0, 1, 2))  # 5 sequences (n=5) on one replica
    assert router.in_flight[big.replica] == 7
    nxt = router.route([9], 1, (0, 1, 2))
    assert nxt.replica != big.replica
    for route in routes:
        router.done(route)
    router.done(routes[0])  # done twice: counted once
    assert sum(router.in_flight) == 6 and router.in_flight[big.replica] == 5
    # the same prompt again (a group's other rollouts) is not a continuation: it spreads too
    group = [router.route([3, 3, 3], 1, (0, 1, 2)).replica for _ in range(3)]
    assert len(set(group)) >= 2


def test_only_eligible_replicas_get_requests_and_a_restart_forgets_affinity():
    router = ReplicaRouter(2, max_entries=100)
    first = serve(router, [1, 2], [3])
    other = 1 - first
    # the owner is down (or lacks the adapter): the continuation goes elsewhere rather than nowhere
    assert router.route([1, 2, 3, 4], 1, [other]).replica == other
    router.restarted(first)  # it came back with an empty prefix cache
    router.route([5], 3, [other])  # load the other one
    assert router.route([1, 2, 3, 4], 1, BOTH).replica == first  # least loaded now, not the old affinity
    with pytest.raises(ValueError):
        router.route([1], 1, [])


def affine(router: ReplicaRouter, prompt: list[int], replica: int) -> bool:
    """Whether `prompt` goes to `replica` although that replica is by far the most loaded (affinity only)."""
    router.route([-1], 1000, [replica])
    return router.route(prompt, 1, BOTH).replica == replica


def test_the_remembered_sequences_are_bounded_least_recently_used_first():
    router = ReplicaRouter(2, max_entries=3)
    owners = [serve(router, [100 + i], [i]) for i in range(4)]  # the first one is evicted
    assert len(router) == 3
    assert not affine(router, [100, 0, 1], owners[0])
    assert affine(router, [101, 1, 1], owners[1])  # kept (and now the most recently used)
    serve(router, [200], [1], eligible=[0])  # evicts [102, 2], not the one just used
    assert len(router) == 3
    assert not affine(router, [102, 2, 1], owners[2])
    assert affine(router, [101, 1, 7], owners[1]) and affine(router, [103, 3, 7], owners[3])
    unbounded = ReplicaRouter(2, max_entries=0)  # remembers nothing
    unbounded.done(unbounded.route([1], 1, BOTH), [[2]])
    assert len(unbounded) == 0


def test_on_cpu_one_rank_runs_in_the_engine_core_unless_the_environment_says():
    # no worker process (its busy wait took the agents' core): the engine core runs the model
    single = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert cpu_process_env(True, 1, {}) == single
    assert cpu_process_env(True, 1, {"PATH": "/bin"}) == single
    assert cpu_process_env(True, 1, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}) == {}  # the user's say
    assert cpu_process_env(True, 2, {}) == {}  # tensor-parallel ranks: vLLM's worker processes
    # cores chosen (the user's, or several replicas' own): only a worker process vLLM starts binds them
    assert cpu_process_env(True, 1, {"VLLM_CPU_OMP_THREADS_BIND": "2,3"}) == {}
    assert cpu_process_env(False, 1, {}) == {}  # GPUs: vLLM's own choice


def test_replicas_on_one_machine_get_their_own_cores_or_gpus():
    cores = [0, 1, 2, 3]
    assert replica_placement(0, 1, 1, True, cores, {}) == {}  # one replica: vLLM's own choice, as before
    assert [replica_placement(i, 2, 1, True, cores, {}) for i in (0, 1)] == [
        {"VLLM_CPU_OMP_THREADS_BIND": "0,1"},
        {"VLLM_CPU_OMP_THREADS_BIND": "2,3"},
    ]
    assert replica_placement(1, 2, 2, True, cores, {}) == {
        "VLLM_CPU_OMP_THREADS_BIND": "2|3"
    }  # a list per rank
    assert replica_placement(1, 3, 1, True, [0, 1], {}) == {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    assert replica_placement(1, 2, 1, True, cores, {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}) == {}
    assert replica_placement(1, 2, 2, False, cores, {}) == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert replica_placement(1, 2, 1, False, cores, {}, ["4", "6"]) == {"CUDA_VISIBLE_DEVICES": "6"}
    assert replica_placement(1, 2, 1, False, cores, {"CUDA_VISIBLE_DEVICES": "0"}) == {}


def test_replica_settings_are_checked():
    assert VLLMConfig(replicas=2, tensor_parallel_size=2).replica_count == 2
    several = VLLMConfig(url=["http://a:1", "http://b:2"])
    assert several.urls == ("http://a:1", "http://b:2") and several.replica_count == 2
    assert VLLMConfig(url="http://a:1").urls == ("http://a:1",)
    with pytest.raises(ValueError, match="artrl starts no server when url is set"):
        VLLMConfig(url="http://a:1", replicas=2)
    with pytest.raises(ValueError, match="at least one server"):
        VLLMConfig(url=[])
    with pytest.raises(ValueError, match="2 entries for 3 replicas"):
        VLLMConfig(replicas=3, replica_env=({}, {}))
    import artrl

    backend = artrl.LocalBackend(engine="vllm", vllm_url=["http://a:1", "http://b:2"])
    assert backend.engine_config.vllm.urls == ("http://a:1", "http://b:2")
    with pytest.raises(ValueError, match="artrl starts no server when url is set"):
        artrl.LocalBackend(
            engine=artrl.EngineConfig(kind="vllm", vllm=VLLMConfig(replicas=2)), vllm_url="http://a:1"
        )


def test_placement_refuses_more_gpus_than_are_visible():
    with pytest.raises(ValueError, match=r"2 replicas .* 4 GPUs.* 3 are visible"):
        replica_placement(0, 2, 2, False, [0, 1], {}, ["0", "1", "2"])
    assert replica_placement(0, 2, 2, False, [0, 1], {"CUDA_VISIBLE_DEVICES": "0"}, ["0"]) == {}  # the user's


def test_a_sequence_served_across_a_restart_is_not_remembered_for_the_new_life():
    router = ReplicaRouter(2, 100)
    route = router.route([1, 2], 1, (0, 1))
    router.restarted(route.replica)  # its cache emptied while it served the request
    router.done(route, [[3]])
    assert not router.route([1, 2, 3, 4], 1, (0, 1)).affine

"""The coordinator one iteration at a time, on a scripted cluster and fake ranks (no Ray, no
torch.distributed): which state each event leads to, and what the next formation looks like.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fakes import FakeCluster, FakeRankGroup

from raytrain_dt.config import load_config
from raytrain_dt.config.schema import ElasticConfig
from raytrain_dt.control import watch
from raytrain_dt.control.coordinator import Coordinator
from raytrain_dt.control.deadlines import LEAVE_FLOOR_S
from raytrain_dt.control.group import PlacementTimedOut
from raytrain_dt.control.policies import capacity_request
from raytrain_dt.control.recovery import lost_with_node
from raytrain_dt.control.states import (
    Draining,
    Failed,
    Finished,
    Resizing,
    Restarting,
    Running,
    Waiting,
)
from raytrain_dt.observe.metrics import read_jsonl
from raytrain_dt.topology.nodes import NodeInfo
from raytrain_dt.worker.reports import RankStatus

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def start(tmp_path):
    """A coordinator begun on `nodes` of a fake cluster, with extra config overrides."""

    def make(nodes=("a", "b"), *overrides: str):
        cfg = load_config(
            REPO / "conf" / "test.yaml",
            [
                f"run.dir={tmp_path / 'run'}",
                "cluster.num_ranks=null",
                "trainer.steps=12",
                "checkpoint.every_steps=4",
                "elastic.spot_notice_url=null",
                *overrides,
            ],
        )
        coordinator = Coordinator(cfg, show_progress=False)
        coordinator.run_dir.mkdir(parents=True)
        coordinator.dataset = None  # only handed through to the (fake) ranks
        cluster, group = FakeCluster(list(nodes)), FakeRankGroup(coordinator.checkpoint_root)
        coordinator.begin("accelerator", cluster, group)
        return coordinator, cluster, group

    return make


def advance_until(coordinator: Coordinator, state_type, max_iterations: int = 200):
    for _ in range(max_iterations):
        if isinstance(coordinator.advance(), state_type):
            return coordinator.state
    raise AssertionError(f"still {coordinator.state} after {max_iterations} iterations")


def train_to(coordinator: Coordinator, step: int) -> None:
    for _ in range(200):
        if coordinator.step >= step:
            return
        assert isinstance(coordinator.advance(), Running), coordinator.state
    raise AssertionError(f"stuck at step {coordinator.step}")


def events(coordinator: Coordinator, kind: str) -> list[dict]:
    coordinator.recorder.events._file.flush()
    return [e for e in read_jsonl(coordinator.run_dir / "events.jsonl") if e["event"] == kind]


def test_start_forms_the_planned_layout_and_trains_to_the_end(start):
    coordinator, _, group = start()
    assert isinstance(coordinator.advance(), Resizing)  # the policy planned a layout
    assert isinstance(coordinator.advance(), Running)  # the group formed it
    assert group.formations == [{"a": 2, "b": 2}]
    assert isinstance(advance_until(coordinator, Finished), Finished)
    assert coordinator.state.step == 12
    assert [c.step for c in coordinator.store.committed()][-1] == 12


def test_lost_node_restarts_smaller_from_the_latest_checkpoint(start):
    coordinator, cluster, group = start()
    advance_until(coordinator, Running)
    train_to(coordinator, 6)
    cluster.node_ids.remove("b")
    group.kill_node("b")
    state = coordinator.advance()
    assert isinstance(state, Restarting) and state.decision.nodes == ("a",)
    assert coordinator.lost_nodes == set()  # Ray already lists it gone
    assert isinstance(coordinator.advance(), Running)
    assert group.formations[-1] == {"a": 2} and coordinator.step == 4
    (resize,) = events(coordinator, "resize")
    assert resize["resumed_step"] == 4 and resize["lost_steps"] == 2
    assert resize["new_layout"]["dims"]["world_size"] == 2
    assert {"detection_s", "replan_s", "reform_s", "checkpoint_load_s"} <= set(resize)
    train_to(coordinator, 5)
    (first,) = [e for e in events(coordinator, "first_step") if e["step"] == 5]
    assert first["total_s"] >= first["first_step_s"] > 0


def test_ranks_verify_the_resume_checkpoint_and_a_corrupted_one_falls_back(start):
    """The re-formed group's ranks check the newest checkpoint's files (every file, each by
    one rank) before anyone loads it; a shard changed in place (same size: the driver's
    listing cannot tell) makes the group resume from the previous committed checkpoint."""
    coordinator, cluster, group = start()
    advance_until(coordinator, Running)
    train_to(coordinator, 9)
    newest = coordinator.store.committed()[-1]
    assert newest.step == 8
    shard = Path(coordinator.checkpoint_root, "step_8", "shard_1.bin")
    shard.write_bytes(b"y" * shard.stat().st_size)
    cluster.node_ids.remove("b")
    group.kill_node("b")
    assert isinstance(coordinator.advance(), Restarting)
    assert isinstance(coordinator.advance(), Running)
    assert coordinator.step == 4
    # Step 8's files were verified (all of them), then step 4's; the group loads step 4.
    assert group.verified[-2:] == [
        set(newest.record["files"]),
        {f"shard_{r}.bin" for r in range(4)},
    ]
    (damaged,) = events(coordinator, "checkpoint_damaged")
    assert damaged["step"] == 8 and damaged["problems"] == [
        f"{newest.uri}/shard_1.bin: checksum mismatch"
    ]
    (resize,) = events(coordinator, "resize")
    assert resize["resumed_step"] == 4 and resize["lost_steps"] == 5
    assert resize["checkpoint_verify_s"] >= 0
    # Step 8 is trained again and committed anew: the next formation may resume from it.
    train_to(coordinator, 9)
    assert coordinator.store.latest_valid().step == 8


def test_below_min_nodes_waits_then_starts_actors_on_a_new_node(start):
    """Survivors too few to train (elastic.min_nodes) wait; a node that joins meanwhile gets
    its actors started at once (not deferred as after a failure that could re-form), and the
    group forms on it and the survivors."""
    coordinator, cluster, group = start(
        ("a", "b"), "elastic.min_nodes=2", "elastic.grow_stable_s=0"
    )
    advance_until(coordinator, Running)
    train_to(coordinator, 5)
    cluster.node_ids.remove("b")
    group.kill_node("b")
    assert isinstance(coordinator.advance(), Waiting)
    cluster.node_ids.append("c")
    state = advance_until(coordinator, Resizing, max_iterations=5)
    assert state.decision.nodes == ("a", "c")
    assert isinstance(coordinator.advance(), Running)
    assert group.formations[-1] == {"a": 2, "c": 2} and coordinator.step == 4


def test_node_lost_before_ray_notices_is_left_out_of_the_plan(start):
    coordinator, _, group = start()
    advance_until(coordinator, Running)
    train_to(coordinator, 5)
    group.kill_node("b")  # Ray's health check has not caught up: the cluster still lists b
    state = coordinator.advance()
    assert isinstance(state, Restarting) and state.decision.nodes == ("a",)
    assert coordinator.lost_nodes == {"b"}


def test_a_dead_rank_is_replaced_in_the_background_and_grown_back_to(start, monkeypatch):
    """The survivors train at once (re-planned: the dead rank's node has one started actor),
    a replacement starts at their first step (not before: it would take the CPU their
    re-formation needs; not at the next periodic look at the cluster: at once), and the group
    grows back to the node once it has started (just in time, at a step boundary): the dead
    rank does not take its node out."""
    coordinator, _, group = start(("a", "b"), "elastic.grow_stable_s=0")
    advance_until(coordinator, Running)
    train_to(coordinator, 5)
    # No periodic look at the cluster from here: only those the coordinator forces.
    monkeypatch.setattr(watch, "CLUSTER_CHECK_INTERVAL_S", 1e6)
    group.kill_rank(1)
    state = coordinator.advance()
    assert isinstance(state, Restarting) and not group.starting
    assert isinstance(coordinator.advance(), Running) and coordinator.step == 4
    # Planned for the three survivors only (a: 1, b: 2): it did not wait for the replacement.
    assert state.decision.layout.dims.world_size == sum(group.formations[-1].values()) < 4
    assert not group.starting and not group.idle  # formed, no step yet: nothing started
    train_to(coordinator, 5)  # the new layout's first step
    assert [s.node_id for s in group.starting + group.idle] == ["a"]  # the replacement
    train_to(coordinator, 6)  # it has started, but the group grows only at a look
    assert group.formations[-1] == {"a": 1, "b": 2}
    monkeypatch.setattr(watch, "CLUSTER_CHECK_INTERVAL_S", 0.0)  # the next periodic look
    state = advance_until(coordinator, Draining, max_iterations=1)  # the replacement started
    assert state.decision.nodes == ("a", "b") and state.decision.checkpoint_first
    assert isinstance(coordinator.advance(), Resizing)
    assert isinstance(coordinator.advance(), Running)
    assert group.formations[-1] == {"a": 2, "b": 2} and not group.idle and not group.starting
    # The failure's teardown aborted at once; the planned one gave each loop the floor's
    # grace to end at its step boundary first.
    assert [grace for grace, _ in group.teardown_times] == [0.0, LEAVE_FLOOR_S]
    grown = events(coordinator, "resize")[-1]
    assert grown["lost_steps"] == 0 and grown["resumed_step"] == coordinator.step
    assert isinstance(advance_until(coordinator, Finished), Finished)


def test_a_rank_death_keeps_every_survivor_and_tears_them_down_at_once(start):
    """Four ranks, one dies: the three survivors are kept (none replaced) and trained on at
    world size 3; they all leave their layout in one round, and the resize names the kept
    and the new actors."""
    coordinator, _, group = start(("a", "b"))
    advance_until(coordinator, Running)
    train_to(coordinator, 5)
    before = [s.actor_index for s in group.slots]
    group.kill_rank(1)
    assert isinstance(coordinator.advance(), Restarting)
    # The dead rank dropped, the three survivors (ranks 0, 1, 2 now) torn down together.
    assert group.dropped == 1 and group.torn_down == [[0, 1, 2]]
    assert isinstance(coordinator.advance(), Running)
    (resize,) = events(coordinator, "resize")
    assert resize["new_layout"]["dims"]["world_size"] == 3
    assert resize["kept_actors"] == [before[0], *before[2:]] and resize["new_actors"] == []
    # Detection ends at the poll that saw the failure; the teardown after it is the re-form's.
    assert 0 <= resize["detection_s"] < 0.3
    assert resize["reform_s"] >= resize["teardown_s"] > 0


def test_survivors_of_slow_steps_have_a_step_to_leave(start):
    """Steps of 7 s (a large model's): a survivor told to leave after a rank death has its
    communicators aborted at once (its step cannot finish: no grace to reach a step boundary;
    on NCCL a survivor blocked on the dead rank would wait for the abort), and it has the
    measured step (the p99 of the layout's intervals) to return before it is given up as
    stuck, not a fixed 2 s: a survivor mid-step is kept, with its in-memory copies."""
    coordinator, _, group = start(("a", "b"))
    group.step_s = 7.0
    advance_until(coordinator, Running)
    train_to(coordinator, 5)
    group.kill_rank(1)
    assert isinstance(coordinator.advance(), Restarting)
    assert group.teardown_times == [(0.0, pytest.approx(7.0))]


@pytest.mark.parametrize("survivor_raises_first", [False, True])
def test_a_node_lost_while_forming_is_re_planned_not_raised(start, survivor_raises_first):
    """A node dies while the group re-forms after a rank death (its actors die in set-up):
    the formation is a failure like the others (recorded, the node left out, re-planned)
    and the run forms on what is left and trains to the end. Whether Ray reports the dead
    actors first or a survivor's set-up raises first (its peer closed the connection), the
    node's loss is not the step's fault: it is no repeat of the rank death at that step."""
    # A batch of 12 spreads evenly over all six ranks (the planner's pick for 8 is four).
    coordinator, _, group = start(
        ("a", "b", "c"), "elastic.grow_stable_s=1000", "trainer.global_batch=12"
    )
    advance_until(coordinator, Running)
    assert group.formations[-1] == {"a": 2, "b": 2, "c": 2}
    train_to(coordinator, 5)
    group.kill_rank(1)
    assert isinstance(coordinator.advance(), Restarting)
    group.setup_loses_node = "c"  # Ray's health check has not caught up: still listed
    group.survivor_raises_first = survivor_raises_first
    state = coordinator.advance()  # the formation's set-up fails: re-planned at once
    assert isinstance(state, Restarting) and state.decision.nodes == ("a", "b")
    failures = events(coordinator, "failure")
    assert [f.get("phase") for f in failures] == [None, "forming"]
    assert failures[1]["lost_nodes"] == ["c"] and failures[1]["step"] == 5
    assert coordinator.lost_nodes == {"c"} and coordinator.streak.count == 1
    assert isinstance(coordinator.advance(), Running)
    assert group.formations[-1] == {"a": 1, "b": 2} and coordinator.step == 4
    resize = events(coordinator, "resize")[-1]
    assert resize["new_layout"]["dims"]["world_size"] == 3 and resize["new_actors"] == []
    assert isinstance(advance_until(coordinator, Finished), Finished)
    assert coordinator.step == 12


def test_a_placement_timeout_while_re_forming_re_plans_without_the_node(start):
    """After a rank death, the re-formation finds no room on node c within the placement
    time-out (its resources still held): the run re-plans without c, trains on, and the
    first layout's placement time-out stays the user's error (tested in tests/ray)."""
    coordinator, _, group = start(
        ("a", "b", "c"), "elastic.grow_stable_s=1000", "trainer.global_batch=12"
    )
    advance_until(coordinator, Running)
    train_to(coordinator, 5)
    group.kill_rank(1)
    assert isinstance(coordinator.advance(), Restarting)
    group.placement_times_out_on = "c"
    state = coordinator.advance()
    assert isinstance(state, Restarting) and state.decision.nodes == ("a", "b")
    (timeout,) = events(coordinator, "placement_timeout")
    assert timeout["node"] == "c" and timeout["bench_s"] == 1000 + 60
    assert set(coordinator.run_state.benched_nodes) == {"c"}
    assert isinstance(coordinator.advance(), Running)
    assert group.formations[-1] == {"a": 1, "b": 2}
    assert isinstance(advance_until(coordinator, Finished), Finished)
    assert coordinator.step == 12


def test_a_placement_timeout_in_the_first_formation_is_the_users_error(start):
    coordinator, _, group = start()
    group.placement_times_out_on = "a"
    with pytest.raises(PlacementTimedOut, match="cluster.placement_timeout_s"):
        advance_until(coordinator, Running)


@pytest.mark.parametrize("source", ["sigterm", "spot", "ray-drain"])
def test_a_notice_checkpoints_at_the_next_boundary_then_shrinks(start, source):
    coordinator, cluster, group = start()
    advance_until(coordinator, Running)
    train_to(coordinator, 5)
    if source == "ray-drain":
        cluster.drained.add("b")
    else:
        group.notice(3, source)
    advance_until(coordinator, Draining, max_iterations=20)
    (notice,) = events(coordinator, "preemption_notice")
    assert notice["node"] == "b" and notice["source"] == source
    assert isinstance(coordinator.advance(), Resizing)
    drained_at = coordinator.step
    assert coordinator.store.committed()[-1].step == drained_at  # just in time
    assert isinstance(coordinator.advance(), Running)
    assert group.formations[-1] == {"a": 2}
    (resize,) = events(coordinator, "resize")
    assert resize["resumed_step"] == drained_at and resize["lost_steps"] == 0
    assert resize["drain_s"] >= 0
    assert isinstance(advance_until(coordinator, Finished), Finished)


def test_a_node_gone_between_a_drains_decision_and_its_formation_is_re_planned(start):
    """A notice on c drains the group, which re-plans onto a and b; b is gone before the
    formation (no room for the plan any more). The group has left its layout: the run
    re-plans from no layout onto a and trains every step, instead of watching an empty group
    (whose ranks, all zero of them, are "done") and ending early."""
    coordinator, cluster, group = start(("a", "b", "c"), "trainer.global_batch=12")
    advance_until(coordinator, Running)
    train_to(coordinator, 5)
    group.notice(5, "sigterm")  # a rank on c
    advance_until(coordinator, Draining, max_iterations=20)
    state = coordinator.advance()
    assert isinstance(state, Resizing) and state.decision.nodes == ("a", "b")
    drained_at = coordinator.step
    cluster.node_ids.remove("b")
    state = coordinator.advance()  # no room on b: re-planned from no layout, at once
    assert isinstance(state, Resizing) and state.decision.nodes == ("a",)
    assert state.decision.reason.startswith("start:")
    assert isinstance(coordinator.advance(), Running)
    assert group.formations[-1] == {"a": 2}
    assert events(coordinator, "resize")[-1]["resumed_step"] == drained_at
    assert isinstance(advance_until(coordinator, Finished), Finished)
    assert coordinator.step == 12


def test_new_capacity_is_used_once_stable(start):
    coordinator, cluster, group = start(("a",), "elastic.grow_stable_s=0.3")
    advance_until(coordinator, Running)
    train_to(coordinator, 2)
    cluster.node_ids.append("b")
    state = advance_until(coordinator, Draining, max_iterations=30)
    assert state.decision.layout.dims.world_size == 4
    assert isinstance(coordinator.advance(), Resizing)
    assert isinstance(coordinator.advance(), Running)
    assert group.formations == [{"a": 2}, {"a": 2, "b": 2}]
    (resize,) = events(coordinator, "resize")
    # The clock starts when the node appeared, so it includes the hysteresis.
    assert resize["lost_steps"] == 0 and resize["detection_s"] >= 0.3


def test_a_hang_replaces_the_whole_group(start):
    coordinator, _, group = start(
        ("a", "b"), "elastic.hang_timeout_s=1", "elastic.hang_step_multiple=1"
    )
    advance_until(coordinator, Running)
    train_to(coordinator, 4)
    group.hung = True
    state = advance_until(coordinator, Restarting, max_iterations=20)
    (failure,) = events(coordinator, "failure")
    assert failure["health"] == "hung"
    # A fake step per poll (0.1 s): the floor is the bound in force, and the event says so.
    assert (failure["bound_s"], failure["bound_basis"]) == (1.0, "hang_timeout_s")
    assert failure["since_step_s"] >= failure["since_progress_s"] > 1.0
    assert group.dropped == 4 and state.decision.nodes == ("a", "b")


def test_a_final_save_slower_than_a_step_is_no_hang(start):
    """The last step's save takes longer than a step's hang bound to write (a large final
    checkpoint), and the ranks finish one poll after they report it written. Its writing is
    the group's progress: the run finishes, with no hang detected between the commit and the
    ranks' end (a hang counted from the last step once the save committed, no longer in
    flight, restarted a finished run)."""
    coordinator, _, group = start(
        ("a",),
        "elastic.hang_timeout_s=1",
        "elastic.hang_step_multiple=1",
        "trainer.steps=4",
        "checkpoint.every_steps=2",
    )
    group.final_save_s = 1.5
    assert isinstance(advance_until(coordinator, Finished), Finished)
    assert events(coordinator, "failure") == []
    assert coordinator.step == 4 and group.dropped == 0


def test_a_formation_past_its_deadline_fails_the_run_naming_the_key(start):
    coordinator, _, group = start(("a", "b"), "elastic.formation_timeout_s=5")
    group.setup_hangs = True
    assert isinstance(coordinator.advance(), Resizing)
    state = coordinator.advance()
    assert isinstance(state, Failed) and state.reason.startswith("elastic.formation_timeout_s: ")
    (failure,) = events(coordinator, "failure")
    assert failure["health"] == "formation_timeout"
    assert (failure["bound_s"], failure["bound_basis"]) == (5.0, "formation")


def test_the_same_step_failing_twice_fails_the_run(start):
    coordinator, _, group = start(("a", "b"), "checkpoint.every_steps=0")
    advance_until(coordinator, Running)
    train_to(coordinator, 3)
    group.kill_rank(1)
    advance_until(coordinator, Running)  # restarts from step 0 ...
    train_to(coordinator, 3)
    group.kill_rank(1)  # ... and fails after step 3 again
    assert isinstance(coordinator.advance(), Failed)
    assert "deterministic" in coordinator.state.reason


def test_only_the_trainings_own_failures_repeat_at_a_step(start):
    """A node lost at the step a rank failed at is not a repeat of that failure, and a rank
    failing there after it is the first repeat: only the second repeat fails the run."""
    coordinator, cluster, group = start(("a", "b"), "checkpoint.every_steps=0")
    advance_until(coordinator, Running)
    train_to(coordinator, 3)
    group.kill_rank(1)  # the training's failure at step 3 (1 of elastic.max_failures_at_step=2)
    advance_until(coordinator, Running)  # restarts from step 0 ...
    train_to(coordinator, 3)
    cluster.node_ids.remove("b")
    group.kill_node("b")  # ... and loses a node at step 3: not the step's fault
    assert isinstance(coordinator.advance(), Restarting)
    assert isinstance(coordinator.advance(), Running) and group.formations[-1] == {"a": 2}
    assert coordinator.streak.count == 1
    train_to(coordinator, 3)
    group.kill_rank(1)  # the training fails at step 3 a second time
    assert isinstance(coordinator.advance(), Failed)
    assert "step 4 failed 2 times" in coordinator.state.reason


def test_the_autoscaler_is_asked_for_max_nodes(start):
    coordinator, cluster, _ = start(("a",), "elastic.max_nodes=3")
    coordinator.advance()
    assert cluster.requests == [[{"accelerator": 2}] * 3]


def test_capacity_request_bounds():
    two = (NodeInfo("a", 2), NodeInfo("b", 2))
    assert capacity_request(ElasticConfig(max_nodes=None), "GPU", two, 8, None) == []
    assert capacity_request(ElasticConfig(max_nodes=4), "GPU", two, 8, None) == [{"GPU": 2}] * 4
    # cluster.num_ranks=6 needs 3 nodes of 2, fewer than max_nodes.
    assert capacity_request(ElasticConfig(max_nodes=4), "GPU", two, 8, 6) == [{"GPU": 2}] * 3
    # Before any node is known, the configured node size is assumed.
    assert capacity_request(ElasticConfig(max_nodes=2), "GPU", (), 8, None) == [{"GPU": 8}] * 2


def test_lost_with_node_tells_a_dead_process_from_a_dead_node():
    dead = RankStatus(0, "dead", node_id="b", error="worker process has died")
    peer_failed = RankStatus(1, "failed", node_id="b", error="gloo")
    assert lost_with_node([dead, peer_failed], ["a", "a", "b", "b"]) == set()
    assert lost_with_node([dead, dead], ["a", "a", "b", "b"]) == {"b"}
    assert lost_with_node([dead], ["a", "b"]) == set()
    by_node = RankStatus(0, "dead", node_id="b", error="The actor died because its node has died.")
    assert lost_with_node([by_node], ["a", "b"]) == {"b"}

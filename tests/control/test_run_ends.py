"""Every end of a run lets go of the cluster: finished, failed, stopped by SIGTERM, Ctrl-C, an
error, and a killed driver's run resumed by the next one. The autoscaler request is withdrawn
(Ray's `request_resources` call recorded), the run's status record leaves Ray's KV store (a
dict standing in for it) and the actors are shut down. Fake ranks, no Ray cluster.
"""

from __future__ import annotations

import io
import json
import os
import signal
from pathlib import Path

import pytest
from fakes import FakeCluster, FakeKV, FakeRankGroup

from raytrain_dt.config import load_config
from raytrain_dt.control.cluster import RayClusterView
from raytrain_dt.control.coordinator import Coordinator, TrainingFailed
from raytrain_dt.control.states import Running
from raytrain_dt.errors import UserError
from raytrain_dt.observe import status

REPO = Path(__file__).resolve().parents[2]
MAX_NODES = [{"accelerator": 2}] * 3  # what elastic.max_nodes=3 asks for, in node-sized bundles


class SdkCluster(FakeCluster):
    """The scripted cluster, asking the autoscaler through Ray's SDK as the real view does."""

    def request_capacity(self, bundles: list[dict]) -> None:
        super().request_capacity(bundles)
        RayClusterView("accelerator").request_capacity(bundles)


class ScriptedGroup(FakeRankGroup):
    """Fake ranks that run `at_step(step)` once, when the group has trained that step."""

    def __init__(self, checkpoint_root: str, at_step: int | None = None, action=None):
        super().__init__(checkpoint_root)
        self.at_step, self.action, self.shut_down = at_step, action, 0

    def poll(self, timeout_s: float = 30.0):
        statuses = super().poll(timeout_s)
        if self.action and self.step == self.at_step:
            action, self.action = self.action, None
            action()
        return statuses

    def shutdown(self) -> None:
        self.shut_down += 1
        super().shutdown()


@pytest.fixture
def no_data_coordinator(monkeypatch) -> None:
    """A cluster where Ray Data runs no autoscaling coordinator: the run asks through Ray's SDK
    (with one, it asks through the coordinator: tests/ray/test_autoscaler_request.py)."""
    from raytrain_dt.control import cluster

    monkeypatch.setattr(cluster, "ask_with_ray_data", lambda requester, bundles: False)


@pytest.fixture
def sdk_calls(monkeypatch, no_data_coordinator) -> list:
    """The bundles of every `ray.autoscaler.sdk.request_resources` call, in order."""
    import ray.autoscaler.sdk

    calls: list = []
    monkeypatch.setattr(
        ray.autoscaler.sdk,
        "request_resources",
        lambda num_cpus=None, bundles=None: calls.append(bundles),
    )
    return calls


@pytest.fixture
def kv(monkeypatch) -> FakeKV:
    store = FakeKV()
    monkeypatch.setattr(status, "_kv", lambda: store)
    return store


@pytest.fixture
def begin(tmp_path):
    """A coordinator begun on two fake nodes with elastic.max_nodes=3, publishing its status."""

    def make(
        *overrides: str,
        at_step: int | None = None,
        action=None,
        show_progress=False,
        run_dir: str = "run",
    ):
        cfg = load_config(
            REPO / "conf" / "test.yaml",
            [
                f"run.dir={tmp_path / run_dir}",
                "cluster.num_ranks=null",
                "trainer.steps=8",
                "checkpoint.every_steps=4",
                "elastic.spot_notice_url=null",
                "elastic.max_nodes=3",
                *overrides,
            ],
        )
        coordinator = Coordinator(cfg, show_progress=show_progress)
        coordinator.run_dir.mkdir(parents=True, exist_ok=True)
        coordinator.dataset = None
        group = ScriptedGroup(coordinator.checkpoint_root, at_step, action)
        coordinator.begin("accelerator", SdkCluster(["a", "b"]), group)
        # The live status sink default_sinks adds on a Ray cluster.
        coordinator.recorder.sinks.append(
            status.StatusPublisher(coordinator.cfg, coordinator.run_dir)
        )
        return coordinator, group

    return make


def _ended_cleanly(coordinator: Coordinator, group: ScriptedGroup, sdk_calls, kv) -> None:
    assert sdk_calls == [MAX_NODES, []], "the autoscaler request was not withdrawn"
    assert coordinator.run_state.capacity_requested == []
    assert kv.data == {}, "the run's status record is still in the KV store"
    assert group.shut_down == 1 and not group.slots


def test_a_finished_run_withdraws_its_request_and_its_status(begin, sdk_calls, kv):
    coordinator, group = begin()
    result = coordinator.drive()
    assert result.final_step == 8 and not result.stopped
    _ended_cleanly(coordinator, group, sdk_calls, kv)


def test_a_failed_run_withdraws_its_request_and_its_status(begin, sdk_calls, kv):
    coordinator, group = begin("elastic.formation_timeout_s=5")
    group.setup_hangs = True  # the formation passes its deadline: the run fails
    with pytest.raises(TrainingFailed, match="elastic.formation_timeout_s"):
        coordinator.drive()
    _ended_cleanly(coordinator, group, sdk_calls, kv)


def test_a_run_stopped_by_sigterm_withdraws_its_request_and_its_status(begin, sdk_calls, kv):
    # The driver's real SIGTERM handler (`ray job stop`): checkpoint at the next step, stop.
    coordinator, group = begin(at_step=3, action=lambda: os.kill(os.getpid(), signal.SIGTERM))
    result = coordinator.drive()
    assert result.stopped and result.latest_checkpoint.endswith("step_4")
    _ended_cleanly(coordinator, group, sdk_calls, kv)


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_ctrl_c_or_an_error_withdraws_the_request_and_the_status(begin, sdk_calls, kv, error):
    def interrupt():
        raise error("interrupted at step 3")

    coordinator, group = begin(at_step=3, action=interrupt)
    with pytest.raises(error):
        coordinator.drive()
    _ended_cleanly(coordinator, group, sdk_calls, kv)


def test_a_killed_driver_is_withdrawn_by_the_run_that_resumes_it(begin, sdk_calls, kv):
    killed, _ = begin()
    for _ in range(200):  # the killed driver trains to step 6 and never reaches its end
        if killed.step >= 6:
            break
        killed.advance()
    assert isinstance(killed.state, Running) and sdk_calls == [MAX_NODES]
    (record,) = kv.data.values()  # a killed driver cannot remove its record
    assert json.loads(record)["state"] == "running"

    resumed, group = begin("resume=true")
    result = resumed.drive()
    assert result.final_step == 8
    # The resumed run asks again for what it needs (its own state starts empty) and lets go.
    assert sdk_calls == [MAX_NODES, MAX_NODES, []]
    assert kv.data == {} and group.shut_down == 1


def test_a_run_ending_before_it_asks_still_withdraws_a_killed_drivers_request(begin, sdk_calls, kv):
    """The resumed run fails before its first request: the killed driver's request (same
    config) must not outlive it."""
    coordinator, _ = begin("resume=true")
    coordinator.request_stop("SIGTERM")  # before its first decision: no request made
    assert coordinator.drive().stopped
    assert sdk_calls == [[]] and kv.data == {}


def test_a_run_that_never_asks_leaves_the_autoscaler_alone(begin, sdk_calls, kv):
    coordinator, _ = begin("elastic.max_nodes=null")
    coordinator.drive()
    assert sdk_calls == [] and kv.data == {}


def test_without_a_terminal_progress_is_plain_lines(begin, sdk_calls, kv, monkeypatch):
    """A run whose stderr is no terminal (a job log) prints whole progress lines, no bar: one
    every 10% of the steps (the fake steps take no time)."""
    stderr = io.StringIO()
    monkeypatch.setattr("sys.stderr", stderr)
    coordinator, _ = begin("trainer.steps=20", show_progress=True)
    coordinator.drive()
    assert "\r" not in stderr.getvalue()
    lines = stderr.getvalue().splitlines()
    assert [line.split(" | ")[0] for line in lines] == [
        f"train {s}/20 ({5 * s}%)" for s in range(2, 21, 2)
    ]


def test_status_all_lists_the_live_runs_only(begin, sdk_calls, kv, monkeypatch, capsys):
    """`raytrain-dt status --all`: a run that ended has no record; a live one (here a driver
    that never reached its end) is listed; asking for an ended run by name says where to look."""
    import ray

    monkeypatch.setattr(status, "STEP_PUBLISH_INTERVAL_S", 0.0)  # every step, not once a second
    live, _ = begin("run.name=live", run_dir="live")
    for _ in range(200):
        if live.step >= 2:
            break
        live.advance()
    ended, _ = begin("run.name=ended", run_dir="ended")
    ended.drive()

    monkeypatch.setattr(ray, "is_initialized", lambda: True)  # "joined": the KV is the fake
    assert status.show_status(None, None, every=True) == 0
    out = capsys.readouterr().out
    assert str(live.run_dir) in out and "running" in out and "2/8" in out
    assert str(ended.run_dir) not in out
    with pytest.raises(UserError, match=r"^RUN: no live raytrain_dt run ended on this cluster"):
        status.show_status(None, "ended")
    assert status.show_status(None, "live") == 0 and "live" in capsys.readouterr().out

    live._end()
    assert status.show_status(None, None, every=True) == 0
    assert capsys.readouterr().out.strip() == "no live raytrain_dt runs on this cluster"


def test_a_withdrawal_that_fails_leaves_the_runs_outcome_and_the_rest_of_its_end(
    begin, kv, monkeypatch, caplog, no_data_coordinator
):
    """The head went with the run: the withdrawal's error is a warning, the run's own failure
    is what the caller sees, and the actors and the status record still go."""
    import ray.autoscaler.sdk

    def request_resources(num_cpus=None, bundles=None):
        if bundles == []:
            raise ConnectionError("GCS unreachable")

    monkeypatch.setattr(ray.autoscaler.sdk, "request_resources", request_resources)
    coordinator, group = begin("elastic.formation_timeout_s=5")
    group.setup_hangs = True
    with pytest.raises(TrainingFailed):
        coordinator.drive()
    assert "could not withdraw the autoscaler request (ConnectionError" in caplog.text
    assert kv.data == {} and group.shut_down == 1

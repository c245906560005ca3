"""The coordinator: the driver-side control plane of one training run, as a state machine.

`while not state.terminal: state = step(state)`. It prepares the run, connects to Ray, asks
the elastic policy what to do (start, resize, wait, fail), executes the decision with the rank
group, and watches the group: progress, metrics and ledger, checkpoint commits, dead or hung
ranks, preemption notices and new nodes. It never imports torch.distributed: everything it
knows about ranks comes from their reports.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from raytrain_dt.checkpoint.store import CheckpointRef, CheckpointStore
from raytrain_dt.config.load import to_yaml
from raytrain_dt.config.schema import TrainConfig
from raytrain_dt.control.chaos import Chaos
from raytrain_dt.control.checkpoint_tracker import CheckpointTracker
from raytrain_dt.control.cluster import (
    ClusterHandle,
    NodeInfo,
    alive_nodes,
    connect,
    simulated_node_args,
)
from raytrain_dt.control.placement import counts_by_node
from raytrain_dt.control.policies import ElasticPolicy, Fail, Noop, Observation, Resize, Wait
from raytrain_dt.control.rank_group import RankGroup
from raytrain_dt.control.run_setup import (
    RunResult,
    TrainingFailed,
    model_shape,
    open_dataset,
    plan_for_nodes,
    rank_specs,
)
from raytrain_dt.control.states import (
    Draining,
    Failed,
    Finished,
    Resizing,
    Restarting,
    Running,
    Starting,
    State,
    Waiting,
)
from raytrain_dt.data.source import TokenDataset
from raytrain_dt.errors import ConfigError, UserError
from raytrain_dt.observe.logs import setup_driver_logging
from raytrain_dt.observe.metrics import RunRecorder

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.1
CLUSTER_CHECK_INTERVAL_S = 0.5


class Coordinator:
    def __init__(self, cfg: TrainConfig, ray_temp_dir: str | None = None,
                 show_progress: bool = True, simulated_cluster: object | None = None):  # fmt: skip
        self.cfg = cfg
        self.run_dir = Path(cfg.run.dir).resolve()
        self.checkpoint_root = cfg.checkpoint.dir or str(self.run_dir / "checkpoints")
        self.store = CheckpointStore(self.checkpoint_root)
        self.ray_temp_dir = ray_temp_dir
        self.show_progress = show_progress
        self.simulated_cluster = simulated_cluster
        self.shape = model_shape(cfg)

    # --- before any actor starts: everything that can be wrong with the input ----------------
    def _prepare(self) -> TokenDataset:
        existing = self.store.committed()
        if existing and not self.cfg.resume:
            raise UserError(
                f"run.dir: {self.run_dir} already has checkpoints (latest step "
                f"{existing[-1].step}); pass resume=true to continue it or choose another run.dir"
            )
        dataset = open_dataset(self.cfg)
        if self.shape.vocab_size < 256:
            raise ConfigError(f"model.vocab_size: {self.shape.vocab_size} < 256 byte tokens")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(to_yaml(self.cfg))
        return dataset

    def run(self) -> RunResult:
        self.dataset = self._prepare()
        handler = setup_driver_logging(self.run_dir)
        try:
            with connect(self.cfg.cluster, self.ray_temp_dir) as handle:
                return self._run(handle)
        finally:
            logging.getLogger("raytrain_dt").removeHandler(handler)
            handler.close()

    # --- the state machine -------------------------------------------------------------------
    def _run(self, handle: ClusterHandle) -> RunResult:
        self.handle = handle
        self.resource = handle.accelerator_resource
        self.policy = ElasticPolicy(self.cfg.elastic, self._plan_for)
        self.chaos = Chaos(list(self.cfg.chaos), self.simulated_cluster or handle.simulated,
                           simulated_node_args(self.cfg.cluster, self.resource))  # fmt: skip
        self.group = RankGroup(
            str(self.run_dir),
            self.resource,
            self.cfg.cluster.cpus_per_rank,
            runtime_env=storage_runtime_env(),
        )
        # The running layout (None while no group is formed) and the one before it.
        self.layout, self.layout_nodes, self.step = None, (), 0
        self.previous_layout = None
        self.formed = False
        self.recorder = RunRecorder(self.run_dir, self._resume_point()[1])
        self.restarts, self.failures_at_step, self.failed_step = 0, 0, -1
        self.draining: set[str] = set()
        self.preempting: dict[str, int] = {}  # simulated notices: node -> chaos action index
        self._nodes_key: tuple[str, ...] | None = None  # node set seen last, and since when
        self._nodes_since = 0.0
        self._last_cluster_check = 0.0
        self._last_plan = None
        # Nodes whose actors died with their node: excluded before Ray's health check says so.
        self.lost_nodes: set[str] = set()
        self.timings: list[dict] = []
        self.bar = tqdm(total=self.cfg.trainer.steps, desc="train", unit="step",
                        disable=not self.show_progress, dynamic_ncols=True)  # fmt: skip
        state: State = Starting()
        try:
            while not state.terminal:
                new_state = self._step(state)
                if type(new_state) is not type(state):
                    self.recorder.event("transition", old=type(state).__name__.lower(),
                                        new=type(new_state).__name__.lower(),
                                        reason=getattr(new_state, "reason", None))  # fmt: skip
                state = new_state
        finally:
            self.bar.close()
            self.group.shutdown()
            self.recorder.close()
        if isinstance(state, Failed):
            raise TrainingFailed(state.reason)
        committed = self.store.committed()
        return RunResult(str(self.run_dir), state.step, self.recorder.last_metrics,
                         committed[-1].uri if committed else None, self.layout, self.timings)  # fmt: skip

    def _step(self, state: State) -> State:
        if isinstance(state, Starting | Waiting):
            return self._decide(
                self._observe("ok"), waiting=state if isinstance(state, Waiting) else None
            )
        if isinstance(state, Running):
            return self._watch()
        if isinstance(state, Draining):
            return self._drain(state)
        if isinstance(state, Resizing | Restarting):
            return self._form(state)
        raise AssertionError(f"unhandled state {state}")

    def _observe(self, health: str) -> Observation:
        listed = alive_nodes(self.resource)
        self.lost_nodes &= {n.node_id for n in listed}  # forget them once Ray agrees
        nodes = tuple(n for n in listed if n.node_id not in self.lost_nodes)
        key = tuple(n.node_id for n in nodes)
        if key != self._nodes_key:
            self._nodes_key, self._nodes_since = key, time.time()
        return Observation(
            now=time.time(), nodes=nodes, draining=frozenset(self.draining), layout=self.layout,
            layout_nodes=self.layout_nodes, health=health, step=self.step,
            restarts=self.restarts, failures_at_step=self.failures_at_step,
            nodes_stable_since=self._nodes_since,
        )  # fmt: skip

    def _decide(self, obs: Observation, waiting: Waiting | None = None) -> State:
        if waiting is not None:
            obs = replace(obs, waiting_since=waiting.since)
        decision = self.policy.decide(obs)
        if not isinstance(decision, Noop):
            self.recorder.event("decision", decision=type(decision).__name__.lower(), reason=decision.reason,
                                health=obs.health, step=obs.step)  # fmt: skip
            log.info("decision: %s", decision.reason)
        if isinstance(decision, Fail):
            return Failed(decision.reason)
        if isinstance(decision, Wait):
            if waiting is None:
                log.warning("waiting: %s", decision.reason)
            time.sleep(1.0)
            return Waiting(decision.reason, waiting.since if waiting else obs.now)
        if isinstance(decision, Resize):
            if decision.checkpoint_first and self.layout is not None:
                return Draining(decision)
            return Restarting(decision) if obs.health in ("failed", "hung") else Resizing(decision)
        return Running()

    def _plan_for(self, nodes: tuple[NodeInfo, ...]):
        planned = plan_for_nodes(self.cfg, self.shape, self.resource, nodes)
        if planned is None:
            return None
        self._last_plan = planned
        return planned.best.layout

    def _resume_point(self) -> tuple[CheckpointRef | None, int]:
        """The checkpoint a formation starts from: the newest intact one, except that the very
        first formation of a run with resume=false starts fresh."""
        if not self.formed and not self.cfg.resume:
            return None, 0
        ref = self.store.latest_valid()
        return ref, (ref.step if ref else 0)

    # --- executing a Resize: (re)form the group ----------------------------------------------
    def _form(self, state: Resizing | Restarting) -> State:
        decision = state.decision
        started = time.perf_counter()
        old = self.layout or self.previous_layout
        if self.group.slots:
            broken = self.group.try_call("teardown", timeout_s=30)
            self.group.drop(broken)  # hung or dead actors cannot be reused
        resume, resume_step = self._resume_point()
        self.recorder.rewind(resume_step)
        self.chaos.fired.update(
            i for i, a in enumerate(self.chaos.actions) if a.at_step <= resume_step
        )
        nodes = {n.node_id: n.accelerators for n in self._observe("ok").nodes}
        counts = counts_by_node(decision.layout.dims.world_size, decision.layout.dims.tp,
                                [(n, nodes[n]) for n in decision.nodes if n in nodes])  # fmt: skip
        self.group.form(counts, self.cfg.cluster.placement_timeout_s)
        formed = time.perf_counter()
        cfg = replace(self.cfg, chaos=self.chaos.remaining())
        specs = rank_specs(cfg, self.shape, decision.layout, self.dataset, self.group.master_endpoint(),
                           self.checkpoint_root, resume)  # fmt: skip
        setup = self.group.call("setup", [(s,) for s in specs])
        self.group.call("start")
        self.layout, self.layout_nodes = decision.layout, tuple(sorted(counts))
        self.formed = True
        self.step = resume_step
        self.bar.n = resume_step
        self.tracker = CheckpointTracker(self.store, decision.layout.dims.world_size, self.recorder,
                                         self.cfg.checkpoint.keep_last, self.cfg.checkpoint.keep_every)  # fmt: skip
        self.last_progress = time.time()
        self.timings.append({"kind": type(state).__name__.lower(), "form_s": formed - started,
                             "setup_s": time.perf_counter() - formed, "ranks": setup})  # fmt: skip
        (self.run_dir / "layout.json").write_text(json.dumps(decision.layout.as_dict(), indent=2))
        if self._last_plan is not None:
            (self.run_dir / "plan.json").write_text(json.dumps(self._last_plan.to_json(), indent=2))
        self.recorder.event(
            "resize" if old is not None else "start", reason=decision.reason,
            old_layout=old.as_dict() if old else None, new_layout=decision.layout.as_dict(),
            resumed_from=resume.uri if resume else None, resumed_step=resume_step,
            lost_steps=max(0, self._failure_step - resume_step) if isinstance(state, Restarting) else 0,
            form_s=formed - started, setup_s=time.perf_counter() - formed,
            node_ids=[s.node_id for s in self.group.slots],
        )  # fmt: skip
        self._pending_first_step = time.perf_counter()
        self._form_started = started
        return Running()

    @property
    def _failure_step(self) -> int:
        return max(self.step, self.failed_step)

    # --- running -----------------------------------------------------------------------------
    def _handle_reports(self, statuses: list[dict]) -> None:
        dims = self.layout.dims
        for status in statuses:
            for report in status["reports"]:
                kind = report["kind"]
                if kind == "step":
                    if "sample_ids" in report:
                        self.recorder.step_samples(report["step"], dims.coords(status["rank"]).dp,
                                                   dims.dp, report["sample_ids"])  # fmt: skip
                    if "loss" in report:
                        self._on_step(report)
                elif kind != "stopped":
                    self.tracker.on_report(report)

    def _on_step(self, report: dict) -> None:
        self.recorder.step_metrics(report, self.layout.dims.world_size, self.layout.describe())
        self.bar.update(report["step"] - self.bar.n)
        self.bar.set_postfix(loss=f"{report['loss']:.4f}", tok_s=f"{report['tokens_per_s']:.0f}",
                             world=self.layout.dims.world_size)  # fmt: skip
        self.step, self.last_progress = report["step"], time.time()
        if self.failed_step < self.step:
            self.failures_at_step = 0
        if self._pending_first_step is not None:
            self.recorder.event("first_step", step=self.step,
                                since_form_s=time.perf_counter() - self._form_started)  # fmt: skip
            self._pending_first_step = None

    def _watch(self) -> State:
        statuses = self.group.poll()
        self._handle_reports(statuses)
        broken = _broken(statuses)
        if broken:
            return self._on_failure("failed", broken)
        if all(s["state"] == "done" for s in statuses):
            return Finished(self.step)
        if time.time() - self.last_progress > self.cfg.elastic.hang_timeout_s:
            log.warning(
                "no step completed for %.0fs: the group is hung", self.cfg.elastic.hang_timeout_s
            )
            return self._on_failure("hung", [])
        self._fire_node_chaos()
        if time.time() - self._last_cluster_check > CLUSTER_CHECK_INTERVAL_S:
            self._last_cluster_check = time.time()
            state = self._decide(self._observe("notice" if self.draining else "ok"))
            if not isinstance(state, Running):
                return state
        time.sleep(POLL_INTERVAL_S)
        return Running()

    def _on_failure(self, health: str, broken: list[dict]) -> State:
        if health == "failed":
            broken = self._settle(broken)
        errors = {s["rank"]: (s.get("error") or s["state"]).strip().splitlines()[0] for s in broken}
        # Actors that died with their node mark the node lost before Ray's health check does.
        self.lost_nodes |= {
            s["node_id"]
            for s in broken
            if s["state"] == "dead" and "node" in s.get("error", "").lower()
        }
        self.recorder.event("failure", health=health, step=self.step, ranks=errors)
        log.warning("ranks %s %s at step %d: %s", sorted(errors), health, self.step + 1, errors)
        self.failures_at_step = self.failures_at_step + 1 if self.failed_step == self.step else 1
        self.failed_step = self.step
        self.restarts += 1
        self.chaos.mark_rank_faults_fired(self.step + 1)
        if health == "hung":  # threads stuck in a collective cannot be reused: replace all
            self.group.drop(list(range(self.group.world_size)))
        else:  # dead ones go; survivors are torn down and reused by the next formation
            self.group.drop([s["rank"] for s in broken if s["state"] != "failed"])
        # No group trains now: the policy plans from scratch (and Waiting cannot mistake an
        # idle group for a finished one).
        self.previous_layout, self.layout, self.layout_nodes = self.layout, None, ()
        return self._decide(self._observe(health))

    def _settle(self, broken: list[dict], wait_s: float = 5.0) -> list[dict]:
        """When one rank fails, its peers fail or die within moments (a lost node takes
        several). Collect them all before deciding, so the plan excludes every lost node."""
        deadline = time.time() + wait_s
        while time.time() < deadline:
            statuses = self.group.poll()
            self._handle_reports(statuses)
            broken = [s for s in statuses if s["state"] != "running"]
            if len(broken) == len(statuses) and all(s["state"] != "done" for s in broken):
                break
            time.sleep(0.25)
        return _broken(broken)

    def _drain(self, state: Draining) -> State:
        """Save at the next step boundary and stop there; resize once it is committed."""
        self.group.try_call("request_checkpoint_and_stop", timeout_s=30)
        deadline = time.time() + self.cfg.elastic.hang_timeout_s
        while True:
            if time.time() > deadline:
                return self._on_failure("hung", [])
            statuses = self.group.poll()
            self._handle_reports(statuses)
            broken = _broken(statuses)
            if broken:
                return self._on_failure("failed", broken)
            if all(s["state"] == "done" for s in statuses):
                latest = self.store.committed()
                if latest and latest[-1].step == self.step:
                    break
            time.sleep(POLL_INTERVAL_S)
        self.recorder.event("drained", step=self.step, reason=state.decision.reason)
        for node, index in self.preempting.items():  # the notice has been served: reclaim the node
            self.chaos.fired.add(index)
            self.chaos.kill_node(node)
        self.preempting.clear()
        # Nodes under notice are leaving: plan without them even before Ray reports them gone.
        self.lost_nodes |= self.draining
        self.draining.clear()
        # Re-plan now: the node under notice may be gone, or the capacity may have changed.
        decision = self.policy.decide(replace(self._observe("ok"), layout=None))
        if isinstance(decision, Resize):
            return Resizing(replace(decision, reason=state.decision.reason))
        return self._decide(self._observe("ok"))

    def _node_of_rank(self, rank: int) -> str:
        return self.group.slots[min(rank, self.group.world_size - 1)].node_id

    def _fire_node_chaos(self) -> None:
        for i, action in self.chaos.due_node_actions(self.step):
            if action.action == "kill_node":
                self.chaos.fired.add(i)
                self.chaos.kill_node(self._node_of_rank(action.target))
            elif action.action == "add_node":
                self.chaos.fired.add(i)
                self.chaos.add_node()
            elif action.action == "preempt_node" and i not in self.preempting.values():
                node = self._node_of_rank(action.target)
                self.preempting[node] = i
                self.draining.add(node)
                self.recorder.event("preemption_notice", node=node, step=self.step)


def storage_runtime_env() -> dict | None:
    """The driver's AWS_* settings (credentials, region, AWS_ENDPOINT_URL) for the rank actors.

    Actors run in worker processes of raylets that may have started before this driver set
    them, so without this they would not see the storage the checkpoints go to.
    """
    env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    return {"env_vars": env} if env else None


def _broken(statuses: list[dict]) -> list[dict]:
    return [s for s in statuses if s["state"] in ("failed", "dead", "unresponsive")]


def train(cfg: TrainConfig, **kwargs) -> RunResult:
    return Coordinator(cfg, **kwargs).run()


__all__ = ["Coordinator", "RunResult", "TrainingFailed", "train"]

"""The coordinator: the driver-side control plane of one training run, as a state machine.

`while not state.terminal: state = step(state)`. It prepares the run, connects to Ray, asks
the elastic policy what to do (start, resize, wait, fail), executes the decision with the rank
group (forming and recovering it: `control/recovery.py`), and watches the group: progress,
metrics and ledger, checkpoint commits, dead or hung ranks, preemption notices (from ranks:
SIGTERM, spot notices; from the GCS: node drains), new nodes and the capacity to ask the
autoscaler for. It never imports torch.distributed: everything it knows about ranks comes from
their reports. The cluster view and the rank group are the only parts that touch Ray; `begin`
takes them, so unit tests drive `advance` on fakes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from raytrain_dt.checkpoint.initial import check_matches
from raytrain_dt.checkpoint.record import check_resume_fits
from raytrain_dt.checkpoint.store import CheckpointRef, CheckpointStore
from raytrain_dt.config.load import to_yaml
from raytrain_dt.config.schema import TrainConfig
from raytrain_dt.control.chaos import Chaos
from raytrain_dt.control.cluster import (
    ClusterHandle,
    ClusterView,
    NodeInfo,
    RayClusterView,
    check_device_available,
    connect,
    simulated_node_args,
)
from raytrain_dt.control.comm_env import run_comm_env, with_comm_env
from raytrain_dt.control.deadlines import Deadlines
from raytrain_dt.control.policies import (
    ElasticPolicy,
    Fail,
    FailureStreak,
    Noop,
    Observation,
    Resize,
    Wait,
    capacity_request,
)
from raytrain_dt.control.rank_group import RankGroup
from raytrain_dt.control.recovery import POLL_INTERVAL_S, GroupRecovery, broken_statuses
from raytrain_dt.control.recovery_timing import RecoveryTimer
from raytrain_dt.control.run_setup import (
    RunResult,
    TrainingFailed,
    check_dataset,
    model_shape,
    open_dataset,
    plan_for_nodes,
    uses_user_data,
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
    Stopped,
    Waiting,
)
from raytrain_dt.errors import ConfigError, UserError
from raytrain_dt.models.model_spec import ModelSpec, model_spec
from raytrain_dt.observe.exporters import default_sinks
from raytrain_dt.observe.logs import setup_driver_logging
from raytrain_dt.observe.metrics import RunRecorder

log = logging.getLogger(__name__)

CLUSTER_CHECK_INTERVAL_S = 0.5


class Coordinator(GroupRecovery):
    def __init__(self, cfg: TrainConfig, ray_temp_dir: str | None = None,
                 show_progress: bool = True, simulated_cluster: object | None = None,
                 model: ModelSpec | None = None, dataset: object | None = None,
                 tokenize: Callable | None = None):  # fmt: skip
        self.cfg = cfg
        self.run_dir = Path(cfg.run.dir).resolve()
        self.checkpoint_root = cfg.checkpoint.dir or str(self.run_dir / "checkpoints")
        self.store = CheckpointStore(self.checkpoint_root)
        self.ray_temp_dir = ray_temp_dir
        self.show_progress = show_progress
        self.stop_reason: str | None = None
        self.simulated_cluster = simulated_cluster
        # The Python API may hand over a model spec, a Ray Dataset and a tokenize map.
        self.model_spec = model or model_spec(cfg)
        self.shape = self.model_spec.shape
        self.user_dataset, self.tokenize = dataset, tokenize

    # --- before any actor starts: everything that can be wrong with the input ----------------
    def _prepare(self) -> None:
        existing = self.store.committed()
        if existing and not self.cfg.resume:
            raise UserError(
                f"run.dir: {self.run_dir} already has checkpoints (latest step "
                f"{existing[-1].step}); pass resume=true to continue it or choose another run.dir"
            )
        check_dataset(self.cfg, self.user_dataset)
        if not uses_user_data(self.cfg, self.user_dataset) and self.shape.vocab_size < 256:
            raise ConfigError(f"model.vocab_size: {self.shape.vocab_size} < 256 byte tokens")
        if self.cfg.model.init_from and not existing:
            check_matches(self.cfg.model.init_from, self.shape)
        if existing:  # the checkpoint to resume from must fit the configured model
            check_resume_fits(existing[-1], self.model_spec, self.cfg.data.seq_len)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(to_yaml(self.cfg))

    def run(self) -> RunResult:
        self._prepare()
        handler = setup_driver_logging(self.run_dir)
        try:
            connecting = time.perf_counter()
            with connect(self.cfg.cluster, self.ray_temp_dir) as handle:
                self.ray_start_s = time.perf_counter() - connecting  # start-up benchmark
                # A device the cluster cannot give is refused before any work: preparing the
                # default corpus takes minutes, packing user data needs Ray Data.
                check_device_available(self.cfg.cluster)
                self.dataset = open_dataset(
                    self.cfg, self.user_dataset, self.tokenize, self.shape.vocab_size
                )
                return self._run(handle)
        finally:
            logging.getLogger("raytrain_dt").removeHandler(handler)
            handler.close()

    # --- the state machine -------------------------------------------------------------------
    def _run(self, handle: ClusterHandle) -> RunResult:
        self.begin(
            handle.accelerator_resource,
            RayClusterView(handle.accelerator_resource),
            RankGroup(
                str(self.run_dir),
                handle.accelerator_resource,
                self.cfg.cluster.cpus_per_rank,
                runtime_env=with_comm_env(
                    storage_runtime_env(), run_comm_env(self.cfg, handle.mode, self.run_dir)
                ),
            ),
            self.simulated_cluster or handle.simulated,
        )
        self.recorder.event("connected", mode=handle.mode, ray_start_s=self.ray_start_s)
        try:
            # Installed only now: `ray.init` replaces any SIGTERM handler set before it.
            with _sigterm_stops(self):
                while not self.state.terminal:
                    self.advance()
        finally:
            self.bar.close()
            self.group.shutdown()
            self.recorder.close()
        if isinstance(self.state, Failed):
            raise TrainingFailed(self.state.reason)
        committed = self.store.committed()
        return RunResult(str(self.run_dir), self.state.step, self.recorder.last_metrics,
                         committed[-1].uri if committed else None, self.layout, self.timings,
                         stopped=isinstance(self.state, Stopped))  # fmt: skip

    def request_stop(self, reason: str) -> None:
        """Stop at the next step boundary with a checkpoint (safe from a signal handler: it
        only sets a flag the loop reads)."""
        self.stop_reason = reason

    def begin(self, resource: str, cluster: ClusterView, group: RankGroup,
              simulated: object | None = None) -> None:  # fmt: skip
        """Ready the state machine on a cluster view and a rank group (the only parts that
        touch Ray, so unit tests hand in fakes and drive `advance` themselves)."""
        self.resource, self.cluster, self.group = resource, cluster, group
        self.policy = ElasticPolicy(self.cfg.elastic, self._plan_for)
        self.chaos = Chaos(list(self.cfg.chaos), simulated,
                           simulated_node_args(self.cfg.cluster, self.resource))  # fmt: skip
        # The running layout (None while no group is formed) and the one before it.
        self.layout, self.layout_nodes, self.step = None, (), 0
        self.previous_layout = None
        self.formed = False
        self.group_left = False  # the group's actors have left their layout (torn down)
        resumed_step = self._resume_point()[1]
        self.recorder = RunRecorder(self.run_dir, resumed_step,
                                    default_sinks(self.cfg, self.run_dir, resumed_step))  # fmt: skip
        # `failed_step`: the last completed step at the latest failure, for its lost steps.
        self.restarts, self.failed_step, self.streak = 0, -1, FailureStreak()
        self.draining: set[str] = set()
        self.preempting: dict[str, int] = {}  # simulated notices: node -> chaos action index
        self._nodes_key: tuple[str, ...] | None = None  # node set seen last, and since when
        self._nodes_since = 0.0
        self._last_cluster_check = 0.0
        self._last_plan = None
        # Nodes whose actors died with their node: excluded before Ray's health check says so.
        self.lost_nodes: set[str] = set()
        self.timings: list[dict] = []
        self.capacity_requested: list[dict] = []  # nothing asked of the autoscaler yet
        self.recovery = RecoveryTimer()
        self.deadlines = Deadlines.from_config(self.cfg)
        self._formation_timer: RecoveryTimer | None = None  # runs until the first step
        self._last_healthy = time.perf_counter()
        self._shrunk_at = float("-inf")  # perf_counter of the latest failure
        self.bar = tqdm(total=self.cfg.trainer.steps, desc="train", unit="step",
                        disable=not self.show_progress, dynamic_ncols=True)  # fmt: skip
        self.state: State = Starting()

    def advance(self) -> State:
        """One iteration of the state machine; every change of state is logged with its reason."""
        state, new_state = self.state, self._step(self.state)
        if type(new_state) is not type(state):
            self.recorder.event("transition", old=type(state).__name__.lower(),
                                new=type(new_state).__name__.lower(),
                                reason=getattr(new_state, "reason", None))  # fmt: skip
        self.state = new_state
        return new_state

    def _step(self, state: State) -> State:
        if self.stop_reason and not isinstance(state, Draining | Running):
            return Stopped(self.step, self.stop_reason)  # no group trains: nothing to save
        if self.stop_reason and isinstance(state, Running):
            return Draining(Resize(self.layout, self.layout_nodes, f"stop: {self.stop_reason}",
                                   checkpoint_first=True))  # fmt: skip
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
        listed = self.cluster.nodes()
        self.lost_nodes &= {n.node_id for n in listed}  # forget them once Ray agrees
        nodes = tuple(n for n in listed if n.node_id not in self.lost_nodes)
        key = tuple(n.node_id for n in nodes)
        if key != self._nodes_key:
            self._nodes_key, self._nodes_since = key, time.time()
        drained = self.cluster.draining() & set(key)
        for node in drained & set(self.layout_nodes) - self.draining:
            self._notice(node, "ray-drain", "the GCS is draining the node")
        self._request_capacity(nodes)
        draining = frozenset(self.draining | drained)
        return Observation(
            now=time.time(), nodes=self._warm_capacity(nodes, draining), draining=draining,
            layout=self.layout,
            layout_nodes=self.layout_nodes, health=health, step=self.step,
            restarts=self.restarts, failures_at_step=self.streak.count,
            nodes_stable_since=self._nodes_since,
        )  # fmt: skip

    def _notice(self, node: str, source: str, detail: str) -> None:
        """A preemption notice for a node the group uses: drain at the next step boundary."""
        self.draining.add(node)
        self._last_cluster_check = 0.0  # decide at once, not at the next periodic check
        self.recovery.cause(time.perf_counter())
        self.recorder.event("preemption_notice", node=node, step=self.step, source=source,
                            detail=detail)  # fmt: skip
        log.warning("preemption notice for node %s (%s): %s", node[:12], source, detail)

    def _request_capacity(self, nodes: tuple[NodeInfo, ...]) -> None:
        bundles = capacity_request(self.cfg.elastic, self.resource, nodes,
                                   self.cfg.cluster.accelerators_per_node, self.cfg.cluster.num_ranks)  # fmt: skip
        if bundles != self.capacity_requested:
            self.capacity_requested = bundles
            self.cluster.request_capacity(bundles)
            self.recorder.event("capacity_request", bundles=bundles)

    def _decide(self, obs: Observation, waiting: Waiting | None = None) -> State:
        if waiting is not None:
            obs = replace(obs, waiting_since=waiting.since)
        started = time.perf_counter()
        decision = self.policy.decide(obs)
        if isinstance(decision, Resize):
            if decision.checkpoint_first and not self.draining:
                # Growth: since the nodes appeared, or since the failure that shrank the group
                # (a grow back onto a dead rank's warmed replacement), whichever is later.
                appeared = started - (time.time() - self._nodes_since)
                self.recovery.cause(max(appeared, self._shrunk_at))
            self.recovery.decided(started, time.perf_counter())
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

    # --- running -----------------------------------------------------------------------------
    def _handle_reports(self, statuses: list[dict]) -> None:
        # The layout that sent them (after a failure, the group is still the old layout's).
        layout = self.layout or self.previous_layout
        dims = layout.dims
        for status in statuses:
            notice = status.get("notice")
            if notice and status["state"] != "dead":
                node = self.group.slots[status["rank"]].node_id
                if node not in self.draining | self.lost_nodes:
                    self._notice(node, notice["source"], notice["detail"])
            for report in status["reports"]:
                kind = report["kind"]
                if kind == "step":
                    self.recorder.rank_step(status["rank"], report)
                    if "sample_ids" in report:
                        self.recorder.step_samples(report["step"], dims.coords(status["rank"]).dp,
                                                   dims.dp, report["sample_ids"])  # fmt: skip
                    if "loss" in report:
                        self._on_step(report, layout)
                elif kind != "stopped":
                    self.tracker.on_report(report)

    def _on_step(self, report: dict, layout) -> None:
        self.recorder.step_metrics(report, layout.dims.world_size, layout.describe())
        self.bar.update(report["step"] - self.bar.n)
        self.bar.set_postfix(loss=f"{report['loss']:.4f}", tok_s=f"{report['tokens_per_s']:.0f}",
                             world=layout.dims.world_size)  # fmt: skip
        self.step, self.last_progress = report["step"], time.time()
        self.deadlines.step_finished(report.get("finished_at", self.last_progress))
        self.streak.progressed(self.step)
        if self._formation_timer is not None:  # the whole breakdown, first step included
            timer, self._formation_timer = self._formation_timer, None
            self.recorder.event("first_step", step=self.step, **timer.first_step())

    def _watch(self) -> State:
        statuses = self.group.poll()
        self._handle_reports(statuses)
        broken = broken_statuses(statuses)
        if broken:
            return self._on_failure("failed", broken)
        self._last_healthy = time.perf_counter()
        if all(s["state"] == "done" for s in statuses):
            return Finished(self.step)
        bound = self.deadlines.hang_bound(saving=bool(self.tracker.in_flight))
        if time.time() - self.last_progress > bound.seconds:
            log.warning(
                "no step completed for %.0fs (%s): the group is hung", bound.seconds, bound.detail
            )
            return self._on_failure("hung", [], bound)
        self._fire_node_chaos()
        if time.time() - self._last_cluster_check > CLUSTER_CHECK_INTERVAL_S:
            self._last_cluster_check = time.time()
            state = self._decide(self._observe("notice" if self.draining else "ok"))
            if not isinstance(state, Running):
                return state
        time.sleep(POLL_INTERVAL_S)
        return Running()


def storage_runtime_env() -> dict | None:
    """The driver's AWS_* settings (credentials, region, AWS_ENDPOINT_URL) for the rank actors.

    Actors run in worker processes of raylets that may have started before this driver set
    them, so without this they would not see the storage the checkpoints go to.
    """
    env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    return {"env_vars": env} if env else None


def train(cfg: TrainConfig, **kwargs) -> RunResult:
    """Run training to the end. A SIGTERM to this process (`ray job stop`, a scheduler, a
    spot driver node) stops it gracefully: checkpoint at the next step boundary, then return
    with `stopped`; a second SIGTERM exits at once."""
    return Coordinator(cfg, **kwargs).run()


@contextlib.contextmanager
def _sigterm_stops(coordinator: Coordinator) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may handle signals
        return

    def on_sigterm(signum, frame):
        if coordinator.stop_reason:
            raise SystemExit(128 + signum)
        log.warning("SIGTERM: stopping at the next step boundary with a checkpoint")
        coordinator.request_stop("SIGTERM")

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


__all__ = ["Coordinator", "RunResult", "TrainingFailed", "model_shape", "train"]

"""The coordinator: the driver-side control plane of one training run, as a state machine.

`while not state.terminal: state = step(state)`. It prepares the run, connects to Ray, and
composes the parts that run it, each in its own module and sharing only `RunState`: deciding
(`control/deciding.py`: the elastic policy's start, resize, wait or fail), forming the group
(`control/formation.py`), watching it (`control/watch.py`: progress, metrics and ledger,
checkpoint commits, dead or hung ranks, preemption notices from ranks), recovering it
(`control/recovery.py`: failures, drains) and capacity (`control/capacity.py`: actors warmed
ahead of need, the autoscaler's request). State handlers return the next state; a decision due
comes back as `Deciding`, which `advance` answers (`control/states.py` has the diagram). It
never imports torch.distributed: everything it knows about ranks comes from their reports
(`worker/reports.py`). The cluster view and the rank group are the only parts that touch Ray;
`begin` takes them, so unit tests drive `advance` on fakes."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

from raytrain_dt.checkpoint.initial import check_matches
from raytrain_dt.checkpoint.record import check_resume_fits
from raytrain_dt.checkpoint.store import CheckpointRef, CheckpointStore
from raytrain_dt.config.load import to_yaml
from raytrain_dt.config.schema import TrainConfig, memory_copy_interval
from raytrain_dt.control.capacity import Capacity
from raytrain_dt.control.cluster import (
    ClusterHandle,
    ClusterView,
    NodeInfo,
    RayClusterView,
    check_device_available,
    connect,
    simulated_node_args,
)
from raytrain_dt.control.comm_env import rank_runtime_env
from raytrain_dt.control.copy_holders import CopyHolders, live_actors
from raytrain_dt.control.deadlines import Deadlines
from raytrain_dt.control.deciding import Decider
from raytrain_dt.control.driver_signals import sigterm_stops
from raytrain_dt.control.formation import Formation, FormationTimedOut, NoRoomForLayout
from raytrain_dt.control.group import FormationFault, PlacementTimedOut, RankGroupLike
from raytrain_dt.control.node_chaos import Chaos
from raytrain_dt.control.policies import (
    ElasticPolicy,
    FailureStreak,
    Observation,
    Resize,
)
from raytrain_dt.control.rank_group import RankGroup
from raytrain_dt.control.recovery import Recovery, broken_statuses
from raytrain_dt.control.run_setup import (
    RunResult,
    TrainingFailed,
    check_dataset,
    check_parallel_pins,
    model_shape,
    open_dataset,
    plan_for_nodes,
    uses_user_data,
)
from raytrain_dt.control.run_state import RunState
from raytrain_dt.control.states import (
    Deciding,
    Draining,
    Failed,
    Resizing,
    Restarting,
    Running,
    Starting,
    State,
    Stopped,
    Waiting,
)
from raytrain_dt.control.watch import GroupWatch
from raytrain_dt.data.remote import check_credentials
from raytrain_dt.errors import CheckpointError, ConfigError, UserError
from raytrain_dt.models.model_spec import ModelSpec, model_spec
from raytrain_dt.observe.exporters import default_sinks
from raytrain_dt.observe.logs import setup_driver_logging
from raytrain_dt.observe.metrics import RunRecorder
from raytrain_dt.observe.progress import progress_display
from raytrain_dt.observe.trackers import check_installed

log = logging.getLogger(__name__)


class Coordinator:
    def __init__(
        self,
        cfg: TrainConfig,
        ray_temp_dir: str | None = None,
        show_progress: bool = True,
        simulated_cluster: object | None = None,
        model: ModelSpec | None = None,
        dataset: object | None = None,
        tokenize: Callable | None = None,
    ):
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
        check_installed(self.cfg)  # the experiment trackers' packages
        # cp or ep the model or the engine has no structure for: refused whatever the cluster.
        check_parallel_pins(self.cfg, self.shape)
        check_credentials(self.checkpoint_root, "checkpoint.dir", CheckpointError)
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
        group = RankGroup(
            str(self.run_dir),
            handle.accelerator_resource,
            self.cfg.cluster.cpus_per_rank,
            runtime_env=rank_runtime_env(self.cfg, handle.mode),
            keep_warm_s=self.cfg.cluster.keep_warm_s,
            device=self.cfg.cluster.device,
            data_cpus_per_rank=self.cfg.cluster.data_cpus_per_rank,
        )
        group.host_data_services()  # on the driver's node, not a rank's that may be lost
        warm = group.adopt_warm()  # actors this driver's last run kept (`cluster.keep_warm_s`)
        self.begin(
            handle.accelerator_resource,
            RayClusterView(handle.accelerator_resource, requester=f"raytrain_dt:{self.run_dir}"),
            group,
            self.simulated_cluster or handle.simulated,
        )
        self.recorder.event(
            "connected", mode=handle.mode, ray_start_s=self.ray_start_s, warm_actors=warm
        )
        return self.drive()

    def drive(self) -> RunResult:
        """Run the begun state machine to its end; whatever the end, `_end` then takes back
        what the run holds on the cluster."""
        try:
            # Installed only now: `ray.init` replaces any SIGTERM handler set before it.
            with sigterm_stops(self.request_stop, lambda: self.stop_reason):
                while not self.state.terminal:
                    self.advance()
        finally:
            self._end()
            tracker = self.watch.tracker
            failed_saves = tracker.summary() if tracker is not None else None
            if failed_saves:
                log.error("%s", failed_saves)
        if isinstance(self.state, Failed):
            raise TrainingFailed(self.state.reason)
        committed = self.store.committed()
        return RunResult(
            str(self.run_dir),
            self.state.step,
            self.recorder.last_metrics,
            committed[-1].uri if committed else None,
            self.run_state.layout,
            self.run_state.timings,
            stopped=isinstance(self.state, Stopped),
        )

    def _end(self) -> None:
        """The one place a run lets go of the cluster, at every end: finished, failed, stopped
        (SIGTERM), Ctrl-C or an error. The autoscaler request is withdrawn (first: its event
        is then the run's last, so the actors' shutdown does not count in the run's wall time),
        the actors go, and closing the recorder removes the run's status record from Ray's KV
        store. A killed driver cannot do this: resuming its run.dir asks again and lets go at
        its own end. Each step runs even if one before it raises (ExitStack runs every
        callback)."""
        with ExitStack() as ends:  # callbacks run last-registered first
            ends.callback(self.recorder.close)
            ends.callback(self.group.shutdown)
            ends.callback(self.capacity.withdraw)
            ends.callback(self.progress.close)

    def request_stop(self, reason: str) -> None:
        """Stop at the next step boundary with a checkpoint (safe from a signal handler: it
        only sets a flag the loop reads)."""
        self.stop_reason = reason

    def begin(
        self,
        resource: str,
        cluster: ClusterView,
        group: RankGroupLike,
        simulated: object | None = None,
    ) -> None:
        """Ready the state machine on a cluster view and a rank group (the only parts that
        touch Ray, so unit tests hand in fakes and drive `advance` themselves)."""
        self.resource, self.cluster, self.group = resource, cluster, group
        # The in-memory copies' interval, resolved once for these ranks (null: by device).
        every = memory_copy_interval(self.cfg.checkpoint, resource == "GPU")
        self.cfg = replace(
            self.cfg, checkpoint=replace(self.cfg.checkpoint, memory_every_steps=every)
        )
        self.policy = ElasticPolicy(self.cfg.elastic, self._plan_for)
        self.chaos = Chaos(
            list(self.cfg.chaos),
            simulated,
            simulated_node_args(self.cfg.cluster, self.resource),
            processes_on=self._rank_processes_on,
        )
        self.run_state = RunState()
        self.copies = CopyHolders()
        resumed_step = self._resume_point()[1]
        self.recorder = RunRecorder(
            self.run_dir, resumed_step, default_sinks(self.cfg, self.run_dir, resumed_step)
        )
        self.deadlines = Deadlines.from_config(self.cfg)
        self.progress = progress_display(self.cfg.trainer.steps, self.show_progress)
        self.capacity = Capacity(self.cfg, resource, cluster, group, self.run_state, self.recorder)
        self.formation = Formation(
            self.cfg,
            self.run_dir,
            self.shape,
            self.model_spec,
            self.dataset,
            self.checkpoint_root,
            self.store,
            resource,
            group,
            self.deadlines,
            self.recorder,
            self.copies,
        )
        self.watch = GroupWatch(
            self.run_state,
            group,
            self.recorder,
            self.deadlines,
            self.chaos,
            self.progress,
            self._notice,
        )
        self.watch.copies = self.copies
        self.recovery = Recovery(
            self.run_state,
            group,
            cluster,
            self.recorder,
            self.chaos,
            self.deadlines,
            self.store,
            self.watch.handle_reports,
            self.copies,
            lambda: self.watch.tracker.in_flight if self.watch.tracker else set(),
        )
        self.watch.recovery = self.recovery
        self.decider = Decider(self.policy, self.run_state, self.recorder, self._observe)
        self.state: State = Starting()

    # What tests and callers read of the run's state.
    @property
    def step(self) -> int:
        return self.run_state.step

    def _rank_processes_on(self, node_id: str) -> list[int]:
        """The worker processes of the rank actors on `node_id` (node chaos kills them)."""
        slots = [*self.group.slots, *self.group.idle]
        return [s.pid for s in slots if s.node_id == node_id and s.pid]

    @property
    def lost_nodes(self) -> set[str]:
        return self.run_state.lost_nodes

    @property
    def streak(self) -> FailureStreak:
        return self.run_state.streak

    def advance(self) -> State:
        """One iteration of the state machine; every change of state is logged with its reason.
        A handler that returns `Deciding` is answered with a decision in the same iteration."""
        state, new_state = self.state, self._step(self.state)
        if isinstance(new_state, Deciding):
            new_state = self.decider.decide(new_state)
        if type(new_state) is not type(state):
            self.recorder.event(
                "transition",
                old=type(state).__name__.lower(),
                new=type(new_state).__name__.lower(),
                reason=getattr(new_state, "reason", None),
            )
        self.state = new_state
        return new_state

    def _step(self, state: State) -> State:
        run = self.run_state
        if self.stop_reason and not isinstance(state, Draining | Running):
            return Stopped(run.step, self.stop_reason)  # no group trains: nothing to save
        if self.stop_reason and isinstance(state, Running):
            return Draining(
                Resize(
                    run.layout, run.layout_nodes, f"stop: {self.stop_reason}", checkpoint_first=True
                )
            )
        if isinstance(state, Starting):
            return Deciding("ok")
        if isinstance(state, Waiting):
            return Deciding("ok", waiting=state)
        if isinstance(state, Running):
            return self.watch.check()
        if isinstance(state, Draining):
            saving = bool(self.watch.tracker and self.watch.tracker.in_flight)
            return self.recovery.drain(state, saving, self.stop_reason)
        if isinstance(state, Resizing | Restarting):
            return self._form(state)
        raise AssertionError(f"unhandled state {state}")

    # --- deciding ----------------------------------------------------------------------------
    def _observe(self, health: str) -> Observation:
        run = self.run_state
        listed = self.cluster.nodes()
        run.lost_nodes &= {n.node_id for n in listed}  # forget them once Ray agrees
        now = time.time()
        run.benched_nodes = {n: until for n, until in run.benched_nodes.items() if until > now}
        left_out = run.lost_nodes | set(run.benched_nodes)
        nodes = tuple(n for n in listed if n.node_id not in left_out)
        key = tuple(n.node_id for n in nodes)
        if key != run.nodes_key:
            run.nodes_key, run.nodes_since = key, time.time()
        drained = self.cluster.draining() & set(key)
        for node in drained & set(run.layout_nodes) - run.draining:
            self._notice(node, "ray-drain", "the GCS is draining the node")
        self.capacity.request(nodes)
        draining = frozenset(run.draining | drained)
        shown = self.capacity.warm(nodes, draining, waiting=isinstance(self.state, Waiting))
        return Observation(
            now=time.time(),
            nodes=shown,
            draining=draining,
            layout=run.layout,
            layout_nodes=run.layout_nodes,
            health=health,
            step=run.step,
            restarts=run.restarts,
            failures_at_step=run.streak.count,
            nodes_stable_since=run.nodes_since,
        )

    def _notice(self, node: str, source: str, detail: str) -> None:
        """A preemption notice for a node the group uses: drain at the next step boundary."""
        run = self.run_state
        run.draining.add(node)
        run.last_cluster_check = 0.0  # decide at once, not at the next periodic check
        run.incident.cause(time.perf_counter())
        self.recorder.event(
            "preemption_notice", node=node, step=run.step, source=source, detail=detail
        )
        log.warning("preemption notice for node %s (%s): %s", node[:12], source, detail)

    def _plan_for(self, nodes: tuple[NodeInfo, ...]):
        planned = plan_for_nodes(self.cfg, self.shape, self.resource, nodes)
        if planned is None:
            return None
        self.run_state.last_plan = planned
        return planned.best.layout

    def _resume_point(self) -> tuple[CheckpointRef | None, int]:
        """The state a formation starts from: the ranks' in-memory copies of the newest step
        every rank's copy survives, unless the newest intact checkpoint is newer; the very
        first formation of a run with resume=false starts fresh."""
        if not self.run_state.formed and not self.cfg.resume:
            return None, 0
        ref = self.store.latest_valid()
        step = ref.step if ref else 0
        live = live_actors([*self.group.slots, *self.group.idle])
        memory = self.copies.resume_point(live, not_before=step) if self.run_state.formed else None
        if memory is None and self.run_state.formed and self.copies.held_bytes():
            log.warning(
                "no in-memory copy newer than step %d survives: resuming from storage", step
            )
        return (memory, memory.step) if memory else (ref, step)

    # --- executing a Resize: (re)form the group ----------------------------------------------
    def _form(self, state: Resizing | Restarting) -> State:
        run, decision = self.run_state, state.decision
        started = time.perf_counter()
        old = run.layout or run.previous_layout
        if self.group.slots and not run.group_left:
            self.recovery.leave_layout()
        capacity = {n.node_id: n.accelerators for n in self._observe("ok").nodes}
        try:
            begun = run.failure_step + 1
            formed = self.formation.form(
                decision, capacity, self._resume_point, self.chaos, run.incident, begun
            )
        except FormationFault as exc:  # a rank or node lost while forming: re-plan
            return self.recovery.on_formation_fault(exc)
        except NoRoomForLayout as exc:  # capacity went since the decision: re-plan
            log.warning("%s: re-planning", exc)
            # The group has left the old layout (above): the plan starts from no layout, or
            # the policy would keep the old one and the loop would watch an empty group.
            run.left_layout()
            return Deciding("failed" if isinstance(state, Restarting) else "ok")
        except PlacementTimedOut as exc:
            if not run.formed:
                raise  # the first layout does not fit the cluster: the user's to fix
            # A node that held ranks cannot host them again in time: re-plan without it.
            run.left_layout()
            bench_s = self.cfg.elastic.grow_stable_s + self.cfg.cluster.placement_timeout_s
            return self.recovery.on_placement_timeout(exc, bench_s, isinstance(state, Restarting))
        except FormationTimedOut as exc:
            # The run stops with its checkpoints intact and the reason; this is the one place
            # a retry elsewhere would go.
            self.recorder.event(
                "failure", health="formation_timeout", step=run.step, ranks={}, **exc.bound.fields()
            )
            log.error("%s", exc.reason)
            return Failed(exc.reason)
        self.watch.tracker = self.formation.record(self.run_state, state, formed, old, started)
        self.progress.reset(formed.resume_step)
        # After the formation's event: no step may precede its record.
        run.group_left = False
        try:
            self.group.start()
        except FormationFault:  # a rank died before its loop started: the group's failure
            return self.recovery.on_failure("failed", broken_statuses(self.group.poll()))
        return Running()


def train(cfg: TrainConfig, **kwargs) -> RunResult:
    """Run training to the end. A SIGTERM to this process (`ray job stop`, a scheduler, a
    spot driver node) stops it gracefully: checkpoint at the next step boundary, then return
    with `stopped`; a second SIGTERM exits at once."""
    return Coordinator(cfg, **kwargs).run()


__all__ = ["Coordinator", "RunResult", "TrainingFailed", "model_shape", "train"]

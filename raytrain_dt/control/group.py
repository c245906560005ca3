"""What the coordinator uses of a rank group, as a Protocol: `RankGroup` (Ray actors) has it, and
so does the unit tests' fake (`tests/control/fakes.py`); `tests/control/test_group_protocol.py`
checks that both keep to it, method by method and parameter by parameter, so the fake cannot
drift from the real group. The cluster's side is `control.cluster.ClusterView`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

from raytrain_dt.errors import UserError
from raytrain_dt.worker.reports import RankStatus

if TYPE_CHECKING:
    from raytrain_dt.worker.spec import RankSpec

# How Ray words an actor's death when its node died (ray/_raylet, gcs_server in Ray 2.60).
NODE_DIED = "because its node has died"


class Slot(Protocol):
    """One started actor: where it runs, its run-wide index and its process (for the `resize`
    event's `kept_actors` and `new_actors`)."""

    node_id: str
    actor_index: int
    pid: int
    actor_index: int  # names its in-memory copies (`control/copy_holders.py`)
    handle: object  # the actor, which peers read copies from


class FormationFault(Exception):
    """A rank actor died (`actor_died`), or a rank's call raised, while the group formed
    (placement, start, verification, set-up or the loop's start): the formation is a failure
    like any other, re-planned without the dead. `nodes`: the nodes Ray said died with them."""

    def __init__(self, detail: str, nodes: frozenset[str] = frozenset(), actor_died: bool = True):
        super().__init__(detail)
        self.nodes, self.actor_died = nodes, actor_died


class PlacementTimedOut(UserError):
    """No room for a node's ranks within `cluster.placement_timeout_s`: on a cluster too small
    for the first layout, the user's error; in a re-formation, a node that cannot host what it
    hosted before (its resources held, the node going), which the coordinator re-plans
    without for a while."""

    def __init__(self, detail: str, node_id: str):
        super().__init__(detail)
        self.node_id = node_id


@runtime_checkable
class RankGroupLike(Protocol):
    # Actors by role: in the layout (ordered by rank once formed), started in no layout, and
    # warming ahead of need (`RankGroup.warm`).
    slots: list
    idle: list
    starting: list

    @property
    def world_size(self) -> int: ...

    # --- actors ahead of need ------------------------------------------------------------
    def warm(self, node_id: str, count: int) -> None: ...

    def collect_warm(self, timeout_s: float = 0.0, give_up_s: float = 300.0) -> None: ...

    def actors_on(self, node_id: str) -> int: ...

    def starting_on(self, node_id: str) -> int: ...

    def actor_count(self) -> int: ...

    def drop_spares(self, node_ids: set[str]) -> None: ...

    # --- a layout's life -----------------------------------------------------------------
    def form(
        self, counts_by_node: dict[str, int], timeout_s: float, start_timeout_s: float | None = None
    ) -> None: ...

    def master_endpoint(self, timeout_s: float | None = None) -> tuple[str, int]: ...

    def verify_checkpoint(
        self, uri: str, shares: list[dict[str, dict]], timeout_s: float | None = None
    ) -> list[list[str]]: ...

    def setup(self, specs: list[RankSpec], timeout_s: float | None = None) -> list[dict]: ...

    def start(self) -> None: ...

    def poll(self, timeout_s: float = 30.0) -> list[RankStatus]: ...

    def request_checkpoint_and_stop(
        self, timeout_s: float = 30.0, memory_only: bool = False
    ) -> list[int]: ...

    def teardown(
        self,
        grace_s: float,
        timeout_s: float = 30.0,
        keep_save: bool = True,
        return_s: float = 0.0,
    ) -> list[int]: ...

    def drop(self, ranks: list[int]) -> None: ...

    def shutdown(self) -> None: ...

    def adopt_warm(self) -> int: ...

    def host_data_services(self) -> None: ...

"""What the coordinator uses of a rank group, as a Protocol: `RankGroup` (Ray actors) has it, and
so does the unit tests' fake (`tests/control/fakes.py`); `tests/control/test_group_protocol.py`
checks that both keep to it, method by method and parameter by parameter, so the fake cannot
drift from the real group. The cluster's side is `control.cluster.ClusterView`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

from raytrain_dt.worker.reports import RankStatus

if TYPE_CHECKING:
    from raytrain_dt.worker.spec import RankSpec


class Slot(Protocol):
    """One started actor: where it runs, and its process (for the `resize` event)."""

    node_id: str
    pid: int


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

    def master_endpoint(self) -> tuple[str, int]: ...

    def verify_checkpoint(
        self, uri: str, shares: list[dict[str, dict]], timeout_s: float | None = None
    ) -> list[list[str]]: ...

    def setup(self, specs: list[RankSpec], timeout_s: float | None = None) -> list[dict]: ...

    def start(self) -> None: ...

    def poll(self, timeout_s: float = 30.0) -> list[RankStatus]: ...

    def request_checkpoint_and_stop(self, timeout_s: float = 30.0) -> list[int]: ...

    def teardown(self, grace_s: float, timeout_s: float = 30.0) -> list[int]: ...

    def drop(self, ranks: list[int]) -> None: ...

    def shutdown(self) -> None: ...

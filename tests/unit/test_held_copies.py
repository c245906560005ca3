"""In-memory copies held as tensors (`checkpoint/memory_files.py`, `worker/peer_copies.py`):
a copy staged into one allocation travels as one array, the peer's rebuilt copy owns its
memory (it outlives the sender's buffers), a load from copies returns exactly the staged state,
and the copier's rotating buffer sets never overwrite a copy the store still holds."""

import pickle
from types import SimpleNamespace

import torch

from raytrain_dt.checkpoint.memory_files import (
    CopyReader,
    capture_copy,
    copy_metadata,
    from_wire,
    load_packed,
    to_wire,
)
from raytrain_dt.checkpoint.staging import ReusableStager
from raytrain_dt.worker.peer_copies import CopyStore, PeerCopier


def _state(seed: float) -> dict:
    weight = torch.arange(12, dtype=torch.float32).reshape(4, 3) + seed
    return {
        "model": {"w": weight, "b": torch.full((3,), seed, dtype=torch.bfloat16)},
        "optim": {"state.w.step": torch.tensor(seed), "param_groups.w.lr": 0.1 * seed},
    }


def _copy(state: dict, stager: ReusableStager):
    staged = stager.stage(state)
    return capture_copy(staged, 0, b"rng", copy_metadata(staged, 0))


def _loaded(copy) -> dict:
    target = _state(0.0)
    return load_packed(target, CopyReader([0], lambda owner: copy))


def test_a_copy_travels_as_one_array_and_the_peer_owns_its_memory():
    stager = ReusableStager(one_allocation=True)
    copy = _copy(_state(2.0), stager)
    wire = pickle.loads(pickle.dumps(to_wire(copy), protocol=5))
    assert len(wire["arrays"]) == 1
    held = from_wire(wire)
    _copy(_state(5.0), stager)  # the sender's buffers change (or die): the peer's copy stays
    loaded = _loaded(held)
    expected = _state(2.0)
    assert torch.equal(loaded["model"]["w"], expected["model"]["w"])
    assert torch.equal(loaded["model"]["b"], expected["model"]["b"])
    assert loaded["model"]["b"].dtype == torch.bfloat16
    assert loaded["optim"] == {"state.w.step": torch.tensor(2.0), "param_groups.w.lr": 0.2}
    assert held.rng == b"rng"


class _StagingEngine:
    """`stage_copy` as the FSDP2 engine's, of a state that changes every step."""

    def __init__(self):
        self.state = _state(0.0)

    def stage_copy(self, stager):
        return stager.stage(self.state)


def test_rotating_buffers_never_overwrite_a_held_copy():
    engine, store = _StagingEngine(), CopyStore(keep=2)
    reports = []
    cpu = SimpleNamespace(is_accelerator=False)  # the generators taken: the CPU's alone
    copier = PeerCopier(engine, cpu, 0, 1, 0, store, None, reports.append)
    for step in range(1, 6):
        engine.state = _state(float(step))
        copier.copy(step, None)
        copier.wait()
    assert len(reports) == 5
    for step in (4, 5):  # the newest two, each still its own step's state
        assert _loaded(store.get((1, step, 0)))["optim"]["state.w.step"] == float(step)
    assert store.get((1, 3, 0)) is None
    copier.close()


def _wire(seed: float) -> dict:
    copy = _copy(_state(seed), ReusableStager(one_allocation=True))
    return pickle.loads(pickle.dumps(to_wire(copy), protocol=5))


def test_a_holder_receives_into_the_buffers_of_the_copies_it_let_go_never_a_lent_one():
    store = CopyStore(keep=2)
    for step in (1, 2):
        store.hold((1, step, 0), _wire(float(step)))
    first = store._copies[(1, 1, 0)].owned[0].data_ptr()
    store.hold((1, 3, 0), _wire(3.0))  # lets step 1 go: its buffer becomes a spare
    store.hold((1, 4, 0), _wire(4.0))  # received into step 1's buffer
    assert store._copies[(1, 4, 0)].owned[0].data_ptr() == first
    for step in (3, 4):  # each held copy still its own step's state
        assert torch.equal(
            _loaded(store.get((1, step, 0)))["model"]["w"], _state(step)["model"]["w"]
        )
    # Copies 3 and 4 were handed out, and a load still views them: never written again.
    viewed = [store.get((1, s, 0)) for s in (3, 4)]
    for step in (5, 6, 7):
        store.hold((1, step, 0), _wire(float(step)))
    for step, copy in zip((3, 4), viewed, strict=True):
        assert torch.equal(_loaded(copy)["model"]["w"], _state(step)["model"]["w"])
    assert torch.equal(_loaded(store.get((1, 7, 0)))["model"]["w"], _state(7)["model"]["w"])

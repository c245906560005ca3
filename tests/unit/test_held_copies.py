"""In-memory copies held as tensors (`checkpoint/memory_files.py`, `worker/peer_copies.py`):
a copy staged into one allocation travels as one array, the peer's rebuilt copy owns its
memory (it outlives the sender's buffers), a load from copies returns exactly the staged state,
and the copier's rotating buffer sets never overwrite a copy the store still holds."""

import pickle
from types import SimpleNamespace

import pytest
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


def test_a_load_leaves_the_held_copy_as_it_was_taken():
    """The optimizer steps its 0-dim counts in place after a load: the values a load hands it
    are its own, not the held copy's (a later recovery may load the same copy again)."""
    copy = _copy(_state(2.0), ReusableStager())
    loaded = _loaded(copy)
    loaded["optim"]["state.w.step"].add_(1)  # what AdamW does to its step count
    assert copy.objects["optim.state.w.step"] == torch.tensor(2.0)
    assert _loaded(copy)["optim"]["state.w.step"] == torch.tensor(2.0)


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


class _PeerHandle:
    """A peer actor's `hold_copy` as `PeerCopier._send` calls it, pickled as Ray sends it;
    `fail_at` steps raise (the peer slow or gone)."""

    def __init__(self, store: CopyStore, fail_at: tuple[int, ...] = ()):
        self.store, self.fail_at = store, fail_at
        self.sent: list[tuple[int, bytes]] = []  # (step, the wire as pickled)
        self.hold_copy = SimpleNamespace(options=lambda **_: SimpleNamespace(remote=self._hold))

    def _hold(self, key, wire):
        self.sent.append((key[1], pickle.dumps(wire, protocol=5)))
        if key[1] in self.fail_at:
            raise TimeoutError("peer too slow")
        self.store.hold(key, pickle.loads(self.sent[-1][1]))


def test_a_peer_is_sent_the_layout_once_and_again_after_a_failed_send(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "get", lambda value, timeout=None: value)  # the call is direct
    engine, held = _StagingEngine(), CopyStore(keep=2)
    peer = _PeerHandle(held, fail_at=(3,))
    cpu = SimpleNamespace(is_accelerator=False)
    copier = PeerCopier(engine, cpu, 0, 1, 0, CopyStore(keep=2), None, lambda report: None)
    copier.peer = SimpleNamespace(actor_index=1, handle=peer)
    for step in range(1, 7):
        engine.state = _state(float(step))
        copier.copy(step, None)
        copier.wait()
    carried = [pickle.loads(wire)["layout"] is not None for _, wire in peer.sent]
    # The first copy carries it; the next, staged into other buffers, do not; the failed send
    # of step 3 makes step 4's carry it again.
    assert carried == [True, False, False, True, False, False]
    sizes = [len(wire) for _, wire in peer.sent]
    assert max(sizes[1:3]) < sizes[0] and max(sizes[4:]) < sizes[3]
    for step in (5, 6):  # rebuilt with the layout received before: each step's exact state
        loaded = _loaded(held.get((1, step, 0)))
        assert torch.equal(loaded["model"]["w"], _state(step)["model"]["w"])
        assert loaded["optim"]["state.w.step"] == float(step)
    copier.close()


def test_a_holder_refuses_a_copy_whose_layout_it_never_received():
    stager = ReusableStager(one_allocation=True)
    first = _copy(_state(1.0), stager)
    layout = to_wire(first)["layout"]
    second = capture_copy(stager.stage(_state(2.0)), 0, b"rng", first.metadata)
    wire = pickle.loads(pickle.dumps(to_wire(second, known=layout), protocol=5))
    assert wire["layout"] is None
    with pytest.raises(ValueError, match="without its layout"):
        CopyStore(keep=2).hold((2, 2, 0), wire)

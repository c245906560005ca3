"""Elastic training on the simulated multi-node cluster: failures, lost and added nodes,
preemption notices and hangs, checked against the single-process reference and the ledger.

These tests change the shared cluster's nodes and put it back as they found it.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from reference import check_run_matches_reference, reference_run
from report_checks import check_report

from raytrain_dt.control.coordinator import train
from raytrain_dt.observe.metrics import read_jsonl


def _resizes(result) -> list[dict]:
    return [e for e in read_jsonl(f"{result.run_dir}/events.jsonl") if e["event"] == "resize"]


def test_hung_rank_is_detected_and_the_run_recovers(ray_cluster, make_config):
    cfg = make_config(
        "trainer.steps=6",
        "checkpoint.every_steps=2",
        "elastic.hang_timeout_s=8",
        "chaos=[{at_step: 4, action: hang_rank, target: 1}]",
    )
    result = train(cfg, show_progress=False)
    assert result.final_step == 6
    events = read_jsonl(f"{result.run_dir}/events.jsonl")
    failure = next(e for e in events if e["event"] == "failure")
    assert failure["health"] == "hung"
    metrics = read_jsonl(f"{result.run_dir}/metrics.jsonl")
    ref_losses, _ = reference_run(cfg, 6)
    assert [m["loss"] for m in metrics] == pytest.approx(ref_losses, abs=1e-5)


# Six formations: about 2 minutes alone on this machine, far more when shared.
@pytest.mark.timeout(900)
def test_four_faults_match_an_uninterrupted_run(restore_nodes, make_config):
    """A rank dies (the survivors go on, then grow back onto its replacement), a node dies, a
    node joins, a node is preempted: the run still trains exactly what an uninterrupted one
    would, and logs every resize with both layouts."""
    # The preemption waits for the grown layout (its actors start first), then needs a few
    # steps to drain. Each growth trains on (0.3 s steps) while its new actors start: 10-15
    # steps here, more on a busier host, so the story needs more steps than its last at_step.
    steps = 60
    cfg = make_config(
        f"trainer.steps={steps}",
        "checkpoint.every_steps=5",
        "cluster.num_ranks=null",
        "engine.zero_stage=3",
        "chaos_step_delay_s=0.3",
        "elastic.grow_stable_s=0.5",
        "chaos=[{at_step: 6, action: kill_rank, target: 1},"
        " {at_step: 12, action: kill_node, target: 3},"
        " {at_step: 18, action: add_node, target: 0},"
        " {at_step: 24, action: preempt_node, target: 3}]",
    )
    result = train(cfg, simulated_cluster=restore_nodes, show_progress=False)
    # Six formations over 60 steps, each summing in another order (dp 4, 2, 4, 2, 4, 2 with
    # ZeRO-3): at lr 3e-3 that fp32 rounding grows to ~4e-4 in the loss by the last layouts.
    # A lost, repeated or misplaced step moves it by ~1e-1; the ledger below stays exact.
    metrics = check_run_matches_reference(cfg, result, steps, atol=1e-3)
    events = read_jsonl(f"{result.run_dir}/events.jsonl")
    resizes = _resizes(result)
    sizes = [
        (r["old_layout"]["dims"]["world_size"], r["new_layout"]["dims"]["world_size"])
        for r in resizes
    ]
    # The rank death re-forms at once on all three survivors (dp=3, an uneven batch) and
    # grows back to 4 once the replacement has started; the node loss keeps both survivors
    # of the other node, the arrival grows back to 4 in one resize, the preemption takes it
    # to 2.
    assert sizes == [(4, 3), (3, 4), (4, 2), (2, 4), (4, 2)], sizes
    regrown, lost = 1, 2
    (start,) = [e for e in events if e["event"] == "start"]
    first = start["new_actors"]  # in rank order
    assert [(r["kept_actors"], r["new_actors"]) for r in resizes[:2]] == [
        ([first[0], *first[2:]], []),
        ([first[0], *first[2:]], resizes[1]["new_actors"]),
    ]
    assert len(resizes[1]["new_actors"]) == 1
    failures = [e for e in events if e["event"] == "failure"]
    assert [f["health"] for f in failures] == ["failed", "failed"]
    assert resizes[lost]["time"] > failures[1]["time"] > resizes[regrown]["time"]
    # The node loss keeps exactly the ranks of the full layout that were not on the lost node.
    full = resizes[regrown]
    dead = {full["node_ids"][int(r)] for r, e in failures[1]["ranks"].items() if "Died" in e}
    assert len(dead) == 1 and resizes[lost]["new_actors"] == []
    assert resizes[lost]["pids"] == [
        pid for pid, node in zip(full["pids"], full["node_ids"]) if node not in dead
    ]
    # Growth and preemption checkpoint just in time and lose no step.
    assert [r["lost_steps"] for i, r in enumerate(resizes) if i not in (0, lost)] == [0] * (
        len(resizes) - 2
    )

    # The rank and node faults resume from the newest checkpoint committed before them: step
    # 5's for the rank (it died just after step 5's save, whose every `saved` report the
    # driver collects, late ones at teardown); the node when the driver saw step 12 (or later).
    def committed_before(event: dict) -> int:
        return max(
            e["step"] for e in events if e["event"] == "checkpoint" and e["time"] < event["time"]
        )

    assert failures[0]["step"] == 5 and failures[1]["step"] >= 12
    node_loss = resizes[lost]
    assert [(r["resumed_step"], r["lost_steps"]) for r in (resizes[0], node_loss)] == [
        (5, 0),
        (committed_before(failures[1]), failures[1]["step"] - node_loss["resumed_step"]),
    ]
    assert node_loss["resumed_step"] >= 10
    notice = next(e for e in events if e["event"] == "preemption_notice")
    assert resizes[-1]["resumed_step"] >= notice["step"] >= 24
    # Grown back after the rank death: both nodes; after the node loss: one; grown after the
    # arrival: two; after the preemption: one.
    node_counts = [
        len(set(r["node_ids"])) for r in (resizes[regrown], node_loss, resizes[-2], resizes[-1])
    ]
    assert node_counts == [2, 1, 2, 1]
    # Each layout trained from its resume point on (every step after it at the new size),
    # unless the next fault rewound every step it trained (a fault in its first steps).
    for resize, following in zip(resizes, [*resizes[1:], None]):
        if following is not None and following["resumed_step"] <= resize["resumed_step"]:
            continue
        step_after = metrics[resize["resumed_step"]]
        assert step_after["world_size"] == resize["new_layout"]["dims"]["world_size"]
    # Each resize says where its seconds went.
    for resize in resizes:
        assert {"detection_s", "replan_s", "reform_s", "checkpoint_load_s"} <= set(resize)
    assert result.layout.global_batch == cfg.trainer.global_batch
    check_report(cfg, result.run_dir)  # plots, goodput and summary against these records


@pytest.mark.timeout(600)
def test_a_node_lost_while_re_forming_after_a_rank_death(restore_nodes, make_config):
    """Rank 1 of 4 dies; while the three survivors re-form (placed, not yet set up) the node
    holding two of them dies too. The formation's fault is a failure like the first: it is
    recorded, the node left out, and the run re-forms on the one survivor left, keeping it,
    and trains exactly what an uninterrupted run would."""
    steps = 12
    cfg = make_config(
        f"trainer.steps={steps}",
        "checkpoint.every_steps=5",
        "cluster.num_ranks=null",
        "engine.zero_stage=3",
        "chaos_step_delay_s=0.3",
        "chaos=[{at_step: 6, action: kill_rank, target: 1},"
        " {at_step: 6, action: kill_node, target: 2, at: forming}]",
    )
    result = train(cfg, simulated_cluster=restore_nodes, show_progress=False)
    assert result.final_step == steps
    check_run_matches_reference(cfg, result, steps, atol=1e-5)
    events = read_jsonl(f"{result.run_dir}/events.jsonl")
    (start,) = [e for e in events if e["event"] == "start"]
    first = start["new_actors"]  # in rank order: ranks 0, 1 on one node, 2, 3 on the other
    assert len(first) == 4 and start["kept_actors"] == []
    failures = [e for e in events if e["event"] == "failure"]
    assert [(f["health"], f.get("phase"), f["step"]) for f in failures] == [
        ("failed", None, 5),
        ("failed", "forming", 5),
    ]
    assert failures[1]["lost_nodes"] == [start["node_ids"][2]]
    resizes = _resizes(result)
    # The one survivor of the node loss is kept and trains alone from step 5's checkpoint.
    assert resizes[0]["kept_actors"] == [first[0]] and resizes[0]["new_actors"] == []
    assert resizes[0]["new_layout"]["dims"]["world_size"] == 1
    assert (resizes[0]["resumed_step"], resizes[0]["lost_steps"]) == (5, 0)
    assert resizes[0]["node_ids"] == [start["node_ids"][0]]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("dies_at", ["forming", "joined"])
def test_a_peer_dying_while_the_survivors_join_keeps_every_survivor(
    restore_nodes, make_config, dies_at
):
    """Rank 1 of 4 dies; in the re-formation on the three survivors, rank 2 of the new layout
    dies as it begins joining ("forming": the other two wait in the join for it), or once all
    three have joined ("joined": the other two wait for its address as the process groups
    form, in C++). Their polls and teardown are answered during that set-up and end its wait
    (`worker/rendezvous.py`), so both are kept: the run re-forms on exactly those two actors,
    with no new one, and trains what an uninterrupted run would."""
    steps = 10
    cfg = make_config(
        f"trainer.steps={steps}",
        "checkpoint.every_steps=5",
        "cluster.num_ranks=null",
        "engine.zero_stage=3",
        "chaos_step_delay_s=0.3",
        "chaos=[{at_step: 6, action: kill_rank, target: 1},"
        f" {{at_step: 6, action: kill_rank, target: 2, at: {dies_at}}}]",
    )
    result = train(cfg, simulated_cluster=restore_nodes, show_progress=False)
    assert result.final_step == steps
    check_run_matches_reference(cfg, result, steps, atol=1e-5)
    events = read_jsonl(f"{result.run_dir}/events.jsonl")
    (start,) = [e for e in events if e["event"] == "start"]
    first = start["new_actors"]
    failures = [e for e in events if e["event"] == "failure"]
    assert [(f["health"], f.get("phase"), f["step"]) for f in failures] == [
        ("failed", None, 5),
        ("failed", "forming", 5),
    ]
    assert list(failures[1]["ranks"]) == ["2"]  # only the rank that died joining
    survivors = {first[0], first[2], first[3]}
    resize = _resizes(result)[0]
    assert len(resize["kept_actors"]) == 2 and set(resize["kept_actors"]) < survivors
    assert resize["new_actors"] == []
    assert resize["new_layout"]["dims"]["world_size"] == 2
    assert (resize["resumed_step"], resize["lost_steps"]) == (5, 0)


class SpotNoticeServer(http.server.ThreadingHTTPServer):
    """AWS's `spot/instance-action` on loopback, per simulated node: 404 until `armed` names
    the node, then the notice."""

    armed: str | None = None

    def __init__(self):
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                if server.armed and f"/{server.armed}/" in self.path:
                    body = json.dumps({"action": "terminate", "time": "2026-01-01T00:00:00Z"})
                    self.send_response(200)
                    self.end_headers()
                    self.wfile.write(body.encode())
                else:
                    self.send_error(404)

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


def _when_step(run_dir: Path, step: int, action) -> threading.Thread:
    """Run `action` from another thread once the run has trained `step` steps."""

    def wait_then_act():
        deadline = time.time() + 240
        while time.time() < deadline:
            lines = (
                (run_dir / "metrics.jsonl").read_text().splitlines()
                if (run_dir / "metrics.jsonl").exists()
                else []
            )
            if len(lines) >= step:
                action()
                return
            time.sleep(0.05)

    thread = threading.Thread(target=wait_then_act, daemon=True)
    thread.start()
    return thread


# Ray's own command line (`ray ...`), its arguments read as a JSON list from stdin: its imports
# are done before the arguments arrive.
RAY_CLI_ON_STDIN = """
import json, sys
from ray.scripts.scripts import cli
cli.main(args=json.loads(sys.stdin.readline()), prog_name="ray")
"""


@pytest.mark.timeout(600)
@pytest.mark.parametrize("source", ["sigterm", "spot", "ray-drain"])
def test_real_preemption_notices_lose_no_step(restore_nodes, make_config, source):
    """SIGTERM to a rank, the node's spot notice, `ray drain-node`: each one checkpoints at
    the next step boundary and shrinks away from the node, with no step lost."""
    server = SpotNoticeServer()
    steps = 8
    cfg = make_config(
        # The only periodic checkpoint is the last: the resize resumes from the just-in-time one.
        f"trainer.steps={steps}",
        f"checkpoint.every_steps={steps}",
        "cluster.num_ranks=null",
        "engine.zero_stage=3",
        "chaos_step_delay_s=0.4",
        f"elastic.spot_notice_url=http://127.0.0.1:{server.server_address[1]}"
        "/{node_id}/latest/meta-data/spot/instance-action",
    )
    run_dir = Path(cfg.run.dir)
    target: dict = {}

    def notify():  # aimed at the node of the last rank
        (start,) = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "start"]
        target["node"] = start["node_ids"][-1]
        if source == "sigterm":
            os.kill(start["pids"][-1], signal.SIGTERM)
        elif source == "spot":
            server.armed = target["node"]
        else:
            args = [
                "drain-node",
                f"--address={restore_nodes.address}",
                f"--node-id={target['node']}",
                "--reason=DRAIN_NODE_REASON_PREEMPTION",
                "--reason-message=test",
                "--deadline-remaining-seconds=120",
            ]
            _, stderr = ray_cli.communicate(json.dumps(args) + "\n", timeout=120)
            target["drain"] = subprocess.CompletedProcess(args, ray_cli.returncode, "", stderr)

    # `ray drain-node` in a process that imported Ray's command line before the run: started
    # cold at step 2, the `ray` command took longer on a loaded host than the run's last 6
    # steps (3.4 s), and the drain landed after the run had ended.
    ray_cli = subprocess.Popen(
        [sys.executable, "-c", RAY_CLI_ON_STDIN],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    watcher = _when_step(run_dir, 2, notify)
    try:
        result = train(cfg, simulated_cluster=restore_nodes, show_progress=False)
    finally:
        watcher.join(5)
        server.shutdown()
        if ray_cli.poll() is None:  # not asked to drain (the sigterm and spot cases)
            ray_cli.kill()
            ray_cli.wait()
        if source == "ray-drain":  # a draining node takes no new work: replace it
            for node in restore_nodes.list_all_nodes():
                if node.node_id == target.get("node"):
                    with contextlib.suppress(Exception):  # it may have exited, drained
                        restore_nodes.remove_node(node)
    assert target.get("drain") is None or target["drain"].returncode == 0, target["drain"].stderr
    check_run_matches_reference(cfg, result, steps)
    events = read_jsonl(run_dir / "events.jsonl")
    notices = [e for e in events if e["event"] == "preemption_notice"]
    assert [(n["source"], n["node"]) for n in notices] == [(source, target["node"])]
    (resize,) = _resizes(result)
    assert resize["lost_steps"] == 0 and resize["resumed_step"] >= notices[0]["step"]
    assert resize["new_layout"]["dims"]["world_size"] == 2
    assert target["node"] not in resize["node_ids"]
    assert not any(e["event"] == "failure" for e in events)

"""The simulation report: a summary table on stdout, and JSON, PNG plots and report.md in DIR."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

POLICY_TITLES = {
    "restart": "checkpoint-restart, fixed size (Ray Train / torchrun)",
    "dp_only": "elastic DP-only (torchft-like)",
    "ours": "ours: re-plan + JIT checkpoints",
}
COLUMNS = [  # (key, header, format)
    ("policy", "policy", "{}"),
    ("batch", "batch", "{}"),
    ("goodput", "goodput", "{:.3f}"),
    ("steps", "steps", "{:,}"),
    ("steps_lost", "steps lost", "{:,}"),
    ("down_h", "down h", "{:.1f}"),
    ("degraded_h", "degraded h", "{:.1f}"),
    ("below_best_h", "below best h", "{:.1f}"),
    ("failures", "failures", "{}"),
    ("drains", "JIT saves", "{}"),
    ("spot_usd", "spot $", "{:,.0f}"),
    ("on_demand_usd_same_work", "on-demand $ (same work)", "{:,.0f}"),
    ("spot_saving", "saving", "{:+.0%}"),
]


def table(rows: list[dict]) -> list[str]:
    """A markdown table, also what the CLI prints."""
    lines = ["| " + " | ".join(h for _, h, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        lines.append("| " + " | ".join(f.format(row[k]) for k, _, f in COLUMNS) + " |")
    return lines


def summary(result: dict) -> str:
    head = (
        f"{result['model']} on {result['nodes']} nodes x {result['gpus_per_node']} GPUs, "
        f"{result['days']:g} days ({result['trace']['source']}: {result['trace']['notice']} notices, "
        f"{result['trace']['down']} losses, {result['trace']['up']} arrivals); best layout "
        f"{result['best_layout']} at {result['best_step_s']:.3f} s/step; checkpoint every "
        f"{result['ckpt_every']} steps; in-memory copies every "
        f"{result.get('memory_every', 0)} steps (0: none); batch tolerance "
        f"{result.get('batch_tolerance', 0.0):g}"
    )
    best = ", ".join(
        f"{n} {b['ckpt_every']} steps (goodput {b['goodput']:.3f})"
        for n, b in result["best_interval"].items()
    )
    failed = [f"{r['policy']} stopped: {r['failed']}" for r in result["comparison"] if r["failed"]]
    return "\n".join(
        [
            head,
            *table(result["comparison"]),
            f"best checkpoint interval: {best}",
            *failed,
            f"simulated in {result['sim_wall_s']:.1f} s",
        ]
    )


def _plot_timelines(result: dict, out: Path) -> list[str]:
    names = []
    fig, (ax_work, ax_gpus) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for name, points in result["timelines"].items():
        if not points:
            continue
        t = [p[0] / 86400 for p in points]
        ax_work.plot(t, [p[1] / 1e6 for p in points], label=POLICY_TITLES.get(name, name))
        ax_gpus.step(t, [p[2] for p in points], where="post", label=name, linewidth=0.8)
    ax_work.set_ylabel("samples trained (millions)")
    ax_work.legend(fontsize=8)
    ax_gpus.set_ylabel("GPUs training")
    ax_gpus.set_xlabel("simulated time (days)")
    fig.tight_layout()
    fig.savefig(out / "timeline.png", dpi=110)
    plt.close(fig)
    names.append("timeline.png")
    fig, ax = plt.subplots(figsize=(7, 4))
    for name in result["best_interval"]:
        rows = [r for r in result["sweep"] if r["policy"] == name]
        ax.plot(
            [r["ckpt_every"] for r in rows],
            [r["goodput"] for r in rows],
            marker="o",
            label=POLICY_TITLES.get(name, name),
        )
    ax.set_xscale("log")
    ax.set_xlabel("checkpoint interval (steps)")
    ax.set_ylabel("goodput")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "sweep.png", dpi=110)
    plt.close(fig)
    return [*names, "sweep.png"]


def _markdown(result: dict, images: list[str]) -> str:
    c = result["costs"]
    lines = [
        "# Elasticity at scale, by simulation",
        "",
        summary(result).splitlines()[0] + ".",
        "",
        "Goodput: samples trained and kept, over what the best layout for the whole cluster "
        "trains in the same wall time. Down: no step running (detection, waiting for capacity, "
        "draining, re-forming). Degraded: training slower than the best layout. Spot $: every "
        "alive node's GPU-hours at the spot price; on-demand $: the same work on the best "
        "layout without interruptions at the on-demand price.",
        "",
        *table(result["comparison"]),
        "",
        "## Checkpoint interval sweep",
        "",
        *table(result["sweep"]),
        "",
        "Best interval per policy: "
        + ", ".join(f"{n}: {b['ckpt_every']} steps" for n, b in result["best_interval"].items()),
        "",
        *[f"![{img}]({img})" for img in images],
        "",
        "## Costs assumed (seconds, $/GPU-hour)",
        "",
        ", ".join(f"{k}={v}" for k, v in c.items()),
        "",
        "Checkpoint save/load/stall at the best layout: "
        + ", ".join(f"{k} {v:.2f} s" for k, v in result["checkpoint_s"].items()),
        "",
    ]
    return "\n".join(lines)


def write_report(result: dict, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "simulation.json").write_text(json.dumps(result, indent=1) + "\n")
    images = _plot_timelines(result, out)
    (out / "report.md").write_text(_markdown(result, images))
    return out / "report.md"

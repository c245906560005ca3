"""`raytrain-dt report RUN_DIR`: `report.html` with PNG plots, and the summary as text.

Plots (in RUN_DIR/report/): loss against step and against wall time, tokens/s (and MFU),
the real global batch of each step (smaller than trainer.global_batch while a batch tolerance
lets it drop), world size and layout over time with failures, preemption notices and resizes
marked, and the goodput breakdown defined in `observe/goodput.py`. Everything is read from metrics.jsonl and
events.jsonl, so it works on a finished, failed or running run. `train` renders it at the end;
a failure to render only warns.
"""

from __future__ import annotations

import html
import logging
from dataclasses import dataclass
from pathlib import Path

from raytrain_dt.observe.goodput import summarize
from raytrain_dt.observe.metrics import read_jsonl
from raytrain_dt.topology.layout import Layout

log = logging.getLogger(__name__)

PLOTS = ("loss_vs_step", "loss_vs_time", "tokens_per_s", "global_batch", "world_size", "goodput")
MARKERS = {
    "failure": ("tab:red", "failure"),
    "preemption_notice": ("tab:orange", "preemption"),
    "resize": ("tab:blue", "resize"),
}


@dataclass
class Report:
    html: Path
    plots: dict[str, Path]
    summary: dict


def _figure(name: str, out: Path, draw) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6))
    draw(ax)
    fig.tight_layout()
    path = out / f"{name}.png"
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def _world_size_segments(events: list[dict], t0: float, t_end: float):
    """(start, end, world size, layout text) per formation; 0 while no group runs."""
    points: list[tuple[float, int, str]] = []
    for e in events:
        if e["event"] in ("start", "resize"):
            layout = Layout.from_dict(e["new_layout"])
            points.append((e["time"] - t0, layout.dims.world_size, layout.describe()))
        elif e["event"] == "failure" or (e["event"] == "transition" and e["new"] == "finished"):
            points.append((e["time"] - t0, 0, ""))
    ends = [p[0] for p in points[1:]] + [t_end - t0]
    return [(start, end, size, text) for (start, size, text), end in zip(points, ends)]


def render_report(run_dir: str | Path) -> Report:
    run_dir = Path(run_dir)
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    events = read_jsonl(run_dir / "events.jsonl")
    if not metrics and not events:
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl or events.jsonl to report on")
    summary = summarize(metrics, events)
    sessions = [e["time"] for e in events if e["event"] == "session"]
    t0 = sessions[0] if sessions else min(r["time"] for r in metrics + events)
    t_end = max(r["time"] for r in metrics + events)
    out = run_dir / "report"
    out.mkdir(exist_ok=True)
    steps = [m["step"] for m in metrics]

    def loss_vs_step(ax):
        ax.plot(steps, [m["loss"] for m in metrics], marker=".")
        ax.set(xlabel="step", ylabel="loss", title="Loss against step")

    def loss_vs_time(ax):
        ax.plot([m["time"] - t0 for m in metrics], [m["loss"] for m in metrics], marker=".")
        ax.set(xlabel="wall time (s)", ylabel="loss", title="Loss against wall time")

    def tokens_per_s(ax):
        ax.plot(steps, [m["tokens_per_s"] for m in metrics], marker=".", label="tokens/s")
        ax.set(xlabel="step", ylabel="tokens/s", title="Throughput")
        if any("mfu" in m for m in metrics):
            twin = ax.twinx()
            twin.plot(steps, [100 * m.get("mfu", 0.0) for m in metrics], color="tab:green")
            twin.set_ylabel("MFU (%)", color="tab:green")

    def global_batch(ax):
        rows = [m for m in metrics if "global_batch" in m]  # runs before it was recorded: none
        ax.step([m["step"] for m in rows], [m["global_batch"] for m in rows], where="post")
        ax.set(xlabel="step", ylabel="samples per step", title="Real global batch")
        ax.set_ylim(bottom=0, top=max([m["global_batch"] for m in rows], default=1) * 1.2)

    def world_size(ax):
        names: dict[str, str] = {}  # layout -> letter, in order of first use
        for start, end, size, text in _world_size_segments(events, t0, t_end):
            ax.hlines(size, start, end, colors="black", linewidth=2)
            if text:
                letter = names.setdefault(text, chr(ord("A") + len(names)))
                ax.annotate(
                    letter, (start, size), textcoords="offset points", xytext=(2, 4), fontsize=8
                )
        legend = "\n".join(f"{letter}: {text}" for text, letter in names.items())
        ax.text(0, -0.25, legend, transform=ax.transAxes, fontsize=8, va="top")
        for kind, (color, label) in MARKERS.items():
            times = [e["time"] - t0 for e in events if e["event"] == kind]
            for i, t in enumerate(times):
                ax.axvline(t, color=color, linestyle="--", label=label if i == 0 else None)
        ax.set(xlabel="wall time (s)", ylabel="world size", title="World size and layout")
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0, top=max(summary["world_sizes"], default=1) * 1.3)
        ax.yaxis.get_major_locator().set_params(integer=True)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="lower right", fontsize=8)

    def goodput(ax):
        parts = {
            k: summary[k]
            for k in (
                "productive_s",
                "checkpoint_stall_s",
                "recovery_s",
                "lost_work_s",
                "startup_s",
                "other_s",
            )
        }
        names = [k.removesuffix("_s").replace("_", " ") for k in parts]
        colors = ["tab:green", "tab:orange", "tab:red", "tab:purple", "tab:gray", "silver"]
        bars = ax.barh(names, list(parts.values()), color=colors)
        ax.bar_label(bars, fmt="%.1fs", fontsize=8)
        ax.invert_yaxis()
        ax.set(
            xlabel="seconds",
            title=f"Goodput {100 * summary['goodput']:.1f}% of {summary['wall_s']:.1f}s wall time",
        )

    draw = {
        "loss_vs_step": loss_vs_step,
        "loss_vs_time": loss_vs_time,
        "tokens_per_s": tokens_per_s,
        "global_batch": global_batch,
        "world_size": world_size,
        "goodput": goodput,
    }
    plots = {name: _figure(name, out, draw[name]) for name in PLOTS}
    page = run_dir / "report.html"
    page.write_text(_html(run_dir, summary, events, plots))
    return Report(page, plots, summary)


def summary_rows(summary: dict) -> list[tuple[str, str]]:
    """The summary as (label, value) rows: the terminal table and the page's table."""

    def secs(key: str) -> str:
        share = summary[key] / summary["wall_s"] if summary["wall_s"] else 0.0
        return f"{summary[key]:.2f}s ({100 * share:.1f}%)"

    peak = summary["peak_memory_bytes"]
    mfu = summary["mean_mfu"]
    loss = summary["final_loss"]
    return [
        ("steps", str(summary["steps"])),
        ("final loss", f"{loss:.4f}" if loss is not None else "-"),
        ("wall time", f"{summary['wall_s']:.2f}s"),
        ("goodput", f"{100 * summary['goodput']:.1f}%"),
        ("productive", secs("productive_s")),
        ("checkpoint stall", secs("checkpoint_stall_s")),
        ("recovery", secs("recovery_s")),
        ("lost work", secs("lost_work_s")),
        ("startup", secs("startup_s")),
        ("other", secs("other_s")),
        ("failures", str(summary["failures"])),
        ("preemptions", str(summary["preemptions"])),
        ("resizes", str(summary["resizes"])),
        ("recoveries", str(summary["recoveries"])),
        ("lost steps", str(summary["lost_steps"])),
        ("checkpoints", str(summary["checkpoints"])),
        ("mean tokens/s", f"{summary['mean_tokens_per_s']:.1f}"),
        ("mean MFU", f"{100 * mfu:.2f}%" if mfu is not None else "-"),
        ("peak memory", f"{peak / 2**30:.2f} GiB" if peak is not None else "-"),
        ("world sizes", " -> ".join(map(str, summary["world_sizes"])) or "-"),
    ]


def format_summary(summary: dict) -> str:
    rows = summary_rows(summary)
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


def _html(run_dir: Path, summary: dict, events: list[dict], plots: dict[str, Path]) -> str:
    rows = "".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
        for k, v in summary_rows(summary)
    )
    recoveries = "".join(
        f"<tr><td>{e['step']}</td><td>{html.escape(e['cause'])}</td>"
        f"<td>{e['resumed_step']}</td><td>{e['recovery_s']:.2f}</td><td>{e['lost_steps']}</td>"
        f"<td>{e['lost_work_s']:.2f}</td></tr>"
        for e in events
        if e["event"] == "recovery"
    )
    images = "".join(
        f'<h2>{name.replace("_", " ")}</h2><img src="report/{p.name}">' for name, p in plots.items()
    )
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>raytrain_dt report: "
        f"{html.escape(run_dir.name)}</title><style>body{{font-family:sans-serif;margin:2em}}"
        f"td,th{{padding:2px 10px;text-align:left}}</style></head><body>"
        f"<h1>Run report: {html.escape(str(run_dir))}</h1><table>{rows}</table>"
        f"<h2>Recoveries</h2><table><tr><th>first step</th><th>cause</th><th>resumed at</th>"
        f"<th>recovery s</th><th>lost steps</th><th>lost work s</th></tr>{recoveries}</table>"
        f"{images}<p>Definitions: raytrain_dt/observe/goodput.py and observe/recovery_tracker.py.</p>"
        f"</body></html>"
    )


def report_after_run(run_dir: str | Path) -> Report | None:
    """Render the report at the end of `train`; a failure to render only warns."""
    if not (Path(run_dir) / "events.jsonl").exists():  # the run stopped before it began
        return None
    try:
        report = render_report(run_dir)
    except Exception as exc:
        log.warning(
            "could not render the run report for %s: %s: %s", run_dir, type(exc).__name__, exc
        )
        return None
    print(format_summary(report.summary))
    print(f"report: {report.html}")
    return report

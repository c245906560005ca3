"""Where a host's CPU goes during a window of a benchmark run: every process's CPU seconds,
sampled in the background, integrated between two instants.

`bench_elastic` uses it to split a node arrival's CPU between the joining ranks, the survivors
and Ray itself, and so to bound from below how fast a growth can be on this host: on the
simulated cluster every node shares the same cores.
"""

from __future__ import annotations

import bisect
import threading
import time

import psutil


def _name(proc: psutil.Process) -> str:
    """What a process is: Ray's title for its workers (`ray::RankWorker`), else its command."""
    try:
        words = proc.cmdline()
    except psutil.Error:
        return ""
    return " ".join(words)[:100] if words else proc.name()


class CpuSampler:
    """Samples every process's cumulative CPU time (user + system) every `interval_s`."""

    def __init__(self, interval_s: float = 0.2):
        self.interval_s = interval_s
        self.times: list[float] = []
        self.samples: list[dict[int, float]] = []
        self.names: dict[int, str] = {}  # the name of each process seen
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            snapshot = {}
            # A Ray worker's title changes as it takes work (`ray::IDLE`, `ray::RankWorker`):
            # names are read again every second and the last one kept.
            rename = len(self.samples) % max(1, round(1 / self.interval_s)) == 0
            for proc in psutil.process_iter(["cpu_times"]):
                cpu = proc.info["cpu_times"]
                if cpu is not None:  # gone, or not ours to read
                    snapshot[proc.pid] = cpu.user + cpu.system
                    if rename or proc.pid not in self.names:
                        self.names[proc.pid] = _name(proc) or self.names.get(proc.pid, "?")
            self.times.append(time.time())
            self.samples.append(snapshot)
            self._stop.wait(self.interval_s)

    def _at(self, pid: int, when: float) -> float:
        """The process's cumulative CPU at `when`, interpolated between samples (0 before it
        was first seen; its last value after it was last seen)."""
        i = bisect.bisect_left(self.times, when)
        after = next((j for j in range(i, len(self.times)) if pid in self.samples[j]), None)
        before = next(
            (j for j in range(min(i, len(self.times)) - 1, -1, -1) if pid in self.samples[j]), None
        )
        if before is None:
            return 0.0
        if after is None or self.times[after] == self.times[before]:
            return self.samples[before][pid]
        share = (when - self.times[before]) / (self.times[after] - self.times[before])
        low, high = self.samples[before][pid], self.samples[after][pid]
        return low + min(max(share, 0.0), 1.0) * (high - low)

    def cpu_seconds(self, start: float, end: float) -> dict[int, float]:
        """CPU seconds each process spent between the two epoch instants."""
        pids = {pid for sample in self.samples for pid in sample}
        spent = {pid: self._at(pid, end) - self._at(pid, start) for pid in pids}
        return {pid: s for pid, s in spent.items() if s > 0}

"""How busy the machine was, and with whose work: benchmarks on a shared small machine need to say so.

`CpuMeter` reads /proc/stat (all CPUs) around a run and subtracts the CPU time of our own processes
(the benchmark process, its finished children, a server's process group), giving the share of the
machine that *other* work took while we measured. `wait_quiet` waits until the machine is idle
enough before a run. Linux only; elsewhere both degrade to no-ops.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _machine_jiffies() -> tuple[int, int] | None:
    """(busy, total) jiffies over all CPUs since boot, or None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest is inside user)
    return total - idle, total


def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) used so far by the live processes of process group `pgid`."""
    total = 0
    for name in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        rest = stat[stat.rfind(")") + 2 :].split()  # fields after "pid (comm)", starting at state
        if int(rest[2]) == pgid:  # pgrp
            total += int(rest[11]) + int(rest[12])  # utime, stime
    return total / _TICKS


def _own_cpu_s() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)  # children we have waited for
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


@dataclass
class CpuUsage:
    wall_s: float
    machine_busy: float  # share of all CPUs busy, 0..1
    ours_cpu_s: float
    others_busy: float  # share of all CPUs taken by work that is not ours, 0..1

    def as_dict(self) -> dict:
        return {
            "wall_s": round(self.wall_s, 2),
            "machine_busy": round(self.machine_busy, 3),
            "ours_cpu_s": round(self.ours_cpu_s, 2),
            "others_busy": round(self.others_busy, 3),
        }


def pid_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process `pid` has used so far (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return 0.0
    rest = stat[stat.rfind(")") + 2 :].split()
    return (int(rest[11]) + int(rest[12])) / _TICKS


class CpuMeter:
    """Measure one run: `start()`, run, `stop()`. `pgid`: a server's process group to count as
    ours; `pids`: more processes to count as ours (servers started in our own group)."""

    def __init__(self, pgid: int | None = None, pids: tuple[int, ...] = ()) -> None:
        self.pgid = pgid
        self.pids = pids

    def _ours(self) -> float:
        groups = group_cpu_s(self.pgid) if self.pgid else 0.0
        return _own_cpu_s() + groups + sum(pid_cpu_s(p) for p in self.pids)

    def start(self) -> None:
        self._t0 = time.perf_counter()
        self._m0 = _machine_jiffies()
        self._o0 = self._ours()

    def stop(self) -> CpuUsage:
        wall = time.perf_counter() - self._t0
        m1 = _machine_jiffies()
        ours = self._ours() - self._o0
        if self._m0 is None or m1 is None or m1[1] == self._m0[1]:
            return CpuUsage(wall, 0.0, ours, 0.0)
        busy_j, total_j = m1[0] - self._m0[0], m1[1] - self._m0[1]
        machine_busy = busy_j / total_j
        cpu_capacity_s = total_j / _TICKS  # all CPUs together over the window
        others = max(0.0, busy_j / _TICKS - ours) / cpu_capacity_s if cpu_capacity_s else 0.0
        return CpuUsage(wall, machine_busy, ours, min(1.0, others))


def busy_fraction(window_s: float = 2.0) -> float:
    """Share of all CPUs busy over the next `window_s` seconds (0 off Linux)."""
    a = _machine_jiffies()
    time.sleep(window_s)
    b = _machine_jiffies()
    if a is None or b is None or b[1] == a[1]:
        return 0.0
    return (b[0] - a[0]) / (b[1] - a[1])


def wait_quiet(max_busy: float, timeout_s: float, window_s: float = 3.0) -> tuple[bool, float]:
    """Wait until the machine is at most `max_busy` busy over a `window_s` window, for at most
    `timeout_s`. Returns (was quiet, last busy fraction seen)."""
    deadline = time.monotonic() + timeout_s
    busy = busy_fraction(window_s)
    while busy > max_busy and time.monotonic() < deadline:
        busy = busy_fraction(window_s)
    return busy <= max_busy, busy

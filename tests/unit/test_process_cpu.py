"""benchmarks.process_cpu: core-seconds per process and thread between two /proc snapshots."""

from __future__ import annotations

import os
import threading
import time

from benchmarks.process_cpu import core_seconds, report, snapshot

HZ = os.sysconf("SC_CLK_TCK")


def test_core_seconds_are_tick_differences_per_thread_grouped_by_process():
    before = {"10/10": ["router", "python", 100], "10/11": ["router", "event_engine", 5], "20/20": ["redis", "r", 7]}
    after = {"10/10": ["router", "python", 100 + 2 * HZ], "10/11": ["router", "event_engine", 5],
             "20/20": ["redis", "r", 7 + HZ // 2], "30/31": ["new", "w", HZ]}  # started in between: all of it
    assert core_seconds(before, after) == {("10", "router"): {"python#10": 2.0}, ("20", "redis"): {"r#20": 0.5},
                                           ("30", "new"): {"w#31": 1.0}}


def test_report_lists_the_busiest_process_first_and_totals_everything():
    used = {("20", "redis"): {"r#20": 0.5}, ("10", "router"): {"python#10": 2.0, "event_engine#11": 0.01}}
    lines = report(used, min_s=0.03).splitlines()
    assert "router" in lines[0] and "python#10" in lines[1] and "redis" in lines[2]
    assert not any("event_engine" in line for line in lines)  # below min_s
    assert lines[-1].split()[0] == "2.51"


def test_this_threads_busy_spell_shows_as_its_cpu():
    before = snapshot()
    until = time.monotonic() + 0.3
    while time.monotonic() < until:  # busy on this thread, which is alive at both snapshots
        pass
    used = core_seconds(before, snapshot())
    mine = used[next(key for key in used if key[0] == str(os.getpid()))]
    this_thread = [s for name, s in mine.items() if name.endswith(f"#{threading.get_native_id()}")]
    assert this_thread and this_thread[0] > 0.05

"""CPU time per process and thread between two snapshots of /proc: where a benchmark's cores went.

    python -m benchmarks.process_cpu snap before.json
    ... run the load ...
    python -m benchmarks.process_cpu snap after.json
    python -m benchmarks.process_cpu diff before.json after.json [--min-s 0.03]

`diff` prints each process's core-seconds (user + system) over the interval, largest first, with its
threads (name#tid) beneath; threads that started and ended between the snapshots are not seen.
Python threads share the name "python": `py-spy dump --pid PID` maps their tids to what they run.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict


def snapshot() -> dict[str, list]:
    """{"pid/tid": [command line, thread name, clock ticks]} for every thread on the machine."""
    threads: dict[str, list] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:120]
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    stat = f.read()
                name = stat[stat.index("(") + 1:stat.rindex(")")]
                fields = stat[stat.rindex(")") + 2:].split()
                threads[f"{pid}/{tid}"] = [command, name, int(fields[11]) + int(fields[12])]  # utime + stime
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # ended while we read it
    return threads


def core_seconds(before: dict[str, list], after: dict[str, list]) -> dict[tuple[str, str], dict[str, float]]:
    """{(pid, command): {"name#tid": core-seconds}} over the interval, for threads that used any."""
    ticks_per_s = os.sysconf("SC_CLK_TCK")
    used: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
    for key, (command, name, ticks) in after.items():
        seconds = (ticks - before.get(key, [None, None, 0])[2]) / ticks_per_s
        if seconds > 0:
            pid, tid = key.split("/")
            used[(pid, command)][f"{name}#{tid}"] = seconds
    return used


def report(used: dict[tuple[str, str], dict[str, float]], min_s: float) -> str:
    lines, total = [], 0.0
    for (pid, command), threads in sorted(used.items(), key=lambda item: -sum(item[1].values())):
        process_s = sum(threads.values())
        total += process_s
        if process_s < min_s:
            continue
        lines.append(f"{process_s:7.2f}  {pid:>7} {command[:90]}")
        lines += [f"          {s:6.2f} {name}" for name, s in sorted(threads.items(), key=lambda t: -t[1])
                  if s >= min_s]
    lines.append(f"{total:7.2f}  total core-s")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    snap = commands.add_parser("snap")
    snap.add_argument("out")
    diff = commands.add_parser("diff")
    diff.add_argument("before")
    diff.add_argument("after")
    diff.add_argument("--min-s", type=float, default=0.03)
    args = parser.parse_args()
    if args.command == "snap":
        with open(args.out, "w") as f:
            json.dump(snapshot(), f)
    else:
        with open(args.before) as f, open(args.after) as g:
            print(report(core_seconds(json.load(f), json.load(g)), args.min_s))


if __name__ == "__main__":
    main()

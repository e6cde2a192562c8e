"""Which CPU cores each worker runs on.

A prefill and a decode worker on one machine each default to a torch thread
pool as wide as the machine, so their matmuls preempt each other. `distserve up`
gives each worker its own cores (`split_cores`), passes them as `--cpus`, and
each worker pins itself at start (`apply_cpus`), before torch does parallel work.

A worker may run its serving threads (event loop, gRPC, KV transfers) on other cores than its
forwards (`serving_cpus`): the forward thread pins itself to the worker's cores as it starts
(`pin_compute_thread`), and the OpenMP team it starts inherits them. A forward thread on several
cores binds its team one thread per core (`bind_openmp_team`).

Where prefill workers lend their cores (`distserve up --lend-cores`), the decode worker and the control
plane run at a lower CPU priority (`lower_priority`), so the kernel hands a prefill thread the core
whenever it wants it.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Iterable

from distserve.config import ConfigError

log = logging.getLogger(__name__)

_compute_cpus: list[int] | None = None  # where forwards run, when serving threads run elsewhere
AUTOGROUP_PATH = "/proc/self/autogroup"


def parse_cpu_list(text: str, field: str = "cpus") -> list[int]:
    """Parses a Linux CPU list such as "0", "2-3" or "0,2-3" into sorted core ids.

    Raises ConfigError (a ValueError) whose message starts with `field`.
    """
    cpus: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not (first.isdigit() and (not dash or last.isdigit())):
            raise ConfigError(f"{field}: expected core ids like 0, 2-3 or 0,2-3; got {text!r}")
        low, high = int(first), int(last) if dash else int(first)
        if low > high:
            raise ConfigError(f"{field}: range {part.strip()!r} runs backwards")
        cpus.update(range(low, high + 1))
    return sorted(cpus)


def format_cpu_list(cpus: list[int]) -> str:
    """The inverse of parse_cpu_list: [0, 2, 3] -> "0,2,3"."""
    return ",".join(str(cpu) for cpu in cpus)


def split_cores(available: list[int], num_prefill: int, num_decode: int, num_colocated: int = 0) -> list[list[int]]:
    """Assigns cores to N = num_prefill + num_decode + num_colocated workers, in the order prefill-0..,
    decode-0.., then colocated-0...

    With at least as many cores as workers, every worker gets its own contiguous,
    disjoint run of `available` (in the order given): each gets len(available) // N
    cores and the first len(available) % N workers one more, so spare cores go to
    prefill workers first (prefill is compute-bound and gains most from threads).
    No two workers share a core. 2 cores, 1+1: [[0], [1]]; 4 cores, 1+1: [[0, 1], [2, 3]].

    With fewer cores than workers, worker i gets the single core available[i % len(available)]
    (round-robin) and a warning is logged, since workers on one core slow each other down.
    2 cores, 2+2: [[0], [1], [0], [1]].
    """
    num_workers = num_prefill + num_decode + num_colocated
    if num_workers == 0:
        return []
    if not available:
        raise ConfigError("cpus: no cores to split")
    if num_workers <= len(available):
        share, extra = divmod(len(available), num_workers)
        split, start = [], 0
        for i in range(num_workers):
            end = start + share + (1 if i < extra else 0)
            split.append(list(available[start:end]))
            start = end
        return split
    log.warning("%d workers but only %d cores %s: workers share cores round-robin and will slow each other "
                "down; start fewer workers or give more cores (--cpus)", num_workers, len(available), available)
    return [[available[i % len(available)]] for i in range(num_workers)]


def pin_process(cpus: list[int]) -> None:
    """Pins every thread of this process to `cpus` and sizes torch's thread pools to match.

    Call before torch does any parallel work: the inter-op pool can only be sized
    before its first use (after that it is left as it is). Raises ConfigError naming
    `cpus` when any of the cores is not one this process may run on.
    """
    import torch  # here, so that planning cores (the launcher) does not load torch

    pinned = _pin_threads(cpus, "cpus")
    torch.set_num_threads(len(pinned))
    try:
        torch.set_num_interop_threads(1)  # inference runs one graph at a time
    except RuntimeError:  # already sized, or parallel work already started
        pass


def _pin_threads(cpus: list[int], field: str) -> list[int]:
    """Pins every thread of this process to `cpus`; returns the cores it got. Raises ConfigError naming
    `field` when any of the cores is not one this process may run on."""
    allowed = sorted(os.sched_getaffinity(0))
    for thread_id in _thread_ids():
        try:
            os.sched_setaffinity(thread_id, cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        except OSError as exc:
            raise ConfigError(f"{field}: cannot pin to cores {cpus} (this process may use {allowed}): {exc}") from exc
    # The kernel silently drops cores outside the cgroup's cpuset; asking for them is a mistake.
    pinned = sorted(os.sched_getaffinity(0))
    if set(pinned) != set(cpus):
        raise ConfigError(f"{field}: cores {sorted(set(cpus) - set(pinned))} are not available (got {pinned})")
    return pinned


def apply_cpus(text: str, serving_text: str = "") -> list[int]:
    """A worker's start-up step: pins to the cores in `text` (a --cpus value), or with "" stays on the
    current affinity mask; either way torch gets one thread per core. Returns the cores.

    With `serving_text` (a --serving-cpus value) the threads running now, and those they start later,
    move to those cores; forwards stay on `text`'s (see pin_compute_thread)."""
    import torch

    global _compute_cpus
    if text:
        cpus = parse_cpu_list(text)
        pin_process(cpus)
        log.info("pinned to cores %s, torch threads %d", cpus, torch.get_num_threads())
    else:
        cpus = sorted(os.sched_getaffinity(0))
        torch.set_num_threads(len(cpus))
        log.info("not pinned: cores %s, torch threads %d", cpus, torch.get_num_threads())
    if serving_text:
        serving = _pin_threads(parse_cpu_list(serving_text, "serving_cpus"), "serving_cpus")
        _compute_cpus = cpus
        log.info("serving threads on cores %s, forwards on %s", serving, cpus)
    return cpus


def pin_compute_thread() -> None:
    """Run on a forward thread as it starts: back on the worker's cores when its serving threads run
    elsewhere (apply_cpus with serving cores); otherwise it already is."""
    if _compute_cpus is not None:
        os.sched_setaffinity(0, _compute_cpus)


def bind_openmp_team() -> list[int]:
    """Run on a forward thread as it starts: starts its OpenMP team, then binds the thread to its first
    core and each team thread to one of the others. Returns the team's thread ids (this one first; just
    this one on one core).

    Unbound, the kernel puts a team thread that wakes while the worker's other cores are busy (decode
    steps on cores lent to prefill) beside the forward thread on its core instead, where the two take
    turns, and a statically split parallel loop waits for the slower: a 256-token bf16 prefill on two
    cores took as long as on one (64 ms) until bound (48 ms). Bound, each waits for its own core.
    """
    import torch

    me, cpus = threading.get_native_id(), sorted(os.sched_getaffinity(0))
    if len(cpus) < 2 or torch.get_num_threads() < 2:
        return [me]
    before = set(_thread_ids())
    torch.ones(1 << 20).add_(1.0)  # a parallel loop: libgomp starts this thread's team, kept for later ones
    name = _thread_name(me)
    team = sorted(t for t in set(_thread_ids()) - before if _thread_name(t) == name)  # named after their creator
    team_cores = {thread_id: cpus[1 + index % (len(cpus) - 1)] for index, thread_id in enumerate(team)}
    os.sched_setaffinity(me, [cpus[0]])
    for thread_id, core in team_cores.items():
        os.sched_setaffinity(thread_id, [core])
    log.info("forward thread %d on core %d, its OpenMP threads on %s", me, cpus[0], team_cores)
    return [me, *team]


def session_group_nice(path: str | None = None) -> int | None:
    """The nice value of the session group (autogroup) that `path` (a /proc/<pid>/autogroup file; this
    process's by default) describes, or None where there is none: no such file (a kernel without
    autogroups), or an empty one (the process is in the root group, as init's session is in a container;
    it has no nice of its own)."""
    try:
        with open(path or AUTOGROUP_PATH) as autogroup:
            fields = autogroup.read().split()  # "/autogroup-318 nice 0"
    except FileNotFoundError:
        return None
    return int(fields[-1]) if fields else None


def lower_priority(nice: int) -> str | None:
    """Lowers this process's CPU priority by `nice` (0-19): every thread's nice value (threads started
    later inherit it), and, where the kernel shares the CPU between sessions first (autogroup) and this
    process leads its own session (as `distserve up` starts every child), its session's group too:
    there a thread's nice weighs only against threads of the same session.

    Returns why the session's group could not be lowered (None: it was, or there is none to lower).
    Logs nothing: the launcher also calls it in a child between fork and exec, where a logging lock
    held by another of the launcher's threads would never be released."""
    if not nice:
        return None
    for thread_id in _thread_ids():
        try:
            os.setpriority(os.PRIO_PROCESS, thread_id, os.getpriority(os.PRIO_PROCESS, thread_id) + nice)
        except ProcessLookupError:  # the thread ended meanwhile
            continue
    if os.getsid(0) != os.getpid():
        return None
    try:
        group_nice = session_group_nice()
        if group_nice is not None:
            with open(AUTOGROUP_PATH, "w") as autogroup:
                autogroup.write(str(min(group_nice + nice, 19)))
    except (OSError, ValueError) as exc:  # e.g. a read-only /proc in a container: thread priorities still apply
        return f"{AUTOGROUP_PATH}: {exc}"
    return None


def _thread_name(thread_id: int) -> str:
    try:
        with open(f"/proc/self/task/{thread_id}/comm") as comm:
            return comm.read().strip()
    except OSError:
        return ""


def _thread_ids() -> list[int]:
    """Ids of this process's threads (sched_setaffinity(0) would pin only the calling one)."""
    try:
        return [int(name) for name in os.listdir("/proc/self/task")]
    except FileNotFoundError:
        return [0]


def process_tree(pids: Iterable[int]) -> list[int]:
    """These processes and all their descendants (from each process's parent in /proc/<pid>/stat)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as stat:
                ppid = int(stat.read().rsplit(")", 1)[1].split()[1])  # after "(comm)": state, ppid
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(name))
    tree, todo = [], list(pids)
    while todo:
        pid = todo.pop()
        if pid not in tree:
            tree.append(pid)
            todo += children.get(pid, [])
    return tree


def threads_elsewhere(pids: Iterable[int], cpus: list[int]) -> bool:
    """Whether a thread of these processes may run on a core outside `cpus` (gone ones are skipped)."""
    wanted = set(cpus)
    for pid in pids:
        try:
            thread_ids = [int(name) for name in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for thread_id in thread_ids:
            try:
                if os.sched_getaffinity(thread_id) != wanted:
                    return True
            except OSError:
                pass
    return False


def move_threads(pids: Iterable[int], cpus: list[int]) -> None:
    """Sets every thread of each of these (other) processes to run on `cpus`; threads started later
    inherit their creator's cores. Processes and threads that are gone meanwhile are skipped."""
    for pid in pids:
        try:
            thread_ids = [int(name) for name in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for thread_id in thread_ids:
            try:
                os.sched_setaffinity(thread_id, cpus)
            except OSError:  # the thread ended (ESRCH) meanwhile
                pass

"""The control plane's cores follow the load, on a machine with no core to spare for it.

With every core given to a worker, `distserve up` pins the router, gateway, kvbroker and Redis to the
decode workers' cores (launcher.plan_control_cpus): a prompt's TTFT is one forward on the prefill
core, stretched by whatever else runs there, while a decode batch absorbs an interruption across all
its sequences. Under a burst that trade inverts: spilling workers prefill and decode on every core,
and a control plane held on one of them slows that core's share of the work (docs/goodput.md, Spilling:
bf16 rate inf with spilling, control plane pinned / floating, 470 and 538 / 685 and 599 tok/s). So while
a router marks itself spilling, or the registry shows the pairs saturated (distserve.spill_policy, on
the workers' reported load) or spilled requests still under way, the control plane may run on every
core; then it goes back.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import redis

from distserve.cpus import move_threads
from distserve.record_signing import RecordSigner
from distserve.registry import SPILLING_KEY, WorkerRecord, lists_now
from distserve.spill_policy import SpillPolicy

log = logging.getLogger(__name__)


def every_core_busy(client: redis.Redis, policy: SpillPolicy, signer: RecordSigner | None = None) -> bool:
    """Whether a router is spilling (its mark in the registry), or the registry's reports show the pairs
    saturated (SpillPolicy on the least-loaded prefill and decode workers) or spilled work still under
    way: a prefill worker decoding, or a decode worker prefilling, whole requests of its own (their
    spill-only records). False without a pair. signer: checks the records (lists_now)."""
    spilling, workers = lists_now(client, ("prefill", "decode", "colocated"), signer)
    # a router spilled within the last second: the quickest sign
    return spilling or workers_show_every_core_busy(workers, policy)


def workers_show_every_core_busy(workers: dict[str, list[WorkerRecord]], policy: SpillPolicy) -> bool:
    """every_core_busy's reading of the workers' reports (role -> records), without the spilling mark."""
    prefill, decode = workers["prefill"], workers["decode"]
    if not prefill or not decode:
        return False
    queued = min(w.load.get("outstanding_tokens", 0) for w in prefill)
    running = min(w.load.get("num_running", 0) + w.load.get("num_waiting", 0) for w in decode)
    prefill_ids, decode_ids = {w.worker_id for w in prefill}, {w.worker_id for w in decode}
    spilled = any((w.worker_id in prefill_ids and w.load.get("num_running", 0))
                  or (w.worker_id in decode_ids and w.load.get("outstanding_tokens", 0))
                  for w in workers["colocated"] if w.load.get("spill_only"))
    return spilled or policy.saturated(queued, running)


class ControlPlacement:
    """A thread that keeps the control plane on `own` cores and lets it use `every` core while
    every_core_busy: the routers' spilling mark is read every interval_s (one round trip), the workers'
    reports every records_interval_s (they change once per heartbeat; reading and verifying them ten
    times a second cost the launcher ~15 ms of CPU a second, on a worker's core)."""

    def __init__(self, redis_url: str, pids: Callable[[], list[int]], own: list[int], every: list[int],
                 policy: SpillPolicy, interval_s: float = 0.1, signer: RecordSigner | None = None,
                 records_interval_s: float = 1.0, clock: Callable[[], float] = time.monotonic):
        """signer: checks the registry's records with the workers' key (default: this process's)."""
        self._client = redis.Redis.from_url(redis_url, socket_timeout=2.0)
        self._signer = signer
        self._pids = pids
        self._own, self._every = own, every
        self._policy = policy
        self._interval_s = interval_s
        self._records_interval_s = records_interval_s
        self._clock = clock
        self._records_read_at = float("-inf")
        self._workers_busy = False  # what the last read of the workers' reports showed
        self.floating = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="control-placement", daemon=True)

    def start(self) -> "ControlPlacement":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._client.close()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.check()
            except (redis.RedisError, OSError) as exc:  # Redis restarting: keep the placement as it is
                log.debug("control placement check failed: %s", exc)

    def check(self) -> None:
        """Moves the control plane when every_core_busy changed since the last check."""
        now = self._clock()
        if now - self._records_read_at >= self._records_interval_s:
            spilling, workers = lists_now(self._client, ("prefill", "decode", "colocated"), self._signer)
            self._workers_busy = workers_show_every_core_busy(workers, self._policy)
            self._records_read_at = now
        else:
            spilling = bool(self._client.exists(SPILLING_KEY))
        busy = spilling or self._workers_busy
        if busy != self.floating:
            move_threads(self._pids(), self._every if busy else self._own)
            self.floating = busy
            log.info("control plane -> %s (%s)", self._every if busy else self._own,
                     "every core busy" if busy else "pairs have room")

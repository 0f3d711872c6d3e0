"""The controller's goodput accounting of finished jobs, for its metrics and the goodput SLO.

Every `goodput.interval_s` (on a thread of its own, never on the report path or in the control
round) the accountant looks at the jobs gathered under `goodput.directory`
(healthd.controller.goodput_gather). A job whose log has not grown for `settle_s` is looked up in
Slurm: its partition and account are remembered, and once Slurm says it has ended (or no longer
knows it) its log is joined with the ledger's requeues and incidents and accounted
(healthd.goodput). The result is one row of `<directory>/accounted.sqlite`; a job whose log grows
again later (a requeue after its end) is accounted again and its row replaced.

The metrics are the sums of those rows (`GoodputFigures`): GPU-seconds by partition and category,
the interruption cost by partition and cause, jobs by partition, and each partition's objective. They
are counters, which only grow: a job accounted again adds what grew, and what shrank (all of its old
account when its partition changed) is added to a `*_retracted` counter instead, so total - retracted
is always the sum over the jobs' latest accounts. Prometheus's `rate` of that difference is the GPU
time of the jobs that ended in a window; prometheus/healthd-alerts.yml turns it into the error
budget's burn rate and the ETTR. Two gauges, the worst sliding-window ETTR and the longest
unproductive stretch of the jobs accounted in the last 30 days, are read from the rows themselves.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from healthd import goodput
from healthd.controller import goodput_ledger
from healthd.controller.goodput_gather import job_parts, read_parts
from healthd.controller.ledger.accounted import ACCOUNTED_NAME, RETRACTED, AccountedStore
from healthd.controller.metrics import GoodputFigures
from healthd.goodput_categories import CATEGORIES
from healthd.slurm.backend import JobInfo, JobRun, SlurmBackend, SlurmError

_log = logging.getLogger("healthd.controller")

ENDED_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL",
                          "DEADLINE", "OUT_OF_MEMORY"})
"""Slurm job states after which a job runs no more (a requeued job is PENDING or REQUEUED again)."""
UNKNOWN = "unknown"
"""The partition (or account) of a job Slurm had forgotten before the accountant first asked."""
LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9:._-]{0,63}")
MAX_CAUSES = 64
"""Distinct `cause` label values exported; the rest are summed as `other` (a bounded label set)."""
MAX_LOG_BYTES = 64 * 1024 * 1024
GATHERED_NAME = "goodput-gathered"
"""The default directory of the gathered logs, beside the ledger."""
ETTR_RECENT_S = 30 * 86400.0
"""The jobs whose worst window and longest unproductive stretch the gauges take: those accounted this
recently (an SLO period)."""
FORGOTTEN_S = 86400.0
"""A job neither Slurm's accounting nor slurmctld knows is accounted from its log alone once its log
has not grown for this long."""


@dataclass(frozen=True)
class GoodputSettings:
    """Goodput at the controller: the gathered logs, the accounting of ended jobs and the SLO."""

    enabled: bool = True
    """false: the controller takes no goodput logs (POST /v1/goodput is answered 404), accounts no
    job and exports no goodput metrics."""
    directory: str | None = None
    """Where the agents' goodput logs are gathered (`<job>/<node>.jsonl`) and the accounted jobs kept;
    None: `goodput-gathered` beside the ledger (/var/lib/healthd/goodput-gathered by default)."""
    max_log_bytes: int = MAX_LOG_BYTES
    """One node's part of one job's log stops growing here (a shipment past it is refused)."""
    interval_s: float = 60.0
    """How often the accountant looks for jobs that ended."""
    settle_s: float = 120.0
    """A job's log must not have grown for this long before it is accounted (the epilog's run end
    arrives after the job ends). Keep it under Slurm's MinJobAge (300 s by default), so the job's
    partition and account are read while slurmctld still holds it."""
    objective: float = 0.9
    """The goodput objective of every partition not in `objectives`: the share of held GPU time
    that should be productive. The error budget is 1 - objective."""
    objectives: Mapping[str, float] = field(default_factory=dict)
    """partition -> its own objective."""
    keep_days: float = 90.0
    """A job's gathered log and its row are deleted this long after it was accounted."""
    ettr_window_s: float = goodput.ETTR_WINDOW_S
    """The sliding window of the effective training time ratio, in held wall time: each job's lowest
    ETTR over any window this long is kept with its account (the whole job when it held less)."""
    sacct: bool = True
    """Read each job's runs from Slurm's accounting (`sacct --duplicates`) where the site runs
    slurmdbd: their starts, ends, end states, GPUs, partition and account replace the log's own. Where
    sacct says accounting is disabled, the log's runs and squeue are used."""
    admin_comment: bool = True
    """With Slurm's accounting, write `healthd: goodput=...` to the ended job's AdminComment
    (`sacctmgr modify job`), only when it is empty or healthd's own; not in --dry-run."""

    def at(self, ledger: str) -> GoodputSettings | None:
        """These settings with the directory resolved for a controller whose ledger is `ledger`; None
        when goodput is not enabled."""
        if not self.enabled:
            return None
        return dataclasses.replace(self, directory=self.directory or os.path.join(os.path.dirname(ledger),
                                                                                  GATHERED_NAME))

    def objective_of(self, partition: str) -> float:
        return self.objectives.get(partition, self.objective)


def label(value: str | None) -> str:
    """A partition, account or cause as a label value: itself when it looks like one, else `other`."""
    return value if value and LABEL.fullmatch(value) else ("other" if value else UNKNOWN)


class AccountedJobs(AccountedStore):
    """`<directory>/accounted.sqlite`: one row per job (its partition as soon as it is known, its
    account once it ended) and the running totals the metrics export. Used by one thread."""

    def accounted(self, job: str, partition: str, account: str, at: float, last_write: float,
                  acc: goodput.Account, window_s: float = goodput.ETTR_WINDOW_S) -> None:
        """Record the job's account and change the totals by what changed: the first time, all of it;
        when it is accounted again in the same partition, what grew is added and what shrank is
        retracted; in another partition, all of the old account is retracted from its partition (its
        job too) and all of the new one added to the new partition."""
        cost: dict[str, float] = {}
        for inc in acc.incidents:
            cost[inc.cause] = cost.get(inc.cause, 0.0) + inc.cost_gpu_s
        before = self.last_account(job)
        new = {"jobs": {"": 1.0}, "gpu_s": dict(acc.gpu_s), "cost": cost}
        part = label(partition)
        adds: list[tuple[str, str, str, float]] = []
        if before is not None and label(before[0]) != part:
            old_part, old = label(before[0]), {"jobs": {"": 1.0}, "gpu_s": before[1], "cost": before[2]}
            adds += [(old_part, kind + RETRACTED, key, v) for kind, values in old.items() for key, v in values.items()]
            before = None
        old = {"jobs": {"": 1.0}, "gpu_s": before[1], "cost": before[2]} if before is not None else {}
        for kind, values in new.items():
            was = old.get(kind, {})
            for key in sorted(set(values) | set(was)):
                d = values.get(key, 0.0) - was.get(key, 0.0)
                adds.append((part, kind, key, d) if d > 0 else (part, kind + RETRACTED, key, -d))
        e = goodput.ettr(acc, window_s)
        self.record_account(job, partition, account, at, last_write, acc.held_gpu_s, acc.gpu_s, cost, acc.problems,
                            adds, e.window_min, e.longest_unproductive_s)

    def figures(self, settings: GoodputSettings, now: float | None = None) -> GoodputFigures:
        """The totals as the metrics export them, and the gauges over the jobs accounted since
        `now - ETTR_RECENT_S` (`now`: the clock's time when not given)."""
        now = time.time() if now is None else now
        sums: dict[str, dict[tuple[str, str], float]] = {}
        for partition, kind, key, value in self.totals():
            if kind in ("gpu_s", "gpu_s" + RETRACTED) and key not in CATEGORIES:
                continue
            if kind in ("cost", "cost" + RETRACTED):
                key = label(key)
            into = sums.setdefault(kind, {})
            into[(partition, key)] = into.get((partition, key), 0.0) + value
        jobs = {p: int(v) for (p, _), v in sums.get("jobs", {}).items()}
        jobs_back = {p: int(v) for (p, _), v in sums.get("jobs" + RETRACTED, {}).items()}
        # every series from its partition's first job on, at 0 until it moves: a counter that first
        # appears at a value hides that first increase from rate()
        gpu_s, gpu_back = sums.get("gpu_s", {}), sums.get("gpu_s" + RETRACTED, {})
        for part in jobs:
            jobs_back.setdefault(part, 0)
            for c in CATEGORIES:
                gpu_s.setdefault((part, c), 0.0)
                gpu_back.setdefault((part, c), 0.0)
        weight: dict[str, float] = {}
        for (_, cause), v in sums.get("cost", {}).items():
            weight[cause] = weight.get(cause, 0.0) + v
        kept = set(sorted(weight, key=lambda c: (-weight[c], c))[:MAX_CAUSES])

        def bounded(values: Mapping[tuple[str, str], float]) -> dict[tuple[str, str], float]:
            out: dict[tuple[str, str], float] = {}
            for (part, cause), v in values.items():
                k = (part, cause if cause in kept else "other")
                out[k] = out.get(k, 0.0) + v
            return out

        cost, cost_back = bounded(sums.get("cost", {})), bounded(sums.get("cost" + RETRACTED, {}))
        for k in cost:
            cost_back.setdefault(k, 0.0)
        worst: dict[str, float] = {}
        longest: dict[str, float] = {}
        for row in self.accounted_since(now - ETTR_RECENT_S):
            part = label(row.partition)
            if row.window_min is not None:
                worst[part] = min(worst.get(part, 1.0), row.window_min)
            if row.longest_unproductive_s is not None:
                longest[part] = max(longest.get(part, 0.0), row.longest_unproductive_s)
        partitions = set(jobs) | {label(p) for p in settings.objectives}
        return GoodputFigures(gpu_s, cost, jobs, {p: settings.objective_of(p) for p in sorted(partitions)},
                              gpu_back, cost_back, jobs_back, worst, longest)


def _newest_write(directory: str) -> float:
    return max((os.stat(p).st_mtime for p in job_parts(directory)), default=0.0)


class GoodputAccountant:
    """Accounts the ended jobs under `settings.directory` (module doc). `publish` receives the
    figures after each pass."""

    def __init__(self, settings: GoodputSettings, backend: SlurmBackend, ledger_path: str,
                 publish: Callable[[GoodputFigures], None], clock: Callable[[], float] = time.time):
        assert settings.directory is not None
        self.settings = settings
        self.backend = backend
        self.ledger_path = ledger_path
        self.publish = publish
        self.clock = clock
        os.makedirs(settings.directory, mode=0o750, exist_ok=True)
        self.jobs = AccountedJobs(os.path.join(settings.directory, ACCOUNTED_NAME))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._no_accounting = False

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="healthd-goodput", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10.0)
        self.jobs.close()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.pass_once()
            except Exception:  # a bad pass must not end the accounting for the daemon's lifetime
                _log.exception("goodput accounting pass failed")
            self._stop.wait(self.settings.interval_s)

    def pass_once(self) -> list[str]:
        """One look at every gathered job; returns the jobs accounted in it."""
        now = self.clock()
        directory = self.settings.directory
        assert directory is not None
        known = self.jobs.known()
        done: list[str] = []
        requeues: goodput_ledger.Requeues | None = None
        requeues_read = False
        for name in sorted(os.listdir(directory)):
            path = os.path.join(directory, name)
            if not os.path.isdir(path) or os.path.islink(path):
                continue
            try:
                last_write = _newest_write(path)
            except OSError:
                continue
            row = known.get(name)
            if row is not None and row[2] is not None:
                if row[3] is not None and last_write <= row[3]:
                    if now - row[2] > self.settings.keep_days * 86400:
                        self._delete(name, path)
                    continue
            if now - last_write < self.settings.settle_s:
                continue
            partition, account = (row[0], row[1]) if row is not None else (UNKNOWN, UNKNOWN)
            try:
                runs = self._runs(name)
                # no accounting, or none of this job yet (slurmdbd behind): ask slurmctld
                info = self.backend.job(name) if not runs else None
            except (SlurmError, ValueError) as exc:
                _log.debug("goodput: job %s not looked up: %s", name, exc)
                continue
            if runs:
                last = runs[-1]
                partition, account = last.partition or partition, last.account or account
                self.jobs.seen(name, partition, account)
                if _state(last.state) not in ENDED_STATES:
                    continue  # running, or requeued and waiting to start again
            elif info is not None:
                partition, account = info.partition or partition, info.account or account
                self.jobs.seen(name, partition, account)
                if not _ended(info):
                    continue
            elif runs == [] and now - last_write < FORGOTTEN_S:
                continue  # neither accounting nor slurmctld knows it yet (slurmdbd behind)
            if not requeues_read:
                requeues, requeues_read = goodput_ledger.ledger_requeues(self.ledger_path), True
            try:
                log = read_parts(job_parts(path), name, self.settings.max_log_bytes)
            except OSError as exc:
                _log.warning("goodput: job %s's log not read: %s", name, exc)
                continue
            log, _ = goodput_ledger.joined(log, requeues)
            if runs:
                log = goodput.with_runs(log, [goodput.SlurmRun(r.start, r.end, _state(r.state), r.gpus)
                                              for r in runs if r.start is not None])
            acc = goodput.account(log)
            self.jobs.accounted(name, partition, account, now, last_write, acc, self.settings.ettr_window_s)
            done.append(name)
            if runs and self.settings.admin_comment:
                self._comment(name, runs[-1], acc)
            _log.info("goodput: job %s (partition %s) accounted: %s of %.2f GPU-h%s", name, partition,
                      "-" if acc.goodput is None else f"{acc.goodput:.1%}", acc.held_gpu_s / 3600,
                      " (partial)" if acc.partial else "")
        # every pass, not only one that accounted a job: the gauges drop the jobs accounted too long ago
        self.publish(self.jobs.figures(self.settings, now))
        return done

    def _runs(self, job: str) -> list[JobRun] | None:
        """The job's runs from sacct; None without Slurm accounting (asked once: a site that starts
        slurmdbd restarts the controller with its new slurm.conf)."""
        if not self.settings.sacct or self._no_accounting:
            return None
        runs = self.backend.job_runs(job)
        if runs is None:
            self._no_accounting = True
            _log.info("goodput: Slurm keeps no job accounting here (sacct); runs are read from the logs")
        return runs

    def _comment(self, job: str, last: JobRun, acc: goodput.Account) -> None:
        """`healthd: goodput=...` in the job's AdminComment, unless it holds someone else's text."""
        if acc.goodput is None:
            return
        if last.admin_comment and not last.admin_comment.startswith(ADMIN_COMMENT_PREFIX):
            _log.info("goodput: job %s's AdminComment is not healthd's; left as it is", job)
            return
        text = admin_comment(acc)
        if text == last.admin_comment:
            return
        try:
            self.backend.set_admin_comment(job, text)
        except (SlurmError, ValueError) as exc:
            _log.warning("goodput: job %s's AdminComment not written: %s", job, exc)

    def _delete(self, job: str, path: str) -> None:
        try:
            for part in os.listdir(path):
                os.unlink(os.path.join(path, part))
            os.rmdir(path)
        except OSError as exc:
            _log.warning("goodput: job %s's gathered log not deleted: %s", job, exc)
            return
        self.jobs.forget(job)


def _state(state: str) -> str:
    return state.split()[0].rstrip("+") if state.strip() else ""


def _ended(info: JobInfo) -> bool:
    return _state(info.state) in ENDED_STATES


ADMIN_COMMENT_PREFIX = "healthd:"


def admin_comment(acc: goodput.Account) -> str:
    """The job's one line for `sacct -o AdminComment` (pure): its goodput of the GPU time its runs
    held (allocated; the time it waited in the queue between runs is not held)."""
    share = "-" if acc.goodput is None else f"{acc.goodput:.1%}"
    return (f"{ADMIN_COMMENT_PREFIX} goodput={share} of {acc.held_gpu_s / 3600:.2f} GPU-h held, {acc.runs} run(s), "
            f"{acc.interruptions} interruption(s)" + (" (partial)" if acc.partial else ""))

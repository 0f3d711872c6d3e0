"""An in-memory Slurm implementing the SlurmBackend Protocol, for controller tests and benches that are
about the controller, not Slurm (the real cluster is tests/support/slurm_cluster.py)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence

from healthd.slurm.backend import (
    JobInfo,
    JobRun,
    NodeInfo,
    SlurmRefused,
    StepResult,
    filter_nodes,
    reservation_args,
    slurm_hostlist,
    validate_admin_comment,
    validate_argv,
    validate_job_id,
    validate_reservation_name,
)
from healthd.slurm.scontrol import STEP_PATH, parse_scontrol_node_line, step_result


class FakeBackend:
    """In-memory Slurm implementing the SlurmBackend Protocol; `writes` logs every write call."""

    def __init__(self, nodes: Iterable[str] = ("node01", "node02", "node03", "node04"),
                 partition: str | Sequence[str] = "gpu", *, clock: Callable[[], float] = time.time):
        """`partition`: one for every node, or several dealt round-robin; `clock` stamps reason times
        (tests on a fixed clock pass theirs)."""
        parts = (partition,) if isinstance(partition, str) else tuple(partition)
        self.dry_run = False
        self.planned: list[list[str]] = []
        self.state = {n: NodeInfo(name=n, state="idle", partitions=(parts[i % len(parts)],)) for i, n in enumerate(nodes)}
        self.writes: list[tuple] = []
        self.fail_next: str | None = None
        self.before_write = None  # a hook run right before a write lands (race simulation)
        self.unavailable = False
        self.clock = clock
        """Stamps reason times, as slurmctld does (whole seconds)."""
        self.user = "root"
        self.started_at: float | None = 1_000_000_000.0
        """slurmctld's start (ctld_started_at)."""
        self.reservations: set[str] = set()
        self.running: dict[str, list[JobInfo]] = {}
        """node -> the jobs running on it (jobs_on)."""
        self.runs: dict[str, list[JobRun]] | None = None
        """job id -> its runs in accounting (job_runs); None: the site keeps no accounting."""
        self.admin_comments: dict[str, str] = {}
        self.known_jobs: dict[str, JobInfo] = {}
        """job id -> a job in any state (job), besides those running."""
        self.addresses = {n: "127.0.0.1" for n in self.state}
        self.steps: list[list[str]] = []
        """Every command run_step ran (for real: the reintegration tests run small scripts)."""

    def _names(self, nodes: str | Sequence[str]) -> list[str]:
        return [nodes] if isinstance(nodes, str) else list(nodes)

    def _write(self, call: tuple) -> None:
        if self.fail_next:
            msg, self.fail_next = self.fail_next, None
            raise SlurmRefused(msg, list(call), 1, msg)
        self.writes.append(call)

    def nodes(self, names: Iterable[str] | None = None) -> list[NodeInfo]:
        if self.unavailable:
            from healthd.slurm.backend import SlurmUnavailable

            raise SlurmUnavailable("slurmctld down")
        return filter_nodes(self.state.values(), names)

    def node(self, name: str) -> NodeInfo:
        return self.state[name]

    def _stamp(self) -> float:
        return float(int(self.clock()))

    def set_reason(self, node: str, reason: str, *, user: str = "admin", drain: bool = True) -> None:
        """Someone else writes `node`'s reason (an administrator's `scontrol update`)."""
        info = self.state[node]
        self.state[node] = dataclasses.replace(info, flags=info.flags | ({"DRAIN"} if drain else set()),
                                               reason=reason, reason_user=user, reason_time=self._stamp())

    def drain(self, nodes, reason):
        self._write(("drain", slurm_hostlist(nodes), reason))
        for n in self._names(nodes):
            self.state[n] = dataclasses.replace(self.state[n], flags=self.state[n].flags | {"DRAIN"}, reason=reason,
                                                reason_user=self.user, reason_time=self._stamp())

    def resume(self, nodes):
        self._write(("resume", slurm_hostlist(nodes)))
        for n in self._names(nodes):
            self.state[n] = dataclasses.replace(self.state[n], flags=frozenset(), reason="", reason_user=None,
                                                reason_time=None)

    def reboot_asap(self, nodes, reason, next_state="RESUME"):
        self._write(("reboot_asap", slurm_hostlist(nodes), reason, next_state))
        for n in self._names(nodes):
            self.state[n] = dataclasses.replace(self.state[n], flags=self.state[n].flags | {"DRAIN", "REBOOT_REQUESTED"},
                                                reason=reason, reason_user=self.user, reason_time=self._stamp())

    def cancel_reboot(self, nodes):
        self._write(("cancel_reboot", slurm_hostlist(nodes)))

    def requeue(self, job_id):
        self._write(("requeue", str(job_id)))

    def create_reservation(self, name, nodes, duration_min, users=("root",), flags=("MAINT", "IGNORE_JOBS")):
        if name in self.reservations:
            raise SlurmRefused("Duplicate reservation name", ["create_reservation", name], 1, "Duplicate reservation name")
        self._write(("create_reservation", name))
        self.reservations.add(name)

    def delete_reservation(self, name):
        self._write(("delete_reservation", name))
        self.reservations.discard(name)  # already gone is done

    def reservation_exists(self, name) -> bool:
        return name in self.reservations

    def ctld_started_at(self) -> float | None:
        return self.started_at

    def jobs_on(self, node: str) -> list[JobInfo]:
        self.nodes()  # unavailable like every read
        return list(self.running.get(node, []))

    def job(self, job_id) -> JobInfo | None:
        text = validate_job_id(job_id)
        self.nodes()
        running = {j.job_id: j for jobs in self.running.values() for j in jobs}
        return running.get(text) or self.known_jobs.get(text)

    def job_runs(self, job_id) -> list[JobRun] | None:
        text = validate_job_id(job_id)
        self.nodes()
        if self.runs is None:
            return None
        return [dataclasses.replace(r, admin_comment=self.admin_comments.get(text, r.admin_comment))
                for r in self.runs.get(text, [])]

    def set_admin_comment(self, job_id, text: str) -> None:
        job = validate_job_id(job_id)
        validate_admin_comment(text)
        argv = ["sacctmgr", "--immediate", "modify", "job", "where", f"jobid={job}", "set", f"AdminComment={text}"]
        if self.dry_run:
            self.planned.append(argv)
            return
        self.nodes()
        self.writes.append(("admin_comment", job, text))
        self.admin_comments[job] = text

    def node_addresses(self, names: Iterable[str] | None = None) -> dict[str, str]:
        wanted = {n.name for n in self.nodes(names)}
        return {n: a for n, a in self.addresses.items() if n in wanted}

    def run_step(self, argv: Sequence[str], timeout_s: float) -> StepResult:
        command = validate_argv(argv)
        self.steps.append(command)
        return step_result(command, {"PATH": STEP_PATH, "LANG": "C"}, timeout_s)

    def version(self) -> str:
        return "24.05.0"

    def describe(self, action: str, **kw) -> list[str]:
        if action == "drain":
            return ["scontrol", "update", f"NodeName={slurm_hostlist(kw['nodes'])}", "State=DRAIN", f"Reason={kw['reason']}"]
        if action == "reboot_asap":
            return ["scontrol", "reboot", "ASAP", "nextstate=RESUME", f"Reason={kw['reason']}", slurm_hostlist(kw["nodes"])]
        if action == "resume":
            return ["scontrol", "update", f"NodeName={slurm_hostlist(kw['nodes'])}", "State=RESUME"]
        if action == "requeue":
            return ["scontrol", "requeue", validate_job_id(kw["job_id"])]
        if action == "create_reservation":  # as healthd.slurm.jobs writes it
            name, hl, minutes, users, flags = reservation_args(kw["name"], kw["nodes"], kw["duration_min"],
                                                               kw.get("users", ("root",)), kw.get("flags", ()))
            return ["scontrol", "create", "reservation", f"ReservationName={name}", f"Nodes={hl}", "StartTime=now",
                    f"Duration={minutes}", f"Users={','.join(users)}", *([f"Flags={','.join(flags)}"] if flags else [])]
        if action == "delete_reservation":
            return ["scontrol", "delete", f"ReservationName={validate_reservation_name(kw['name'])}"]
        raise ValueError(action)


def scontrol_line(info: NodeInfo) -> str:
    """`info` as one line of `scontrol show node -o` (the fields healthd reads, and some it does not)."""
    state = info.state.upper() + "".join(f"+{f}" for f in sorted(info.flags))
    line = (f"NodeName={info.name} Arch=x86_64 CoresPerSocket=1 CPUAlloc=0 CPUTot=64 CPULoad=0.10 Gres=gpu:8 "
            f"NodeAddr=10.0.0.1 State={state} Partitions={','.join(info.partitions)} "
            "BootTime=2026-12-01T07:34:35 LastBusyTime=2026-12-01T07:40:00")
    if info.reason:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(info.reason_time or 0))
        line += f" Reason={info.reason} [{info.reason_user or 'root'}@{stamp}]"
    return line


class FakeLinesBackend(FakeBackend):
    """The in-memory Slurm listing its nodes as `scontrol show node -o` lines, parsed with the real
    parser (the fleet view's incremental path). Lines are rendered again only after a write, as
    slurmctld's answer changes only then."""

    parse_node_line = staticmethod(parse_scontrol_node_line)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._rendered: list[str] | None = None
        self._writes_seen = -1

    def node_lines(self) -> list[str]:
        if self.unavailable:
            from healthd.slurm.backend import SlurmUnavailable

            raise SlurmUnavailable("slurmctld down")
        if self._rendered is None or self._writes_seen != len(self.writes):
            self._rendered = [scontrol_line(i) for i in self.state.values()]
            self._writes_seen = len(self.writes)
        return list(self._rendered)

"""The scontrol backend's jobs and reservations: requeue, the jobs on a node (squeue), a job's runs
from Slurm's accounting (sacct) and its AdminComment (sacctmgr), and maintenance reservations; with
the parsers of what squeue and sacct print (pure)."""

from __future__ import annotations

import re
from collections.abc import Sequence

from healthd.slurm.backend import (
    MAINT_FLAGS,
    MAINT_USERS,
    JobInfo,
    JobRun,
    SlurmRefused,
    SlurmUnavailable,
    reservation_args,
    validate_admin_comment,
    validate_job_id,
    validate_node_name,
    validate_reservation_name,
)
from healthd.slurm.nodeparse import local_epoch
from healthd.slurm.runner import ClientRunner

# slurmctld's answer to a reservation name it does not hold (ESLURM_RESERVATION_INVALID), and
# `scontrol show reservation NAME`'s for one that does not exist
RESERVATION_GONE_MARKERS = ("Requested reservation is invalid", "not found")
# squeue's answer to a job id slurmctld no longer holds (ESLURM_INVALID_JOB_ID)
JOB_GONE_MARKER = "Invalid job id"
SQUEUE_FORMAT = "--Format=JobID:40|,BatchFlag:4|,RestartCnt:10|,State:24|,Partition:64|,Account:64|,Comment:1000"
"""The batch flag (sbatch, not salloc/srun) is only in --Format; fields padded, '|' ends all but the
free-text comment, which comes last (Slurm refuses '|' in partition and account names)."""
SACCT_FORMAT = "--format=JobIDRaw,State,Start,End,Partition,Account,AllocTRES,NodeList,AdminComment"
"""With --parsable2: '|' between fields; the free-text AdminComment comes last."""
ACCOUNTING_DISABLED_MARKER = "accounting storage is disabled"
DBD_UNAVAILABLE_MARKERS = ("Problem talking to the database", "persistent connection", "Connection refused",
                           "Unable to contact")
"""sacct's words when slurmdbd (or its database) does not answer."""
_GPU_TRES_RE = re.compile(r"(?:^|,)gres/gpu=(\d+)(?:,|$)")


def parse_squeue_jobs(text: str) -> list[JobInfo]:
    """The lines of `squeue --noheader` with SQUEUE_FORMAT (pure); lines without a job id are skipped."""
    out = []
    for line in text.splitlines():
        parts = line.split("|", 6)
        if len(parts) != 7 or not parts[0].strip():
            continue
        job, batch, restarts, state, partition, account, comment = (p.strip() for p in parts)
        out.append(JobInfo(job, batch == "1", comment, int(restarts) if restarts.isdigit() else 0,
                           state, partition, account))
    return out


def _sacct_time(text: str) -> float | None:
    return None if text in ("", "Unknown", "None") else local_epoch(text)


def parse_sacct_runs(text: str) -> list[JobRun]:
    """The lines of `sacct --duplicates --allocations --parsable2 --noheader` with SACCT_FORMAT
    (pure): one run per line, in sacct's order (oldest first); lines that are not a run are skipped."""
    out = []
    for line in text.splitlines():
        parts = line.split("|", 8)
        if len(parts) != 9 or not parts[0].strip():
            continue
        job, state, start, end, partition, account, tres, nodes, comment = parts
        words = state.split()
        m = _GPU_TRES_RE.search(tres)
        out.append(JobRun(job.strip(), words[0].rstrip("+") if words else "", _sacct_time(start.strip()),
                          _sacct_time(end.strip()), partition.strip(), account.strip(),
                          int(m.group(1)) if m else None, nodes.strip(), comment.strip()))
    return out


class JobsAndReservations(ClientRunner):
    """Job and reservation calls; a write runs the argv its `_argv_<action>` builds (what describe()
    shows)."""

    # -- argv ---------------------------------------------------------------------------

    def _argv_requeue(self, job_id: int | str) -> list[str]:
        return [self._bin("scontrol"), "requeue", validate_job_id(job_id)]

    def _argv_set_admin_comment(self, job_id: int | str, text: str) -> list[str]:
        return [self._bin("sacctmgr"), "--immediate", "modify", "job", "where", f"jobid={validate_job_id(job_id)}",
                "set", f"AdminComment={validate_admin_comment(text)}"]

    def _argv_create_reservation(self, name: str, nodes: str | Sequence[str], duration_min: int,
                                 users: Sequence[str] = MAINT_USERS, flags: Sequence[str] = MAINT_FLAGS) -> list[str]:
        name, hl, duration_min, users, flags = reservation_args(name, nodes, duration_min, users, flags)
        argv = [
            self._bin("scontrol"),
            "create",
            "reservation",
            f"ReservationName={name}",
            f"Nodes={hl}",
            "StartTime=now",
            f"Duration={duration_min}",
            f"Users={','.join(users)}",
        ]
        if flags:
            argv.append(f"Flags={','.join(flags)}")
        return argv

    def _argv_delete_reservation(self, name: str) -> list[str]:
        return [self._bin("scontrol"), "delete", f"ReservationName={validate_reservation_name(name)}"]

    # -- jobs ---------------------------------------------------------------------------

    def requeue(self, job_id: int | str) -> None:
        self._write(self._argv_requeue(job_id))

    def set_admin_comment(self, job_id: int | str, text: str) -> None:
        """`sacctmgr --immediate modify job where jobid=J set AdminComment=TEXT` (slurmdbd)."""
        self._write(self._argv_set_admin_comment(job_id, text))

    def job_runs(self, job_id: int | str) -> list[JobRun] | None:
        """Every run of the job from `sacct --duplicates` (a requeued job's earlier runs included);
        None when the site keeps no accounting; SlurmUnavailable when slurmdbd does not answer."""
        argv = [self._bin("sacct"), f"--jobs={validate_job_id(job_id)}", "--duplicates", "--allocations",
                "--parsable2", "--noheader", SACCT_FORMAT]
        try:
            out = self._run(argv)
        except SlurmRefused as exc:
            said = exc.stderr + str(exc)
            if ACCOUNTING_DISABLED_MARKER in said:
                return None
            if any(m in said for m in DBD_UNAVAILABLE_MARKERS):
                raise SlurmUnavailable(f"sacct: slurmdbd unreachable: {said.strip().splitlines()[-1][:200]}",
                                       argv=argv, returncode=exc.returncode, stderr=exc.stderr) from None
            raise
        return parse_sacct_runs(out)

    def _squeue(self, select: list[str]) -> list[JobInfo]:
        return parse_squeue_jobs(self._run([self._bin("squeue"), "--noheader", *select, SQUEUE_FORMAT]))

    def jobs_on(self, node: str) -> list[JobInfo]:
        """The jobs running on `node` (squeue): id, batch flag, restart count, comment."""
        return self._squeue([f"--nodelist={validate_node_name(node)}", "--states=RUNNING"])

    def job(self, job_id: int | str) -> JobInfo | None:
        """One job in any state, None once slurmctld no longer holds it: its restart count tells
        whether a requeue whose client died with the controller reached slurmctld."""
        text = validate_job_id(job_id)
        try:
            found = self._squeue([f"--jobs={text}", "--states=all"])
        except SlurmRefused as exc:
            if JOB_GONE_MARKER in (exc.stderr + str(exc)):
                return None
            raise
        return next((j for j in found if j.job_id == text), None)

    # -- reservations -------------------------------------------------------------------

    def create_reservation(self, name: str, nodes: str | Sequence[str], duration_min: int,
                           users: Sequence[str] = MAINT_USERS, flags: Sequence[str] = MAINT_FLAGS) -> None:
        self._write(self._argv_create_reservation(name, nodes, duration_min, users, flags))

    def delete_reservation(self, name: str) -> None:
        """Delete the reservation; one that is already gone is done, not an error."""
        try:
            self._write(self._argv_delete_reservation(name))
        except SlurmRefused as exc:
            if not any(m in (exc.stderr + str(exc)) for m in RESERVATION_GONE_MARKERS):
                raise
            self._log.info("delete reservation %s: already gone", name)

    def reservation_exists(self, name: str) -> bool:
        argv = [self._bin("scontrol"), "show", "reservation", "-o", validate_reservation_name(name)]
        try:
            out = self._run(argv)
        except SlurmRefused as exc:
            if any(m in (exc.stderr + str(exc)) for m in RESERVATION_GONE_MARKERS):
                return False
            raise
        return f"ReservationName={name} " in out + " "

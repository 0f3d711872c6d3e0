"""The controller's accounting of ended jobs (healthd.controller.goodput_jobs): a job is accounted once
Slurm says it ended and its log has settled, joined with the ledger, by the partition Slurm gave;
the exported totals only grow; `healthctl goodput --by partition` reads the same records."""

from __future__ import annotations

import json
import os

import pytest

from healthd.controller import healthctl
from healthd.controller.goodput_jobs import AccountedJobs, GoodputAccountant, GoodputFigures, GoodputSettings, label
from healthd.slurm.backend import JobInfo
from tests.goodput.test_ledger_join import JOB, ledger, node_log
from tests.support.fake_slurm import FakeBackend


class Clock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def world(tmp_path):
    gathered = tmp_path / "gathered"
    (gathered / JOB).mkdir(parents=True)
    part = gathered / JOB / "node01.jsonl"
    part.write_text(node_log())
    written = os.stat(part).st_mtime
    backend = FakeBackend()
    published: list[GoodputFigures] = []
    clock = Clock(written + 10)
    settings = GoodputSettings(directory=str(gathered), settle_s=60, objective=0.9, objectives={"big": 0.95})
    acct = GoodputAccountant(settings, backend, str(tmp_path / "ledger.db"), published.append, clock=clock)
    yield acct, backend, clock, published, tmp_path
    acct.jobs.close()


def test_a_job_is_accounted_once_it_ended_and_its_log_settled(world):
    acct, backend, clock, published, tmp_path = world
    inc = ledger(tmp_path / "ledger.db")
    backend.known_jobs[JOB] = JobInfo(JOB, True, "", 1, "RUNNING", "gpu", "ml")
    assert acct.pass_once() == []  # the log was written 10 s ago
    assert published[-1].jobs == {}  # the first pass publishes, with nothing yet
    clock.t += 120
    assert acct.pass_once() == []  # settled, but still running: its partition is noted
    assert acct.jobs.known()[JOB][:2] == ("gpu", "ml")
    backend.known_jobs[JOB] = JobInfo(JOB, True, "", 1, "COMPLETED", "gpu", "ml")
    assert acct.pass_once() == [JOB]
    f = published[-1]
    # the hand-computed job of test_ledger_join, charged to its incident's cause
    assert f.jobs == {"gpu": 1}
    assert f.gpu_s[("gpu", "productive")] == 1240 and sum(v for (p, _), v in f.gpu_s.items() if p == "gpu") == 1800
    assert f.lost == {("gpu", "xid:79"): 40 + 60 + 220 + 40 + 120}
    assert f.objective == {"big": 0.95, "gpu": 0.9}
    assert inc
    assert acct.pass_once() == []  # nothing new: not accounted again


def test_a_job_slurm_forgot_is_accounted_with_what_was_noted(world):
    acct, backend, clock, published, _ = world
    clock.t += 120
    backend.known_jobs[JOB] = JobInfo(JOB, True, "", 0, "RUNNING", "big", "ml")
    acct.pass_once()
    del backend.known_jobs[JOB]  # past MinJobAge
    assert acct.pass_once() == [JOB]
    assert published[-1].jobs == {"big": 1}


def test_slurm_unreachable_accounts_nothing(world):
    acct, backend, clock, published, _ = world
    clock.t += 120
    backend.unavailable = True
    assert acct.pass_once() == []
    backend.unavailable = False
    assert acct.pass_once() == [JOB]
    assert published[-1].jobs == {"unknown": 1}  # Slurm no longer knows it and nobody noted it


def test_the_totals_only_grow(tmp_path):
    """A job accounted again (its log grew after its end) adds what grew; a category that shrank keeps
    its total, so Prometheus never sees a counter go down."""
    from healthd import goodput

    jobs = AccountedJobs(str(tmp_path / "a.sqlite"))
    first = goodput.account(goodput.parse_log(node_log()))
    jobs.accounted(JOB, "gpu", "ml", 1.0, 1.0, first)
    s = GoodputSettings()
    before = jobs.figures(s)
    again = goodput.Account(JOB, first.held_gpu_s + 100, {**first.gpu_s, "productive": first.gpu_s["productive"] - 50,
                                                             "lost": first.gpu_s["lost"] + 150},
                            first.incidents, first.runs, first.interruptions, first.running_s)
    jobs.accounted(JOB, "gpu", "ml", 2.0, 2.0, again)
    after = jobs.figures(s)
    assert all(after.gpu_s[k] >= v for k, v in before.gpu_s.items())
    assert after.gpu_s[("gpu", "lost")] == before.gpu_s[("gpu", "lost")] + 150
    assert after.gpu_s[("gpu", "productive")] == before.gpu_s[("gpu", "productive")]
    assert after.jobs == {"gpu": 1}
    jobs.forget(JOB)
    assert jobs.figures(s) == after  # an old job's row deleted: its share of the totals stays
    jobs.close()


def test_an_old_job_is_deleted_and_its_totals_stay(world):
    acct, backend, clock, published, _ = world
    clock.t += 120
    backend.known_jobs[JOB] = JobInfo(JOB, True, "", 0, "FAILED", "gpu", "ml")
    assert acct.pass_once() == [JOB]
    kept = published[-1]
    clock.t += acct.settings.keep_days * 86400 + 1
    acct.pass_once()
    assert not os.path.exists(os.path.join(acct.settings.directory, JOB))
    assert JOB not in acct.jobs.known()
    assert acct.jobs.figures(acct.settings) == kept


@pytest.mark.parametrize("value, want", [("gpu", "gpu"), ("xid:79", "xid:79"), ("", "unknown"), (None, "unknown"),
                                         ("a b", "other"), ("x" * 65, "other"), ('"}\n', "other")])
def test_label_values_stay_a_bounded_clean_set(value, want):
    assert label(value) == want


def test_healthctl_reads_the_gathered_logs_by_partition(world, capsys):
    acct, backend, clock, _, tmp_path = world
    ledger(tmp_path / "ledger.db")
    clock.t += 120
    backend.known_jobs[JOB] = JobInfo(JOB, True, "", 1, "COMPLETED", "gpu", "ml")
    acct.pass_once()
    gathered = acct.settings.directory
    assert healthctl.main(["--ledger", str(tmp_path / "ledger.db"), "--json", "goodput", "--logs", gathered,
                           "--by", "partition"]) == 0
    doc = json.loads(capsys.readouterr().out)
    [row] = doc["cost"]
    assert row["partition"] == "gpu" and row["jobs"] == 1 and row["held_gpu_s"] == 1800
    assert row["productive_gpu_s"] == 1240
    assert healthctl.main(["--ledger", str(tmp_path / "ledger.db"), "goodput", "--logs", gathered,
                           "--job", JOB]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"job {JOB}: goodput 68.9% of 0.50 GPU-h held over 2 run(s)")
    assert "1 requeue(s) of job 4242 and their incidents joined" in out


# ----------------------------------------------------------------------------- with Slurm's accounting


def _runs(partition: str = "gpu", comment: str = "", last: str = "COMPLETED") -> list:
    from healthd.slurm.backend import JobRun

    # the log's runs start at 0 and 300 (rank 0's process); Slurm's allocations a little earlier
    return [JobRun(JOB, "REQUEUED", -5.0, 210.0, partition, "ml", 4, "node01"),
            JobRun(JOB, last, 290.0, 540.0, partition, "ml", 4, "node02", comment)]


def test_slurms_runs_replace_the_logs_own():
    from healthd import goodput

    log = goodput.parse_log(node_log())
    runs = [goodput.SlurmRun(r.start, r.end, r.state, r.gpus) for r in _runs()]
    acc = goodput.account(goodput.with_runs(log, runs))
    mine = goodput.account(log)
    # Slurm allocated 5 s before rank 0 started (4 GPUs): startup the log could not see; the second
    # run's 10 s earlier start moves that time from the queue into the held time, as its restart
    assert acc.held_gpu_s == mine.held_gpu_s + (5 + 10) * 4
    assert acc.gpu_s["other"] == mine.gpu_s["other"] + 5 * 4
    assert acc.gpu_s["restart"] == mine.gpu_s["restart"] + 10 * 4
    assert acc.gpu_s["waiting"] == mine.gpu_s["waiting"]
    assert (acc.queued_s, mine.queued_s) == (80, 90)
    assert acc.gpu_s["productive"] == mine.gpu_s["productive"]
    assert (acc.runs, acc.interruptions, acc.problems) == (2, 1, ())
    [inc] = acc.incidents
    assert inc.cause == "REQUEUED"  # without the ledger: the run's end as Slurm recorded it


def test_without_gpus_in_accounting_a_run_holds_what_its_log_says():
    from healthd import goodput

    log = goodput.parse_log(node_log())
    acc = goodput.account(goodput.with_runs(log, [goodput.SlurmRun(0.0, 210.0, "FAILED"),
                                                  goodput.SlurmRun(300.0, 540.0, "COMPLETED")]))
    assert acc.held_gpu_s == goodput.account(log).held_gpu_s and not acc.problems


def test_the_accountant_reads_sacct_and_writes_the_admin_comment_once(world):
    acct, backend, clock, published, tmp_path = world
    ledger(tmp_path / "ledger.db")
    clock.t += 120
    backend.runs = {JOB: _runs(last="PENDING")}
    assert acct.pass_once() == []  # requeued, waiting to run again
    backend.runs = {JOB: _runs()}
    assert acct.pass_once() == [JOB]
    assert backend.admin_comments[JOB].startswith("healthd: goodput=")
    assert "2 run(s), 1 interruption(s)" in backend.admin_comments[JOB]
    assert published[-1].jobs == {"gpu": 1}
    # accounted again (its log grew): the same line is not written twice
    os.utime(os.path.join(acct.settings.directory, JOB, "node01.jsonl"), (clock.t, clock.t))
    clock.t += 200
    writes = len(backend.writes)
    assert acct.pass_once() == [JOB]
    assert len(backend.writes) == writes


def test_an_admin_comment_that_is_not_healthds_is_left_alone(world):
    acct, backend, clock, _, _ = world
    clock.t += 120
    backend.runs = {JOB: _runs(comment="ticket 1234: watch this job")}
    assert acct.pass_once() == [JOB]
    assert JOB not in backend.admin_comments and backend.writes == []


def test_a_dry_run_controller_only_plans_the_admin_comment(world):
    acct, backend, clock, _, _ = world
    clock.t += 120
    backend.dry_run = True
    backend.runs = {JOB: _runs(comment="healthd: goodput=1.0% of 0.01 GPU-h, 1 run(s), 0 interruption(s)")}
    assert acct.pass_once() == [JOB]
    assert backend.writes == [] and backend.planned[-1][:6] == ["sacctmgr", "--immediate", "modify", "job", "where",
                                                                 f"jobid={JOB}"]


def test_without_accounting_sacct_is_asked_once(world):
    acct, backend, clock, _, _ = world
    clock.t += 120
    asked = []
    real = backend.job_runs
    backend.job_runs = lambda job: asked.append(job) or real(job)
    backend.known_jobs[JOB] = JobInfo(JOB, True, "", 0, "RUNNING", "gpu", "ml")
    acct.pass_once()
    acct.pass_once()
    assert asked == [JOB]


def test_a_job_accounting_has_not_recorded_yet_waits(world):
    acct, backend, clock, _, _ = world
    clock.t += 120
    backend.runs = {}  # slurmdbd up, but behind: no record of the job, and slurmctld does not know it
    assert acct.pass_once() == []
    backend.known_jobs[JOB] = JobInfo(JOB, True, "", 0, "COMPLETED", "gpu", "ml")
    assert acct.pass_once() == [JOB]  # slurmctld says it ended


def test_a_job_nobody_in_slurm_knows_is_accounted_from_its_log_a_day_later(world):
    acct, backend, clock, published, _ = world
    clock.t += 120
    backend.runs = {}
    assert acct.pass_once() == []
    clock.t += 86400
    assert acct.pass_once() == [JOB]
    assert published[-1].jobs == {"unknown": 1}

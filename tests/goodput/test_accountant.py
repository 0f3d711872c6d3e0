"""The controller's accounting of ended jobs (healthd.controller.goodput_jobs): a job is accounted once
Slurm says it ended and its log has settled, joined with the ledger, by the partition Slurm gave;
the exported totals only grow, and total - retracted is exactly the sum over the jobs' latest accounts
however often and wherever a job is accounted again; `healthctl goodput --by partition` reads the
same records."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from healthd.controller import healthctl
from healthd.controller.goodput_jobs import AccountedJobs, GoodputAccountant, GoodputFigures, GoodputSettings, label
from healthd.goodput_categories import CATEGORIES
from healthd.slurm.backend import JobInfo
from tests.goodput.test_accounting import ckpt, hd, log, start, step
from tests.goodput.test_ledger_join import JOB, ledger, node_log
from tests.support.fake_slurm import FakeBackend


class Clock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


def totals(f: GoodputFigures) -> GoodputFigures:
    """The counters of `f`, without the gauges read from the rows of recent jobs."""
    return dataclasses.replace(f, worst_window_ettr={}, longest_unproductive_s={})


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
    assert f.cost == {("gpu", "xid:79"): 40 + 60 + 220 + 40 + 120}
    assert f.cost_retracted == {("gpu", "xid:79"): 0} and set(f.gpu_s_retracted.values()) == {0}
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


def test_a_category_that_shrank_is_retracted_and_the_counters_only_grow(tmp_path):
    """A job accounted again (its log grew after its end) adds what grew; what shrank goes to its
    retraction counter, so Prometheus never sees a counter go down and total - retracted is the new
    account."""
    from healthd import goodput

    jobs = AccountedJobs(str(tmp_path / "a.sqlite"))
    first = goodput.account(goodput.parse_log(node_log()))
    jobs.accounted(JOB, "gpu", "ml", 1.0, 1.0, first)
    s = GoodputSettings()
    before = jobs.figures(s, 2.0)
    again = goodput.Account(JOB, first.held_gpu_s + 100, {**first.gpu_s, "productive": first.gpu_s["productive"] - 50,
                                                             "lost": first.gpu_s["lost"] + 150},
                            first.incidents, first.runs, first.interruptions, first.running_s)
    jobs.accounted(JOB, "gpu", "ml", 2.0, 2.0, again)
    after = jobs.figures(s, 2.0)
    assert all(after.gpu_s[k] >= v for k, v in before.gpu_s.items())
    assert all(after.gpu_s_retracted[k] >= v for k, v in before.gpu_s_retracted.items())
    assert after.gpu_s[("gpu", "lost")] == before.gpu_s[("gpu", "lost")] + 150
    assert after.gpu_s[("gpu", "productive")] == before.gpu_s[("gpu", "productive")]
    assert after.gpu_s_retracted[("gpu", "productive")] == 50
    assert {c: after.gpu_s[("gpu", c)] - after.gpu_s_retracted[("gpu", c)] for c in CATEGORIES} == again.gpu_s
    assert after.jobs == {"gpu": 1} and after.jobs_retracted == {"gpu": 0}
    jobs.forget(JOB)
    assert totals(jobs.figures(s, 2.0)) == totals(after)  # an old job's row deleted: its share of the totals stays
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
    assert totals(acct.jobs.figures(acct.settings, clock.t)) == totals(kept)


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
    backend.runs = {JOB: _runs(comment="healthd: goodput=1.0% of 0.01 GPU-h held, 1 run(s), 0 interruption(s)")}
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


# ----------------------------------------------------------------------------- accounting a job again


PARTITIONS = ("gpu", "big", "a b", "", "c d")
"""Partitions as Slurm may name them: two that are labels, and three that are not ("a b" and "c d"
are both exported as `other`, "" as `unknown`)."""
CAUSES = ("xid:79", "FAILED", "NODE_FAIL", "x y")


@st.composite
def accountings(draw):
    """A sequence of accountings: each of a random job (of a few) in a random partition, with random
    GPU-seconds by category and interruption cost by cause, so that categories grow, shrink, vanish
    and come back, and a job moves between partitions and back."""
    from healthd import goodput

    out = []
    for _ in range(draw(st.integers(1, 25))):
        job = draw(st.sampled_from(("1", "2", "3", "4")))
        partition = draw(st.sampled_from(PARTITIONS))
        amount = st.integers(0, 50_000).map(lambda x: x / 8)  # 0 included: a category that vanishes
        gpu_s = {c: draw(amount) for c in CATEGORIES}
        incidents = tuple(goodput.Incident(str(i), cause, None, None, False, {"lost": draw(amount), "waiting": draw(amount)})
                          for i, cause in enumerate(draw(st.lists(st.sampled_from(CAUSES), max_size=3))))
        out.append((job, partition, goodput.Account(job, sum(gpu_s.values()), gpu_s, incidents, 1 + len(incidents),
                                                    len(incidents), 1.0)))
    return out


def net(total: dict, retracted: dict) -> dict:
    return {k: v - retracted.get(k, 0.0) for k, v in total.items()}


def latest_sums(latest: dict) -> tuple[dict, dict, dict]:
    """What the exported totals must come to: the sums over each job's latest account, by the
    partition as it is exported (the test's own model of the rule)."""
    gpu_s: dict = {}
    cost: dict = {}
    jobs: dict = {}
    for partition, acc in latest.values():
        p = label(partition)
        jobs[p] = jobs.get(p, 0) + 1
        for c, v in acc.gpu_s.items():
            gpu_s[(p, c)] = gpu_s.get((p, c), 0.0) + v
        for inc in acc.incidents:
            k = (p, label(inc.cause))
            cost[k] = cost.get(k, 0.0) + sum(inc.gpu_s.values())
    return gpu_s, cost, jobs


def nonzero(d: dict) -> dict:
    return {k: v for k, v in d.items() if abs(v) > 1e-6}


@settings(max_examples=120, deadline=None)
@given(accountings())
def test_total_less_retracted_is_the_sum_of_the_latest_accounts(seq):
    # a real file, on a RAM disk where there is one: each accounting is a transaction
    where = tempfile.mkdtemp(prefix="healthd-accounted-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    jobs = AccountedJobs(os.path.join(where, "a.sqlite"))
    try:
        latest: dict = {}
        before = jobs.figures(GoodputSettings(), 100.0)
        for n, (job, partition, acc) in enumerate(seq):
            jobs.accounted(job, partition, "ml", float(n), float(n), acc)
            latest[job] = (partition, acc)
            f = jobs.figures(GoodputSettings(), 100.0)
            # counters: no series goes down or disappears
            for old, new in ((before.gpu_s, f.gpu_s), (before.gpu_s_retracted, f.gpu_s_retracted),
                             (before.cost, f.cost), (before.cost_retracted, f.cost_retracted),
                             (before.jobs, f.jobs), (before.jobs_retracted, f.jobs_retracted)):
                assert all(new[k] >= v - 1e-9 for k, v in old.items())
            want_gpu, want_cost, want_jobs = latest_sums(latest)
            assert nonzero(net(f.gpu_s, f.gpu_s_retracted)) == pytest.approx(nonzero(want_gpu), abs=1e-6)
            assert nonzero(net(f.cost, f.cost_retracted)) == pytest.approx(nonzero(want_cost), abs=1e-6)
            assert nonzero(net(f.jobs, f.jobs_retracted)) == want_jobs
            # every retraction series has its total, so the SLO rules can subtract key by key
            assert set(f.gpu_s_retracted) <= set(f.gpu_s) and set(f.cost_retracted) <= set(f.cost)
            assert set(f.jobs_retracted) <= set(f.jobs)
            before = f
    finally:
        jobs.close()
        shutil.rmtree(where)


def _grown_after_a_requeue(world, moved_to: str) -> tuple[GoodputFigures, GoodputFigures, object, object]:
    """Job 4242's first run (it failed; its durable save of step 99 on the node) accounted as the job
    Slurm says ended, in partition gpu; then the job is requeued (into `moved_to`) and its second run
    restores nothing (the save was not readable), so the first run's work up to step 99 is now lost
    work, and the job is accounted again. Returns the figures after each pass and the two accounts."""
    from healthd import goodput

    acct, backend, clock, published, _ = world
    part = os.path.join(acct.settings.directory, JOB, "node01.jsonl")
    first = log(*start(0, 4), step(0, 10), step(100, 110), *ckpt(110, 120), hd("durable", 125, step=99),
                step(150, 170), hd("run_end", 210, state="FAILED"))
    second = log(*start(300, 4), step(0, 330), step(50, 380), {"job_end_time": 390})
    with open(part, "w") as f:
        f.write(first)
    os.utime(part, (clock.t, clock.t))
    clock.t += 120
    backend.known_jobs[JOB] = JobInfo(JOB, True, "", 0, "FAILED", "gpu", "ml")
    assert acct.pass_once() == [JOB]
    once = published[-1]
    with open(part, "a") as f:
        f.write(second)
    os.utime(part, (clock.t, clock.t))
    clock.t += 120
    backend.known_jobs[JOB] = JobInfo(JOB, True, "", 1, "COMPLETED", moved_to, "ml")
    assert acct.pass_once() == [JOB]
    return once, published[-1], goodput.account(goodput.parse_log(first)), goodput.account(goodput.parse_log(first + second))


def _net_of(f: GoodputFigures, partition: str) -> dict[str, float]:
    return {c: f.gpu_s[(partition, c)] - f.gpu_s_retracted[(partition, c)] for c in CATEGORIES}


def test_a_log_that_grew_after_a_requeue_is_not_counted_twice(world):
    once, twice, a, b = _grown_after_a_requeue(world, "gpu")
    assert _net_of(once, "gpu") == pytest.approx(a.gpu_s)
    assert _net_of(twice, "gpu") == pytest.approx(b.gpu_s)
    # the case that needs a retraction: the first run's surviving work became lost work
    assert b.gpu_s["productive"] < a.gpu_s["productive"] and b.gpu_s["lost"] > a.gpu_s["lost"]
    assert twice.gpu_s_retracted[("gpu", "productive")] > 0
    assert sum(_net_of(twice, "gpu").values()) == pytest.approx(b.held_gpu_s)
    assert twice.jobs == {"gpu": 1} and twice.jobs_retracted == {"gpu": 0}
    assert net(dict(twice.cost), dict(twice.cost_retracted)) == pytest.approx(
        {("gpu", inc.cause): inc.cost_gpu_s for inc in b.incidents})


def test_a_job_requeued_into_another_partition_moves_there_whole(world):
    once, twice, a, b = _grown_after_a_requeue(world, "big")
    assert _net_of(twice, "gpu") == pytest.approx(dict.fromkeys(CATEGORIES, 0.0))
    assert twice.gpu_s_retracted[("gpu", "productive")] == pytest.approx(a.gpu_s["productive"])
    assert _net_of(twice, "big") == pytest.approx(b.gpu_s)
    assert twice.jobs == {"gpu": 1, "big": 1} and twice.jobs_retracted == {"gpu": 1, "big": 0}
    assert all(twice.gpu_s[k] >= v for k, v in once.gpu_s.items())
    # the gauges read the job's one row: in its new partition only
    assert set(twice.longest_unproductive_s) == {"big"}


def test_an_older_file_with_lost_columns_keeps_counting(tmp_path):
    """A file written when the interruption cost was kept as `lost` (column and kind): opened, its
    rows and totals are the interruption cost, and accounting its job again retracts from them."""
    import sqlite3

    from healthd import goodput

    path = str(tmp_path / "accounted.sqlite")
    acc = goodput.account(goodput.parse_log(node_log()))
    [inc] = acc.incidents
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE jobs (job TEXT PRIMARY KEY, partition TEXT NOT NULL, account TEXT NOT NULL, "
               "accounted_at REAL, last_write REAL, held_gpu_s REAL, gpu_s TEXT, lost TEXT, problems TEXT)")
    db.execute("CREATE TABLE totals (partition TEXT NOT NULL, kind TEXT NOT NULL, key TEXT NOT NULL, "
               "value REAL NOT NULL, PRIMARY KEY (partition, kind, key))")
    db.execute("INSERT INTO jobs VALUES (?, 'gpu', 'ml', 1.0, 1.0, ?, ?, ?, '[]')",
               (JOB, acc.held_gpu_s, json.dumps(dict(acc.gpu_s)), json.dumps({inc.cause: inc.cost_gpu_s})))
    rows = [("gpu", "jobs", "", 1.0), ("gpu", "lost", inc.cause, inc.cost_gpu_s),
            *(("gpu", "gpu_s", c, v) for c, v in acc.gpu_s.items() if v > 0)]
    db.executemany("INSERT INTO totals VALUES (?, ?, ?, ?)", rows)
    db.commit()
    db.close()
    jobs = AccountedJobs(path)
    try:
        f = jobs.figures(GoodputSettings(), 2.0)
        assert f.cost == {("gpu", inc.cause): inc.cost_gpu_s} and f.jobs == {"gpu": 1}
        assert jobs.last_account(JOB) == ("gpu", pytest.approx(dict(acc.gpu_s)), {inc.cause: inc.cost_gpu_s})
        smaller = dataclasses.replace(inc, gpu_s={**inc.gpu_s, "lost": 0.0})
        jobs.accounted(JOB, "gpu", "ml", 2.0, 2.0, dataclasses.replace(acc, incidents=(smaller,)))
        g = jobs.figures(GoodputSettings(), 2.0)
        assert g.cost[("gpu", inc.cause)] == inc.cost_gpu_s
        assert g.cost_retracted[("gpu", inc.cause)] == pytest.approx(inc.gpu_s["lost"]) and inc.gpu_s["lost"] > 0
        assert jobs.db.execute("SELECT count(*) FROM totals WHERE kind LIKE 'lost%'").fetchone() == (0,)
    finally:
        jobs.close()
    AccountedJobs(path).close()  # opening it again changes nothing
    assert sqlite3.connect(path).execute("SELECT value FROM totals WHERE kind = 'cost'").fetchone() == (inc.cost_gpu_s,)


# ----------------------------------------------------------------------------- ETTR gauges


def _steady(runs_gap: float, stop: float) -> str:
    """4 GPUs. A run that trains from 10 s to 7200 s with a save at 3600 and dies at `stop` (its
    steps since the save are lost work), then, `runs_gap` later, a run that restores and trains for
    an hour."""
    r = stop + runs_gap
    return log(*start(0, 4), step(0, 10), step(3590, 3600), *ckpt(3600, 3610), hd("durable", 3611, step=3589),
               step(3600, 3610), step(3600 + int(stop - 3610), stop), hd("run_end", stop, state="FAILED"),
               *start(r, 4), hd("restored", r + 10, step=3589), step(3590, r + 60), step(7190, r + 3660),
               {"job_end_time": r + 3660})


def test_the_ettr_gauges_take_each_recent_jobs_latest_row(tmp_path):
    from healthd import goodput

    jobs = AccountedJobs(str(tmp_path / "a.sqlite"))
    day = 86400.0
    now = 100 * day
    try:
        accs = {j: goodput.account(goodput.parse_log(_steady(600, stop))) for j, stop in
                (("1", 5000.0), ("2", 7000.0), ("3", 4000.0))}
        e = {j: goodput.ettr(a, 3600) for j, a in accs.items()}
        jobs.accounted("1", "gpu", "ml", now - day, 0.0, accs["1"], 3600)
        jobs.accounted("2", "gpu", "ml", now - 29 * day, 0.0, accs["2"], 3600)
        jobs.accounted("3", "gpu", "ml", now - 31 * day, 0.0, accs["3"], 3600)  # too long ago for the gauges
        f = jobs.figures(GoodputSettings(), now)
        assert f.worst_window_ettr == {"gpu": pytest.approx(min(e["1"].window_min, e["2"].window_min))}
        assert f.longest_unproductive_s == {"gpu": pytest.approx(max(e["1"].longest_unproductive_s,
                                                                     e["2"].longest_unproductive_s))}
        # job 2 accounted again with a better account: its row replaced, not added to
        jobs.accounted("2", "gpu", "ml", now, 0.0, accs["1"], 3600)
        f = jobs.figures(GoodputSettings(), now)
        assert f.worst_window_ettr == {"gpu": pytest.approx(e["1"].window_min)}
        assert f.longest_unproductive_s == {"gpu": pytest.approx(e["1"].longest_unproductive_s)}
        # the window is the setting's: the whole job at a window longer than it held
        jobs.accounted("1", "gpu", "ml", now, 0.0, accs["1"], 10 * day)
        jobs.accounted("2", "gpu", "ml", now, 0.0, accs["1"], 10 * day)
        f = jobs.figures(GoodputSettings(), now)
        assert f.worst_window_ettr == {"gpu": pytest.approx(goodput.ettr(accs["1"]).cumulative)}
        assert e["1"].window_min < goodput.ettr(accs["1"]).cumulative
    finally:
        jobs.close()


def test_the_collector_exports_the_retractions_and_the_gauges(world):
    from healthd.controller.metrics import GoodputCollector

    _, twice, _, b = _grown_after_a_requeue(world, "big")
    collector = GoodputCollector()
    collector.publish(twice)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for fam in collector.collect() for s in fam.samples}
    assert samples[("healthd_goodput_jobs_retracted_total", (("partition", "gpu"),))] == 1
    assert samples[("healthd_goodput_gpu_seconds_retracted_total", (("category", "productive"), ("partition", "gpu")))] > 0
    assert samples[("healthd_goodput_interruption_cost_gpu_seconds_total", (("cause", "FAILED"), ("partition", "big")))] \
        == pytest.approx(sum(i.cost_gpu_s for i in b.incidents))
    # a retraction series is there at 0 from its total's first sample on
    assert samples[("healthd_goodput_interruption_cost_gpu_seconds_retracted_total",
                    (("cause", "FAILED"), ("partition", "big")))] == 0
    e = goodput_ettr(b)
    assert samples[("healthd_goodput_worst_window_ettr_ratio", (("partition", "big"),))] == pytest.approx(e.window_min)
    assert samples[("healthd_goodput_longest_unproductive_seconds", (("partition", "big"),))] == \
        pytest.approx(e.longest_unproductive_s)
    assert not any("lost_gpu_seconds" in name for name, _ in samples)


def goodput_ettr(acc):
    from healthd import goodput

    return goodput.ettr(acc, GoodputSettings().ettr_window_s)

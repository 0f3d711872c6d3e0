"""Slurm's accounting in goodput: a real slurmdbd backed by a real MariaDB beside the local cluster.

A requeued job's runs come from `sacct --duplicates` through the scontrol backend (starts, ends, end
states, GPUs from AllocTRES, partition, account); the controller's accountant puts them under the
job's gathered log, and writes `healthd: goodput=...` to the job's AdminComment with `sacctmgr`,
never over someone else's. Without slurmdbd, sacct says accounting is disabled and the backend
answers None."""

from __future__ import annotations

import json

import pytest

from healthd.controller import healthctl
from healthd.controller.goodput_jobs import GoodputAccountant, GoodputSettings
from healthd.goodput import log_line
from healthd.slurm.backend import SlurmUnavailable
from healthd.slurm.scontrol import ScontrolBackend
from tests.slurm.conftest import _new_root
from tests.support import slurm_accounting
from tests.support.slurm_accounting import AccountingDB
from tests.support.slurm_cluster import SlurmCluster

GPUS = 2


@pytest.fixture(scope="module")
def accounted_cluster(slurm_conf_env):
    missing = slurm_accounting.installed()
    if missing:
        pytest.fail(f"{missing} is not installed (make deps installs mariadb-server and slurmdbd)")
    root = _new_root("acct")
    db = AccountingDB(root / "acct")
    cluster = SlurmCluster(root / "slurm", nodes=2, extra_conf=db.slurm_conf_lines(root / "slurm" / "munge" / "munge.sock")
                           + "\nAccountingStorageTRES=gres/gpu")
    try:
        db.start(cluster)
        cluster.up()
        db.wait_registered(cluster)
        yield cluster, db
    finally:
        try:
            cluster.down()
        finally:
            db.stop()


def _submit(cluster: SlurmCluster, *args: str) -> str:
    out = cluster.run(["sbatch", "--parsable", "--requeue", "-N1", f"--gres=gpu:{GPUS}", *args], check=True).stdout
    return out.strip().split(";")[0]


def _state(cluster: SlurmCluster, job: str) -> str:
    out = cluster.run(["squeue", "-h", "-j", job, "--states=all", "-o", "%T"], timeout=10).stdout.strip()
    return out or "GONE"


def _requeued_job(cluster: SlurmCluster) -> str:
    """A batch job requeued while it ran, then run to completion: two runs in accounting."""
    job = _submit(cluster, "--wrap", "sleep 4")
    cluster.wait_for(lambda: _state(cluster, job) == "RUNNING", 30, what=f"job {job} to run")
    # accounting keeps whole seconds: a first run shorter than one would end when it started
    cluster.wait_for(lambda: cluster.run(["squeue", "-h", "-j", job, "-o", "%M"], timeout=10).stdout.strip()
                     not in ("", "0:00"), 30, what=f"job {job}'s first second of run time")
    cluster.run(["scontrol", "requeue", job], check=True)
    # a requeued job waits (BeginTime) before it starts again; let it go at once
    cluster.wait_for(lambda: _state(cluster, job) == "PENDING", 30, what=f"job {job} requeued")
    cluster.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], timeout=10)
    cluster.wait_for(lambda: _state(cluster, job) == "COMPLETED", 60, what=f"job {job} to complete")
    return job


def test_sacct_has_every_run_of_a_requeued_job(accounted_cluster):
    cluster, _ = accounted_cluster
    job = _requeued_job(cluster)
    backend = ScontrolBackend(str(cluster.conf_path))
    runs = cluster.wait_for(lambda: (r := backend.job_runs(job)) and len(r) == 2 and r[-1].end and r, 30,
                            what=f"both runs of job {job} in accounting")
    first, second = runs
    assert (first.job_id, first.state, second.state) == (job, "REQUEUED", "COMPLETED")
    assert first.start < first.end <= second.start < second.end
    assert all(r.gpus == GPUS and r.partition == "debug" and r.account == "root" for r in runs), runs
    assert first.nodes.startswith("node") and second.admin_comment == ""
    assert backend.job_runs("999999") == []


def test_the_accountant_takes_the_runs_from_sacct_and_writes_the_admin_comment(accounted_cluster, tmp_path, capsys):
    cluster, _ = accounted_cluster
    job = _requeued_job(cluster)
    foreign = _requeued_job(cluster)
    backend = ScontrolBackend(str(cluster.conf_path))
    for j in (job, foreign):
        cluster.wait_for(lambda j=j: (r := backend.job_runs(j)) and len(r) == 2 and r[-1].end, 30,
                         what=f"job {j} in accounting")
    cluster.run(["sacctmgr", "-i", "modify", "job", "where", f"jobid={foreign}", "set",
                 "AdminComment=owner: keep me"], check=True)
    gathered = tmp_path / "gathered"
    for j in (job, foreign):
        first, second = backend.job_runs(j)
        # what rank 0's agent would have logged inside the two runs (its process starts a little
        # after Slurm's start), with a durable save in the first run that the second restores
        a, b = first.start + 0.5, second.start + 0.5
        lines = [log_line(j, job_start_time=a), log_line(j, healthd_event="allocation", time=a, gpus=GPUS),
                 log_line(j, step_count=0, step_start_time=a + 0.1),
                 log_line(j, healthd_event="durable", time=a + 0.5, step=0),
                 log_line(j, healthd_event="run_end", time=first.end, state="FAILED"),
                 log_line(j, job_start_time=b), log_line(j, healthd_event="allocation", time=b, gpus=GPUS),
                 log_line(j, healthd_event="restored", time=b + 0.1, step=0),
                 log_line(j, step_count=1, step_start_time=b + 0.2),
                 log_line(j, healthd_event="run_end", time=second.end, state="COMPLETED")]
        (gathered / j).mkdir(parents=True)
        (gathered / j / "node01.jsonl").write_text("".join(f"{x}\n" for x in lines))
    published = []
    settings = GoodputSettings(directory=str(gathered), settle_s=0)
    acct = GoodputAccountant(settings, backend, str(tmp_path / "no-ledger.sqlite"), published.append)
    try:
        assert sorted(acct.pass_once()) == sorted([job, foreign])
        rows = {r[0]: r for r in acct.jobs.db.execute("SELECT job, partition, account, held_gpu_s, problems FROM jobs")}
    finally:
        acct.jobs.close()
    first, second = backend.job_runs(job)
    held = ((first.end - first.start) + (second.end - second.start)) * GPUS  # allocated: the queue between is not held
    assert rows[job][1:3] == ("debug", "root")
    assert rows[job][3] == pytest.approx(held)  # Slurm's runs, not the log's (which start later)
    assert json.loads(rows[job][4]) == []
    assert published[-1].jobs == {"debug": 2}

    def comment(j: str) -> str:
        return cluster.run(["sacct", "-n", "-X", "-P", "-j", j, "-o", "AdminComment"], check=True).stdout.split("\n")[-2]

    assert comment(job).startswith("healthd: goodput=") and "2 run(s), 1 interruption(s)" in comment(job)
    assert comment(foreign) == "owner: keep me"
    # healthctl on the head node reads the same runs with --sacct, and says the same
    config = tmp_path / "controller.yaml"
    config.write_text(f"slurm_conf: {cluster.conf_path}\n")
    assert healthctl.main(["--config", str(config), "--ledger", str(tmp_path / "no-ledger.sqlite"), "--json", "goodput",
                           "--job", job, "--logs", str(gathered), "--sacct"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["held_gpu_s"] == pytest.approx(held) and doc["ledger"].endswith("2 run(s) from Slurm's accounting")
    assert doc["queued_s"] == pytest.approx(second.start - first.end) and doc["runs"] == 2
    assert f"goodput={doc['goodput']:.1%}" in comment(job)


def test_sacct_says_when_the_site_keeps_no_accounting(slurm_cluster):
    assert ScontrolBackend(str(slurm_cluster.conf_path)).job_runs("1") is None


def test_slurmdbd_down_is_unavailable_not_empty(accounted_cluster):
    cluster, db = accounted_cluster
    proc = db._procs["slurmdbd"]
    proc.terminate()
    proc.wait(timeout=15)
    try:
        with pytest.raises(SlurmUnavailable):
            ScontrolBackend(str(cluster.conf_path), timeout_s=20).job_runs("1")
    finally:
        db.start_slurmdbd(cluster)

"""The per-job in-band directory on a REAL local Slurm cluster (tests/slurm/e2e_support.py): healthd's
Prolog and Epilog through the operator wrapper, and healthd-taskprolog as slurm.conf's TaskProlog.
Jobs run as `nobody`, so the TaskProlog runs as nobody too.

1. A job's tasks get HEALTHD_INBAND_DIR = <run_dir>/inband/<job>, the job user's directory, 0700, in
   the batch step and in every task of an srun step.
2. Ranks write rings there with healthd_inband; after the job the epilog has moved the directory to
   inband/done/<job> (root's, 0700), rings inside, and the live directory is gone.
3. A link planted at inband/<job> before the job: the prolog refuses it and its target stays as it
   was, the job runs, the TaskProlog exports nothing, the epilog moves the link away without
   following it.
4. inband.keep_jobs: done/ keeps the newest jobs only.
5. inband.enabled false: no directory, no export, and the job runs.

`nobody` can neither run this venv's interpreter nor read a checkout in a private directory (under
/root, mode 0700), so the cluster gets a copy of healthd that every user can read (`lib/`, as a site
installs it), and the TaskProlog slurmd runs is a two-line launcher that runs the same entry point,
healthd.hooks.taskprolog:main, from that copy with the system python3 and the node's healthd.yaml (a
site's TaskProlog does the same: docs/inband.md). The jobs' ranks import healthd_inband from there too.
"""

from __future__ import annotations

import os
import pwd
import shutil
import struct
import sys
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from tests.slurm.e2e_support import REPO, HooksCluster, HealthdNode, running_cluster, scenario_then_restore, wait_for

VENV_BIN = Path(sys.executable).parent
SYSTEM_PYTHON = "/usr/bin/python3"
NOBODY = pwd.getpwnam("nobody")

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="a real Slurm cluster needs root (slurmd, mknod)"),
    pytest.mark.skipif(not os.access(SYSTEM_PYTHON, os.X_OK), reason=f"the TaskProlog as nobody needs {SYSTEM_PYTHON}"),
]

LAUNCHER = """#!/bin/sh
# slurm.conf's TaskProlog: run as the job's user, with the task's environment
exec {python} -I -c 'import sys; sys.path.insert(0, "{lib}"); from healthd.hooks.taskprolog import main; \
sys.exit(main(sys.argv[1:]))' --config "{root}/nodes/$SLURMD_NODENAME/healthd.yaml"
"""

# what every job prints: the variable in the batch step, and the directory's mode and owner
SHOW = 'echo "batch HEALTHD_INBAND_DIR=${HEALTHD_INBAND_DIR-unset}"; ' \
       '[ -n "$HEALTHD_INBAND_DIR" ] && stat -c "stat %a %u %F" "$HEALTHD_INBAND_DIR"; '


def readable_copy(cluster: HooksCluster) -> Path:
    """healthd and healthd_inband.py under the cluster's root, readable by every user."""
    lib = cluster.root / "lib"
    shutil.copytree(REPO / "healthd", lib / "healthd", ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
    shutil.copy2(REPO / "healthd_inband.py", lib / "healthd_inband.py")
    for path in [lib, *lib.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return lib


def install_taskprolog(cluster: HooksCluster) -> None:
    cluster.bin.mkdir(parents=True, exist_ok=True)
    path = cluster.bin / "healthd-taskprolog"
    path.write_text(LAUNCHER.format(python=SYSTEM_PYTHON, lib=readable_copy(cluster), root=cluster.root))
    path.chmod(0o755)
    cluster.hooks["TaskProlog"] = str(path)
    out = cluster.root / "out"
    out.mkdir(exist_ok=True)
    out.chmod(0o1777)


@pytest.fixture(scope="module")
def e2e(request: pytest.FixtureRequest, shared_slurm) -> Iterator[HooksCluster]:
    with running_cluster(request, "e2e-inband", VENV_BIN, install_taskprolog, shared=shared_slurm) as cluster:
        yield cluster


@pytest.fixture(autouse=True)
def scenario(e2e: HooksCluster) -> Iterator[HooksCluster]:
    def default_inband() -> None:
        for node in e2e.nodes.values():
            set_inband(node, None)

    with scenario_then_restore(e2e, 120, reset=default_inband):
        yield e2e


def set_inband(node: HealthdNode, section: dict | None) -> None:
    """The node's `inband:` section (None: none, the defaults). The hooks read the file on every run."""
    doc = yaml.safe_load(node.config.read_text())
    doc.pop("inband", None)
    if section is not None:
        doc["inband"] = section
    node.config.write_text(yaml.safe_dump(doc, sort_keys=False))


def submit(e2e: HooksCluster, node: str, script: str, *args: str) -> tuple[str, Path]:
    """A batch job as nobody on `node`; returns (job id, its output file). Submitted as nobody with
    setpriv: `sbatch --uid` (root submitting for another user) is gone from Slurm 26.05."""
    out = e2e.root / "out" / f"{node}-%j.out"
    nobody = pwd.getpwnam("nobody")
    r = e2e.run("setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups",
                "sbatch", "--parsable", "--chdir=/tmp", "-o", str(out), "--time=3", "-w", node,
                *args, "--wrap", script)
    job = r.stdout.strip().split(";", 1)[0]
    assert job.isdigit(), r.stdout
    return job, Path(str(out).replace("%j", job))


def finished(e2e: HooksCluster, node: HealthdNode, job: str, out: Path) -> list[str]:
    """Until the job COMPLETED and its epilog ran; the job's output lines."""
    e2e.wait_job(job, ("COMPLETED",), timeout=40)
    wait_for(lambda: any(f"job {job}: in-band directory" in x or f"job {job} ended" in x
                         for x in node.hook_lines("healthd-epilog")), 20, f"job {job}'s epilog",
             diagnostics=node.diagnostics)
    return out.read_text().splitlines()


def epilog_inband_line(node: HealthdNode, job: str) -> str:
    return node.wait_line("healthd-epilog", f"job {job}: in-band directory", timeout=20)


def value(lines: list[str], prefix: str) -> list[str]:
    return [x[len(prefix):] for x in lines if x.startswith(prefix)]


def ring_head(path: Path) -> tuple[bytes, int]:
    """(magic, head sequence number) of a ring file (docs/inband.md, the header)."""
    data = path.read_bytes()
    return data[:8], struct.unpack_from("<Q", data, 120)[0]


# ----------------------------------------------------------------------------- 1 and 2


def test_the_tasks_get_their_jobs_0700_directory_and_the_epilog_archives_the_rings(e2e: HooksCluster):
    assert "TaskProlog" in e2e.cluster.conf_path.read_text()
    n1 = e2e.nodes["node01"]
    steps = 4
    lib = e2e.root / "lib"
    script = (SHOW + "srun -n2 sh -c 'echo \"task $SLURM_PROCID HEALTHD_INBAND_DIR=$HEALTHD_INBAND_DIR\"'; "
              f"srun -n2 {SYSTEM_PYTHON} -I -c "
              f"'import sys; sys.path.insert(0, \"{lib}\"); import healthd_inband as hd; "
              f"print(\"enabled\", hd.enabled); [hd.step(i) for i in range({steps})]'")
    job, out = submit(e2e, "node01", script, "-n2")
    lines = finished(e2e, n1, job, out)
    live = n1.run_dir / "inband" / job
    assert value(lines, "batch HEALTHD_INBAND_DIR=") == [str(live)], lines
    assert value(lines, "stat ") == [f"700 {NOBODY.pw_uid} directory"], lines
    tasks = sorted(x for x in lines if x.startswith("task "))
    assert tasks == [f"task {r} HEALTHD_INBAND_DIR={live}" for r in (0, 1)], lines
    assert value(lines, "enabled ") == ["True", "True"], lines
    n1.wait_line("healthd-prolog", f"job {job}: in-band directory created {live} (uid {NOBODY.pw_uid}, mode 0700)")

    line = epilog_inband_line(n1, job)
    done = n1.run_dir / "inband" / "done"
    assert f"moved {live} to {done / job}" in line, line
    assert not os.path.lexists(live)
    st = done.lstat()
    assert (st.st_uid, st.st_mode & 0o777) == (0, 0o700)
    rings = sorted(p.name for p in (done / job).iterdir())
    assert rings == ["rank-0.ring", "rank-1.ring"], rings
    for name in rings:
        ring = done / job / name
        assert ring.lstat().st_uid == NOBODY.pw_uid
        assert ring_head(ring) == (b"HDINBAND", steps)


# ----------------------------------------------------------------------------- 3


def test_a_link_planted_at_the_jobs_directory_is_not_followed_and_the_job_runs(e2e: HooksCluster):
    n2 = e2e.nodes["node02"]
    decoy = e2e.root / "decoy"
    decoy.mkdir(mode=0o755)
    decoy.chmod(0o755)
    (decoy / "keep.txt").write_text("untouched\n")
    os.chown(decoy, NOBODY.pw_uid, NOBODY.pw_gid)  # the user's own: a TaskProlog following the link would export it
    before = [(p.name, p.lstat().st_uid, p.lstat().st_mode) for p in (decoy, decoy / "keep.txt")]

    job, out = submit(e2e, "node02", SHOW + "echo ran", "--hold")
    inband = n2.run_dir / "inband"
    inband.mkdir(mode=0o755, exist_ok=True)
    (inband / job).symlink_to(decoy)
    e2e.run("scontrol", "release", job)
    lines = finished(e2e, n2, job, out)

    assert "ran" in lines and value(lines, "batch HEALTHD_INBAND_DIR=") == ["unset"], lines
    assert not value(lines, "stat "), lines
    n2.wait_line("healthd-prolog", f"job {job}: no in-band directory: {inband / job} is a symbolic link")
    assert any(f"job {job} runs" in x for x in n2.hook_lines("healthd-prolog"))
    line = epilog_inband_line(n2, job)
    assert "(a symbolic link, not followed)" in line, line
    assert not os.path.lexists(inband / job)
    assert [(p.name, p.lstat().st_uid, p.lstat().st_mode) for p in (decoy, decoy / "keep.txt")] == before
    assert (decoy / "keep.txt").read_text() == "untouched\n" and sorted(os.listdir(decoy)) == ["keep.txt"]


# ----------------------------------------------------------------------------- 4


def test_done_keeps_the_newest_keep_jobs(e2e: HooksCluster):
    n3 = e2e.nodes["node03"]
    set_inband(n3, {"keep_jobs": 2})
    jobs = []
    for _ in range(4):
        job, out = submit(e2e, "node03", f"touch \"$HEALTHD_INBAND_DIR/mark\"; {SHOW}")
        finished(e2e, n3, job, out)
        epilog_inband_line(n3, job)
        jobs.append(job)
    done = n3.run_dir / "inband" / "done"
    assert sorted(os.listdir(done), key=int) == jobs[-2:]
    assert all((done / j / "mark").is_file() for j in jobs[-2:])
    assert "removed 1 older" in epilog_inband_line(n3, jobs[-1])


# ----------------------------------------------------------------------------- 5


def test_inband_disabled_makes_no_directory_and_exports_nothing(e2e: HooksCluster):
    n4 = e2e.nodes["node04"]
    set_inband(n4, {"enabled": False})
    job, out = submit(e2e, "node04", SHOW + "srun -n1 sh -c 'echo \"task HEALTHD_INBAND_DIR=${HEALTHD_INBAND_DIR-unset}\"'")
    lines = finished(e2e, n4, job, out)
    assert value(lines, "batch HEALTHD_INBAND_DIR=") == ["unset"], lines
    assert value(lines, "task HEALTHD_INBAND_DIR=") == ["unset"], lines
    assert not os.path.lexists(n4.run_dir / "inband" / job)
    assert not os.path.lexists(n4.run_dir / "inband" / "done" / job)
    assert not [x for x in n4.hook_lines() if f"job {job}: " in x and "in-band" in x]

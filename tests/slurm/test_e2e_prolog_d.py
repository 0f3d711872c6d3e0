"""healthd next to a site's own prologs and epilogs, on a REAL local Slurm cluster (22.05 on Debian 12):
slurm.conf says `Prolog=<dir>/prolog.d/*` and `Epilog=<dir>/epilog.d/*` (the layout of
slurm/slurm.conf.snippet), healthd's wrapper is linked in as prolog.d/healthd-prolog and
epilog.d/healthd-epilog, and the site has two scripts in each directory: `00-site-*` and `zz-site-*`, one
on each side of healthd's in any name order.

What Slurm 22.05.8 does with such a glob (verified here, and what slurm/README.md says):
- it runs the matches one after the other, never two at once, in REVERSE byte order of their names
  (zz-site-prolog, healthd-prolog, 00-site-prolog);
- the first one that exits non-zero ends the run: the rest of the list is skipped. A Prolog failure
  drains the node with "Prolog error" unless it is drained already; an Epilog failure likewise with
  "Epilog error".

1. A job on a healthy node: every prolog and every epilog ran, and healthd's prolog recorded the
   binding, its epilog closed it.
2. A job refused by healthd (Xid 79 on node02, gating local): the node keeps healthd's reason -- never
   "Prolog error" -- whether a site prolog ran before healthd's or was skipped after it; both site
   epilogs still run, before and after healthd's (healthd's epilog drains for the T1 finding and exits 0).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Iterator

import pytest

from tests.slurm.e2e_support import HooksCluster, job_field, running_cluster, scenario_then_restore, wait_for
from tests.slurm.test_e2e_hooks import XID79_TEXT, reasons_set, wait_done_binding
from tests.support.slurm_cluster import slurm_version

VENV_BIN = Path(sys.executable).parent
SITE = ("00-site", "zz-site")

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="a real Slurm cluster needs root (slurmd, mknod)")


@pytest.fixture(scope="module")
def e2e(request: pytest.FixtureRequest, shared_slurm) -> Iterator[HooksCluster]:
    """Like test_e2e_hooks's cluster, with the hook directories and a site script on each side."""
    def site_scripts(cluster: HooksCluster) -> None:
        cluster.install_wrappers()
        for prefix in SITE:
            cluster.site_script(cluster.prolog_d, f"{prefix}-prolog")
            cluster.site_script(cluster.epilog_d, f"{prefix}-epilog")

    with running_cluster(request, "e2e-prolog-d", VENV_BIN, site_scripts, shared=shared_slurm,
                         hook_dirs=True) as cluster:
        yield cluster


@pytest.fixture(autouse=True)
def scenario(e2e: HooksCluster) -> Iterator[HooksCluster]:
    with scenario_then_restore(e2e, 90):
        yield e2e


def marks(e2e: HooksCluster, job: str, context: str) -> list[tuple[str, str]]:
    """(site script, healthd binding state when it ran) for `job` in `context`, in the order they ran."""
    return [(m[0], m[4]) for m in e2e.site_marks(job) if m[1] == context]


def test_slurm_conf_names_the_directories_and_healthds_entries_are_the_wrapper(e2e: HooksCluster):
    conf = e2e.cluster.conf_path.read_text().splitlines()
    assert f"Prolog={e2e.prolog_d}/*" in conf and f"Epilog={e2e.epilog_d}/*" in conf
    assert f"HealthCheckProgram={e2e.bin / 'healthd-healthcheck'}" in conf
    assert os.readlink(e2e.prolog_d / "healthd-prolog") == "../bin/healthd-hook"
    assert os.readlink(e2e.epilog_d / "healthd-epilog") == "../bin/healthd-hook"


def test_site_and_healthd_prologs_and_epilogs_all_run_for_a_job(e2e: HooksCluster):
    n1 = e2e.nodes["node01"]
    job = e2e.sbatch("-w", "node01", "--gres=gpu:1", wrap="true")
    e2e.wait_job(job, ("COMPLETED",))
    done = wait_done_binding(n1, job)  # healthd's epilog ran to its end
    assert done["job"] == job and len(done["gpus"]) == 1, done
    n1.wait_line("healthd-prolog", f"job {job} runs")
    pro = wait_for(lambda: len(m := marks(e2e, job, "prolog_slurmd")) == 2 and m, 10, "both site prologs' marks")
    epi = wait_for(lambda: len(m := marks(e2e, job, "epilog_slurmd")) == 2 and m, 10, "both site epilogs' marks")
    # one after the other: each site script saw healthd's binding either not yet written or already there
    assert {s for s, _ in pro} == {"00-site-prolog", "zz-site-prolog"}, pro
    assert {s for s, _ in epi} == {"00-site-epilog", "zz-site-epilog"}, epi
    assert {b for _, b in pro} == {"none", "open"}, pro      # one before healthd's prolog, one after it
    assert {b for _, b in epi} == {"open", "done"}, epi      # one before healthd's epilog, one after it
    if slurm_version() == (22, 5):
        # 22.05 runs the glob's matches in reverse name order: zz-site, healthd-..., 00-site
        assert pro == [("zz-site-prolog", "none"), ("00-site-prolog", "open")], pro
        assert epi == [("zz-site-epilog", "open"), ("00-site-epilog", "done")], epi
    node = e2e.node("node01")
    assert "DRAIN" not in node["State"] and "Reason" not in node, node


def test_refused_job_keeps_healthds_reason_whichever_side_of_healthd_a_site_prolog_runs(e2e: HooksCluster):
    n2 = e2e.nodes["node02"]
    n2.xid(0, 79, XID79_TEXT)
    finding = n2.wait_finding(lambda f: f["id"] == "xid:gpu0:79")
    mark = e2e.ctld_mark()
    job = e2e.sbatch("-w", "node02", "--gres=gpu:4", wrap="true")
    wait_for(lambda: (j := e2e.job(job)) and job_field(j, "Restarts") == "1" and job_field(j, "JobState") == "PENDING",
             30, f"job {job} to be requeued", diagnostics=lambda: e2e.diagnostics(job))
    expected = f"healthd: {finding['summary']} [job {job}]"
    n2.wait_line("healthd-prolog", f"refused job {job}: {expected}")
    node = e2e.node("node02")
    assert "DRAIN" in node["State"].split("+") and node["Reason"] == expected, node

    # the epilog of the refused launch: healthd's finds the node drained, keeps the reason, exits 0
    n2.wait_line("healthd-epilog", f"already drained by healthd ({expected})")
    epi = wait_for(lambda: len(m := marks(e2e, job, "epilog_slurmd")) == 2 and m, 20, "both site epilogs to run")
    log = e2e.ctld_since(mark)
    assert f"Prolog launch failure, JobId={job}" in log and f"JobId={job} epilog error" not in log, log
    assert reasons_set(log, "node02") == [expected], log  # no "Prolog error", no "Epilog error"

    pro = marks(e2e, job, "prolog_slurmd")
    # a site prolog that ran before healthd's saw no binding yet; none ran after healthd's refusal
    assert pro and all(b == "none" for _, b in pro), pro
    # both site epilogs ran: the one before healthd's with the binding still open, the one after it closed
    assert {b for _, b in epi} == {"open", "done"}, epi
    if slurm_version() == (22, 5):
        # reverse name order: zz-site-* runs before healthd's, 00-site-* after it
        assert pro == [("zz-site-prolog", "none")], pro
        assert epi == [("zz-site-epilog", "open"), ("00-site-epilog", "done")], epi
    e2e.run("scancel", job)
    n2.wait_health_checks(1)
    assert e2e.node("node02")["Reason"] == expected

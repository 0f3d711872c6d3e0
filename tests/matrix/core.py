"""The real-cluster core that runs on every Slurm release of the version matrix: tests of the
ordinary suite, chosen here by node id (a whole module when the id ends in `::`), marked `matrix` at
collection (tests/conftest.py). On the host they run with the host's Slurm as part of the suite; in
each release's root file system (tests/support/slurm_roots.py) `pytest -m matrix` runs them again
with that release's Slurm, munge and python3 (tests/matrix/test_slurm_versions.py).

Chosen for what differs between Slurm releases (node states, reasons, reboot, requeue, reservations,
the hooks slurmd runs, slurmctld's state save) and for their cost: the core's share of `make test` is
held to 10 minutes on a 2-core machine (docs/testing.md has the measured times)."""

from __future__ import annotations

CORE: tuple[str, ...] = (
    # the backend contract on a real slurmctld (scontrol backend): drain and resume (reasons up to
    # the longest, hostile text, hostlists), reboot ASAP and its cancel, requeue, a maintenance
    # reservation, jobs, steps, slurmctld down; both node readers (sinfo --json and scontrol -o)
    "tests/slurm/test_backend_contract.py::test_scontrol_backend_on_real_slurm",
    "tests/slurm/test_backend_contract.py::test_scontrol_json_and_oneliner_reads_agree",
    "tests/slurm/test_backend_contract.py::test_fleet_cache_follows_real_slurm_parsing_only_changed_lines",
    "tests/slurm/test_backend_contract.py::test_scontrol_reads_boot_times_from_real_slurm",
    # the same contract on the real pyslurm (24.11 only: ONLY_ON), and both backends reading alike
    "tests/slurm/test_backend_contract.py::test_pyslurm_backend_on_real_pyslurm",
    "tests/slurm/test_backend_contract.py::test_real_pyslurm_reads_what_scontrol_reads",
    # the test cluster itself, and a job a prolog refused: requeued without a hold
    "tests/slurm/test_cluster.py::test_four_idle_nodes_with_four_gpus_each",
    "tests/slurm/test_cluster.py::test_srun_gets_a_gpu_on_every_node",
    "tests/slurm/test_cluster.py::test_drain_with_spaces_then_resume",
    "tests/slurm/test_cluster.py::test_hooks_run_and_a_refused_job_is_requeued_without_hold",
    # prolog.d/epilog.d: the order of a site's scripts and healthd's, a refused job's reason
    "tests/slurm/test_e2e_prolog_d.py::",
    # HealthCheckProgram, the prolog and epilog through the operator's wrapper; an administrator's
    # drain kept; a reboot requested by the epilog
    "tests/slurm/test_e2e_hooks.py::test_cluster_runs_the_hooks_through_the_operator_wrapper",
    "tests/slurm/test_e2e_hooks.py::test_xid79_prolog_refuses_the_job_drains_with_healthds_reason_and_the_job_runs_elsewhere",
    "tests/slurm/test_e2e_hooks.py::test_admin_drain_reason_survives_health_checks_and_epilogs",
    "tests/slurm/test_e2e_hooks.py::test_pending_row_remap_epilog_requests_a_reset_and_slurm_shows_the_reboot_request",
    # the controller on the cluster: a drain, and the requeue of an opted-in job
    "tests/controller/test_controller_cluster.py::test_auto_drains_node02_with_healthd_reason",
    "tests/controller/test_controller_cluster.py::test_drain_and_requeue_requeues_the_opted_in_batch_job",
    # a whole fleet (agents, healthd-controller): drain and resume with the ownership proof,
    # reconcile after slurmctld is killed and restarted, the maintenance reservation and validation
    "tests/faults/test_ownership.py::test_a_lookalike_healthd_reason_is_foreign",
    "tests/faults/test_ownership.py::test_a_same_text_redrain_is_invisible_in_slurm_and_release_hands_the_node_over",
    "tests/faults/test_ownership.py::test_an_administrator_resuming_a_healthd_drain_is_respected_and_a_new_fault_is_acted_on",
    "tests/faults/test_slurmctld.py::test_slurmctld_killed_right_after_a_drain_comes_back_without_it_and_healthd_applies_it_again",
    "tests/faults/test_kill_points.py::test_kill_at_each_reintegration_write[after-resume into the reservation-State=RESUME]",
    "tests/faults/test_kill_points.py::test_kill_at_the_redrain_after_a_failed_validation[after]",
    # sacct with slurmdbd (and MariaDB): a requeued job's runs, the AdminComment written with
    # sacctmgr, slurmdbd down
    "tests/slurm/test_accounting.py::",
    # not Slurm, but the release's own systemd: since 254 a journal reader left at the tail of a
    # journal without a kernel line never sees a later one (the agent seeks to the head then)
    "tests/agent/collectors/kernel_log/test_follower.py::test_empty_journal_dir_without_fallback_is_watched",
    "tests/agent/collectors/kernel_log/test_follower.py::test_start_at_tail_before_any_kernel_line",
    "tests/agent/collectors/kernel_log/test_follower.py::test_start_at_tail_reads_only_new_lines",
)


# entries of the core that run on one release only (elsewhere they skip, saying why): pyslurm 24.11.0
# builds only against Slurm 24.11 (tests/support/pyslurm_build.py, make pyslurm-root)
ONLY_ON: dict[str, str] = {
    "tests/slurm/test_backend_contract.py::test_pyslurm_backend_on_real_pyslurm": "trixie",
    "tests/slurm/test_backend_contract.py::test_real_pyslurm_reads_what_scontrol_reads": "trixie",
}


def applies(entry: str, release: str) -> bool:
    """Whether an entry of the core must pass on `release` (a Debian release of the matrix)."""
    return ONLY_ON.get(entry, release) == release


def in_core(nodeid: str) -> bool:
    """Whether a collected test (its node id) belongs to the core."""
    return any(nodeid == c or (c.endswith("::") and nodeid.startswith(c)) or nodeid.startswith(c + "[")
               for c in CORE)

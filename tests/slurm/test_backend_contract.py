"""The SlurmBackend contract (tests/slurm/contract.py) against
- ScontrolBackend on a real Slurm (a local cluster from tests/support/slurm_cluster.py), and
- PyslurmBackend on the pyslurm 25.11 stand-in (tests/slurm/pyslurm_standin).

The real cluster is the session's `slurm_cluster`: its RebootProgram=/bin/true lets `scontrol reboot`
through (refused outright without one: "RebootProgram isn't defined"). The reboot checks use a busy
node, so the reboot stays requested and is cancelled before it is ever issued; /bin/true never runs.
"""

from __future__ import annotations

import importlib
import sys
import time
from pathlib import Path

import pytest

from healthd.slurm.backend import SlurmUnavailable
from healthd.slurm.pyslurm_backend import PyslurmBackend
from healthd.slurm.scontrol import CommandResult, CommandTimeout, ScontrolBackend, run_command
from tests.slurm import contract

STANDIN_DIR = Path(__file__).parent / "pyslurm_standin"


# ----------------------------------------------------------------------------- the real cluster


class CountingRunner:
    """run_command, counting the client processes started."""

    def __init__(self):
        self.count = 0

    def __call__(self, argv, env, timeout_s):
        self.count += 1
        return run_command(argv, env, timeout_s)


class RealCtl:
    def __init__(self, cluster, runner: CountingRunner):
        self.cluster = cluster
        self.runner = runner
        self.nodes = list(cluster.nodes)

    def _out(self, argv, timeout=15) -> str:
        return self.cluster.run(argv, timeout=timeout, check=True).stdout

    def reset(self) -> None:
        self.cluster.run(["scancel", "--user=root"], timeout=15)
        self.cluster.wait_for(
            lambda: not self._out(["squeue", "-h", "-o", "%i"]).strip(), 30, what="all jobs to end"
        )
        for line in self.cluster.run(["scontrol", "show", "reservation", "-o"], timeout=10).stdout.splitlines():
            if line.startswith("ReservationName=healthd-"):
                name = line.split()[0].split("=", 1)[1]
                self.cluster.run(["scontrol", "delete", f"ReservationName={name}"], timeout=10)
        for node in self.nodes:
            state = self.cluster.node_state(node)["State"]
            if "REBOOT_REQUESTED" in state:
                self.cluster.run(["scontrol", "cancel_reboot", node], timeout=10)
                state = self.cluster.node_state(node)["State"]
            if any(flag in state for flag in ("DRAIN", "DOWN", "FAIL", "REBOOT")):
                self.cluster.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], timeout=10, check=True)
        self.cluster.wait_idle(30)

    def submit_running_job(self, node: str, comment: str = "") -> int:
        extra = [f"--comment={comment}"] if comment else []
        out = self._out(["sbatch", "--parsable", "-w", node, "-o", "/dev/null", *extra, "--wrap", "sleep 300"])
        job = int(out.strip().split(";")[0])
        self.cluster.wait_for(lambda: self.job_state(job) == "RUNNING", 30, what=f"job {job} to run on {node}")
        return job

    def job_state(self, job_id: int) -> str:
        res = self.cluster.run(["squeue", "-h", "-j", str(job_id), "-o", "%T"], timeout=10)
        return res.stdout.strip() if res.returncode == 0 else ""

    def reservation_exists(self, name: str) -> bool:
        res = self.cluster.run(["scontrol", "show", "reservation", "-o", name], timeout=10)
        return res.returncode == 0 and f"ReservationName={name} " in res.stdout

    def step(self, node: str, command: list[str]) -> list[str]:
        return step_argv(node, command)

    def stop_ctld(self) -> None:
        self.cluster.stop_ctld()

    def start_ctld(self) -> None:
        self.cluster.start_ctld()

    def calls(self) -> int:
        return self.runner.count

    def settle(self, node: str) -> None:
        self.cluster.wait_for(
            lambda: not self.cluster.sinfo_states().get(node, "*").endswith("*"), 15, what=f"{node} to respond"
        )


def step_argv(node: str, command: list[str]) -> list[str]:
    return ["srun", f"--nodelist={node}", "--nodes=1", "--time=1", "--job-name=healthd-contract", *command]


@pytest.fixture(scope="module")
def contract_cluster(slurm_cluster):
    return slurm_cluster


def real_env(cluster, pyslurm_module=None):
    """The backend on the real cluster and its Ctl, both counting the Slurm calls made: ScontrolBackend,
    or PyslurmBackend over `pyslurm_module` with a ScontrolBackend as its fallback. Reset around each test."""
    runner = CountingRunner()
    scontrol = ScontrolBackend(str(cluster.conf_path), timeout_s=10, runner=runner)
    if pyslurm_module is None:
        backend, ctl = scontrol, RealCtl(cluster, runner)
    else:
        backend = CountingPyslurmBackend(pyslurm_module, fallback=scontrol, timeout_s=10)
        ctl = RealPyslurmCtl(cluster, runner, backend)
    ctl.reset()
    yield backend, ctl
    ctl.reset()


@pytest.fixture
def scontrol_env(contract_cluster):
    yield from real_env(contract_cluster)


@pytest.mark.slow
@pytest.mark.parametrize("check", contract.CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
def test_scontrol_backend_on_real_slurm(check, scontrol_env):
    backend, ctl = scontrol_env
    check(backend, ctl)


def test_scontrol_json_and_oneliner_reads_agree(scontrol_env):
    """The same drained node read through `sinfo --json` and through `scontrol show node -o`."""
    backend, ctl = scontrol_env
    backend.drain("node02", contract.HOSTILE_REASON)
    as_json = backend.nodes()
    oneliner = ScontrolBackend(backend.slurm_conf, read_mode="oneliner").nodes()
    assert as_json == oneliner
    assert {n.name: n for n in oneliner}["node02"].reason == contract.HOSTILE_REASON


def test_fleet_cache_follows_real_slurm_parsing_only_changed_lines(scontrol_env):
    """The controller's fleet view over `scontrol show node -o`: the first read parses every node, a
    read with nothing changed parses none, and after a drain (a hostile reason) and a resume the
    snapshot equals what a whole read of Slurm gives."""
    from healthd.controller.fleetcache import FleetCache, out_of_service

    backend, ctl = scontrol_env
    cache = FleetCache(backend)
    assert cache.node_addresses() is None  # nothing read yet
    first = cache.refresh()
    assert first.parsed == len(ctl.nodes) and first.changed == len(ctl.nodes)
    assert dict(cache.snapshot().nodes) == {n.name: n for n in backend.nodes()}
    assert cache.node_addresses() == backend.node_addresses()  # NodeAddr comes with the lines
    backend.drain("node02", contract.HOSTILE_REASON)
    after = cache.refresh()
    assert 1 <= after.parsed <= len(ctl.nodes)  # node02, and any whose load figures moved meanwhile
    snap = cache.snapshot()
    assert snap.nodes["node02"].reason == contract.HOSTILE_REASON and "node02" in snap.out_of_service
    assert dict(snap.nodes) == {n.name: n for n in backend.nodes()}
    backend.resume("node02")
    cache.refresh()
    snap = cache.snapshot()
    whole = {n.name: n for n in backend.nodes()}
    assert dict(snap.nodes) == whole and snap.nodes["node02"].reason == ""
    assert cache.node_addresses() == backend.node_addresses()
    assert snap.out_of_service == {n for n, info in whole.items() if out_of_service(info)}
    assert set(snap.partitions["debug"]) == set(ctl.nodes)


def test_scontrol_reads_boot_times_from_real_slurm(scontrol_env):
    """A real slurmctld gives both times the reconciler needs: the node's boot and its own start."""
    backend, _ = scontrol_env
    import time

    (info,) = backend.nodes(["node01"])
    assert info.boot_time is not None and info.boot_time <= time.time()
    assert backend.node("node01").boot_time == info.boot_time
    started = backend.ctld_started_at()
    assert started is not None and info.boot_time <= started <= time.time() + 1


# ----------------------------------------------------------------------------- the pyslurm stand-in


@pytest.fixture
def standin():
    """The stand-in imported as `pyslurm` for this test only: its directory goes first on
    sys.path, and afterwards sys.path and sys.modules are put back as they were."""
    saved = {k: v for k, v in sys.modules.items() if k == "pyslurm" or k.startswith("pyslurm.")}
    for k in saved:
        del sys.modules[k]
    sys.path.insert(0, str(STANDIN_DIR))
    try:
        module = importlib.import_module("pyslurm")
        assert Path(module.__file__).is_relative_to(STANDIN_DIR), module.__file__
        module._standin_reset()
        yield module
    finally:
        sys.path.remove(str(STANDIN_DIR))
        for k in [k for k in sys.modules if k == "pyslurm" or k.startswith("pyslurm.")]:
            del sys.modules[k]
        sys.modules.update(saved)


class StandinScontrol:
    """What the stand-in cluster answers to the client calls PyslurmBackend's fallback makes: reboot
    and array-task requeue (pyslurm 25.11 has no call for them), squeue for jobs, `scontrol show
    node -o` for node addresses, and srun for job steps (printenv, false and sleep, as a real step
    would end)."""

    def __init__(self, ps):
        self.ps = ps
        self.count = 0

    def __call__(self, argv, env, timeout_s):
        self.count += 1
        assert env.get("SLURM_CONF"), "a Slurm client ran without SLURM_CONF"
        if argv[1:3] == ["reboot", "ASAP"]:
            opts = dict(a.split("=", 1) for a in argv[3:-1])
            try:
                self.ps._standin_reboot(argv[-1], opts["reason"], opts["nextstate"])
            except self.ps.RPCError as exc:
                return CommandResult(1, "", f"scontrol_reboot_nodes error: {exc.msg}\n")
            return CommandResult(0, "", "")
        if argv[1:] == ["show", "config"]:
            if not self.ps._standin_cluster().ctld_up:
                return CommandResult(1, "", "slurm_load_ctl_conf error: Unable to contact slurm controller\n")
            return CommandResult(0, "Configuration data as of 2026-12-01T08:00:00\n"
                                    "BOOT_TIME               = 2026-12-01T07:00:00\n", "")
        if argv[0] == "squeue":
            return self._squeue(argv)
        if argv[1:] == ["show", "node", "-o"]:
            cluster = self.ps._standin_cluster()
            if not cluster.ctld_up:
                return CommandResult(1, "", "slurm_load_node error: Unable to contact slurm controller\n")
            return CommandResult(0, "".join(f"NodeName={n.name} Arch=x86_64 NodeAddr=127.0.0.1 NodeHostName=localhost "
                                            f"State={n.base} Reason=NodeAddr=10.0.0.1\n"
                                            for n in cluster.nodes.values()), "")
        if argv[0] == "srun":
            return self._srun(argv, timeout_s)
        if "/" in argv[0]:
            raise FileNotFoundError(2, "No such file or directory", argv[0])
        return CommandResult(1, "", f"stand-in scontrol cannot do {argv[1:]}\n")

    def _squeue(self, argv):
        cluster = self.ps._standin_cluster()
        if not cluster.ctld_up:
            return CommandResult(1, "", "slurm_load_jobs error: Unable to contact slurm controller (connect failure)\n")
        opts = dict(a.split("=", 1) for a in argv if a.startswith("--") and "=" in a and not a.startswith("--Format"))
        if "--jobs" in opts:
            jid = int(opts["--jobs"])
            if jid not in cluster.jobs:
                return CommandResult(1, "", "slurm_load_jobs error: Invalid job id specified\n")
            jobs = {jid: cluster.jobs[jid]}
        else:
            jobs = {j: job for j, job in cluster.jobs.items()
                    if job["node"] == opts["--nodelist"] and job["state"] == "RUNNING"}
        lines = [f"{j:<40}|{'1' if job['batch'] else '0':<4}|{job.get('restarts', 0):<10}|{job['state']:<24}|"
                 f"{'debug':<64}|{'root':<64}|{job.get('comment', ''):<1000}" for j, job in sorted(jobs.items())]
        return CommandResult(0, "".join(line + "\n" for line in lines), "")

    def _srun(self, argv, timeout_s):
        node = next(a.split("=", 1)[1] for a in argv if a.startswith("--nodelist="))
        command = [a for a in argv[1:] if not a.startswith("-")]
        if command[:2] == ["printenv", "SLURMD_NODENAME"]:
            return CommandResult(0, f"{node}\n", "")
        if command[:1] == ["false"]:
            return CommandResult(1, "", f"srun: error: {node}: task 0: Exited with exit code 1\n")
        if command[:1] == ["sleep"] and float(command[1]) > timeout_s:
            raise CommandTimeout(f"{argv[0]} did not finish within {timeout_s:g} s")
        return CommandResult(0, "", "")


class StandinCtl:
    def __init__(self, ps, fallback_runner: StandinScontrol):
        self.ps = ps
        self.fallback_runner = fallback_runner
        self.nodes = list(contract.NODES)

    @property
    def cluster(self):
        return self.ps._standin_cluster()

    def reset(self) -> None:
        self.ps._standin_reset(self.nodes)

    def submit_running_job(self, node: str, comment: str = "") -> int:
        return self.ps._standin_submit(node, comment)

    def job_state(self, job_id: int) -> str:
        job = self.cluster.jobs.get(job_id)
        return job["state"] if job else ""

    def reservation_exists(self, name: str) -> bool:
        return name in self.cluster.reservations

    def step(self, node: str, command: list[str]) -> list[str]:
        return step_argv(node, command)

    def stop_ctld(self) -> None:
        self.cluster.ctld_up = False

    def start_ctld(self) -> None:
        self.cluster.ctld_up = True

    def calls(self) -> int:
        return len(self.cluster.calls) + self.fallback_runner.count

    def settle(self, node: str) -> None:
        pass


@pytest.fixture
def pyslurm_env(standin):
    runner = StandinScontrol(standin)
    fallback = ScontrolBackend("/standin/slurm.conf", runner=runner)
    backend = PyslurmBackend(standin, fallback=fallback, timeout_s=10)
    ctl = StandinCtl(standin, runner)
    ctl.reset()
    return backend, ctl


@pytest.mark.parametrize("check", contract.CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
def test_pyslurm_backend_on_standin(check, pyslurm_env):
    backend, ctl = pyslurm_env
    check(backend, ctl)


def test_pyslurm_slow_slurmctld_times_out_and_later_calls_fail_fast(pyslurm_env):
    backend, ctl = pyslurm_env
    backend.timeout_s = 0.3
    ctl.cluster.hang_s = 1.0
    started = time.monotonic()
    with pytest.raises(SlurmUnavailable, match="did not return within"):
        backend.nodes()
    with pytest.raises(SlurmUnavailable, match="still waiting"):
        backend.drain("node01", "healthd: x")
    assert time.monotonic() - started < 0.9
    time.sleep(1.0)  # the stuck call returns; the backend is usable again
    ctl.cluster.hang_s = 0.0
    assert len(backend.nodes()) == 4


def test_pyslurm_describe_is_the_call_made(pyslurm_env):
    backend, _ = pyslurm_env
    assert backend.describe("drain", nodes=["node02", "node01"], reason="healthd: x 'y' [#1]") == [
        "pyslurm.Node('node[01-02]').modify(pyslurm.Node(state='DRAIN', reason=\"healthd: x 'y' [#1]\"))"
    ]
    assert backend.describe("requeue", job_id=7) == ["pyslurm.Job(7).requeue()"]
    assert backend.describe("create_reservation", name="healthd-v1", nodes="node03", duration_min=30) == [
        "pyslurm.Reservation(name='healthd-v1', nodes='node03', users=['root'], duration=30, "
        "flags=pyslurm.ReservationFlags.MAINTENANCE | pyslurm.ReservationFlags.IGNORE_RUNNING_JOBS).create()"
    ]
    # what pyslurm 25.11 cannot do goes through scontrol, and says so
    assert backend.describe("reboot_asap", nodes="node03", reason="healthd: r")[1:] == [
        "reboot", "ASAP", "nextstate=RESUME", "reason=healthd: r", "node03"
    ]


# ----------------------------------------------------------------------------- the real pyslurm


def real_pyslurm_skip_reason() -> str | None:
    """Why this interpreter cannot run PyslurmBackend on the real pyslurm (None when it can): pyslurm
    must be installed and built for the Slurm here (tests/support/pyslurm_build.py installs 24.11.0
    in the Debian trixie root, whose Slurm is 24.11). Asked of the package metadata, not by
    importing: `import pyslurm` initialises libslurm for the whole process."""
    import importlib.metadata

    from healthd.slurm.scontrol import parse_version
    from tests.support import pyslurm_build
    from tests.support.slurm_cluster import slurm_version

    try:
        version = importlib.metadata.version("pyslurm")
    except importlib.metadata.PackageNotFoundError:
        built = pyslurm_build.missing_reason()
        return built or ("pyslurm is not installed in this interpreter (it is built for Slurm 24.11 only, in the "
                         "trixie root: python -m tests.support.pyslurm_build ROOT)")
    here = slurm_version()
    if parse_version(version) != here:
        return f"pyslurm {version} is built for another Slurm than this {here[0]}.{here[1]:02d}"
    return None


class CountingPyslurmBackend(PyslurmBackend):
    """PyslurmBackend counting the pyslurm calls it makes (every one goes through _call)."""

    rpcs = 0

    def _call(self, what, fn):
        self.rpcs += 1
        return super()._call(what, fn)


class RealPyslurmCtl(RealCtl):
    def __init__(self, cluster, runner: CountingRunner, backend: CountingPyslurmBackend):
        super().__init__(cluster, runner)
        self.backend = backend

    def calls(self) -> int:
        return self.runner.count + self.backend.rpcs


@pytest.fixture
def real_pyslurm_env(contract_cluster):
    reason = real_pyslurm_skip_reason()
    if reason:
        pytest.skip(reason)
    from healthd.slurm import _import_pyslurm

    module = _import_pyslurm(str(contract_cluster.conf_path))
    assert not Path(module.__file__).is_relative_to(STANDIN_DIR), module.__file__
    yield from real_env(contract_cluster, module)


@pytest.mark.slow
@pytest.mark.parametrize("check", contract.CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
def test_pyslurm_backend_on_real_pyslurm(check, real_pyslurm_env):
    check(*real_pyslurm_env)


def test_real_pyslurm_reads_what_scontrol_reads(real_pyslurm_env):
    """The same cluster read by both backends, a hostile drain reason included: every NodeInfo equal."""
    backend, ctl = real_pyslurm_env
    scontrol = ScontrolBackend(str(ctl.cluster.conf_path), timeout_s=10)
    backend.drain("node02", contract.HOSTILE_REASON)
    ctl.submit_running_job("node03")
    assert backend.nodes() == scontrol.nodes()
    assert backend.node("node02") == scontrol.node("node02")
    assert backend.version() == scontrol.version()
    started = backend.ctld_started_at()
    assert started is not None and abs(started - scontrol.ctld_started_at()) <= 1


# ----------------------------------------------------------------------------- default_backend


def _fake_scontrol(version: str) -> ScontrolBackend:
    def runner(argv, env, timeout_s):
        assert argv[1:] == ["--version"] and env["SLURM_CONF"]
        return CommandResult(0, f"slurm {version}\n", "")

    return ScontrolBackend("/etc/slurm/slurm.conf", runner=runner)


def test_default_backend_needs_a_slurm_conf(monkeypatch):
    from healthd.slurm import default_backend

    monkeypatch.delenv("SLURM_CONF", raising=False)
    with pytest.raises(SlurmUnavailable, match="no slurm.conf"):
        default_backend()


def test_default_backend_takes_pyslurm_only_when_its_slurm_version_matches(standin, caplog):
    from healthd.slurm import default_backend

    caplog.set_level("INFO")
    chosen = default_backend(scontrol=_fake_scontrol("22.05.8"), pyslurm_module=standin, prefer_pyslurm=True)
    assert isinstance(chosen, ScontrolBackend)
    assert "pyslurm 25.11.2 is built for Slurm 25.11, this is Slurm 22.05.8" in caplog.text
    caplog.clear()
    chosen = default_backend(scontrol=_fake_scontrol("25.11.1"), pyslurm_module=standin, prefer_pyslurm=True)
    assert isinstance(chosen, PyslurmBackend) and isinstance(chosen.fallback, ScontrolBackend)
    assert "Slurm backend: pyslurm 25.11.2 (matches Slurm 25.11.1)" in caplog.text
    caplog.clear()
    chosen = default_backend(scontrol=_fake_scontrol("25.11.1"), prefer_pyslurm=False)
    assert isinstance(chosen, ScontrolBackend) and "not wanted" in caplog.text


def test_default_backend_without_pyslurm_installed(caplog):
    import importlib.metadata

    from healthd.slurm import default_backend

    try:
        importlib.metadata.version("pyslurm")
        pytest.skip("pyslurm is installed here")
    except importlib.metadata.PackageNotFoundError:
        pass
    caplog.set_level("INFO")
    assert isinstance(default_backend(scontrol=_fake_scontrol("22.05.8"), prefer_pyslurm=True), ScontrolBackend)
    assert "pyslurm is not installed" in caplog.text


def test_scontrol_is_the_default_even_where_pyslurm_matches(standin, caplog):
    """pyslurm is opt-in (the controller's `slurm_backend: pyslurm`): a matching pyslurm alone
    does not choose it, and the version is not even read."""
    from healthd.slurm import default_backend

    def runner(argv, env, timeout_s):
        raise AssertionError(f"no Slurm client may run to choose the default backend: {argv}")

    caplog.set_level("INFO")
    chosen = default_backend(scontrol=ScontrolBackend("/etc/slurm/slurm.conf", runner=runner), pyslurm_module=standin)
    assert isinstance(chosen, ScontrolBackend) and "not wanted" in caplog.text


def test_pyslurm_is_imported_without_auto_init_and_initialised_with_our_slurm_conf(standin, monkeypatch):
    import os

    from healthd.slurm import _import_pyslurm

    monkeypatch.delenv("PYSLURM_DISABLE_AUTO_INIT", raising=False)
    monkeypatch.setenv("SLURM_CONF", "/elsewhere/slurm.conf")
    module = _import_pyslurm("/etc/slurm/site.conf")
    assert module is standin and module._standin_cluster().init_path == "/etc/slurm/site.conf"
    assert "PYSLURM_DISABLE_AUTO_INIT" not in os.environ
    # pyslurm 24.11 reads SLURM_CONF on import (it has no PYSLURM_DISABLE_AUTO_INIT): ours only meanwhile
    assert os.environ["SLURM_CONF"] == "/elsewhere/slurm.conf"

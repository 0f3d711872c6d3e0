"""FleetHarness: a whole healthd fleet on one machine, every part real and started as its own process.

    from demo.harness import FleetHarness
    with FleetHarness(policy={"mode": "auto"}) as fleet:      # returns once every agent reported
        fleet.inject_xid("node02", 79)                        # a kernel journal entry on node02
        fleet.agent_state("node02")["verdict"]                # the agent's state file
        fleet.slurm_node("node02")["State"]                   # `scontrol show node -o`
        fleet.healthctl("incidents")                          # `healthctl --ledger ... --json incidents`

What runs (all stopped by PID in `stop()`, which `__exit__`, Ctrl-C and a failed start all reach):
- tests/support/slurm_cluster.SlurmCluster: munged + slurmctld + slurmd node01..node04 on 127.0.0.1,
  fake GPUs (gpu:4 per node);
- tests/controller/munge_support.MungeFleet: one munged per node with its own --origin (127.0.0.2..),
  plus the controller's, so the controller checks each report's node against its credential;
- per node, a simulated GPU node (the C stand-in for libnvidia-ml loaded by pynvml, an NDR InfiniBand
  sysfs tree, a directory of real journal files) and one real `healthd run` agent reporting to ...
- ... the real `healthd-controller` (its own YAML config, ledger and admin socket).

Everything lives in one directory under /tmp with mode 0755 (munged, slurmctld and a job's user must
traverse it), removed at stop. Every Slurm client runs with SLURM_CONF set.

A test session passes the cluster and the munged fleet it shares (tests/support/shared_daemons.py):
the harness then runs on them, configured by their owner, and leaves them running at stop.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, TypeVar

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.controller.munge_support import MungeFleet, munged_path  # noqa: E402
from tests.support.fake_nvml import build_fake_nvml, healthy_node, write_nvml_config  # noqa: E402
from tests.support.ib_tree import make_ndr_node  # noqa: E402
from tests.support.journal import write_journal  # noqa: E402
from tests.support.polling import free_port, poll, scrape  # noqa: E402
from tests.support.shared_daemons import base_extra_conf  # noqa: E402
from tests.support.slurm_cluster import SlurmCluster, ensure_installed  # noqa: E402

BIN = Path(sys.executable).parent
HEALTHD = str(BIN / "healthd")
HEALTHCTL = str(BIN / "healthctl")
T = TypeVar("T")

XID_TEXT = {
    79: "GPU has fallen off the bus.",
    48: "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 0, subpartition 0.",
    95: "Uncontained ECC error",
}


class HarnessError(RuntimeError):
    """A part of the fleet did not start or did not answer; the message says which and shows its log."""


def kernel_bus(nvml_bus: str) -> str:
    """00000000:3B:00.0 -> 0000:3b:00, as the driver prints it in an Xid line."""
    return nvml_bus[4:].lower().rsplit(".", 1)[0]


def wait_for(probe: Callable[[], T], timeout_s: float, interval_s: float = 0.05, what: str = "condition") -> T:
    """Call `probe` until it returns something truthy; that value, or HarnessError after timeout_s."""
    return poll(probe, timeout_s, what, interval=interval_s, error=HarnessError)


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"({path} unreadable)"


def _stop_proc(proc: subprocess.Popen | None, grace_s: float = 5.0) -> None:
    """SIGTERM by PID, SIGKILL after grace_s, reap (PID 1 here may not)."""
    _stop_procs([proc], grace_s)


def _stop_procs(procs: Sequence[subprocess.Popen | None], grace_s: float = 5.0) -> None:
    """_stop_proc for several at once: all are sent SIGTERM before any is waited for, so their shutdowns
    (an agent's last report, up to 2 s) overlap."""
    running = [p for p in procs if p is not None and p.poll() is None]
    for proc in list(running):
        try:
            os.kill(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            running.remove(proc)
    deadline = time.monotonic() + grace_s
    for proc in running:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


@dataclasses.dataclass
class SimNode:
    """One simulated GPU node: NVML values, an IB tree, a journal directory, the agent's config."""

    name: str
    root: Path
    gpus: list[dict]
    proc: subprocess.Popen | None = None
    log_from: int = 0
    """The size of `log` when the running agent started: what it logged comes after."""

    @property
    def journal(self) -> Path:
        return self.root / "journal"

    @property
    def config(self) -> Path:
        return self.root / "healthd.yaml"

    @property
    def state_file(self) -> Path:
        return self.root / "run" / "state.json"

    @property
    def nvml_values(self) -> Path:
        return self.root / "nvml.conf"

    @property
    def log(self) -> Path:
        return self.root / "agent.log"

    def bus(self, gpu: int) -> str:
        return kernel_bus(self.gpus[gpu]["bus_id"])


class FleetHarness:
    """Slurm cluster + MungeFleet + one `healthd run` per node + `healthd-controller` (see the module doc).

    policy: the controller config's `policy` mapping (mode, breaker_*, max_actions_per_hour, ...).
    extra_config: further top-level controller config keys (e.g. `reintegration`).
    agent_config: further top-level keys of every agent's config (e.g. `classify`).
    round_s: the controller's round period (its hidden --interval flag).
    agent_interval_s / heartbeat_s: the agents' collector period and report heartbeat.
    requeue_delay_s / sched_interval_s: Slurm's AuthInfo cred_expire (how long a requeued job waits
        before it may start again; Slurm's default 120 s) and SchedulerParameters sched_interval (the
        main scheduling loop's period; default 60 s), shortened so a requeued job restarts within seconds.
    idle_nodes: more nodes declared in slurm.conf (idle00001...) that never run a slurmd: slurmctld
        holds them as down, not responding, as a large fleet's idle view costs it and its clients.
    cluster / munge: a running SlurmCluster (with `nodes` nodes of `gpus_per_node` GPUs, configured
        with slurm_extra_conf()) and a running MungeFleet of its nodes to use instead of starting
        them; stop() leaves both running.
    ledger_dir: where the controller keeps its ledger (default: its own directory);
    controller_extra_env: more environment for the controller (systemd's notify socket).
    """

    def __init__(self, nodes: int = 4, gpus_per_node: int = 4, *, policy: Mapping[str, Any] | None = None,
                 extra_config: Mapping[str, Any] | None = None, agent_config: Mapping[str, Any] | None = None,
                 round_s: float = 0.5,
                 agent_interval_s: float = 5.0, heartbeat_s: float = 5.0, requeue_delay_s: int = 10,
                 sched_interval_s: int = 2, idle_nodes: int = 0, log: Callable[[str], None] | None = None,
                 cluster: SlurmCluster | None = None, munge: MungeFleet | None = None):
        if cluster is not None and (len(cluster.nodes) != nodes or cluster.gpus_per_node != gpus_per_node
                                    or idle_nodes):
            raise HarnessError(f"the cluster given has {len(cluster.nodes)} nodes of {cluster.gpus_per_node} GPUs; "
                               f"this fleet wants {nodes} of {gpus_per_node} and {idle_nodes} idle nodes")
        self.own_cluster = cluster is None
        self.own_munge = munge is None
        self.node_count = nodes
        self.idle_nodes = idle_nodes
        self.gpus_per_node = gpus_per_node
        self.policy = dict(policy or {"mode": "auto"})
        self.extra_config = dict(extra_config or {})
        self.agent_config = dict(agent_config or {})
        self.round_s = round_s
        self.agent_interval_s = agent_interval_s
        self.heartbeat_s = heartbeat_s
        self.requeue_delay_s = requeue_delay_s
        self.sched_interval_s = sched_interval_s
        self.say = log or (lambda _msg: None)
        self.root: Path | None = None
        self.cluster: SlurmCluster | None = cluster
        self.munge: MungeFleet | None = munge
        self.nodes: dict[str, SimNode] = {}
        self.controller: subprocess.Popen | None = None
        self.controller_path_prefix: str | None = None
        """A directory put first on the controller's PATH (a test's Slurm client wrapper)."""
        self.ledger_dir: Path | None = None
        self.controller_extra_env: dict[str, str] | None = None
        self.port = 0
        self.metrics_port = 0
        self._nvml_lib: Path | None = None

    # ------------------------------------------------------------------ paths
    @property
    def dir(self) -> Path:
        if self.root is None:
            raise HarnessError("FleetHarness not started")
        return self.root

    @property
    def ledger(self) -> Path:
        return (self.ledger_dir or self.dir / "controller") / "ledger.sqlite"

    @property
    def admin_socket(self) -> Path:
        return self.dir / "controller" / "admin.sock"

    @property
    def controller_config(self) -> Path:
        return self.dir / "controller" / "controller.yaml"

    @property
    def controller_log(self) -> Path:
        return self.dir / "controller" / "controller.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    @property
    def slurm_conf(self) -> str:
        assert self.cluster is not None
        return str(self.cluster.conf_path)

    @property
    def env(self) -> dict[str, str]:
        """For any process that may run a Slurm client: SLURM_CONF always set."""
        assert self.cluster is not None
        return dict(self.cluster.env, PATH=f"{BIN}:{self.cluster.env['PATH']}")

    # ------------------------------------------------------------------ lifecycle
    def slurm_extra_conf(self, cluster: SlurmCluster) -> str:
        """The slurm.conf lines this fleet runs with: a requeued job may start again after
        requeue_delay_s at the next scheduling pass (sched_interval_s; Slurm's defaults are 120 s and
        60 s), and the idle nodes."""
        lines = base_extra_conf(cluster, self.requeue_delay_s, self.sched_interval_s)
        if self.idle_nodes:
            lines += (f"NodeName=idle[00001-{self.idle_nodes:05d}] NodeHostname=localhost NodeAddr=127.0.0.1 Port=1 "
                      f"CPUs=4 RealMemory=1000 Gres=gpu:{self.gpus_per_node} State=UNKNOWN\n")
        return lines

    def start(self) -> "FleetHarness":
        if munged_path() is None or shutil.which("slurmctld") is None:
            ensure_installed()
        self.root = Path(tempfile.mkdtemp(prefix="healthd-fleet-", dir="/tmp"))
        self.root.chmod(0o755)
        try:
            t0 = time.monotonic()
            if self.own_cluster:
                self.cluster = SlurmCluster(self.root / "slurm", nodes=self.node_count, gpus_per_node=self.gpus_per_node)
                self.cluster.extra_conf = self.slurm_extra_conf(self.cluster)
                self.cluster.up(timeout_s=60 + self.idle_nodes / 100)
            elif self.cluster is None or not self.cluster.is_up():
                raise HarnessError("the cluster given to the harness is not up")
            self.say(f"slurm: munged + slurmctld + {self.node_count} slurmd up ({time.monotonic() - t0:.1f}s), "
                     f"SLURM_CONF={self.cluster.conf_path}")
            if self.own_munge:
                self.munge = MungeFleet(self.cluster.nodes).start()
            assert self.munge is not None
            self.say(f"munge: {len(self.cluster.nodes) + 1} munged, one per node (origins "
                     f"{', '.join(self.munge.node_addrs.values())}) and the controller's")
            self._nvml_lib = build_fake_nvml(self.root / "nvml-lib")
            self.port = free_port()
            self.metrics_port = free_port()
            for i, name in enumerate(self.cluster.nodes):
                self.nodes[name] = self._make_node(name, i)
            self.start_controller()
            for node in self.nodes.values():
                self._start_agent(node)
            self.wait_reported(self.nodes, timeout_s=60)
            self.say(f"agents: `healthd run` on {', '.join(self.nodes)}, all healthy and reporting to the controller")
        except BaseException:
            self.stop()
            raise
        return self

    def stop_processes(self) -> None:
        """Stop the agents and the controller (by PID, all at once); the cluster and munged keep running."""
        _stop_procs([*(node.proc for node in self.nodes.values()), self.controller])
        self.controller = None

    def stop(self) -> None:
        """Stop agents, controller, munged fleet and Slurm (the last two only when the harness started
        them), each by PID; remove the directory."""
        self.stop_processes()
        if self.munge is not None and self.own_munge:
            self.munge.stop()
            self.munge = None
        if self.cluster is not None and self.own_cluster:
            try:
                self.cluster.down()
            except Exception as exc:  # keep cleaning up
                print(f"harness: slurm down: {exc}", file=sys.stderr)
            self.cluster = None
        if self.root is not None and not os.environ.get("HEALTHD_KEEP_FLEET"):
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None

    def __enter__(self) -> "FleetHarness":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ nodes and agents
    def _make_node(self, name: str, index: int) -> SimNode:
        root = self.dir / "nodes" / name
        root.mkdir(parents=True)
        gpus = healthy_node(self.gpus_per_node)
        node = SimNode(name=name, root=root, gpus=gpus)
        write_nvml_config(node.nvml_values, gpus)
        ib = root / "sys/class/infiniband"
        make_ndr_node(ib, ports=2)
        # Each simulated node has its own healthy /proc: the machine's real memory or I/O pressure
        # (a busy CI box) is the host's news, not four simulated nodes' at once.
        proc = root / "proc"
        (proc / "pressure").mkdir(parents=True)
        (proc / "meminfo").write_text("MemTotal:       2113290240 kB\nMemFree:        1900000000 kB\n"
                                      "MemAvailable:   2000000000 kB\n")
        for resource in ("cpu", "memory", "io"):
            (proc / "pressure" / resource).write_text("some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
                                                      "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
        # a boot's first kernel line, so the follower has a journal to follow from the start
        write_journal(node.journal, ["Linux version 6.1.0-28-amd64 (debian-kernel@lists.debian.org)",
                                     "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.127.05"],
                      hostname=name, start_usec=int(time.time() * 1e6) - 60_000_000)
        self.write_agent_config(node)
        return node

    def write_agent_config(self, node: SimNode) -> None:
        """`node`'s healthd.yaml with the harness's agent_config on top; its agent reads it when it starts."""
        assert self.munge is not None
        root = node.root
        doc = {
            "node_name": node.name,
            "state_file": str(node.state_file),
            "state_dir": str(root / "state"),
            "interval_s": self.agent_interval_s,
            "nvml": {"expected_gpus": self.gpus_per_node},
            "kernel_log": {"journal_dir": str(node.journal), "kmsg_path": None, "start_at": "head"},
            "infiniband": {"sysfs_root": str(root / "sys/class/infiniband"), "expected_ports": 2,
                           "expected_rate_gbps": 400},
            "host": {"proc_root": str(root / "proc")},
            "metrics": {"textfile": str(root / "healthd.prom")},
            "controller": {"url": self.url, "munge_socket": self.munge.socket(node.name),
                           "heartbeat_s": self.heartbeat_s, "backoff_max_s": 5.0, "timeout_s": 5.0},
            **self.agent_config,
        }
        node.config.write_text(json.dumps(doc, indent=2) + "\n")  # JSON is YAML

    def _agent_env(self, node: SimNode) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env.update(LD_LIBRARY_PATH=str(self._nvml_lib), FAKE_NVML_CONFIG=str(node.nvml_values),
                   SLURM_CONF=self.slurm_conf)
        return env

    def _start_agent(self, node: SimNode) -> None:
        with open(node.log, "ab") as out:
            node.log_from = out.tell()
            node.proc = subprocess.Popen([HEALTHD, "run", "--config", str(node.config)], env=self._agent_env(node),
                                         stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def stop_agent(self, name: str) -> None:
        """Stop one node's agent by PID (and reap it); start_agent starts it again."""
        _stop_proc(self.nodes[name].proc)

    def stop_agents(self) -> None:
        """Stop every node's agent by PID, all at once."""
        _stop_procs([node.proc for node in self.nodes.values()])

    def start_agent(self, name: str) -> None:
        self._start_agent(self.nodes[name])

    def restart_agent(self, name: str) -> None:
        self.stop_agent(name)
        self.start_agent(name)

    def agent_state(self, name: str) -> dict[str, Any] | None:
        try:
            return json.loads(self.nodes[name].state_file.read_text())
        except (OSError, ValueError):
            return None

    def wait_reported(self, names: Sequence[str] | Mapping[str, Any], timeout_s: float = 60) -> None:
        """Every named agent is running, has published a state, and a report of the running agent was
        accepted (what an agent logged before it was restarted does not count)."""
        def accepted(node: SimNode) -> bool:
            with open(node.log, "rb") as fh:
                fh.seek(node.log_from)
                return b"reports accepted" in fh.read()

        def ready() -> bool:
            for name in names:
                node = self.nodes[name]
                if node.proc is None or node.proc.poll() is not None:
                    raise HarnessError(f"agent {name} exited ({None if node.proc is None else node.proc.returncode}):\n"
                                       f"{_tail(node.log)}")
                if self.agent_state(name) is None or not accepted(node):
                    return False
            return True
        try:
            wait_for(ready, timeout_s, 0.2, "the agents' first accepted report")
        except HarnessError as exc:
            logs = "\n".join(f"--- {n}\n{_tail(self.nodes[n].log)}" for n in names)
            raise HarnessError(f"{exc}\n{logs}\n--- controller\n{_tail(self.controller_log)}") from None

    def inject_xid(self, name: str, xid: int = 79, gpu: int = 0, text: str | None = None, count: int = 1) -> float:
        """Append an NVRM Xid line for `gpu`'s bus id to `name`'s kernel journal; returns the wall time
        just before the write (the entry's own timestamp)."""
        node = self.nodes[name]
        line = f"NVRM: Xid (PCI:{node.bus(gpu)}): {xid}, pid='<unknown>', name=<unknown>, {text or XID_TEXT.get(xid, 'fault')}"
        t = time.time()
        write_journal(node.journal, [line] * count, hostname=name, start_usec=int(t * 1e6))
        return t

    # ------------------------------------------------------------------ controller
    def write_controller_config(self) -> None:
        assert self.munge is not None
        doc: dict[str, Any] = {
            "listen": f"127.0.0.1:{self.port}",
            "ledger": str(self.ledger),
            "munge_socket": self.munge.controller_socket,
            "slurm_conf": self.slurm_conf,
            "node_addrs": dict(self.munge.node_addrs),
            "admin_socket": str(self.admin_socket),
            "policy": self.policy,
            # the rounds' figures: wait_rounds() counts rounds by them
            "metrics_listen": f"127.0.0.1:{self.metrics_port}",
            **self.extra_config,
        }
        self.controller_config.parent.mkdir(parents=True, exist_ok=True)
        self.controller_config.write_text(json.dumps(doc, indent=2) + "\n")

    def start_controller(self) -> None:
        if not self.port:
            self.port = free_port()
        if not self.metrics_port:
            self.metrics_port = free_port()
        self.write_controller_config()
        env = dict(self.env, **(self.controller_extra_env or {}))
        if self.controller_path_prefix:
            env["PATH"] = f"{self.controller_path_prefix}:{env['PATH']}"
        with open(self.controller_log, "ab") as out:
            self.controller = subprocess.Popen(
                [sys.executable, "-m", "healthd.controller.daemon", "--config", str(self.controller_config),
                 "--interval", str(self.round_s)],
                env=env, cwd=str(self.dir), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)

        def up() -> bool:
            if self.controller is None or self.controller.poll() is not None:
                raise HarnessError(f"healthd-controller exited:\n{_tail(self.controller_log, 30)}")
            try:
                with urllib.request.urlopen(f"{self.url}/healthz", timeout=2) as resp:
                    return resp.status == 200
            except OSError:
                return False
        wait_for(up, 30, 0.1, "healthd-controller's /healthz")

    def last_round(self) -> float | None:
        """When the running controller's last full round (Slurm reachable) was, from its metrics; None
        before the first one or when it does not answer."""
        body = scrape(self.metrics_url) if self.metrics_port else None
        for line in (body or "").splitlines():
            if line.startswith("healthd_controller_last_round_timestamp_seconds "):
                value = float(line.split()[1])
                return value or None
        return None

    def wait_rounds(self, rounds: int, timeout_s: float | None = None) -> None:
        """Until the controller has completed `rounds` more full rounds: what a test waits for before it
        asserts that nothing happened (a controller slowed down by a busy machine takes longer, not fewer
        rounds)."""
        seen: set[float] = set()
        after = self.last_round() or 0.0

        def counted() -> bool:
            t = self.last_round()
            if t is not None and t > after:
                seen.add(t)
            return len(seen) >= rounds
        wait_for(counted, timeout_s if timeout_s is not None else 30 + rounds * self.round_s, 0.05,
                 f"{rounds} more control rounds")

    def stop_controller(self, *, fresh_ledger: bool = False) -> None:
        """Stop healthd-controller by PID; with fresh_ledger, delete its ledger and its history (and their WAL) too."""
        _stop_proc(self.controller)
        self.controller = None
        if fresh_ledger:  # and the record of what its rounds saw, kept beside it (history.sqlite)
            for name in (self.ledger, self.ledger.parent / "history.sqlite"):
                for suffix in ("", "-wal", "-shm"):
                    Path(f"{name}{suffix}").unlink(missing_ok=True)

    def healthctl(self, *args: str, json_out: bool = True, check: bool = True) -> Any:
        """`healthctl --ledger L --socket S [--json] ARGS`: the parsed JSON (or the text)."""
        argv = [HEALTHCTL, "--ledger", str(self.ledger), "--socket", str(self.admin_socket)]
        if json_out:
            argv.append("--json")
        p = subprocess.run([*argv, *args], capture_output=True, text=True, timeout=30, env=self.env)
        if check and p.returncode != 0:
            raise HarnessError(f"healthctl {' '.join(args)} exited {p.returncode}: {(p.stderr or p.stdout).strip()}")
        if not json_out:
            return p.stdout
        try:
            return json.loads(p.stdout) if p.stdout.strip() else None
        except ValueError:
            raise HarnessError(f"healthctl {' '.join(args)}: not JSON: {p.stdout[:300]}") from None

    # ------------------------------------------------------------------ Slurm
    def slurm(self, argv: Sequence[str], timeout: float = 15, check: bool = True) -> subprocess.CompletedProcess[str]:
        assert self.cluster is not None
        return self.cluster.run(argv, timeout=timeout, check=check)

    def slurm_node(self, name: str) -> dict[str, str]:
        """`scontrol show node -o NAME` as a mapping (State, Reason, ...)."""
        out = self.slurm(["scontrol", "show", "node", "-o", name]).stdout.strip()
        return _parse_kv(out)

    def slurm_nodes(self) -> dict[str, dict[str, str]]:
        out = self.slurm(["scontrol", "show", "node", "-o"]).stdout
        nodes = [_parse_kv(line) for line in out.splitlines() if line.strip()]
        return {n["NodeName"]: n for n in nodes if "NodeName" in n}

    def job(self, job_id: str) -> dict[str, str]:
        out = self.slurm(["scontrol", "show", "job", "-o", job_id], check=False).stdout.strip()
        return _parse_kv(out) if out else {}

    def resume(self, names: Sequence[str]) -> None:
        if names:
            self.slurm(["scontrol", "update", f"NodeName={','.join(names)}", "State=RESUME"], check=False)


def _parse_kv(line: str) -> dict[str, str]:
    """`Key=value Key2=value two ...` (scontrol -o); a value runs to the next ` Key=` (Reason has spaces)."""
    import re

    out: dict[str, str] = {}
    matches = list(re.finditer(r"(?:^|\s)([A-Za-z][A-Za-z0-9_/:]*)=", line))
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(line)
        out[m.group(1)] = line[m.end():end].strip()
    return out

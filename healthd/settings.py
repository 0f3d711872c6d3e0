"""Settings: frozen dataclasses, one per config section. The YAML loader is healthd.config.

Defaults are the values an administrator gets with an empty config file; thresholds cite where they
come from (see README "Configuration"). A section whose values have limits its types cannot say (a
range, an absolute path) lists what is wrong in a `problems()` method: (key, expected, found) for
each; the loader refuses the first, naming the file and the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping


@dataclass(frozen=True)
class NvmlSettings:
    enabled: bool = True
    """Run the NVML collector at all."""
    expected_gpus: int | None = None
    """GPUs this node must have; fewer is a T1 hardware finding. None: do not check the count."""
    call_timeout_s: float = 5.0
    """Hard limit on one whole NVML collection; a hung driver call makes the tick report an error."""
    margin_warn_c: int = 5
    """Thermal margin (degrees to the nearest slowdown threshold) below which a GPU is reported hot."""
    nvlink_counter_interval_s: float = 120.0
    """How often the per-link NVLink error counters (4 calls per active link: 72 per H100) are read;
    link state is read every tick. Any increase is still found, up to this much later (Xid 74 and
    144-150 for a failing link still come from the kernel log at once); 0 reads them every tick."""


@dataclass(frozen=True)
class KernelLogSettings:
    enabled: bool = True
    """Follow the kernel log for NVRM/Xid lines."""
    journal_dir: str | None = None
    """Directory of journal files to read; None reads the system journal."""
    kmsg_path: str | None = "/dev/kmsg"
    """Fallback when no journal is readable; None disables the fallback."""
    start_at: str = "boot"
    """With no saved cursor: 'boot' reads this boot's kernel lines from the head, 'tail' only new ones,
    'head' everything the journal holds."""


@dataclass(frozen=True)
class IbThresholds:
    """Counter-rate thresholds; defaults from NVSentinel's NIC monitor thresholds."""

    symbol_error_per_hour: float = 120.0
    """Symbol errors over the trailing hour (NVSentinel's fatal line; raw bit errors are normal on
    PAM4 links, so a rate, never "> 0")."""
    symbol_error_per_s: float = 10.0
    """Non-fatal: symbol errors per second in one tick."""
    link_error_recovery_per_min: float = 5.0
    """Link error recoveries per minute over the trailing minute."""
    port_rcv_errors_per_s: float = 10.0
    """Received packets with errors per second."""
    port_xmit_discards_per_s: float = 100.0
    """Outbound packets discarded per second (congestion or a down peer)."""
    local_ack_timeout_err_per_s: float = 1.0
    """hw_counters: RC QP ack timeouts per second (retransmits)."""
    roce_slow_restart_per_s: float = 10.0
    """hw_counters (RoCE): slow restarts per second."""


@dataclass(frozen=True)
class InfinibandSettings:
    enabled: bool = True
    """Read InfiniBand/RoCE ports from sysfs."""
    sysfs_root: str = "/sys/class/infiniband"
    """The class directory holding one entry per HCA."""
    expected_ports: int | None = None
    """Ports this node must have up; None: do not check the count."""
    expected_rate_gbps: float | None = None
    """Each port's expected rate (400 for NDR); a slower link is a T2 fabric finding."""
    flap_cycles: int = 3
    """Down-then-up cycles within flap_window_s that make a flap (gpud: 3)."""
    flap_window_s: float = 600.0
    """Lookback for counting flap cycles (gpud: 10 min)."""
    drop_after_s: float = 240.0
    """A port down longer than this is a drop (gpud: 4 min), a T1 fabric finding."""
    sticky_s: float = 600.0
    """A drop or flap stays reported this long after the port recovers (gpud: 10 min)."""
    thresholds: IbThresholds = field(default_factory=IbThresholds)


@dataclass(frozen=True)
class FilesystemSpec:
    path: str
    """Mount point or directory to probe."""
    role: str = "filesystem"
    """What it is for: checkpoint, dataset, scratch (shows in findings)."""
    timeout_s: float = 5.0
    """Hard limit on the write+fsync probe; past it the filesystem is reported hung."""
    max_latency_s: float = 1.0
    """A probe slower than this is a T2 storage finding."""


@dataclass(frozen=True)
class HostSettings:
    enabled: bool = True
    """Read memory, pressure, D-state processes and the configured filesystems."""
    proc_root: str = "/proc"
    """Where meminfo, pressure/, mounts and the per-process stat files are read."""
    filesystems: tuple[FilesystemSpec, ...] = ()
    """Filesystems jobs depend on, each probed every tick (see the filesystems table)."""
    mem_available_min_pct: float = 5.0
    """Available memory below this share of total is a T2 software finding."""
    psi_memory_full_avg10_max: float = 20.0
    """/proc/pressure/memory 'full avg10' above this is a T3 software finding."""
    psi_io_full_avg10_max: float = 50.0
    """/proc/pressure/io 'full avg10' above this is a T3 storage finding."""
    dstate_min_count: int = 5
    """This many processes in D state at once is a T3 storage finding (a hung mount shows this way)."""
    dstate_scan_min_load: float = 0.5
    """The per-thread D-state scan of /proc runs every tick only while /proc/stat counts blocked
    tasks, the last scan found some, or the 1-minute load average is at least this (tasks in D
    state count in the load: 5 of them lift it past 0.5 within about 10 s). 0 scans every tick."""
    dstate_scan_interval_s: float = 30.0
    """While only the load average opens the scan (a busy node), it runs at most this often."""


@dataclass(frozen=True)
class NvmeSettings:
    """The node's NVMe drives: wear, critical warnings and media errors from each controller's SMART /
    Health log. Off by default; on, it reads sysfs and the SMART logs a site's timer writes, and runs
    a command only when `smart_log_command` names one."""

    enabled: bool = False
    """Read the NVMe controllers at all."""
    sysfs_root: str = "/sys/class/nvme"
    """The class directory holding one entry per controller (nvme0, nvme1, ...): its model, serial,
    firmware_rev and state."""
    smart_log_dir: str | None = None
    """Directory of SMART / Health logs, one `<controller>.json` each: what `nvme smart-log -o json
    /dev/<controller>` (or `smartctl -j -A`) prints, written there by the site (a systemd timer), so
    the agent runs nothing. None: no files are read."""
    smart_log_max_age_s: float = 3600.0
    """A SMART log written longer ago than this is stale: reported as unreadable, its values unused."""
    smart_log_command: tuple[str, ...] = ()
    """Instead of files: the command that prints one controller's SMART / Health log as JSON, as a
    list of arguments to which `/dev/<controller>` is appended, e.g. [nvme, smart-log, -o, json]; run
    without a shell, with a fixed PATH. Empty: no command is run."""
    command_timeout_s: float = 5.0
    """Hard limit on one run of `smart_log_command`; a run past it is killed and reported, and no
    second run for that controller starts until the first has exited."""
    wear_warn_pct: int = 90
    """Percentage used (the drive's estimate of its rated endurance used, which passes 100 on a
    drive used beyond it) at or above which a drive is reported worn (T3)."""
    media_errors_window_s: float = 86400.0
    """How long a rise of a drive's media errors (unrecovered data integrity errors) stays reported (T2)."""

    def problems(self) -> list[tuple[str, str, object]]:
        """(key, expected, found) for each value the loader must refuse."""
        out: list[tuple[str, str, object]] = []
        if not self.sysfs_root.startswith("/"):
            out.append(("sysfs_root", "an absolute path", self.sysfs_root))
        if self.smart_log_dir is not None and not self.smart_log_dir.startswith("/"):
            out.append(("smart_log_dir", "an absolute path, or null", self.smart_log_dir))
        if self.smart_log_command and (not all(self.smart_log_command) or self.smart_log_dir is not None):
            out.append(("smart_log_command", "a list of non-empty arguments, and smart_log_dir null",
                        list(self.smart_log_command)))
        for key in ("smart_log_max_age_s", "command_timeout_s", "media_errors_window_s"):
            if not 0 < getattr(self, key) < float("inf"):
                out.append((key, "a finite number greater than 0", getattr(self, key)))
        if not 1 <= self.wear_warn_pct <= 255:
            out.append(("wear_warn_pct", "a percentage from 1 to 255", self.wear_warn_pct))
        return out


@dataclass(frozen=True)
class XidOverride:
    """A site's change to one catalog row; unset fields keep the catalog's value."""

    attribution: str | None = None
    """hardware | fabric | storage | software | user | unknown."""
    tier: int | None = None
    """1, 2 or 3."""
    action: str | None = None
    """none | reset-gpu-when-idle | reboot-when-idle | drain | drain-and-requeue | inspect-hardware."""
    ignore: bool = False
    """Drop findings for this Xid entirely (still counted in metrics)."""


@dataclass(frozen=True)
class CatalogSettings:
    path: str | None = None
    """Replacement catalog file; None uses the packaged healthd/data/xid_catalog.yaml."""
    overrides: Mapping[int, XidOverride] = field(default_factory=dict)
    """Xid -> site changes to its catalog row (see the overrides table)."""


@dataclass(frozen=True)
class ClassifySettings:
    xid_repeat_window_s: float = 86400.0
    """Window in which a repeating Xid 13/31 on one GPU makes it a hardware suspect."""
    xid_repeat_count: int = 3
    """Occurrences on the same GPU within the window that make Xid 13/31 hardware-suspect (T2)."""
    xid_burst_window_s: float = 180.0
    """Lines of one Xid on one GPU this close together are one occurrence when counting repeats (one
    crash prints a line per SM; NVSentinel's 3-minute burst window)."""
    sympathetic_window_s: float = 120.0
    """Xid 45 within this many seconds after another Xid on the same GPU is sympathetic."""
    ecc_sbe_per_hour: float = 100.0
    """Corrected (single-bit) ECC errors per hour on one GPU that make a T2 trend."""
    pcie_replay_per_min: float = 10.0
    """PCIe replays per minute on one GPU that make a T2 finding (a marginal link or riser)."""
    hw_slowdown_window_s: float = 600.0
    """Window over which the HW-slowdown rate is measured."""
    hw_slowdown_per_min: float = 0.6
    """HW-slowdown clock events per minute over the window (gpud: 0.6/min over 10 min)."""
    finding_ttl_s: float = 3600.0
    """An event-driven finding (an Xid) stays current this long after its last line."""


@dataclass(frozen=True)
class MetricsSettings:
    textfile: str | None = None
    """node_exporter textfile path (e.g. /var/lib/node_exporter/textfile/healthd.prom); None: off."""
    listen: str | None = None
    """'127.0.0.1:9840' to serve /metrics on loopback; None: off."""


@dataclass(frozen=True)
class HookSettings:
    """The Slurm hooks (healthd-healthcheck, healthd-prolog, healthd-epilog) and the agent's side of
    their files. slurmd starts the hooks with almost no environment, so every path is here."""

    gating: str = "off"
    """off: the prolog only logs 'would refuse job J'; local: the prolog refuses a job (exit 1) whose
    GPU has a current T1 hardware finding, and the hooks drain / reboot-ASAP the node; controller: the
    prolog asks the controller (controller.url) for the drain and refuses the job only when it grants it."""
    stale_after_s: float = 60.0
    """An agent state file older than this (or missing, truncated, or whose agent pid is gone) means
    'agent unknown': the job runs and the hook says why."""
    timeout_s: float = 5.0
    """Hard internal limit on one hook run; past it the hook exits with its safe code (prolog 0)."""
    run_dir: str = "/run/healthd"
    """Where the hooks keep job bindings (jobs/JOBID.json, jobs/done/), quick-check results
    (checks.json) and reset/reboot requests for the controller (requests/)."""
    slurm_conf: str = "/etc/slurm/slurm.conf"
    """SLURM_CONF for every Slurm client a hook runs (HealthCheckProgram gets no SLURM_CONF)."""
    path: str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    """PATH for the Slurm clients and dcgmi the hooks run (HealthCheckProgram gets no PATH)."""
    gpu_devices: str = "/dev/nvidia[0-9]*"
    """Glob of GPU device files; the quick check compares their count with nvml.expected_gpus."""
    dcgmi: str | None = "dcgmi"
    """dcgmi path or name; `dcgmi diag -r 1` runs on an idle node when it is installed. None: never."""
    dcgmi_timeout_s: float = 45.0
    """Hard limit on one `dcgmi diag -r 1` run, added to timeout_s for that health-check run (the sum
    stays under the 60 s after which slurmd kills a HealthCheckProgram)."""
    dcgmi_interval_s: float = 3600.0
    """Run `dcgmi diag -r 1` at most this often (the health check runs every HealthCheckInterval)."""
    charges_file: str = "/var/lib/healthd/charges.jsonl"
    """One JSON line per user-attributed finding charged to a job and its user by the epilog."""


@dataclass(frozen=True)
class DetectorSettings:
    """The in-band detector's thresholds (healthd.progress): node config `inband.detector`, and the
    controller's `inband` section for the job-wide comparison."""

    window_steps: int = 25
    """Steps per window; windows are aligned by step number across ranks."""
    min_effect: float = 0.05
    """The smallest slowdown flagged, in jobs of every size and by either test: 0.05 is a rank whose
    compute is 5 % above the median of the job's other ranks, and 5 % above its own baseline when
    that is higher."""
    mad_k: float = 4.0
    """How many robust standard deviations a slow rank must exceed: 1.4826 x MAD across ranks of each
    rank's ratio over its baseline, the median of the job's windows' figures."""
    consecutive: int = 2
    """Slow windows in a row before the magnitude test flags a rank (below min_ranks_spread ranks, at
    least rank_order_consecutive)."""
    min_ranks_spread: int = 16
    """Below this many ranks the spread is pooled over the recent windows of all ranks, and the
    rank-order test runs too."""
    rank_order_p: float = 1e-4
    """The rank-order test's significance: a rank last this improbably often under no straggler."""
    rank_order_consecutive: int = 3
    """Windows in a row the rank-order test must flag before it counts (few ranks on few cores are
    biased: one rank is often last for scheduling reasons alone)."""
    history_windows: int = 8
    """Complete windows kept per rank (and sent in reports)."""
    baseline_windows: int = 3
    """A rank's first windows, kept (and sent) besides its recent ones: the median of its ratios over
    the job's first this many windows is its structure (a heavier pipeline stage, rank 0's extra
    work), and a rank is flagged only for a slowdown beyond it. 0: no baseline, every rank is held to
    the job's median."""
    hang_factor: float = 10.0
    """A hang is no new step for this many median step times..."""
    hang_min_s: float = 60.0
    """...and at least this long."""
    phase_factor: float = 5.0
    """During a save, the bound is this many times the longest save the job has made so far, when
    that is longer than the bound above."""
    first_save_s: float = 600.0
    """During the job's first save (no save seen yet to learn from), and while ranks wait on rank 0
    alone or on ranks on other nodes, the bound is at least this: PyTorch's default NCCL timeout,
    after which ranks waiting in a collective for a save that long abort the job anyway."""


GOODPUT_LOG_DIR = "goodput"
"""Under `state_dir`: each job's goodput event log, `<job>.jsonl` (the agent writes it, the epilog adds
each run's end)."""


@dataclass(frozen=True)
class InbandSettings:
    """In-band signals: the training job's own step records (healthd_inband), read by the agent."""

    enabled: bool = True
    """The prolog creates a directory per job (`<hooks.run_dir>/inband/<job>`, the job user's, 0700),
    the TaskProlog exports it as HEALTHD_INBAND_DIR, the epilog archives it, the agent reads it.
    false: none of this (a job's calls stay no-ops)."""
    keep_jobs: int = 16
    """Ended jobs' in-band directories kept in `<hooks.run_dir>/inband/done` (the oldest go first)."""
    max_ranks: int = 64
    """Rings read per job on this node; a directory holding more is read up to this many."""
    pci_devices: str = "/sys/bus/pci/devices"
    """Where the PCI devices are listed: a GPU's network rail is the HCA (infiniband.sysfs_root)
    behind the same PCIe switch, found by comparing their paths in the PCIe tree."""
    goodput_log: bool = True
    """The agent of the node running a job's rank 0 writes the job's goodput event log,
    `<state_dir>/goodput/<job>.jsonl` (its runs, step marks, saves and restores; the epilog adds each
    run's end); `healthctl goodput --log` reads it. false: no log."""
    goodput_keep_days: float = 30.0
    """Goodput logs (and their cursors) not written for this many days are deleted by the agent, at
    most once an hour; a job still on the node keeps its log."""
    detector: DetectorSettings = field(default_factory=DetectorSettings)


@dataclass(frozen=True)
class ControllerClientSettings:
    """The agent's side of the controller transport: signed reports pushed over HTTP."""

    url: str | None = None
    """Base URL of healthd-controller (e.g. http://head01:9841); None: no controller, nothing is sent."""
    heartbeat_s: float = 30.0
    """Resend an unchanged report this often; a change of verdict or findings is sent at once."""
    timeout_s: float = 5.0
    """Hard limit on one HTTP request to the controller (the prolog uses the smaller of this and its deadline)."""
    munge_socket: str | None = None
    """The node's munged socket that signs reports; None: libmunge's default socket."""
    backoff_max_s: float = 300.0
    """Longest wait between retries while the controller is unreachable (exponential backoff with jitter)."""
    ship_goodput: bool = True
    """Send the goodput logs this node writes (`inband.goodput_log`) to the controller, which gathers
    each job's on the head node (POST /v1/goodput)."""


@dataclass(frozen=True)
class Settings:
    node_name: str
    """This node's Slurm name (default: the short hostname)."""
    state_file: str = "/run/healthd/state.json"
    """The verdict the Slurm hooks read; written atomically."""
    state_dir: str = "/var/lib/healthd"
    """Where the journal cursor, counter baselines and history windows persist across restarts."""
    interval_s: float = 10.0
    """Period of the NVML, InfiniBand, host and NVMe collectors (the kernel log is followed continuously)."""
    log_level: str = "info"
    """debug | info | warning | error (the daemon's log; `--log-level` overrides)."""
    nvml: NvmlSettings = field(default_factory=NvmlSettings)
    kernel_log: KernelLogSettings = field(default_factory=KernelLogSettings)
    infiniband: InfinibandSettings = field(default_factory=InfinibandSettings)
    host: HostSettings = field(default_factory=HostSettings)
    nvme: NvmeSettings = field(default_factory=NvmeSettings)
    """The node's NVMe drives (off by default)."""
    catalog: CatalogSettings = field(default_factory=CatalogSettings)
    classify: ClassifySettings = field(default_factory=ClassifySettings)
    metrics: MetricsSettings = field(default_factory=MetricsSettings)
    hooks: HookSettings = field(default_factory=HookSettings)
    controller: ControllerClientSettings = field(default_factory=ControllerClientSettings)
    inband: InbandSettings = field(default_factory=InbandSettings)

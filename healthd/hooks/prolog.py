"""healthd-prolog: slurmd's Prolog (runs as root at every job launch on this node, before the job).

1. Records the job's binding `<run_dir>/jobs/<SLURM_JOB_ID>.json` = {job, user, uid, node, gpus,
   start} atomically (GPU indices from SLURM_JOB_GPUS, else CUDA_VISIBLE_DEVICES).
   With `inband.enabled`, once the gating below lets the job run, creates its in-band directory
   `<run_dir>/inband/<job>`: the job user's (SLURM_JOB_UID; group SLURM_JOB_GID when slurmd gives
   it, else root's, which mode 0700 makes irrelevant), mode 0700 (healthd.hooks.inband_dirs). A
   failure (a link or another user's directory in its place, a full file system) is logged and the
   job runs without it.
2. Gating (`hooks.gating`): a job is refusable only when it holds GPUs and the FRESH, trusted agent
   state has a current T1 hardware finding on one of them, or a node-level one (fewer GPUs than
   expected, a GPU lost with no index: any GPU job may land on it) (`gate`, a pure function). A job
   that holds no GPU is never refused: such a finding does not touch it (slurmd gives its prolog
   no GPU variable, so it reads as "GPU list unknown"), and with gating `local` its epilog drains
   the node.
   - `off` (default): logs "would refuse job J: <reason>" and exits 0;
   - `local`: drains the node with `healthd: <finding> [job J]` first -- unless someone else's reason
     is there, and the first healthd reason wins -- then exits 1: slurmd fails the launch, a batch
     job is requeued, and Slurm keeps the existing drain reason instead of writing "Prolog error".
   - `controller`: signs a drain request with the node's munged and POSTs it to
     `<controller.url>/v1/request` within the hook's remaining deadline; exits 1 only when the
     controller answers {"granted": true} (it drained the node with its own reason). Refused by the
     controller's envelope, controller down, a timeout, a bad answer: the job runs and the log says
     why. healthd.agent.reporter and the MUNGE binding are imported only on this path.

Exit codes: 0 the job runs; 1 the job is refused (only with gating local or controller, a fresh T1
hardware finding on an allocated GPU or on the node's GPUs as a whole, and the node confirmed
drained -- by this hook, or by the controller that granted the drain). Every doubtful case -- state
missing, stale, truncated or not trusted (not root's, writable by group or others, a link), GPU list
unknown, a finding that is not T1 or not hardware, Slurm unreachable or refusing, a timeout, a bug --
exits 0 and the log says why. The binding is written into the run directory without following a
link at any level (healthd.trusted); when it cannot be, the log says why and the job runs.
"""

from __future__ import annotations


from healthd.bindings import JOBS_DIR, Binding, binding_name
from healthd.hooks import inband_dirs
from healthd.hooks.common import (
    Context,
    Judgement,
    env_gpus,
    env_job_id,
    env_user,
    healthd_reason,
    run_hook,
    take_node,
)
from healthd.record import Record
from healthd.statedoc import ATTRIBUTION, f_gpu, f_id, f_tier, is_node_level, is_t1_hardware, summary

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

HOOK = "healthd-prolog"
RUN, REFUSE = 0, 1


class Gate(Record):
    """refuse: one of the job's GPUs, or the node's GPUs as a whole, has a current T1 hardware
    finding in a fresh state; why; the finding."""

    _fields = ("refuse", "why", "finding")
    _defaults = {"finding": None}
    refuse: bool
    why: str
    finding: dict[str, Any] | None


def gate(judgement: Judgement, gpus: list[int] | None, gpus_why: str = "") -> Gate:
    """Would healthd refuse a job holding `gpus`? Pure; the gating mode is applied by the caller.
    A T1 hardware finding on one of the job's GPUs comes first, then a node-level one
    (`is_node_level`); a job that holds no GPU is not refused for either."""
    if not judgement.known:
        return Gate(False, f"{judgement.reason}")
    node_t1 = sorted((f for f in judgement.findings if is_t1_hardware(f) and is_node_level(f)),
                     key=f_id)
    if gpus is None:
        return Gate(False, f"GPU list unknown ({gpus_why})")
    if not gpus:
        if node_t1:
            return Gate(False, f"the job holds no GPU ({summary(node_t1[0], 100)} concerns GPU jobs only)")
        return Gate(False, "the job holds no GPU")
    mine = [f for f in judgement.findings if f_gpu(f) in gpus]
    blocking = sorted((f for f in mine if is_t1_hardware(f)), key=lambda f: (f_gpu(f), f_id(f)))
    if blocking:
        return Gate(True, summary(blocking[0]), blocking[0])
    if node_t1:
        return Gate(True, summary(node_t1[0]), node_t1[0])
    gl = ",".join(map(str, gpus))
    if mine:
        notes = "; ".join(f"{summary(f, 60)} (T{f_tier(f)} {f.get(ATTRIBUTION)})" for f in mine[:3])
        return Gate(False, f"no T1 hardware finding on GPUs {gl}, only {notes}: not a reason to refuse")
    return Gate(False, f"no finding on GPUs {gl}")


def prolog(ctx: Context) -> int:
    log = ctx.log
    job, why = env_job_id(ctx.env)
    if job is None:
        log.warning(f"{why}; nothing recorded, the job runs")
        return RUN
    user, uid, problems = env_user(ctx.env)
    for p in problems:
        log.warning(f"job {job}: {p}")
    gpus, gpus_why = env_gpus(ctx.env)
    binding = Binding(job=job, node=ctx.node, gpus=tuple(gpus) if gpus is not None else None,
                      start=ctx.now, user=user, uid=uid)
    try:
        with ctx.run_dir(JOBS_DIR, create=True) as jobs:
            jobs.write_json(binding_name(job), binding.to_json())
    except OSError as e:
        log.error(f"job {job}: cannot record the GPU binding: {e}; not a reason to refuse the job")
    code = decide(ctx, job, gpus, gpus_why)
    if code == RUN and ctx.settings.inband.enabled:
        make_inband_dir(ctx, job, uid)
    return code


def decide(ctx: Context, job: str, gpus: list[int] | None, gpus_why: str) -> int:
    log = ctx.log
    judgement = ctx.state()
    g = gate(judgement, gpus, gpus_why)
    if not g.refuse:
        level = log.info if judgement.known else log.warning
        level(f"job {job} runs: {g.why}")
        return RUN
    reason = healthd_reason(g.why, f"[job {job}]")
    if ctx.settings.hooks.gating == "controller":
        return ask_controller(ctx, job, g)
    if ctx.settings.hooks.gating != "local":
        log.warning(f"would refuse job {job}: {reason} (hooks.gating off)")
        return RUN
    if not take_node(ctx, reason):
        log.warning(f"job {job} runs although {g.why}: the node could not be drained first, and refusing "
                    "would leave a 'Prolog error' drain nobody owns")
        return RUN
    log.error(f"refused job {job}: {reason}")
    return REFUSE


def env_gid(env: dict[str, str]) -> int:
    """SLURM_JOB_GID when it is a number, else -1 (the group stays root's)."""
    raw = env.get("SLURM_JOB_GID", "")
    return int(raw) if raw.isascii() and raw.isdigit() and len(raw) <= 10 else -1


def make_inband_dir(ctx: Context, job: str, uid: int | None) -> None:
    log = ctx.log
    if uid is None:
        log.warning(f"job {job}: no usable SLURM_JOB_UID, so no in-band directory; the job runs without it")
        return
    try:
        done = inband_dirs.create(ctx.settings.hooks.run_dir, job, uid, env_gid(ctx.env),
                                  trusted_uid=ctx.trusted_uid)
    except (OSError, ValueError) as e:
        log.warning(f"job {job}: no in-band directory: {e}; the job runs without it")
        return
    log.info(f"job {job}: in-band directory {done}")


CONTROLLER_MIN_S = 0.2
"""Less time than this left in the hook's deadline: do not start a request to the controller."""
CONTROLLER_MARGIN_S = 0.5
"""Time kept back from the deadline for logging and exiting after the request."""


def ask_controller(ctx: Context, job: str, g: Gate) -> int:
    """`hooks.gating: controller`: refuse the job only when the controller grants the drain."""
    log, c = ctx.log, ctx.settings.controller
    left = ctx.deadline.remaining() if ctx.deadline is not None else ctx.settings.hooks.timeout_s
    timeout = min(c.timeout_s, left - CONTROLLER_MARGIN_S)
    if timeout < CONTROLLER_MIN_S:
        log.warning(f"job {job} runs although {g.why}: only {left:.1f}s left of hooks.timeout_s, "
                    "too little to ask the controller")
        return RUN
    from healthd.client import request_drain  # lazy: HTTP and MUNGE only on this path

    assert g.finding is not None
    granted, why = request_drain(c, ctx.node, g.finding, job, timeout)
    if not granted:
        log.warning(f"job {job} runs although {g.why}: the controller did not grant the drain ({why})")
        return RUN
    log.error(f"refused job {job}: the controller drained node {ctx.node} for {g.why} ({why})")
    return REFUSE


def main(argv: list[str] | None = None) -> int:
    return run_hook(HOOK, argv, RUN, prolog)


if __name__ == "__main__":
    raise SystemExit(main())

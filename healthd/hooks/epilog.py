"""healthd-epilog: slurmd's Epilog (runs as root after every job on this node).

1. Closes the job's binding: `<run_dir>/jobs/<id>.json` moves to `jobs/done/<id>.json` with its end
   time and the findings charged to it.
2. Attribution: user-attributed findings on the job's GPUs whose last_seen lies within the job's
   [start, end] are charged to the job and its user: one JSON line each appended to
   `hooks.charges_file` {job, user, node, gpu, serial, xid, finding, summary, time, ...}, and logged.
3. Post-job checks: all expected GPU device files still present (written to checks.json for the
   agent); findings asking for a reset or reboot when idle (pending row remap, Xid 63/92, GSP errors)
   leave a record `<run_dir>/requests/<finding-id>.json` (the controller learns of the finding from
   the agent's report and decides the reboot itself) and, with `hooks.gating: local`, `scontrol reboot ASAP` -- unless the node is drained (a drain is the
   controller's to resolve, and a reboot's next state RESUME would undo it) or carries a reason
   healthd did not write.

4. A current T1 hardware finding in a fresh agent state, with gating `local`: the node is drained
   with a healthd reason (or found drained by someone else, whose reason stays) before the next job
   can land. With gating `controller` or `off` the epilog only logs "would drain the node".
5. The job's in-band directory `<run_dir>/inband/<job>`, when there is one (whatever
   `inband.enabled` says now), moves to `<run_dir>/inband/done/<job>` (root's, 0700: the user can no
   longer write there by path), and the oldest beyond `inband.keep_jobs` are removed
   (healthd.hooks.inband_dirs). Last, so that a large tree left by the job cannot use up the
   deadline before the drain.

Exit code: always 0. The drain is what keeps the next job off the node; a non-zero exit would add
nothing to it and would end Slurm's run of an `Epilog=<dir>/*` glob, skipping the site's epilogs
that sort after healthd's. Every doubtful case exits 0 with a log line -- a state file that is not
trusted (not root's, writable by group or others, a link) among them: then nothing is charged,
requested or drained. Every file is read and written without following a link at any level below
the run directory (healthd.trusted); one that cannot be is logged and skipped.
"""

from __future__ import annotations

import os

from healthd import fastjson, goodput_events, statedoc
from healthd.bindings import charges, close_binding, read_binding, remove_binding
from healthd.checks import CHECKS_FILE, gpu_count_result, merged_doc
from healthd.hooks import inband_dirs
from healthd.hooks.common import (
    Context,
    Judgement,
    env_job_id,
    healthd_reason,
    is_drained,
    is_healthd_reason,
    run_hook,
    slurm_error,
    take_node,
)
from healthd.statedoc import f_action, f_id, f_tier, is_t1_hardware, summary
from healthd.text import clean, iso
from healthd.trusted import TRUSTED_UID, TrustedDir, split_path

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

HOOK = "healthd-epilog"
OK = 0
WHEN_IDLE = ("reboot-when-idle", "reset-gpu-when-idle")
REQUESTS_DIR = "requests"
_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._:-")


def request_name(finding_id: Any) -> str:
    """A finding id as a file name in requests/: no '/', no leading dot, bounded."""
    name = "".join(c if c in _SAFE else "_" for c in str(finding_id))[:150] or "finding"
    return f"_{name}.json" if name.startswith(".") else f"{name}.json"


def when_idle(judgement: Judgement) -> list[dict[str, Any]]:
    """Findings whose remedy is a reset or reboot once the node is idle, reboot first, most certain first."""
    fs = [f for f in judgement.findings if f_action(f) in WHEN_IDLE]
    return sorted(fs, key=lambda f: (WHEN_IDLE.index(f_action(f)), f_tier(f) or 9, f_id(f)))


def append_charges(path: str, lines: list[dict[str, Any]], *, run_dir: str | None = None,
                   trusted_uid: int = TRUSTED_UID) -> None:
    """One O_APPEND write (concurrent epilogs never interleave lines) to a trusted file in a trusted
    directory; under `run_dir` every directory below it is reached without following a link."""
    data = "".join(fastjson.dumps_compact(line) + "\n" for line in lines).encode()
    top, rel, name = split_path(path, run_dir)
    with TrustedDir(top, rel, create=True, trusted_uid=trusted_uid) as d:
        d.append(name, data, 0o640)


def epilog(ctx: Context) -> int:
    log = ctx.log
    end = ctx.now
    judgement = ctx.state()
    if not judgement.known:
        log.warning(f"{judgement.reason}: findings are not attributed to this job and nothing is requested")

    job, why = env_job_id(ctx.env)
    if job is None:
        log.warning(f"{why}; no binding to close")
    else:
        close_job(ctx, job, judgement, end)

    post_job_checks(ctx, end)
    if judgement.known:
        request_when_idle(ctx, judgement, job)

    drain_for_t1(ctx, judgement, job)
    if job is not None:
        archive_inband(ctx, job)  # first: the agent stops reading the run's rings before its end is written
        end_goodput_run(ctx, job, end)
    return OK


def end_goodput_run(ctx: Context, job: str, end: float) -> None:
    """The run's end, into the job's goodput log where this node keeps one (the node of rank 0,
    whose agent writes it): Slurm's exit code when the epilog is given one, else `ENDED`."""
    path = os.path.join(ctx.settings.state_dir, goodput_events.LOG_DIR, job + goodput_events.LOG_SUFFIX)
    code = (ctx.env.get("SLURM_JOB_EXIT_CODE2") or ctx.env.get("SLURM_JOB_EXIT_CODE") or "").strip()[:16]
    state = "ENDED" if not code else "COMPLETED" if code in ("0", "0:0") else "FAILED"
    entry = goodput_events.event("run_end", end, state=state, **({"exit_code": code} if code else {}))
    try:
        # no O_CREAT: only the node that has the log adds to it
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    except OSError as e:
        ctx.log.warning(f"job {job}: run end not added to {path}: {clean(e, 200)}")
        return
    try:
        os.write(fd, (goodput_events.log_line(job, **entry) + "\n").encode())
        ctx.log.info(f"job {job}: run end ({state}) added to its goodput log {path}")
    except OSError as e:
        ctx.log.warning(f"job {job}: run end not added to {path}: {clean(e, 200)}")
    finally:
        os.close(fd)


def drain_for_t1(ctx: Context, judgement: Judgement, job: str | None) -> None:
    log, h = ctx.log, ctx.settings.hooks
    t1 = sorted((f for f in judgement.findings if is_t1_hardware(f)), key=f_id)
    if not t1:
        return
    reason = healthd_reason(summary(t1[0]), f"[job {job}]" if job else "")
    if h.gating != "local":
        log.warning(f"would drain the node: {reason} (hooks.gating {h.gating}: "
                    f"{'the controller decides' if h.gating == 'controller' else 'report only'})")
        return
    if take_node(ctx, reason):
        log.error(f"node drained for a T1 hardware finding: {reason}")
    else:
        log.warning(f"the node could not be drained although {summary(t1[0])}")


def archive_inband(ctx: Context, job: str) -> None:
    """Even with inband disabled: a directory made while it was enabled is still the user's to write."""
    enabled = ctx.settings.inband.enabled
    try:
        text = inband_dirs.archive(ctx.settings.hooks.run_dir, job, ctx.settings.inband.keep_jobs,
                                   trusted_uid=ctx.trusted_uid)
    except FileNotFoundError:
        if enabled:
            ctx.log.info(f"job {job}: no in-band directory to archive")
        return
    except (OSError, ValueError) as e:
        ctx.log.warning(f"job {job}: in-band directory not archived: {e}")
        return
    ctx.log.info(f"job {job}: in-band directory {text}")


def close_job(ctx: Context, job: str, judgement: Judgement, end: float) -> None:
    log, h = ctx.log, ctx.settings.hooks
    try:
        binding = read_binding(h.run_dir, job, trusted_uid=ctx.trusted_uid)
    except FileNotFoundError:
        log.warning(f"job {job}: no binding (the prolog did not run, or {h.run_dir} was cleared); nothing charged")
        return
    except (OSError, ValueError, UnicodeDecodeError) as e:
        log.warning(f"job {job}: binding unusable ({clean(e, 300)}); nothing charged")
        binding = None
    if binding is not None and (binding.job != job or binding.node != ctx.node):
        log.warning(f"job {job}: binding names job {binding.job} on {binding.node}; nothing charged")
        binding = None
    if binding is None:
        try:
            remove_binding(h.run_dir, job, trusted_uid=ctx.trusted_uid)
        except OSError:
            pass
        return
    lines = charges(judgement.findings, binding, end, ctx.node) if judgement.known else []
    if lines:
        try:
            append_charges(h.charges_file, lines, run_dir=h.run_dir, trusted_uid=ctx.trusted_uid)
        except OSError as e:
            log.error(f"job {job}: cannot append to {h.charges_file}: {e}")
        for c in lines:
            log.warning(f"charged to job {job} (user {c['user'] or '?'}): gpu{c['gpu']} "
                        f"{'xid ' + str(c['xid']) + ' ' if c['xid'] is not None else ''}{c['finding']}: {c['summary']}")
    try:
        close_binding(h.run_dir, binding, end, trusted_uid=ctx.trusted_uid, charged=[c["finding"] for c in lines])
    except OSError as e:
        log.error(f"job {job}: cannot close the binding: {e}")
        return
    gl = ",".join(map(str, binding.gpus)) if binding.gpus is not None else "unknown"
    log.info(f"job {job} ended (GPUs {gl}, {end - binding.start:.0f}s, {len(lines)} finding(s) charged)")


def post_job_checks(ctx: Context, now: float) -> None:
    r = gpu_count_result(ctx.settings.hooks.gpu_devices, ctx.settings.nvml.expected_gpus, now, "epilog")
    if r is None:
        return
    if not r["ok"]:
        ctx.log.warning(f"post-job check gpu_count failed: {r['detail']}")
    try:
        old = ctx.read_json(CHECKS_FILE)
    except (OSError, ValueError, UnicodeDecodeError):
        old = None
    try:
        ctx.write_json(CHECKS_FILE, merged_doc(old, ctx.node, now, [r]))
    except OSError as e:
        ctx.log.error(f"cannot write {ctx.path(CHECKS_FILE)}: {e}")


def request_when_idle(ctx: Context, judgement: Judgement, job: str | None) -> None:
    log, h = ctx.log, ctx.settings.hooks
    wanted = when_idle(judgement)
    if not wanted:
        return
    try:
        requests: TrustedDir | None = ctx.run_dir(REQUESTS_DIR, create=True)
    except OSError as e:
        log.error(f"cannot write requests into {ctx.path(REQUESTS_DIR)}: {e}")
        requests = None
    if requests is not None:
        with requests:
            for f in wanted:
                name = request_name(f.get(statedoc.ID))
                path = requests.join(name)
                try:
                    if requests.exists(name):
                        continue
                    requests.write_json(name, {"finding": f.get(statedoc.ID), "action": f_action(f), "node": ctx.node,
                                               "tier": f.get(statedoc.TIER), "summary": summary(f, 300),
                                               "requested_at": iso(ctx.now), "by": HOOK, "job": job})
                    log.warning(f"requested {f_action(f)} for {summary(f)} ({path})")
                except OSError as e:
                    log.error(f"cannot write request {path}: {e}")
    if h.gating != "local":
        return
    if any(is_t1_hardware(f) for f in judgement.findings):
        return  # the node is being drained; a reboot with next state RESUME would undo that
    SlurmError = slurm_error()
    first = wanted[0]
    reason = healthd_reason(summary(first))
    try:
        backend = ctx.backend()
        info = backend.node(ctx.node)
        flags = {str(x).upper() for x in (getattr(info, "flags", ()) or ())}
        current = getattr(info, "reason", None) or ""
        if current and not is_healthd_reason(current):
            log.info(f"no reboot requested: node {ctx.node} carries someone else's reason ({clean(current, 120)})")
        elif is_drained(info):
            log.info(f"no reboot requested: node {ctx.node} is drained ({clean(current, 120)}); the controller decides")
        elif flags & {"REBOOT_REQUESTED", "REBOOT_ISSUED", "REBOOT"}:
            log.info(f"reboot already requested for node {ctx.node}")
        else:
            backend.reboot_asap([ctx.node], reason=reason)
            log.warning(f"requested reboot ASAP of node {ctx.node}: {reason}")
    except SlurmError as e:
        log.warning(f"cannot request a reboot of node {ctx.node}: {clean(e, 200)}")


def main(argv: list[str] | None = None) -> int:
    return run_hook(HOOK, argv, OK, epilog)


if __name__ == "__main__":
    raise SystemExit(main())

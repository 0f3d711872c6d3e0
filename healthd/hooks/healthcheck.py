"""healthd-healthcheck: slurmd's HealthCheckProgram (runs as root every HealthCheckInterval, with
SLURMD_NODENAME as its ONLY environment variable: no PATH, no SLURM_CONF -- both come from the config).

1. Judges the agent's state file and reports the agent alive or unknown (a log line when the agent is
   unknown or its status changed, and the `agent` field of checks.json).
2. Asks Slurm whether the node is idle. Idle: runs the quick active checks -- GPU device files
   (`hooks.gpu_devices`) against `nvml.expected_gpus`, and `dcgmi diag -r 1` when dcgmi is installed
   and the last run is older than `hooks.dcgmi_interval_s` -- and closes job bindings the epilog never
   closed. Busy: skips them. Slurm unreachable: skips them and says so.
3. Writes `<run_dir>/checks.json` atomically for the agent, which turns failed checks into findings.
   Every file under the run directory is read only when root owns it and nobody else can write it
   (nor its directory), and written without following a link at any level (healthd.trusted).

Exit code: always 0. slurmd only logs a non-zero exit; the health check never drains (the agent's
findings and the controller decide).
"""

from __future__ import annotations

import os

from healthd.bindings import open_bindings
from healthd.checks import CHECKS_FILE, gpu_count_result, merged_doc, result
from healthd.hooks.common import Context, run_hook, slurm_error
from healthd.text import clean, iso, parse_time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

HOOK = "healthd-healthcheck"
SLURM_ASK_BUSY_S = 300.0
"""With jobs bound on the node, Slurm is asked at most this often (to find bindings whose epilog
never ran); a node without bindings asks every run, since only Slurm knows it is really idle."""
ORPHAN_GRACE_S = 60.0
"""An open binding younger than this on a node Slurm shows idle may be a prolog racing the check."""


def node_idle(ctx: Context) -> tuple[bool | None, str]:
    """(True, '') idle; (False, what it is doing); (None, why Slurm could not tell)."""
    SlurmError = slurm_error()
    try:
        info = ctx.backend().node(ctx.node)
    except SlurmError as e:
        return None, clean(e, 200)
    words = {w for w in str(getattr(info, "state", "") or "").upper().replace("*", "").split("+") if w}
    words |= {str(f).upper() for f in (getattr(info, "flags", ()) or ())}
    busy = words & {"ALLOCATED", "MIXED", "COMPLETING"}
    if busy:
        return False, f"busy ({'+'.join(sorted(busy)).lower()})"
    if words & {"IDLE", "DOWN"}:
        return True, ""
    return False, f"in state {clean('+'.join(sorted(words)).lower() or 'unknown', 60)}"


def which(name: str, path: str) -> str | None:
    if "/" in name:
        return name if os.access(name, os.X_OK) else None
    for d in path.split(":"):
        candidate = os.path.join(d, name)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def dcgmi_due(old: dict[str, Any] | None, now: float, interval_s: float) -> bool:
    for r in (old or {}).get("results") or []:
        if isinstance(r, dict) and r.get("name") == "dcgmi_diag":
            t = parse_time(r.get("time"))
            return t is None or not 0 <= now - t < interval_s
    return True


def run_dcgmi(ctx: Context, exe: str) -> dict[str, Any]:
    """`dcgmi diag -r 1` with a hard timeout. ok: True passed, False a test failed, None could not
    run (host engine not reachable, timed out)."""
    import subprocess  # lazy: spared from the hooks' start

    h = ctx.settings.hooks
    if ctx.deadline is not None:
        ctx.deadline.extend_to(h.timeout_s + h.dcgmi_timeout_s)
    limit = h.dcgmi_timeout_s
    if ctx.deadline is not None:
        limit = max(0.1, min(limit, ctx.deadline.remaining() - 0.5))
    env = {"PATH": h.path, "SLURM_CONF": h.slurm_conf}
    try:
        p = subprocess.run([exe, "diag", "-r", "1"], capture_output=True, text=True, errors="replace",
                           timeout=limit, env=env, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return result("dcgmi_diag", None, f"dcgmi diag -r 1 timed out after {limit:g}s", ctx.now, HOOK)
    except OSError as e:
        return result("dcgmi_diag", None, f"cannot run {exe}: {e}", ctx.now, HOOK)
    out = (p.stdout or "") + (p.stderr or "")
    if p.returncode == 0:
        return result("dcgmi_diag", True, "dcgmi diag -r 1 passed", ctx.now, HOOK)
    failed = [" ".join(line.replace("|", " ").split()) for line in out.splitlines() if "Fail" in line]
    if failed:
        return result("dcgmi_diag", False, "; ".join(failed)[:300], ctx.now, HOOK)
    first = next((line.strip() for line in out.splitlines() if line.strip()), "no output")
    return result("dcgmi_diag", None, f"dcgmi exited {p.returncode}: {first}", ctx.now, HOOK)


def close_orphans(ctx: Context, bindings: list[tuple[str, Any]]) -> list[str]:
    """Open bindings on a node Slurm shows idle are jobs whose epilog never ran (slurmd was killed,
    the epilog timed out): close them so no later finding is charged to a dead job. A binding
    younger than ORPHAN_GRACE_S may be a prolog racing this check and is left alone."""
    from healthd.bindings import close_binding, remove_binding  # lazy: spared from the hooks' start

    run_dir = ctx.settings.hooks.run_dir
    closed = []
    for job, b in bindings:
        try:
            if b is None:
                remove_binding(run_dir, job, trusted_uid=ctx.trusted_uid)
            elif ctx.now - b.start > ORPHAN_GRACE_S:
                close_binding(run_dir, b, ctx.now, trusted_uid=ctx.trusted_uid,
                              closed_by=f"{HOOK}: Slurm shows the node idle")
            else:
                continue
            closed.append(job)
        except OSError:
            pass
    return closed


def healthcheck(ctx: Context) -> int:
    log, h = ctx.log, ctx.settings.hooks
    judgement = ctx.state()
    path = ctx.path(CHECKS_FILE)
    try:
        old = ctx.read_json(CHECKS_FILE)
    except FileNotFoundError:
        old = None
    except (OSError, ValueError, UnicodeDecodeError) as e:
        log.warning(f"previous quick-check results {path} unusable ({clean(e, 300)}); starting over")
        old = None

    results: list[dict[str, Any]] = []
    bindings = open_bindings(h.run_dir, trusted_uid=ctx.trusted_uid, warn=log.warning)
    asked = parse_time((old or {}).get("slurm_asked_at"))
    if bindings and asked is not None and 0 <= ctx.now - asked < SLURM_ASK_BUSY_S:
        idle, why = False, f"busy (job {bindings[0][0]}{' and others' if len(bindings) > 1 else ''} bound)"
    else:
        idle, why = node_idle(ctx)
        asked = ctx.now
    if idle is None:
        active = f"skipped: Slurm unreachable ({why})"
        log.warning(f"active checks {active}")
    elif not idle:
        active = f"skipped: node {why}"
    else:
        active = "ran"
        r = gpu_count_result(h.gpu_devices, ctx.settings.nvml.expected_gpus, ctx.now, HOOK)
        if r is not None:
            results.append(r)
        exe = which(h.dcgmi, h.path) if h.dcgmi else None
        if exe is not None and dcgmi_due(old, ctx.now, h.dcgmi_interval_s):
            results.append(run_dcgmi(ctx, exe))
        for job in close_orphans(ctx, bindings):
            log.warning(f"closed the binding of job {job}: Slurm shows the node idle and its epilog never closed it")

    agent = {"known": judgement.known, "reason": judgement.reason}
    doc = merged_doc(old, ctx.node, ctx.now, results, agent=agent, active=active,
                     slurm_asked_at=iso(asked) if asked is not None else None)
    try:
        ctx.write_json(CHECKS_FILE, doc)
    except OSError as e:
        log.error(f"cannot write {path}: {e}")

    was = (old or {}).get("agent") if isinstance((old or {}).get("agent"), dict) else {}
    if not judgement.known:
        log.warning(judgement.reason)
    elif was.get("known") is not True:
        log.info(judgement.reason)
    for r in results:
        if r["ok"] is False:
            log.warning(f"quick check {r['name']} failed: {r['detail']}")
        elif r["ok"] is None:
            log.warning(f"quick check {r['name']} could not run: {r['detail']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_hook(HOOK, argv, 0, healthcheck)


if __name__ == "__main__":
    raise SystemExit(main())

"""`healthd` command line.

    healthd --dry-run --once [--format table|json|nagios]   what this node has and would do; touches nothing
    healthd --dry-run                                 the same, continuously (prints on every change)
    healthd run [--once]                              the daemon (systemd starts this)
    healthd state [--format table|json|nagios]        what the RUNNING agent last published: reads its state
                                                      file the way the Slurm hooks do; no hardware, no writes
    healthd check-config [--write-hook-config]        validate the config file and exit (and compile it for the hooks)
    healthd validate [--dcgm-level N]                 reintegration check: dcgmi diag + one agent pass

Exit codes follow Nagios: 0 healthy, 1 degraded, 2 failed, 3 could not check. `--format nagios`
prints exactly one plugin line with perfdata (healthd.agent.render.render_nagios).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from healthd import __version__, hookconfig, sdnotify
from healthd.agent.render import render_nagios, render_text
from healthd.statedoc import EXIT_CODES, judge, load_state
from healthd.trusted import TRUSTED_UID

EXIT_UNKNOWN = 3


def setup_logging(level: str, daemon: bool) -> None:
    """The daemon logs to journald with structured fields (NODE, GPU, XID, FINDING, TIER: the agent's
    finding lines pass them as `extra`) when systemd runs it ($JOURNAL_STREAM is its stderr) or the
    journal socket exists; otherwise, and for one-shot commands, plain lines on stderr."""
    sdnotify.setup_logging("healthd", level=level, journal=None if daemon else False,
                           stderr_format="healthd: %(levelname)s %(message)s")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="healthd", description="GPU node health agent for Slurm clusters.")
    p.add_argument("command", nargs="?", choices=["run", "check-config", "validate", "state"],
                   help="run: the daemon; check-config: validate the config and exit; validate: the reintegration "
                        "check the controller runs through srun (exit 0 pass, 1 fail); state: report what the "
                        "running agent last published (its state file, judged as the Slurm hooks judge it: "
                        "missing, stale or from a dead agent is unknown, exit 3), reading no hardware")
    p.add_argument("--config", "-c", help="config file (default /etc/healthd/healthd.yaml)")
    p.add_argument("--dry-run", action="store_true", help="read everything, write nothing, print what it would do")
    p.add_argument("--once", action="store_true", help="one pass, then exit with the verdict's Nagios code")
    p.add_argument("--format", choices=["table", "json", "nagios"], default="table",
                   help="output of --once / --dry-run / state; nagios: one Nagios/Icinga plugin line with perfdata")
    p.add_argument("--dcgm-level", type=int, default=2, choices=[0, 1, 2, 3, 4],
                   help="validate: dcgmi diag run level (0: no DCGM step)")
    p.add_argument("--timeout", type=float, default=1800.0, help="validate: hard limit for the DCGM step, seconds")
    p.add_argument("--write-hook-config", action="store_true",
                   help="check-config: also compile the config for the Slurm hooks (healthd.hookconfig), as the "
                        "agent does at start and on SIGHUP")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="overrides the config's log_level")
    p.add_argument("--version", action="version", version=f"healthd {__version__}")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command is None and not (args.dry_run or args.once):
        parser().print_help(sys.stderr)
        return EXIT_UNKNOWN
    # `healthd state` runs under NHC and NRPE on every check: it imports only what reading one file
    # needs, not the collectors, the classifier and the metrics of the agent itself.
    if args.command == "validate":
        from healthd.agent import validate  # only validate needs it (spares `healthd state`)

        setup_logging(args.log_level or "warning", False)
        return validate.run(args.config, args.dcgm_level, args.timeout)
    if args.command == "state":
        setup_logging(args.log_level or "warning", False)
        return state(args.config, args.format)
    from healthd.agent import daemon as agent_mod  # the agent itself, past `healthd state`'s return
    from healthd.agent.classify.catalog import CatalogError  # with the agent, for the same reason
    from healthd.config import ConfigError  # with the agent, for the same reason

    nagios = args.format == "nagios"
    daemon = args.command == "run" and not args.dry_run
    setup_logging(args.log_level or "warning" if not daemon else args.log_level or "info", daemon)

    try:
        agent = agent_mod.build_agent(args.config, dry_run=args.dry_run)
    except (ConfigError, CatalogError) as e:
        logging.getLogger("healthd").error("%s", e)
        print(f"healthd: cannot check: {e}", file=sys.stderr)
        if nagios and args.command != "check-config":
            print(render_nagios(None, f"cannot check: {e}")[0], flush=True)
        return EXIT_UNKNOWN
    compile_hooks = (args.command == "run" and not args.dry_run) or (args.command == "check-config" and args.write_hook_config)
    compiled = agent_mod.publish_hook_config(args.config) if compile_hooks else ""
    if args.command == "check-config":
        agent.sources.close()
        print(f"{args.config or '/etc/healthd/healthd.yaml'}: ok (node {agent.settings.node_name})"
              + (f"; compiled for the Slurm hooks into {compiled}" if compiled else ""))
        return 0
    if args.log_level is None and daemon:
        logging.getLogger().setLevel(agent.settings.log_level.upper())

    def emit(a: agent_mod.Agent) -> None:
        if not a.dry_run:
            a.publish()
        if a.dry_run or args.once:
            doc = a.document()
            if args.format == "json":
                print(json.dumps(doc, indent=2), flush=True)
            elif nagios:
                print(render_nagios(doc)[0], flush=True)
            else:
                print(render_text(doc), flush=True)

    if args.once:
        try:
            agent.tick_all()
            emit(agent)
        except Exception as e:
            if not nagios:
                raise
            # a plugin answers with a line and a code, never a traceback (exit 1 would read WARNING)
            logging.getLogger("healthd").exception("the check failed")
            print(render_nagios(None, f"the check failed: {type(e).__name__}: {e}")[0], flush=True)
            return EXIT_UNKNOWN
        finally:
            agent.sources.close()
        return EXIT_CODES[agent.result.verdict]
    last: list[str] = []

    def on_tick(a: agent_mod.Agent) -> None:
        if a.dry_run:
            key = json.dumps([a.result.verdict, [f.to_json() for f in a.result.findings]], default=str)
            if last and last[0] == key:
                return
            last[:] = [key]
        emit(a)

    return agent_mod.run_loop(agent, args.config, on_tick)


def state(config: str | None, fmt: str) -> int:
    """`healthd state`: the running agent's last state file, judged the way the Slurm hooks judge it
    (healthd.statedoc.judge: missing, unparsable, not root's, for another node, older than
    hooks.stale_after_s or from an agent whose pid is gone is unknown). Reads that one file and the
    config; touches no hardware and writes nothing, so it is quick enough for NHC and NRPE."""
    try:
        # the Slurm hooks' compiled copy of the settings when it is current, else the YAML itself
        settings, _ = hookconfig.load(config, TRUSTED_UID)
    except hookconfig.Unusable as e:
        print(f"healthd: cannot check: {e}", file=sys.stderr)
        if fmt == "nagios":
            print(render_nagios(None, f"cannot check: {e}")[0])
        elif fmt == "json":
            print(json.dumps({"known": False, "reason": f"cannot check: {e}", "verdict": "unknown", "state": None}))
        return EXIT_UNKNOWN
    doc, error = load_state(settings.state_file)
    j = judge(doc, time.time(), settings, error=error)
    verdict = j.doc.get("verdict") if j.known and j.doc is not None else "unknown"
    code = EXIT_CODES.get(verdict, EXIT_UNKNOWN) if isinstance(verdict, str) else EXIT_UNKNOWN
    if fmt == "nagios":
        line, code = render_nagios(j.doc, "" if j.known else j.reason)
        print(line)
        return code
    if fmt == "json":
        print(json.dumps({"known": j.known, "reason": j.reason, "verdict": verdict, "state": j.doc}, indent=2))
        return code
    print(f"healthd state {settings.state_file}: {j.reason}")
    if j.known and j.doc is not None:
        try:
            print(render_text(j.doc), end="")
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            print(f"(the document cannot be shown as a table: {type(e).__name__} {e}; see --format json)")
    return code


if __name__ == "__main__":
    sys.exit(main())

"""`healthd` command line.

    healthd --dry-run --once [--format table|json]   what this node has and would do; touches nothing
    healthd --dry-run                                 the same, continuously (prints on every change)
    healthd run [--once]                              the daemon (systemd starts this)
    healthd check-config                              validate the config file and exit
    healthd validate [--dcgm-level N]                 reintegration check: dcgmi diag + one agent pass

Exit codes follow Nagios: 0 healthy, 1 degraded, 2 failed, 3 could not check.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from healthd import __version__, sdnotify
from healthd.agent import daemon as agent_mod
from healthd.agent import validate
from healthd.agent.classify.catalog import CatalogError
from healthd.agent.render import render_text
from healthd.config import ConfigError

EXIT_UNKNOWN = 3


def setup_logging(level: str, daemon: bool) -> None:
    """The daemon logs to journald with structured fields (NODE, GPU, XID, FINDING, TIER: the agent's
    finding lines pass them as `extra`) when systemd runs it ($JOURNAL_STREAM is its stderr) or the
    journal socket exists; otherwise, and for one-shot commands, plain lines on stderr."""
    sdnotify.setup_logging("healthd", level=level, journal=None if daemon else False,
                           stderr_format="healthd: %(levelname)s %(message)s")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="healthd", description="GPU node health agent for Slurm clusters.")
    p.add_argument("command", nargs="?", choices=["run", "check-config", "validate"],
                   help="run: the daemon; check-config: validate the config and exit; validate: the reintegration "
                        "check the controller runs through srun (exit 0 pass, 1 fail)")
    p.add_argument("--config", "-c", help="config file (default /etc/healthd/healthd.yaml)")
    p.add_argument("--dry-run", action="store_true", help="read everything, write nothing, print what it would do")
    p.add_argument("--once", action="store_true", help="one pass, then exit with the verdict's Nagios code")
    p.add_argument("--format", choices=["table", "json"], default="table", help="dry-run output format")
    p.add_argument("--dcgm-level", type=int, default=2, choices=[0, 1, 2, 3, 4],
                   help="validate: dcgmi diag run level (0: no DCGM step)")
    p.add_argument("--timeout", type=float, default=1800.0, help="validate: hard limit for the DCGM step, seconds")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="overrides the config's log_level")
    p.add_argument("--version", action="version", version=f"healthd {__version__}")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command is None and not (args.dry_run or args.once):
        parser().print_help(sys.stderr)
        return EXIT_UNKNOWN
    if args.command == "validate":
        setup_logging(args.log_level or "warning", False)
        return validate.run(args.config, args.dcgm_level, args.timeout)
    daemon = args.command == "run" and not args.dry_run
    setup_logging(args.log_level or "warning" if not daemon else args.log_level or "info", daemon)

    try:
        agent = agent_mod.build_agent(args.config, dry_run=args.dry_run)
    except (ConfigError, CatalogError) as e:
        logging.getLogger("healthd").error("%s", e)
        print(f"healthd: cannot check: {e}", file=sys.stderr)
        return EXIT_UNKNOWN
    if args.command == "check-config":
        agent.sources.close()
        print(f"{args.config or '/etc/healthd/healthd.yaml'}: ok (node {agent.settings.node_name})")
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
            else:
                print(render_text(doc), flush=True)

    if args.once:
        try:
            agent.tick_all()
            emit(agent)
        finally:
            agent.sources.close()
        return agent_mod.EXIT_CODES[agent.result.verdict]
    last: list[str] = []

    def on_tick(a: agent_mod.Agent) -> None:
        if a.dry_run:
            key = json.dumps([a.result.verdict, [f.to_json() for f in a.result.findings]], default=str)
            if last and last[0] == key:
                return
            last[:] = [key]
        emit(a)

    return agent_mod.run_loop(agent, args.config, on_tick)


if __name__ == "__main__":
    sys.exit(main())

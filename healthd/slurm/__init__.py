"""healthd's Slurm backends: the SlurmBackend Protocol and its values (backend), the scontrol/sinfo
implementation for every Slurm version (scontrol), the pyslurm one for sites whose Slurm matches
their pyslurm (pyslurm_backend: 24.11 run against a real Slurm 24.11, 25.11 against a stand-in),
and default_backend() to choose between them: scontrol unless a site asks for pyslurm."""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os

from healthd.slurm.backend import (
    JobInfo,
    NodeInfo,
    SlurmBackend,
    SlurmError,
    SlurmOutputError,
    SlurmRefused,
    SlurmUnavailable,
    StepResult,
)
from healthd.slurm.scontrol import ScontrolBackend, parse_version

__all__ = [
    "BACKENDS",
    "JobInfo",
    "NodeInfo",
    "SlurmBackend",
    "SlurmError",
    "SlurmOutputError",
    "SlurmRefused",
    "SlurmUnavailable",
    "ScontrolBackend",
    "StepResult",
    "default_backend",
]

BACKENDS = ("scontrol", "pyslurm")
"""What a site may ask for (the controller's `slurm_backend`); scontrol is the default."""

_log = logging.getLogger(__name__)


def _import_pyslurm(slurm_conf: str):
    """Import pyslurm with our slurm.conf, never one libslurm finds by itself (possibly configless
    DNS): pyslurm 25.11 skips its auto-init under PYSLURM_DISABLE_AUTO_INIT and is initialised
    explicitly after; pyslurm 24.11 always runs slurm_init() on import, which reads SLURM_CONF, so
    that is ours for the import (and the explicit slurm_init after it is then a no-op)."""
    wanted = {"PYSLURM_DISABLE_AUTO_INIT": "1", "SLURM_CONF": slurm_conf}
    prev = {k: os.environ.get(k) for k in wanted}
    os.environ.update(wanted)
    try:
        module = importlib.import_module("pyslurm")
    finally:
        for k, v in prev.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    module.slurm_init(slurm_conf)
    return module


def default_backend(
    slurm_conf: str | None = None,
    log: logging.Logger | None = None,
    *,
    timeout_s: float = 10.0,
    dry_run: bool = False,
    prefer_pyslurm: bool = False,
    scontrol: ScontrolBackend | None = None,
    pyslurm_module=None,
) -> SlurmBackend:
    """ScontrolBackend, unless `prefer_pyslurm` (the site's `slurm_backend: pyslurm`): then
    PyslurmBackend when pyslurm imports AND its Slurm major.minor (pyslurm's own version is
    SLURM_MAJOR.SLURM_MINOR.PATCH) equals the installed Slurm's (`scontrol --version`), otherwise
    ScontrolBackend still. pyslurm is opt-in on every version: its calls hold the interpreter while
    slurmctld is out of reach (libslurm's retries, about MessageTimeout), which stops every other
    thread of the controller, where an scontrol client is killed at timeout_s; bench/slurm_backends.py
    measures both (docs/slurm.md, "pyslurm"). Logs the choice and why. Raises
    SlurmUnavailable when there is no slurm.conf (slurm_conf or SLURM_CONF): no client runs without one.

    `scontrol` and `pyslurm_module` let tests hand in a ScontrolBackend with a fake runner and an
    already imported (stand-in) pyslurm; production code leaves them None."""
    log = log or _log
    if scontrol is None:
        scontrol = ScontrolBackend(slurm_conf, timeout_s=timeout_s, dry_run=dry_run, logger=log)
    if not prefer_pyslurm:
        log.info("Slurm backend: scontrol (the default: pyslurm not wanted unless slurm_backend is pyslurm)")
        return scontrol
    try:
        slurm_version = scontrol.version()
        slurm_mm = parse_version(slurm_version)
    except SlurmError as exc:
        log.warning("Slurm backend: scontrol (cannot read the Slurm version to check pyslurm: %s)", exc)
        return scontrol
    try:
        ps_version = (
            str(pyslurm_module.__version__) if pyslurm_module is not None else importlib.metadata.version("pyslurm")
        )
    except (importlib.metadata.PackageNotFoundError, AttributeError):
        log.info("Slurm backend: scontrol (pyslurm is not installed; Slurm %s)", slurm_version)
        return scontrol
    try:
        ps_mm = parse_version(ps_version)
    except SlurmError:
        log.info("Slurm backend: scontrol (pyslurm version %r not understood)", ps_version)
        return scontrol
    if ps_mm != slurm_mm:
        log.info(
            "Slurm backend: scontrol (pyslurm %s is built for Slurm %d.%02d, this is Slurm %s)",
            ps_version,
            *ps_mm,
            slurm_version,
        )
        return scontrol
    try:
        module = pyslurm_module if pyslurm_module is not None else _import_pyslurm(scontrol.slurm_conf)
    except Exception as exc:  # noqa: BLE001 - any import failure means: use scontrol
        log.warning("Slurm backend: scontrol (pyslurm %s does not load: %s)", ps_version, exc)
        return scontrol
    from healthd.slurm.pyslurm_backend import PyslurmBackend  # optional dependency: only when pyslurm loads

    log.info("Slurm backend: pyslurm %s (matches Slurm %s); reboot via scontrol", ps_version, slurm_version)
    return PyslurmBackend(module, fallback=scontrol, timeout_s=timeout_s, dry_run=dry_run, logger=log)

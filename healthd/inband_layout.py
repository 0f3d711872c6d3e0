"""The in-band contract between a training job and healthd on a node: where a job's rings live, and
how a ring file is named and laid out (docs/inband.md).

Where they live is healthd's, defined here: the prolog makes `<hooks.run_dir>/inband/<job>` for the
job's user (healthd.hooks.inband_dirs), the TaskProlog hands it to the job's tasks in the environment
(healthd.hooks.taskprolog), the agent reads every ring in it (healthd.agent.inband_jobs), the epilog
moves it to `<hooks.run_dir>/inband/done/<job>`.

The ring itself (its layout, its file name in that directory, the environment variable) is the job's
client's, healthd_inband.py: one standard-library file a job may vendor, so it can import nothing of
healthd and is the one place they can be defined. This module loads that file, installed beside the
healthd package, as a module of its own in which no ring is set up (the client sets one up when
imported with HEALTHD_INBAND_DIR set, and a healthd process only reads rings), and gives its names to
the readers.

Cheap to import (os, sys, importlib.machinery, struct): the TaskProlog loads it before every task.
"""

from __future__ import annotations

import os
import sys
from importlib.machinery import PathFinder, SourceFileLoader

TYPE_CHECKING = False
if TYPE_CHECKING:
    import struct
    from typing import Any, Callable

CLIENT = "healthd_inband"


def _load_client() -> Any:
    """healthd_inband.py beside this package (else the first on sys.path), run with `_LAYOUT_ONLY`
    set so that it sets no ring up; not entered in sys.modules, so a process that imports the client
    itself still gets its own."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), CLIENT + ".py")
    if not os.path.isfile(path):
        spec = PathFinder.find_spec(CLIENT)
        if spec is None or not spec.origin:
            raise ImportError(f"{CLIENT}.py, the in-band client healthd is installed with, is not found", name=CLIENT)
        path = spec.origin
    loader = SourceFileLoader(CLIENT, path)
    module = type(sys)(CLIENT)
    module.__file__ = path
    module.__loader__ = loader
    module.__dict__["_LAYOUT_ONLY"] = True
    loader.exec_module(module)
    return module


client = _load_client()

# --------------------------------------------------------------------------- the ring (the client's)

ENV_DIR: str = client.ENV_DIR
"""The variable that names the job's in-band directory to its tasks."""
MAGIC: bytes = client.MAGIC
VERSION: int = client.VERSION
HEADER: struct.Struct = client.HEADER
STEP_ID: struct.Struct = client.STEP_ID
STEP_ID_OFFSET: int = client.STEP_ID_OFFSET
RECORD: struct.Struct = client.RECORD
MAX_CAPACITY: int = client.MAX_CAPACITY
KINDS: dict[int, str] = client.KINDS
STEP: int = client.STEP
WAIT: int = client.WAIT
CKPT_BEGIN: int = client.CKPT_BEGIN
CKPT_END: int = client.CKPT_END
DURABLE: int = client.DURABLE
RESTORED: int = client.RESTORED
PHASES: dict[int, str] = client.PHASES
FLAG_ERROR: int = client.FLAG_ERROR
RING_PREFIX: str = client.RING_PREFIX
RING_SUFFIX: str = client.RING_SUFFIX
ring_name: Callable[[int], str] = client.ring_name


def ring_rank(name: str) -> int | None:
    """The rank a ring's file name says (`rank-<rank>.ring`, up to 7 digits); None for any other name
    (a writer's temporary file, a ring of no known rank, anything the job left there)."""
    digits = name[len(RING_PREFIX):-len(RING_SUFFIX)] if name.startswith(RING_PREFIX) and name.endswith(RING_SUFFIX) else ""
    if not 1 <= len(digits) <= 7 or not (digits.isascii() and digits.isdigit()):
        return None
    return int(digits)


# --------------------------------------------------------------------------- the directories (healthd's)

INBAND_DIR = "inband"
"""Under hooks.run_dir: one directory per job."""
DONE_DIR = "done"
"""Under INBAND_DIR: the directories of ended jobs, moved there by the epilog."""
MAX_JOB_ID = 20
"""Digits in a job id: what Slurm hands the hooks as SLURM_JOB_ID."""


def valid_job(job: object) -> bool:
    """A job directory's name: 1 to MAX_JOB_ID ASCII digits (never `done`, never a path)."""
    return isinstance(job, str) and 1 <= len(job) <= MAX_JOB_ID and job.isascii() and job.isdigit()


def job_dir(run_dir: str, job: str) -> str:
    """`<run_dir>/inband/<job>`; ValueError for a job that is not a job id (the name never leaves
    inband/)."""
    if not valid_job(job):
        raise ValueError(f"not a job id: {job!r}")
    return os.path.join(run_dir, INBAND_DIR, job)


def done_dir(run_dir: str, job: str) -> str:
    """`<run_dir>/inband/done/<job>`."""
    if not valid_job(job):
        raise ValueError(f"not a job id: {job!r}")
    return os.path.join(run_dir, INBAND_DIR, DONE_DIR, job)

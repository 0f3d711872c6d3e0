"""healthd in-band signals: a training job tells the node's health agent how it is progressing.

    import healthd_inband as hd
    for step in range(start, steps):
        ...forward/backward...
        with hd.wait():                 # around blocking sync points (all-reduce, barrier)
            ...
        optimizer.step()
        hd.step(step)                   # after each committed optimizer step
        if step % 500 == 0:
            with hd.checkpoint(step):   # the blocking part of a save
                save(...)
            hd.checkpoint_durable(step) # when the checkpoint is safely on storage
    # after a restart: hd.restored(step_loaded)

Every call is a no-op unless HEALTHD_INBAND_DIR names a directory (the job's in-band directory on the
node), so a script calls these unconditionally. Enabled, each rank writes fixed-size
records into its own ring file `<dir>/rank-<rank>.ring` through a shared memory mapping: no system
call per call, never blocking, and the file outlives the process (its last record is the evidence of
where a hung job stopped). The layout is in healthd's docs/inband.md and in the constants below.

Standard library only, one file: a job may vendor it by copying this file. Nothing here raises into
the training script: if the ring cannot be set up, the module warns once on stderr and stays a no-op.

This file is the one definition of the ring: its layout, its file name and the environment variable.
healthd's reader takes them from here (healthd.inband_layout loads this file without setting a ring
up), so the two ends cannot disagree.
"""

from __future__ import annotations

import os
import struct
import sys
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

__all__ = ["step", "wait", "checkpoint", "checkpoint_durable", "restored", "torch_ddp_hook", "enabled",
           "ENV_DIR", "ENV_CAPACITY"]

ENV_DIR = "HEALTHD_INBAND_DIR"
ENV_CAPACITY = "HEALTHD_INBAND_CAPACITY"

MAGIC = b"HDINBAND"
VERSION = 1
HEADER = struct.Struct("<8sHHHHIiiiiiQQ32sIIQ16xQ")
"""magic, version, header size, record size, flags, capacity, pid, rank, local rank, world size,
device, start wall ns, start monotonic ns, job id (ASCII, NUL-padded), phase, reserved, phase start
(monotonic ns), 16 reserved bytes, head (the last published sequence number). 128 bytes,
little-endian."""
PHASE_OFFSET = 88
PHASE = struct.Struct("<IIQ")
"""What the rank is doing now, and since when: what tells a hung rank from the ranks waiting for it
(they are inside a collective, it is not). Written on entering and leaving a block, never read back."""
HEAD_OFFSET = 120
HEAD = struct.Struct("<Q")
STEP_ID_OFFSET = 104
STEP_ID = struct.Struct("<I")
"""The first 4 of the header's 16 reserved bytes: the Slurm job step the ring belongs to, stored as
SLURM_STEP_ID + 1 (0: not known, as in a ring written before this field, or outside a step), so a
reader tells an earlier `srun` step's rings from the current one's. Written once at set-up."""
RECORD_SIZE = 64
"""One record per 64-byte cache line."""
SEQ = struct.Struct("<Q")
BODY = struct.Struct("<HHIqQQQQ")
"""At record offset 8: kind, flags, reserved, step, monotonic ns, wall ns, duration ns, wait ns.
The sequence number is at offset 0 and again at offset 56 (the tail)."""
BODY_OFFSET = 8
TAIL_OFFSET = 56
RECORD = struct.Struct("<Q" + BODY.format.lstrip("<") + "Q")
"""A whole record as a reader unpacks it: seq, the body's fields, seq again (the tail)."""
WORD = 8
"""The writer stores a record as eight 8-byte words (kind and flags share the first), the same bytes
as the layout above, through a memoryview cast to signed 64-bit: one store per field, the same C path
for each, which is what keeps step() cheap on a CPU whose caches the training step just emptied."""

STEP, WAIT, CKPT_BEGIN, CKPT_END, DURABLE, RESTORED = 1, 2, 3, 4, 5, 6
PHASE_COMPUTE, PHASE_WAIT, PHASE_CHECKPOINT = 1, 2, 3
"""Header phases (0: not yet known)."""
KINDS = {STEP: "step", WAIT: "wait", CKPT_BEGIN: "checkpoint_begin", CKPT_END: "checkpoint_end",
         DURABLE: "durable", RESTORED: "restored"}
PHASES = {PHASE_COMPUTE: "compute", PHASE_WAIT: "wait", PHASE_CHECKPOINT: "checkpoint"}
FLAG_ERROR = 1
"""Set on a wait or checkpoint_end record whose block ended with an exception."""

DEFAULT_CAPACITY = 8192
MIN_CAPACITY = 64
MAX_CAPACITY = 65536
JOB_BYTES = 32

RING_PREFIX = "rank-"
RING_SUFFIX = ".ring"
RING_UNKNOWN = "unknown"
"""`<dir>/rank-<rank>.ring`, or rank-unknown.ring for a process with no rank in its environment."""


def ring_name(rank: int) -> str:
    return f"{RING_PREFIX}{rank if rank >= 0 else RING_UNKNOWN}{RING_SUFFIX}"


assert HEADER.size == 128 and BODY_OFFSET + BODY.size == TAIL_OFFSET and TAIL_OFFSET + SEQ.size == RECORD_SIZE
assert RECORD.size == RECORD_SIZE
assert (HEADER.size, RECORD_SIZE, HEAD_OFFSET, PHASE_OFFSET) == (16 * WORD, 8 * WORD, 15 * WORD, 11 * WORD)
assert HEADER.format.endswith("Q16xQ") and STEP_ID_OFFSET == 13 * WORD and STEP_ID.size <= 16


# --------------------------------------------------------------------------- the disabled path


def _noop(*_args: Any, **_kwargs: Any) -> None:
    return None


class _NoopContext:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *_exc: Any) -> None:
        return None


_NOOP_CONTEXT = _NoopContext()


def _noop_context(*_args: Any, **_kwargs: Any) -> _NoopContext:
    return _NOOP_CONTEXT


# The public names are plain module attributes, rebound once at import when the ring is set up, so a
# disabled call costs one Python call and nothing else.
step = _noop
checkpoint_durable = _noop
restored = _noop
wait = _noop_context
checkpoint = _noop_context
enabled = False
_ring: "_Ring | None" = None


# --------------------------------------------------------------------------- the ring


def _env_int(env: dict[str, str], *names: str, default: int = -1) -> int:
    """The first of `names` set in `env`, as a signed 32-bit integer (the header's fields);
    `default` when none is set or the value is not one."""
    for name in names:
        value = env.get(name, "").strip()
        if value:
            try:
                n = int(value)
            except ValueError:
                return default
            return n if -(1 << 31) <= n < (1 << 31) else default
    return default


def _step_id(env: dict[str, str]) -> int:
    """SLURM_STEP_ID (else SLURM_STEPID) + 1 as the header stores it; 0 when unknown."""
    step = _env_int(env, "SLURM_STEP_ID", "SLURM_STEPID")
    return step + 1 if step >= 0 else 0


def _device(env: dict[str, str], local_rank: int) -> int:
    """The GPU index this rank most likely uses: its entry of CUDA_VISIBLE_DEVICES (one visible device,
    or the local rank's), -1 when unknown (a UUID, nothing visible)."""
    visible = [v.strip() for v in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if len(visible) == 1:
        pick = visible[0]
    elif 0 <= local_rank < len(visible):
        pick = visible[local_rank]
    else:
        return -1
    try:
        return int(pick)
    except ValueError:
        return -1


class _Ring:
    """One rank's ring: a preallocated file mapped shared, written word by word through a memoryview."""

    def __init__(self, directory: str, env: dict[str, str]) -> None:
        import mmap  # only when enabled: a disabled import stays as light as possible
        import threading

        self.rank = _env_int(env, "RANK", "SLURM_PROCID")
        self.local_rank = _env_int(env, "LOCAL_RANK", "SLURM_LOCALID")
        self.world_size = _env_int(env, "WORLD_SIZE", "SLURM_NTASKS")
        self.device = _device(env, self.local_rank)
        capacity = _env_int(env, ENV_CAPACITY, default=DEFAULT_CAPACITY)
        self.capacity = min(MAX_CAPACITY, max(MIN_CAPACITY, capacity if capacity > 0 else DEFAULT_CAPACITY))
        job = env.get("SLURM_JOB_ID", "").encode("ascii", "replace")[:JOB_BYTES]
        size = HEADER.size + self.capacity * RECORD_SIZE
        self.path = os.path.join(directory, ring_name(self.rank))
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            os.unlink(tmp)  # the name holds this pid: one there is a crashed predecessor's
        except FileNotFoundError:
            pass
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, 0o600)
        try:
            # Written out, not ftruncate'd: a sparse file on a full tmpfs would fail later with SIGBUS
            # on the first store into an unbacked page, killing the job; a write fails here instead.
            zeros = bytes(size)
            written = 0
            while written < size:
                written += os.write(fd, zeros[written:])
            self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            self.start_wall_ns = time.time_ns()
            self.start_mono_ns = time.monotonic_ns()
            HEADER.pack_into(self.mm, 0, MAGIC, VERSION, HEADER.size, RECORD_SIZE, 0, self.capacity, os.getpid(),
                             self.rank, self.local_rank, self.world_size, self.device, self.start_wall_ns,
                             self.start_mono_ns, job, PHASE_COMPUTE, 0, self.start_mono_ns, 0)
            STEP_ID.pack_into(self.mm, STEP_ID_OFFSET, _step_id(env))
            # A new process of the same rank replaces the ring in one rename: a reader sees the old
            # ring or the new one, never a half-written header.
            os.rename(tmp, self.path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        finally:
            os.close(fd)  # the mapping keeps the file
        self.seq = 0
        self.last_step_ns = 0
        self.wait_ns = 0
        self.lock = threading.Lock()
        self.words = memoryview(self.mm).cast("q")
        self.wall = time.time_ns
        self.mono = time.monotonic_ns

    # The word indices below are the layout's offsets over 8 (asserted at import): the header is 16
    # words, the head word 15, the phase words 11 and 12, a record 8 words.

    def record(self, kind: int, step_no: int, dur_ns: int, wait_ns: int, flags: int = 0,
               mono: int | None = None) -> None:
        """Publish one record: the tail copy of the sequence number, the body, the head copy, then
        the header's head. A reader takes a record only when its two copies agree, so one seen
        half-written is skipped, never read as data."""
        if mono is None:
            mono = self.mono()
        wall = self.wall()
        w = self.words
        with self.lock:
            seq = self.seq = self.seq + 1
            b = 16 + ((seq - 1) % self.capacity) * 8
            w[b + 7] = seq
            w[b + 1] = kind | flags << 16
            w[b + 2] = step_no
            w[b + 3] = mono
            w[b + 4] = wall
            w[b + 5] = dur_ns
            w[b + 6] = wait_ns
            w[b] = seq
            w[15] = seq

    def set_phase(self, phase: int, mono: int) -> None:
        w = self.words
        w[12] = mono
        w[11] = phase

    # -- the calls -----------------------------------------------------------------------------

    def step(self, n: int) -> None:
        # Called every step, first thing after the all-reduce, on a CPU whose caches the step just
        # emptied: record() inlined, no call that is not needed.
        mono = self.mono()
        wall = self.wall()
        last = self.last_step_ns
        self.last_step_ns = mono
        waited = self.wait_ns
        self.wait_ns = 0
        if n.__class__ is not int or not -0x8000000000000000 <= n <= 0x7FFFFFFFFFFFFFFF:
            n = _as_int(n)
        w = self.words
        with self.lock:
            seq = self.seq = self.seq + 1
            b = 16 + ((seq - 1) % self.capacity) * 8
            w[b + 7] = seq
            w[b + 1] = 1  # STEP, no flags
            w[b + 2] = n
            w[b + 3] = mono
            w[b + 4] = wall
            w[b + 5] = mono - last if last else 0
            w[b + 6] = waited
            w[b] = seq
            w[15] = seq
        self.step_no = n
        if self.in_wait:  # a DDP step's all-reduce is done; a wait() block already said compute
            self.in_wait = False
            w[12] = mono
            w[11] = PHASE_COMPUTE

    step_no = -1

    in_wait = False
    """A DDP bucket was handed to the all-reduce in this step (the phase word says wait)."""

    def enter_wait(self, mono: int) -> None:
        # From the DDP hook: the first bucket of a step marks the wait; backward goes on, but a rank
        # that stops from here on is stopped inside the all-reduce's reach, like its peers.
        if not self.in_wait:
            self.in_wait = True
            self.set_phase(PHASE_WAIT, mono)

    def add_wait(self, ns: int) -> None:
        # From the DDP hook's callback thread, without the lock: a race with step() can drop one
        # bucket's time from one step, which is cheaper than a lock on every bucket.
        self.wait_ns += ns

    def wait(self) -> "_Timed":
        return _Timed(self, WAIT)

    def checkpoint(self, n: int = -1) -> "_Timed":
        return _Timed(self, CKPT_END, _as_int(n))

    def checkpoint_durable(self, n: int = -1) -> None:
        self.record(DURABLE, _as_int(n), 0, 0)

    def restored(self, n: int = -1) -> None:
        # The step timer restarts: the time before the first step after a restore is not a step.
        self.last_step_ns = 0
        self.wait_ns = 0
        self.record(RESTORED, _as_int(n), 0, 0)


def _as_int(n: Any) -> int:
    """A step number as a signed 64-bit integer; anything else becomes -1 (never an exception)."""
    try:
        n = int(n)
    except Exception:  # noqa: BLE001 - a step number's own __int__ may raise anything
        return -1
    return n if -(1 << 63) <= n < (1 << 63) else -1


class _Timed:
    """A timed block: a wait (its duration also adds to the step's wait) or a checkpoint's blocking
    part (a begin record on entry, so a save that hangs shows as one)."""

    __slots__ = ("ring", "kind", "n", "t0")

    def __init__(self, ring: _Ring, kind: int, n: int | None = None) -> None:
        self.ring, self.kind, self.n = ring, kind, n

    def __enter__(self) -> None:
        ring = self.ring
        self.t0 = t0 = time.monotonic_ns()
        if self.kind == CKPT_END:
            ring.record(CKPT_BEGIN, self.n, 0, 0, 0, t0)
            ring.set_phase(PHASE_CHECKPOINT, t0)
        else:
            ring.set_phase(PHASE_WAIT, t0)
        return None

    def __exit__(self, exc_type: Any, *_exc: Any) -> None:
        mono = time.monotonic_ns()
        dur = mono - self.t0
        ring = self.ring
        flags = FLAG_ERROR if exc_type is not None else 0
        try:
            if self.kind == WAIT:
                ring.wait_ns += dur
                ring.record(WAIT, ring.step_no, dur, ring.wait_ns, flags, mono)
            else:
                ring.record(CKPT_END, self.n, dur, 0, flags, mono)
            ring.set_phase(PHASE_COMPUTE, mono)
        except Exception:  # noqa: BLE001 - never raise into the training script
            pass
        return None


# --------------------------------------------------------------------------- PyTorch


def torch_ddp_hook(model: Any, hook: Any = None, state: Any = None) -> Any:
    """Register a DDP communication hook on `model` (a DistributedDataParallel) that times each
    bucket's all-reduce, from the bucket being ready to its result, and adds it to the step's wait.
    `hook`/`state` are the communication hook to wrap and its state (default: DDP's own all-reduce
    on the default process group). Returns `model`. Does nothing when the module is disabled; raises
    RuntimeError when PyTorch cannot be imported (the one call here that may raise: it runs once,
    at setup, and a missing torch is the caller's mistake)."""
    try:
        # Only here: PyTorch is the job's, never a dependency of this module.
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    except ImportError as e:
        raise RuntimeError(f"healthd_inband.torch_ddp_hook needs PyTorch with torch.distributed ({e})") from e
    ring = _ring
    if ring is None:
        return model
    inner = hook if hook is not None else default_hooks.allreduce_hook
    monotonic_ns = time.monotonic_ns

    # No annotations: DDP checks a hook's annotations and, under `from __future__ import annotations`,
    # would find the string "Any" where it wants dist.GradBucket, and refuse the hook.
    def timed(hook_state, bucket):
        t0 = monotonic_ns()
        ring.enter_wait(t0)
        fut = inner(hook_state, bucket)

        def done(f: Any) -> Any:
            ring.add_wait(monotonic_ns() - t0)
            return f.value()

        return fut.then(done)

    model.register_comm_hook(state, timed)
    return model


# --------------------------------------------------------------------------- setup


def _disable_in_child() -> None:
    """A forked child (a data loader worker) must not write into its parent's ring."""
    global step, checkpoint_durable, restored, wait, checkpoint, enabled, _ring
    step = checkpoint_durable = restored = _noop
    wait = checkpoint = _noop_context
    enabled, _ring = False, None


def _setup(env: dict[str, str] | None = None) -> bool:
    """Set up the ring if HEALTHD_INBAND_DIR is set; on any failure warn once and stay disabled."""
    global step, checkpoint_durable, restored, wait, checkpoint, enabled, _ring
    env = dict(os.environ if env is None else env)
    directory = env.get(ENV_DIR, "")
    if not directory:
        return False
    try:
        ring = _Ring(directory, env)
    except Exception as e:  # noqa: BLE001 - never raise into the training script
        try:
            sys.stderr.write(f"healthd_inband: disabled: cannot set up the ring in {directory!r}: {e}\n")
        except Exception:  # noqa: BLE001 - a closed stderr must not stop the import either
            pass
        return False
    _ring = ring
    step, checkpoint_durable, restored = ring.step, ring.checkpoint_durable, ring.restored
    wait, checkpoint = ring.wait, ring.checkpoint
    enabled = True
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_disable_in_child)
    return True


# healthd's own processes load this file for the definitions above and never write a ring, even where
# HEALTHD_INBAND_DIR is set (an `srun healthd --dry-run`): healthd.inband_layout sets this name first.
if not globals().get("_LAYOUT_ONLY"):
    _setup()

"""A real data-parallel training job for the in-band tests and bench/inband_job.py: torch.distributed
with the gloo backend on CPU, one rank per Slurm task, reporting through healthd_inband.

    srun -N4 -n4 /path/to/venv/bin/python tests/inband/ddp_job.py --steps 600 --ckpt-dir /tmp/ck \\
        --straggle 3:200:0.08

Rendezvous from Slurm's environment: RANK = SLURM_PROCID, WORLD_SIZE = SLURM_NTASKS, MASTER_ADDR
127.0.0.1 (every slurmd of the test cluster is on this machine; MASTER_ADDR in the environment wins),
MASTER_PORT from the environment or derived from SLURM_JOB_ID. Without Slurm, RANK/WORLD_SIZE/
MASTER_PORT from the environment (torchrun's names). The model and batch (--width 128, --batch 1024)
make a step about 50-70 ms with 4 ranks on 2 cores, a third of it the all-reduce; --pin puts rank r on
CPU r mod N, which keeps the ranks' compute within a few per cent of each other on a shared machine.

The loop is the documented one: `hd.torch_ddp_hook(model)` times each all-reduce as the step's wait,
`hd.step(step)` after each optimizer step, a checkpoint every --ckpt-every steps (`hd.checkpoint`
around the blocking save, `hd.checkpoint_durable` once it is renamed into place and synced), and on a
start that finds a checkpoint, the model and optimizer loaded and `hd.restored(step)`. Every call is a
no-op without HEALTHD_INBAND_DIR.

Faults, by argument (each names a rank and a step):
- --device-ms D: every rank sleeps D ms of each step's compute, the device's share of a GPU job's step.
  With it the CPU is no longer the job's bottleneck: on a machine with fewer cores than ranks, a rank
  slowed by sleeping stays slowed instead of handing its core to the others.
- --straggle RANK:ONSET:FRACTION: from step ONSET on, RANK busy-spins (or sleeps, --straggle-by sleep:
  a rank waiting on a slow device, which leaves the core to the others) at the start of each step for
  FRACTION x its own median compute time (step minus all-reduce wait) measured over the steps before
  ONSET: a measured slowdown of that rank's compute. Its own compute before and after the onset is
  printed at the end; on a machine with fewer cores than ranks the scheduler gives part of the spin
  back (the others finish sooner and free the CPU), so the effect that counts, the rank's compute
  against the other ranks' per window, is read from the rings (bench/inband_job.py does).
- --hang RANK:STEP: RANK stops in its compute phase at STEP (sleeps for ever): the others block in the
  all-reduce.
- --crash RANK:STEP: RANK exits with status 1 at STEP, in the job's first run only (SLURM_RESTART_COUNT
  0 or unset): a requeued run goes past it.

At the end every rank prints one line `DDP_JOB {json}`: its figures (steps run, median step, compute
and wait, the straggler's compute before and after the onset, and the cost of an hd.step call, timed
next to an empty call timed the same way).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # healthd_inband.py at the repository root
import healthd_inband as hd  # noqa: E402

WARMUP_STEPS = 3
"""The first steps (allocation, the first all-reduces) are left out of the calibration medians."""


def fault(text: str, fields: int) -> tuple:
    parts = text.split(":")
    if len(parts) != fields:
        raise argparse.ArgumentTypeError(f"{text!r}: expected {fields} fields separated by ':'")
    try:
        out = tuple(int(p) for p in parts[:2]) + tuple(float(p) for p in parts[2:])
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from e
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=600, help="run steps [start, STEPS)")
    p.add_argument("--ckpt-dir", type=Path, default=None, help="checkpoint directory (none: no checkpoints)")
    p.add_argument("--ckpt-every", type=int, default=100, help="save after every N-th step")
    p.add_argument("--width", type=int, default=128, help="hidden width of the MLP")
    p.add_argument("--batch", type=int, default=1024, help="samples per rank per step")
    p.add_argument("--device-ms", type=float, default=0.0,
                   help="each step also waits this long in its compute phase, like a step whose kernels run on "
                        "a GPU while the CPU waits: a job that leaves the cores mostly idle, as a GPU job does")
    p.add_argument("--straggle", type=lambda t: fault(t, 3), default=None, metavar="RANK:ONSET:FRACTION")
    p.add_argument("--straggle-by", choices=("spin", "sleep"), default="spin",
                   help="how the straggler is slowed: spin (its CPU busy) or sleep (like a rank waiting for a "
                        "slow device: the core stays free for the others)")
    p.add_argument("--hang", type=lambda t: fault(t, 2), default=None, metavar="RANK:STEP")
    p.add_argument("--crash", type=lambda t: fault(t, 2), default=None, metavar="RANK:STEP")
    p.add_argument("--pin", action="store_true", help="pin rank r to CPU r mod (CPUs available)")
    p.add_argument("--timeout-s", type=float, default=600, help="the process group's collective timeout")
    return p.parse_args(argv)


def rendezvous() -> tuple[int, int]:
    env = os.environ
    rank = int(env.get("SLURM_PROCID", env.get("RANK", "0")))
    world = int(env.get("SLURM_NTASKS", env.get("WORLD_SIZE", "1")))
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        job = int(env.get("SLURM_JOB_ID", "0") or 0)
        os.environ["MASTER_PORT"] = str(21000 + job % 20000)
    return rank, world


def model_for(width: int) -> nn.Module:
    # small enough for one DDP bucket (the all-reduce starts when backward ends, so the hook's time is
    # the wait), wide enough that compute, not the all-reduce, is most of a step
    return nn.Sequential(nn.Linear(width, width * 2), nn.ReLU(), nn.Linear(width * 2, width * 2), nn.ReLU(),
                         nn.Linear(width * 2, width), nn.ReLU(), nn.Linear(width, 16))


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def noop(_step: int) -> None:
    return None


def median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def p99(values: list[float]) -> float:
    return sorted(values)[int(0.99 * (len(values) - 1))] if values else 0.0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    rank, world = rendezvous()
    if args.pin:
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    restart = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout_s))

    torch.manual_seed(0)
    net = model_for(args.width)
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    # The all-reduce, timed for this script's own figures; healthd_inband wraps it and times it too.
    waits: list[float] = []

    def timed_allreduce(state, bucket):  # unannotated: DDP refuses a hook whose annotations are not its own
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        t0 = time.perf_counter()
        fut = default_hooks.allreduce_hook(state, bucket)

        def done(f):
            waits.append(time.perf_counter() - t0)
            return f.value()

        return fut.then(done)

    if hd.enabled:
        hd.torch_ddp_hook(model, timed_allreduce, None)
    else:
        model.register_comm_hook(None, timed_allreduce)

    start = 0
    ckpt = args.ckpt_dir / "ckpt.pt" if args.ckpt_dir else None
    restored = None
    if ckpt is not None and ckpt.exists():
        saved = torch.load(ckpt, map_location="cpu", weights_only=True)
        net.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        restored = int(saved["step"])
        start = restored + 1
        hd.restored(restored)

    gen = torch.Generator().manual_seed(1000 + rank)
    target_w = torch.randn(args.width, 16, generator=torch.Generator().manual_seed(7))
    loss_fn = nn.MSELoss()

    straggle_rank, onset, fraction = args.straggle if args.straggle else (-1, -1, 0.0)
    if args.straggle and onset - start < WARMUP_STEPS + 5:
        raise SystemExit(f"--straggle: onset {onset} leaves too few steps after {start} to measure compute")
    before: list[float] = []  # this rank's compute per step before the onset
    after: list[float] = []   # ... and from it on (spin included)
    steps_s: list[float] = []
    waits_s: list[float] = []
    hd_first: list[int] = []  # ns per hd.step call, called first after the optimizer step
    hd_second: list[int] = []  # ... called right after an empty call
    empty_first: list[int] = []
    empty_second: list[int] = []
    extra = 0.0

    for step in range(start, args.steps):
        if args.crash and rank == args.crash[0] and step == args.crash[1] and restart == 0:
            sys.stdout.flush()
            os._exit(1)
        t0 = time.perf_counter()
        if args.hang and rank == args.hang[0] and step == args.hang[1]:
            while True:  # compute phase, never coming back: the others wait in the all-reduce
                time.sleep(3600)
        if rank == straggle_rank and step >= onset:
            if not extra:
                extra = fraction * median(before[WARMUP_STEPS:] or before)
            spin(extra) if args.straggle_by == "spin" else time.sleep(extra)
        if args.device_ms:
            time.sleep(args.device_ms / 1000)
        x = torch.randn(args.batch, args.width, generator=gen)
        y = x @ target_w
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        t1 = time.perf_counter()
        # hd.step's cost in the loaded job, next to an empty call timed the same way, each first on
        # every other step: the first call after the all-reduce pays for a cold CPU whatever it is
        if step % 2:
            a = time.perf_counter_ns()
            hd.step(step)
            b = time.perf_counter_ns()
            noop(step)
            c = time.perf_counter_ns()
            hd_first.append(b - a)
            empty_second.append(c - b)
        else:
            a = time.perf_counter_ns()
            noop(step)
            b = time.perf_counter_ns()
            hd.step(step)
            c = time.perf_counter_ns()
            empty_first.append(b - a)
            hd_second.append(c - b)
        waited = sum(waits)
        waits.clear()
        compute = (t1 - t0) - waited
        steps_s.append(t1 - t0)
        waits_s.append(waited)
        if straggle_rank == rank:
            (after if step >= onset else before).append(compute)
        if ckpt is not None and (step + 1) % args.ckpt_every == 0 and step + 1 < args.steps:
            with hd.checkpoint(step):
                if rank == 0:
                    tmp = ckpt.with_name(f"{ckpt.name}.tmp")
                    with open(tmp, "wb") as f:
                        torch.save({"step": step, "model": net.state_dict(), "opt": opt.state_dict()}, f)
                        f.flush()
                        os.fsync(f.fileno())
                    os.replace(tmp, ckpt)
                dist.barrier()
            hd.checkpoint_durable(step)

    report = {
        "rank": rank, "world": world, "restart": restart, "restored": restored, "start": start,
        "steps": len(steps_s), "loss": round(float(loss.detach()), 6) if steps_s else None,
        "step_median_s": median(steps_s[WARMUP_STEPS:]), "wait_median_s": median(waits_s[WARMUP_STEPS:]),
        "compute_median_s": median([s - w for s, w in zip(steps_s, waits_s, strict=True)][WARMUP_STEPS:]),
        "hd_enabled": hd.enabled,
        "hd_step_first_ns": median(hd_first[2:]), "hd_step_second_ns": median(hd_second[2:]),
        "empty_first_ns": median(empty_first[2:]), "empty_second_ns": median(empty_second[2:]),
        "hd_step_second_p99_ns": p99(hd_second[2:]),
    }
    if rank == straggle_rank:
        b = median(before[WARMUP_STEPS:] or before)
        report.update({"straggle_onset": onset, "straggle_fraction": fraction, "straggle_spin_s": extra,
                       "compute_before_s": b, "compute_after_s": median(after),
                       "straggle_measured": (median(after) / b - 1) if b and after else None})
    print("DDP_JOB " + json.dumps(report), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

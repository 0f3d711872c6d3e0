"""The training job's side (healthd_inband): a no-op without its environment, never raising into the
script, and a real writer process whose records the agent's reader sees exactly."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import healthd_inband
from healthd.agent.inband import RingError, RingView, read_ring
from tests.inband.conftest import JOB_ENV, ROOT, run_job

LOOP = """
    import healthd_inband as hd
    for step in range(10, 10 + {steps}):
        with hd.wait():
            pass
        hd.step(step)
        if step % 5 == 0:
            with hd.checkpoint(step):
                pass
            hd.checkpoint_durable(step)
    print("enabled" if hd.enabled else "disabled")
"""


def test_without_its_environment_every_call_is_a_no_op(tmp_path: Path):
    p = run_job("""
        import healthd_inband as hd
        assert not hd.enabled
        assert hd.wait() is hd.wait() is hd.checkpoint(3)   # one shared no-op context manager
        with hd.wait():
            pass
        with hd.checkpoint(1):
            pass
        hd.step(1); hd.step("x"); hd.checkpoint_durable(1); hd.restored(1); hd.restored()
        assert hd.step is hd.restored is hd.checkpoint_durable  # all bound to the one no-op
    """, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stderr == ""
    assert not list(tmp_path.iterdir())


def test_the_no_op_runs_nothing_but_the_call():
    # imported in this test process without the variable (conftest's children set it, this one never does)
    if "HEALTHD_INBAND_DIR" in os.environ:
        pytest.skip("the test environment sets HEALTHD_INBAND_DIR")
    assert healthd_inband.enabled is False
    assert healthd_inband.step(1) is None
    with healthd_inband.wait() as w:
        assert w is None


@pytest.mark.parametrize("make", ["missing", "a file", "not writable", "no space"])
def test_a_ring_that_cannot_be_set_up_disables_the_module_with_one_warning(tmp_path: Path, make: str):
    target = tmp_path / "inband"
    script = LOOP.format(steps=3)
    if make == "a file":
        target.write_text("x")
    elif make == "not writable":
        target.mkdir()
        target.chmod(0o500)
        if os.geteuid() == 0:
            target = Path("/proc/self")  # root may write anywhere but here
    elif make == "no space":
        # a file size limit makes the preallocating write fail as a full disk would (EFBIG, not ENOSPC)
        target.mkdir()
        script = ("import resource, signal\nsignal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
                  "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))\n") + textwrap.dedent(script)
    p = run_job(script, HEALTHD_INBAND_DIR=str(target), RANK="0")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "disabled"
    assert p.stderr.count("healthd_inband: disabled") == 1, p.stderr
    assert len(p.stderr.splitlines()) == 1
    if target.is_dir() and target != Path("/proc/self"):
        assert not list(target.iterdir())  # no ring, no temporary file left


def test_a_job_like_writer_and_the_reader_see_exactly_its_records(tmp_path: Path):
    p = run_job(LOOP.format(steps=12), HEALTHD_INBAND_DIR=str(tmp_path), RANK="5", LOCAL_RANK="1",
                WORLD_SIZE="16", SLURM_JOB_ID="4711", CUDA_VISIBLE_DEVICES="2,3")
    assert p.returncode == 0 and p.stdout.strip() == "enabled", p.stderr
    assert [f.name for f in tmp_path.iterdir()] == ["rank-5.ring"]
    st = (tmp_path / "rank-5.ring").stat()
    assert stat.S_IMODE(st.st_mode) == 0o600

    view = read_ring(str(tmp_path), "rank-5.ring", owner=os.geteuid())
    assert isinstance(view, RingView), view
    h = view.header
    assert (h.rank, h.local_rank, h.world_size, h.device, h.job) == (5, 1, 16, 3, "4711")
    assert h.capacity == healthd_inband.DEFAULT_CAPACITY and h.pid > 0 and h.head == view.last_seq
    assert abs(h.start_wall_ns - time.time_ns()) < 60e9

    expected = []
    for step in range(10, 22):
        expected += [("wait", step - 1 if step > 10 else -1), ("step", step)]
        if step % 5 == 0:
            expected += [("checkpoint_begin", step), ("checkpoint_end", step), ("durable", step)]
    assert [(r.kind_name, r.step) for r in view.records] == expected
    assert [r.seq for r in view.records] == list(range(1, len(expected) + 1))
    assert view.lost == 0 and view.torn == 0
    monos = [r.mono_ns for r in view.records]
    assert monos == sorted(monos) and monos[0] >= h.start_mono_ns
    steps = [r for r in view.records if r.kind_name == "step"]
    assert steps[0].dur_ns == 0 and all(s.dur_ns > 0 for s in steps[1:])
    waits = [r for r in view.records if r.kind_name == "wait"]
    # a step carries the wait since the step before it
    assert [s.wait_ns for s in steps] == [w.dur_ns for w in waits]
    end = [r for r in view.records if r.kind_name == "checkpoint_end"]
    assert all(r.dur_ns > 0 and r.flags == 0 for r in end)


def test_slurm_variables_stand_in_for_torchrun_s(tmp_path: Path):
    p = run_job("import healthd_inband as hd; hd.step(1)", HEALTHD_INBAND_DIR=str(tmp_path), SLURM_PROCID="7",
                SLURM_LOCALID="3", SLURM_NTASKS="8", SLURM_JOB_ID="99", CUDA_VISIBLE_DEVICES="GPU-abc")
    assert p.returncode == 0, p.stderr
    view = read_ring(str(tmp_path), "rank-7.ring")
    assert isinstance(view, RingView), view
    assert (view.header.rank, view.header.local_rank, view.header.world_size, view.header.device) == (7, 3, 8, -1)


def test_an_exception_in_a_block_reaches_the_script_and_is_flagged(tmp_path: Path):
    p = run_job("""
        import healthd_inband as hd
        for block in (hd.wait(), hd.checkpoint(3)):
            try:
                with block:
                    raise KeyError("boom")
            except KeyError:
                print("raised")
    """, HEALTHD_INBAND_DIR=str(tmp_path), RANK="0")
    assert p.stdout.split() == ["raised", "raised"], p.stderr
    view = read_ring(str(tmp_path), "rank-0.ring")
    assert isinstance(view, RingView)
    assert [(r.kind_name, r.flags) for r in view.records] == [("wait", 1), ("checkpoint_begin", 0),
                                                              ("checkpoint_end", 1)]


def test_odd_step_values_never_raise(tmp_path: Path):
    p = run_job("""
        import healthd_inband as hd
        class Bad:
            def __int__(self):
                raise RuntimeError("no")
        for v in (None, "x", 2**80, -2**80, 3.7, object(), True, Bad()):
            hd.step(v); hd.restored(v); hd.checkpoint_durable(v)
            with hd.checkpoint(v):
                pass
    """, HEALTHD_INBAND_DIR=str(tmp_path), RANK="0")
    assert p.returncode == 0, p.stderr
    view = read_ring(str(tmp_path), "rank-0.ring")
    assert isinstance(view, RingView)
    assert {r.step for r in view.records} == {-1, 3, 1}


def test_a_restarted_rank_replaces_its_ring(tmp_path: Path):
    """A new process of the same rank starts a new ring (new pid and start time, sequence from 1),
    swapped in by one rename: the old ring's records are the old process's, and a reader that kept
    a sequence number from it sees the identity change in the header."""
    env = {"HEALTHD_INBAND_DIR": str(tmp_path), "RANK": "2", "SLURM_JOB_ID": "1"}
    assert run_job(LOOP.format(steps=20), **env).returncode == 0
    first = read_ring(str(tmp_path), "rank-2.ring")
    p = run_job("""
        import healthd_inband as hd
        hd.restored(19)
        hd.step(20)
    """, **env)
    assert p.returncode == 0, p.stderr
    second = read_ring(str(tmp_path), "rank-2.ring")
    assert isinstance(first, RingView) and isinstance(second, RingView)
    assert (second.header.pid, second.header.start_wall_ns) != (first.header.pid, first.header.start_wall_ns)
    assert [(r.seq, r.kind_name, r.step) for r in second.records] == [(1, "restored", 19), (2, "step", 20)]
    assert [f.name for f in tmp_path.iterdir()] == ["rank-2.ring"]  # no temporary file left


def test_a_forked_child_does_not_write_into_its_parent_s_ring(tmp_path: Path):
    p = run_job("""
        import os, healthd_inband as hd
        hd.step(1)
        pid = os.fork()
        if pid == 0:
            hd.step(666)
            os._exit(0 if not hd.enabled else 3)
        _, status = os.waitpid(pid, 0)
        hd.step(2)
        print(os.waitstatus_to_exitcode(status))
    """, HEALTHD_INBAND_DIR=str(tmp_path), RANK="0")
    assert p.stdout.strip() == "0", p.stderr
    view = read_ring(str(tmp_path), "rank-0.ring")
    assert isinstance(view, RingView)
    assert [r.step for r in view.records] == [1, 2]


def test_an_overrun_is_counted(tmp_path: Path):
    p = run_job("""
        import healthd_inband as hd
        for i in range(1, 201):
            hd.step(i)
    """, HEALTHD_INBAND_DIR=str(tmp_path), RANK="0", HEALTHD_INBAND_CAPACITY="64")
    assert p.returncode == 0, p.stderr
    view = read_ring(str(tmp_path), "rank-0.ring")
    assert isinstance(view, RingView)
    assert view.header.capacity == 64 and view.last_seq == 200
    assert [r.step for r in view.records] == list(range(137, 201)) and view.lost == 136
    caught_up = read_ring(str(tmp_path), "rank-0.ring", after=150)
    assert isinstance(caught_up, RingView) and caught_up.lost == 0 and len(caught_up.records) == 50
    behind = read_ring(str(tmp_path), "rank-0.ring", after=100)
    assert isinstance(behind, RingView) and behind.lost == 36 and behind.records[0].seq == 137


def test_a_reader_racing_the_writer_never_returns_a_torn_record(tmp_path: Path):
    """The writer rewrites a 64-slot ring as fast as it can, each step's number equal to its sequence
    number; every record the reader returns while racing it must be whole."""
    env = {"HEALTHD_INBAND_DIR": str(tmp_path), "RANK": "0", "HEALTHD_INBAND_CAPACITY": "64"}
    full = {k: v for k, v in os.environ.items() if k not in JOB_ENV} | env | {"PYTHONPATH": str(ROOT)}
    writer = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import time, healthd_inband as hd
        end = time.monotonic() + 3
        i = 0
        while time.monotonic() < end:
            i += 1
            hd.step(i)
    """)], env=full)
    try:
        deadline = time.monotonic() + 10
        while not (tmp_path / "rank-0.ring").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        reads = 0
        while writer.poll() is None:
            view = read_ring(str(tmp_path), "rank-0.ring")
            assert isinstance(view, RingView), view
            for r in view.records:
                assert r.step == r.seq and r.kind_name == "step" and r.mono_ns > 0 and r.wall_ns > 0, r
            reads += 1
        assert reads > 10
    finally:
        writer.kill()
        writer.wait()


def test_the_ddp_hook_without_torch_says_so():
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("torch is installed here")
    with pytest.raises(RuntimeError, match="needs PyTorch"):
        healthd_inband.torch_ddp_hook(object())


def test_read_ring_reports_a_missing_ring(tmp_path: Path):
    assert isinstance(read_ring(str(tmp_path), "rank-0.ring"), RingError)
    assert isinstance(read_ring(str(tmp_path / "nope"), "rank-0.ring"), RingError)


FAKE_TORCH = """
import sys, time, types
calls, inner = [], []


class Future:
    def __init__(self, value):
        self.value_, self.callbacks = value, []

    def then(self, cb):
        child = Future(None)
        self.callbacks.append((cb, child))
        return child

    def value(self):
        return self.value_

    def complete(self):
        for cb, child in self.callbacks:
            child.value_ = cb(self)


def allreduce_hook(state, bucket):
    calls.append((state, bucket))
    inner.append(Future(bucket * 2))
    return inner[-1]


for name in ("torch", "torch.distributed", "torch.distributed.algorithms"):
    sys.modules[name] = types.ModuleType(name)
mod = types.ModuleType("torch.distributed.algorithms.ddp_comm_hooks")
mod.default_hooks = types.SimpleNamespace(allreduce_hook=allreduce_hook)
sys.modules[mod.__name__] = mod


class Model:
    def register_comm_hook(self, state, hook):
        self.state, self.hook = state, hook
"""


def test_the_ddp_hook_adds_each_bucket_s_all_reduce_to_the_step_s_wait(tmp_path: Path):
    """Against a stand-in for torch's hook API (a future with then/value, register_comm_hook): the
    wrapper passes state and bucket through, returns the inner result, and times ready -> done."""
    p = run_job(FAKE_TORCH + textwrap.dedent("""
        import healthd_inband as hd
        model = Model()
        assert hd.torch_ddp_hook(model) is model and model.state is None
        hd.step(1)
        futures = [model.hook("pg", b) for b in (10, 20)]
        time.sleep(0.05)
        for f in inner:
            f.complete()
        assert [f.value() for f in futures] == [20, 40]
        assert calls == [("pg", 10), ("pg", 20)]
        hd.step(2)
    """), HEALTHD_INBAND_DIR=str(tmp_path), RANK="0")
    assert p.returncode == 0, p.stderr
    view = read_ring(str(tmp_path), "rank-0.ring")
    assert isinstance(view, RingView)
    steps = [r for r in view.records if r.kind_name == "step"]
    assert [s.step for s in steps] == [1, 2]
    assert steps[1].wait_ns >= 2 * 45_000_000  # two buckets, each about 50 ms from ready to done


def test_the_ddp_hook_does_nothing_when_disabled():
    p = run_job(FAKE_TORCH + textwrap.dedent("""
        import healthd_inband as hd
        model = Model()
        assert hd.torch_ddp_hook(model) is model and not hasattr(model, "hook")
    """))
    assert p.returncode == 0, p.stderr


def test_out_of_range_rank_variables_become_unknown(tmp_path: Path):
    p = run_job("import healthd_inband as hd; hd.step(1); print(hd.enabled)", HEALTHD_INBAND_DIR=str(tmp_path),
                RANK="99999999999", WORLD_SIZE="x", SLURM_JOB_ID="\u00e9t\u00e9")
    assert p.stdout.strip() == "True", p.stderr
    view = read_ring(str(tmp_path), "rank-unknown.ring")
    assert isinstance(view, RingView), view
    assert (view.header.rank, view.header.world_size, view.header.job) == (-1, -1, "?t?")


REAL_DDP = """
import os, torch, torch.distributed as dist
import healthd_inband as hd
assert hd.enabled
dist.init_process_group("gloo", init_method="file://" + os.environ["STORE"], rank=0, world_size=1)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
hd.torch_ddp_hook(model)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(6):
    opt.zero_grad()
    model(torch.randn(32, 64)).sum().backward()
    opt.step()
    hd.step(step)
# DDP's reducer before the group: torch's gloo threads otherwise now and then abort the exit
# ("terminate called without an active exception", about 1 run in 12 here)
del opt, model
dist.destroy_process_group()
"""


def test_the_ddp_hook_times_a_real_all_reduce(tmp_path: Path):
    """The hook registered on a real DistributedDataParallel (gloo, one rank): DDP accepts it, and each
    step after the first carries the all-reduce's time as its wait."""
    pytest.importorskip("torch")
    proc = run_job(REAL_DDP, timeout=120, HEALTHD_INBAND_DIR=str(tmp_path), RANK="0", LOCAL_RANK="0",
                   WORLD_SIZE="1", SLURM_JOB_ID="5", STORE=str(tmp_path / "store"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    view = read_ring(str(tmp_path), "rank-0.ring")
    steps = [r for r in view.records if r.kind_name == "step"]
    assert [r.step for r in steps] == list(range(6))
    assert all(r.wait_ns > 0 for r in steps)

"""healthd.trusted: what the hooks and the agent trust (root's files in root's directories, no
group/other write, no link followed below the root) and the writer that never leaves the run
directory. Real files, real owners (chown to nobody as root), real links; the agent's side of the
hooks' files against the same hostile files."""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from healthd import trusted as files
from healthd.statedoc import judge
from healthd.statedoc import load_state
from healthd.trusted import TrustedDir, Untrusted, split_path
from healthd.hooks.prolog import gate
from tests.hooks.support import finding, state_doc, snapshot

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


@pytest.fixture
def run(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    d.mkdir(mode=0o755)
    d.chmod(0o755)
    return d


# --------------------------------------------------------------------------- reading


def test_a_root_file_in_a_root_directory_is_read(run):
    (run / "state.json").write_text('{"a": 1}')
    assert files.read_json(str(run / "state.json"), 100) == {"a": 1}


def test_the_trusted_uid_is_a_parameter(run):
    (run / "state.json").write_text('{"a": 1}')
    me = os.geteuid()
    assert files.read_json(str(run / "state.json"), 100, trusted_uid=me) == {"a": 1}
    with pytest.raises(Untrusted) as e:
        files.read_json(str(run / "state.json"), 100, trusted_uid=me + 4242)
    assert f"directory {run} is not trusted (owner uid {me}, mode drwxr-xr-x (0755))" in str(e.value)
    doc, why = load_state(str(run / "state.json"), trusted_uid=me + 4242)
    assert doc is None and why.startswith("state file refused: directory") and f"uid {me + 4242} owns" in why


@as_root
@pytest.mark.parametrize(
    "spoil, said",
    [
        (lambda run, f: os.chown(f, NOBODY, -1), "file {f} is not trusted (owner uid 65534, mode -rw-r--r-- (0644))"),
        (lambda run, f: f.chmod(0o664), "file {f} is not trusted (owner uid 0, mode -rw-rw-r-- (0664))"),
        (lambda run, f: f.chmod(0o646), "file {f} is not trusted (owner uid 0, mode -rw-r--rw- (0646))"),
        (lambda run, f: run.chmod(0o775), "directory {run} is not trusted (owner uid 0, mode drwxrwxr-x (0775))"),
        (lambda run, f: run.chmod(0o1777), "directory {run} is not trusted (owner uid 0, mode drwxrwxrwt (1777))"),
        (lambda run, f: os.chown(run, NOBODY, -1), "directory {run} is not trusted (owner uid 65534, mode drwxr-xr-x (0755))"),
    ],
)
def test_a_file_or_directory_someone_else_owns_or_can_write_is_refused_naming_owner_and_mode(run, spoil, said):
    f = run / "state.json"
    f.write_text(json.dumps(state_doc()))
    f.chmod(0o644)
    spoil(run, f)
    doc, why = load_state(str(f))
    assert doc is None and said.format(f=f, run=run) in why, why
    j = judge(doc, time.time(), _settings(), error=why)
    assert not j.known and j.reason.startswith("agent unknown: state file refused: ") and j.findings == []


def test_a_linked_state_file_or_directory_is_refused_not_followed(run, tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o755)
    (real / "state.json").write_text('{"a": 1}')
    (run / "state.json").symlink_to(real / "state.json")
    doc, why = load_state(str(run / "state.json"))
    assert doc is None and f"file {run / 'state.json'} is a symbolic link (to '{real / 'state.json'}'" in why
    link = tmp_path / "linked-run"
    link.symlink_to(real)
    doc, why = load_state(str(link / "state.json"))
    assert doc is None and f"directory {link} is a symbolic link (to '{real}'" in why


def test_a_fifo_is_refused_without_blocking(run):
    os.mkfifo(run / "checks.json")
    start = time.monotonic()
    with pytest.raises(Untrusted, match="is not a regular file"):
        files.read_json(str(run / "checks.json"), 100)
    with TrustedDir(str(run)) as d, pytest.raises(Untrusted, match="is not a regular file"):
        d.append("checks.json", b"x\n")
    assert time.monotonic() - start < 1.0


def test_a_link_anywhere_below_the_root_fails_the_read(run, decoy):
    (decoy / "7.json").write_text('{"job": "7"}')
    (run / "jobs").symlink_to(decoy)
    with pytest.raises(Untrusted, match=r"directory .*/run/jobs is a symbolic link"):
        files.read_json(str(run / "jobs/7.json"), 100, root=str(run))


# --------------------------------------------------------------------------- writing


def test_the_writer_creates_trusted_directories_and_leaves_no_temporary_file(run):
    files.write_json(str(run / "jobs/done/7.json"), {"job": "7"}, root=str(run))
    assert json.loads((run / "jobs/done/7.json").read_text()) == {"job": "7"}
    for p in (run / "jobs", run / "jobs/done"):
        assert p.stat().st_uid == os.geteuid() and stat.S_IMODE(p.stat().st_mode) & 0o022 == 0
    assert stat.S_IMODE((run / "jobs/done/7.json").stat().st_mode) & 0o022 == 0
    assert sorted(p.name for p in (run / "jobs/done").iterdir()) == ["7.json"]
    files.write_json(str(run / "jobs/done/7.json"), {"job": "7", "end": 1}, root=str(run))
    assert files.read_json(str(run / "jobs/done/7.json"), 100, root=str(run)) == {"job": "7", "end": 1}


@pytest.mark.parametrize("link_at", ["jobs", "jobs/done"])
def test_a_link_at_any_level_below_the_run_directory_fails_the_write_and_nothing_lands_there(run, decoy, link_at):
    if link_at != "jobs":
        (run / "jobs").mkdir(mode=0o755)
    (run / link_at).symlink_to(decoy)
    before = snapshot(decoy)
    with pytest.raises(Untrusted, match=rf"directory {run / link_at} is a symbolic link \(to '{decoy}'"):
        files.write_json(str(run / "jobs/done/7.json"), {"job": "7"}, root=str(run))
    with pytest.raises(Untrusted):
        files.unlink(str(run / "jobs/done/keep.txt"), root=str(run))
    with pytest.raises(Untrusted), TrustedDir(str(run), "jobs/done", create=True) as d:
        d.append("charges.jsonl", b"{}\n")
    assert snapshot(decoy) == before
    assert (run / link_at).is_symlink()  # refused, not "repaired" either


def test_a_link_at_the_run_directory_itself_is_refused(tmp_path, decoy):
    run = tmp_path / "run"
    run.symlink_to(decoy)
    with pytest.raises(Untrusted, match="is a symbolic link"):
        files.write_json(str(run / "jobs/7.json"), {}, root=str(run))
    with pytest.raises(Untrusted, match="is a symbolic link"):  # a trailing slash would follow it
        TrustedDir(f"{run}/", "jobs", create=True)
    assert snapshot(decoy) == {"keep.txt": b"untouched\n"}


def test_an_existing_link_at_the_file_name_is_replaced_never_written_through(run, decoy):
    (run / "checks.json").symlink_to(decoy / "keep.txt")
    files.write_json(str(run / "checks.json"), {"ok": True}, root=str(run))
    assert not (run / "checks.json").is_symlink() and json.loads((run / "checks.json").read_text()) == {"ok": True}
    assert (decoy / "keep.txt").read_text() == "untouched\n"
    (run / "charges.jsonl").symlink_to(decoy / "keep.txt")
    with TrustedDir(str(run)) as d, pytest.raises(Untrusted, match="is a symbolic link"):
        d.append("charges.jsonl", b"{}\n")
    assert (decoy / "keep.txt").read_text() == "untouched\n"


def test_a_directory_swapped_for_a_link_after_it_was_opened_keeps_the_write_inside(run, decoy):
    """The check and the write use one descriptor: swapping the path afterwards changes nothing."""
    (run / "jobs").mkdir(mode=0o755)
    with TrustedDir(str(run), "jobs") as d:
        (run / "jobs").rename(run / "jobs.moved")
        (run / "jobs").symlink_to(decoy)
        d.write_json("7.json", {"job": "7"})
    assert snapshot(decoy) == {"keep.txt": b"untouched\n"}
    assert json.loads((run / "jobs.moved/7.json").read_text()) == {"job": "7"}


@as_root
def test_a_directory_someone_else_owns_is_not_written_into(run):
    (run / "requests").mkdir(mode=0o755)
    os.chown(run / "requests", NOBODY, -1)
    with pytest.raises(Untrusted, match=r"directory .*/requests is not trusted \(owner uid 65534"):
        files.write_json(str(run / "requests/r.json"), {}, root=str(run))
    assert list((run / "requests").iterdir()) == []


@as_root
def test_appending_to_a_file_someone_else_owns_is_refused(run):
    (run / "charges.jsonl").write_text("")
    os.chown(run / "charges.jsonl", NOBODY, -1)
    with TrustedDir(str(run)) as d, pytest.raises(Untrusted, match="owner uid 65534"):
        d.append("charges.jsonl", b"{}\n")
    assert (run / "charges.jsonl").read_text() == ""


def test_concurrent_writers_never_leave_a_partial_file(run):
    stop = threading.Event()
    seen: list[object] = []
    errors: list[BaseException] = []  # what the reader met: an exception in a thread would not fail the test

    def reader() -> None:
        while not stop.is_set():
            try:
                seen.append(files.read_json(str(run / "jobs/7.json"), 1 << 20, root=str(run))["n"])
            except FileNotFoundError:
                pass
            except BaseException as exc:  # noqa: BLE001 - a partial file, or anything else: reported below
                errors.append(exc)
                return

    t = threading.Thread(target=reader)
    t.start()
    try:
        for n in range(200):
            files.write_json(str(run / "jobs/7.json"), {"n": n, "pad": "x" * 5000}, root=str(run))
    finally:
        stop.set()
        t.join()
    assert errors == []
    assert seen and all(isinstance(n, int) for n in seen)  # the reader did read, whole documents only
    assert sorted(p.name for p in (run / "jobs").iterdir()) == ["7.json"]


# --------------------------------------------------------------------------- split_path (pure)

SEGMENT = st.text(st.sampled_from("ab.-_/"), min_size=1, max_size=12)


@given(rel=SEGMENT, name=st.text(st.sampled_from("ab.-_"), min_size=1, max_size=8))
@settings(max_examples=300, deadline=None)
def test_split_path_never_walks_above_the_root(rel, name):
    root = "/run/healthd"
    path = os.path.join(root, rel, name)
    top, reldir, base = split_path(path, root)
    norm = os.path.normpath(path)
    assert os.path.normpath(os.path.join(top, reldir, base)) == norm
    if top == root:  # walked from the root: no component may climb out of it
        assert ".." not in reldir.split("/") and norm.startswith(root + "/")
    else:  # outside the root (`..`, or a sibling like /run/healthd2): only the file's own directory
        assert reldir == "" and not norm.startswith(root + "/")


def test_split_path_does_not_take_a_sibling_with_the_same_prefix_for_the_root():
    assert split_path("/run/healthd2/jobs/7.json", "/run/healthd") == ("/run/healthd2/jobs", "", "7.json")
    assert split_path("/run/healthd/jobs/7.json", "/run/healthd/") == ("/run/healthd", "jobs", "7.json")
    assert split_path("/run/healthd/checks.json", "/run/healthd") == ("/run/healthd", ".", "checks.json")
    assert split_path("/var/lib/healthd/charges.jsonl", "/run/healthd") == ("/var/lib/healthd", "", "charges.jsonl")
    with pytest.raises(ValueError):
        TrustedDir("/", "a/../b")


# --------------------------------------------------------------------------- the gate, as a property

KINDS = st.sampled_from(["gpu", "node", "port", "filesystem"])
FINDINGS = st.lists(
    st.builds(
        lambda kind, index, tier, attribution: finding(f"f:{kind}:{index}:{tier}:{attribution}",
                                                       index if kind == "gpu" else None, tier=tier,
                                                       attribution=attribution, kind=kind),
        KINDS, st.one_of(st.none(), st.integers(0, 7)), st.integers(1, 3),
        st.sampled_from(["hardware", "software", "user", "fabric", "storage", "unknown"]),
    ),
    max_size=6,
)


@given(fs=FINDINGS, gpus=st.one_of(st.none(), st.lists(st.integers(0, 7), max_size=4, unique=True)),
       known=st.booleans())
@settings(max_examples=400, deadline=None)
def test_gate_refuses_exactly_for_a_t1_hardware_finding_on_the_jobs_gpus_or_the_node(fs, gpus, known):
    now = 1_800_000_000.0
    j = judge(state_doc("node01", fs, now=now, age_s=1.0 if known else 3600.0), now, _settings(),
              pid_alive=lambda pid: True)
    g = gate(j, gpus)
    t1 = [f for f in fs if f["tier"] == 1 and f["attribution"] == "hardware"]
    concerned = [f for f in t1 if (f["component"]["kind"] == "gpu" and f["component"]["index"] in (gpus or []))
                 or f["component"]["kind"] == "node"
                 or (f["component"]["kind"] == "gpu" and f["component"]["index"] is None)]
    assert g.refuse == bool(known and gpus and concerned)
    if g.refuse:
        assert g.finding in concerned


def _settings():
    from healthd import config

    return config.parse("node_name: node01")


# --------------------------------------------------------------------------- the agent's side


def _agent(run_dir: Path):
    from healthd.agent.daemon import Agent, Memory, Sources
    from healthd.agent.history import History
    from healthd.settings import HookSettings
    from tests.support.builders import CATALOG, NOW, gpu, kernel, nvml, settings as cfg_settings, xid
    from tests.support.fake_sources import FakeCollector

    cfg = cfg_settings(nvml={"expected_gpus": 4}, hooks=HookSettings(run_dir=str(run_dir)))
    sources = Sources(nvml=FakeCollector("nvml", nvml(*(gpu(i) for i in range(4)))),
                      kernel=FakeCollector("kernel_log", kernel(xid(13, 0, NOW - 5))))
    return Agent(cfg, CATALOG, sources, Memory(history=History()), dry_run=True, clock=lambda: NOW)


def _plant(run_dir: Path) -> None:
    from healthd.checks import merged_doc, result
    from healthd.text import iso
    from tests.support.builders import NOW

    (run_dir / "jobs").mkdir(mode=0o755, exist_ok=True)
    (run_dir / "jobs/41.json").write_text(json.dumps(
        {"job": "41", "user": "alice", "uid": 1000, "node": "gpu001", "gpus": [0], "start": iso(NOW - 60)}))
    (run_dir / "checks.json").write_text(json.dumps(merged_doc(None, "gpu001", NOW - 5, [
        result("gpu_count", False, "3 of 4 GPU device files present", NOW - 5, "healthd-healthcheck")])))


@as_root
@pytest.mark.parametrize(
    "spoil, said",
    [
        (lambda r: [os.chown(r / "checks.json", NOBODY, -1), os.chown(r / "jobs/41.json", NOBODY, -1)],
         ["checks.json unreadable (file", "owner uid 65534", "jobs/41.json is unusable (file"]),
        (lambda r: [(r / "jobs").chmod(0o777), (r / "checks.json").chmod(0o666)],
         ["jobs ignored: directory", "mode drwxrwxrwx (0777)", "mode -rw-rw-rw- (0666)"]),
        (lambda r: r.chmod(0o775), ["run is not trusted (owner uid 0, mode drwxrwxr-x (0775))"]),
    ],
)
def test_the_agent_ignores_checks_and_bindings_someone_else_could_have_planted(tmp_path, caplog, spoil, said):
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o755)
    _plant(run_dir)
    trusted = _agent(run_dir).tick()
    assert trusted.verdict == "failed" and {f.id: f.job for f in trusted.findings}["xid:gpu0:13"] == "41"
    spoil(run_dir)
    agent = _agent(run_dir)
    with caplog.at_level(logging.WARNING, logger="healthd"):
        res = agent.tick()
        agent.tick()
    ids = {f.id: f.job for f in res.findings}
    assert "hooks.gpu_count:node" not in ids and res.verdict != "failed"  # a planted check fails nothing
    assert ids["xid:gpu0:13"] is None  # and a planted binding charges no job
    msgs = [r.getMessage() for r in caplog.records if r.name == "healthd"]
    for s in said:
        assert sum(s in m for m in msgs) >= 1, (s, msgs)
    assert len(msgs) == len(set(msgs))  # once each, not every tick


def test_the_agent_follows_no_link_to_the_hooks_files(tmp_path, caplog):
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o755)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o755)
    _plant(elsewhere)
    (run_dir / "jobs").symlink_to(elsewhere / "jobs")
    (run_dir / "checks.json").symlink_to(elsewhere / "checks.json")
    with caplog.at_level(logging.WARNING, logger="healthd"):
        res = _agent(run_dir).tick()
    ids = {f.id: f.job for f in res.findings}
    assert "hooks.gpu_count:node" not in ids and ids["xid:gpu0:13"] is None
    msgs = " | ".join(r.getMessage() for r in caplog.records)
    assert "is a symbolic link" in msgs and str(run_dir / "jobs") in msgs and str(run_dir / "checks.json") in msgs

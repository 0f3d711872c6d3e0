"""The per-job in-band directory (healthd.hooks.inband_dirs) against hostile layouts, and the
TaskProlog (healthd.hooks.taskprolog): its quick config reader agrees with healthd.config whenever
it answers, it exports only a directory of the user's own, and it exits 0 whatever happens.

The directory tests chown to `nobody`, so they need root; the real-cluster side is
tests/slurm/test_e2e_inband.py."""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from healthd import config
from healthd import inband_layout as layout
from healthd.hooks import inband_dirs as ib
from healthd.hooks import taskprolog as tp
from healthd.settings import HookSettings, InbandSettings
from healthd.trusted import Untrusted
from tests.hooks.support import Node, finding, state_doc

NOBODY = pwd.getpwnam("nobody")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to nobody needs root")
BAD_JOBS = ["", "1/2", "..", "../1", "1/..", ".", "a", "1a", " 1", "1\n", "1" * 21, "\u0661\u0662", "-1", "+1"]


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    d = tmp_path / "run" / "healthd"
    d.mkdir(parents=True)
    d.chmod(0o755)
    return d


def snapshot(d: Path) -> dict[str, tuple[int, int, int]]:
    """Every path under `d` (links not followed) with its owner, mode and size."""
    out = {}
    for p in [d, *sorted(d.rglob("*"))]:
        st = p.lstat()
        out[str(p.relative_to(d))] = (st.st_uid, st.st_mode, st.st_size)
    return out


def mode(p: Path) -> int:
    return stat.S_IMODE(p.lstat().st_mode)


def archived(run_dir: Path, job: str, keep: int = 16) -> str:
    return ib.archive(str(run_dir), job, keep)


# ----------------------------------------------------------------------------- paths


def test_job_dir_is_under_inband():
    assert layout.job_dir("/run/healthd", "123") == "/run/healthd/inband/123"
    assert layout.done_dir("/run/healthd", "123") == "/run/healthd/inband/done/123"
    assert ib.INBAND_DIR == layout.INBAND_DIR == "inband" and ib.DONE_DIR == layout.DONE_DIR == "done"


@pytest.mark.parametrize("job", BAD_JOBS)
def test_a_job_id_that_is_not_digits_never_names_a_path(job, run_dir):
    for call in (lambda: layout.job_dir(str(run_dir), job), lambda: layout.done_dir(str(run_dir), job),
                 lambda: ib.create(str(run_dir), job, 1000),
                 lambda: ib.archive(str(run_dir), job, 4)):
        with pytest.raises(ValueError, match="not a job id"):
            call()
    assert not (run_dir / "inband").exists()


# ----------------------------------------------------------------------------- create


@needs_root
def test_create_makes_the_job_users_0700_directory_in_a_root_0755_inband(run_dir):
    text = ib.create(str(run_dir), "42", NOBODY.pw_uid, NOBODY.pw_gid)
    d = run_dir / "inband" / "42"
    assert text == f"created {d} (uid {NOBODY.pw_uid}, mode 0700)"
    st = d.lstat()
    assert stat.S_ISDIR(st.st_mode) and (st.st_uid, st.st_gid, mode(d)) == (NOBODY.pw_uid, NOBODY.pw_gid, 0o700)
    inband = (run_dir / "inband").lstat()
    assert (inband.st_uid, stat.S_IMODE(inband.st_mode)) == (0, 0o755)


@needs_root
def test_create_without_a_gid_leaves_the_group_roots(run_dir):
    ib.create(str(run_dir), "42", NOBODY.pw_uid)
    st = (run_dir / "inband" / "42").lstat()
    assert (st.st_uid, st.st_gid) == (NOBODY.pw_uid, 0)


@needs_root
def test_create_again_for_a_requeued_job_reuses_the_directory_and_its_rings(run_dir):
    ib.create(str(run_dir), "42", NOBODY.pw_uid, NOBODY.pw_gid)
    d = run_dir / "inband" / "42"
    (d / "rank-0.ring").write_bytes(b"x")
    ino = d.lstat().st_ino
    d.chmod(0o755)  # the user's to change; made 0700 again
    assert ib.create(str(run_dir), "42", NOBODY.pw_uid, NOBODY.pw_gid).startswith("reused ")
    assert d.lstat().st_ino == ino and (d / "rank-0.ring").exists() and mode(d) == 0o700


@needs_root
def test_a_directory_root_made_but_had_not_handed_over_is_handed_over(run_dir):
    (run_dir / "inband" / "42").mkdir(parents=True, mode=0o700)
    (run_dir / "inband").chmod(0o755)
    assert ib.create(str(run_dir), "42", NOBODY.pw_uid).startswith("reused ")
    assert (run_dir / "inband" / "42").lstat().st_uid == NOBODY.pw_uid


@needs_root
def test_another_users_directory_is_refused_and_left_alone(run_dir):
    d = run_dir / "inband" / "42"
    d.mkdir(parents=True, mode=0o700)
    (run_dir / "inband").chmod(0o755)
    os.chown(d, 1234, 1234)
    with pytest.raises(Untrusted, match=r"not the job user's \(uid 65534\).*owner uid 1234"):
        ib.create(str(run_dir), "42", NOBODY.pw_uid)
    assert d.lstat().st_uid == 1234 and mode(d) == 0o700


@needs_root
def test_a_link_in_place_of_the_job_directory_is_refused_and_not_followed(run_dir, decoy):
    (run_dir / "inband").mkdir(mode=0o755)
    (run_dir / "inband" / "42").symlink_to(decoy)
    before = snapshot(decoy)
    with pytest.raises(Untrusted, match=r"inband/42 is a symbolic link \(to '.*decoy'.*not followed"):
        ib.create(str(run_dir), "42", NOBODY.pw_uid)
    assert snapshot(decoy) == before
    assert (run_dir / "inband" / "42").is_symlink()


@needs_root
def test_a_dangling_link_in_place_of_the_job_directory_makes_nothing_at_its_target(run_dir, tmp_path):
    (run_dir / "inband").mkdir(mode=0o755)
    target = tmp_path / "elsewhere"
    (run_dir / "inband" / "42").symlink_to(target)
    with pytest.raises(Untrusted, match="symbolic link"):
        ib.create(str(run_dir), "42", NOBODY.pw_uid)
    assert not target.exists()


@needs_root
def test_a_link_in_place_of_inband_is_refused_and_nothing_is_made_at_its_target(run_dir, decoy):
    (run_dir / "inband").symlink_to(decoy)
    before = snapshot(decoy)
    with pytest.raises(Untrusted, match="symbolic link"):
        ib.create(str(run_dir), "42", NOBODY.pw_uid)
    with pytest.raises(Untrusted, match="symbolic link"):
        ib.archive(str(run_dir), "42", 4)
    assert snapshot(decoy) == before


@needs_root
def test_a_run_directory_that_is_a_link_is_refused(tmp_path, decoy):
    link = tmp_path / "run-link"
    link.symlink_to(decoy)
    with pytest.raises(Untrusted, match="symbolic link"):
        ib.create(str(link), "42", NOBODY.pw_uid)
    assert not (decoy / "inband").exists()


@needs_root
@pytest.mark.parametrize("where", ["inband", "inband/42"])
def test_a_file_in_place_of_a_directory_is_refused(run_dir, where):
    (run_dir / "inband").mkdir(mode=0o755) if where != "inband" else None
    (run_dir / where).write_text("not a directory\n")
    with pytest.raises(Untrusted, match="not a directory"):
        ib.create(str(run_dir), "42", NOBODY.pw_uid)
    assert (run_dir / where).read_text() == "not a directory\n"


@needs_root
@pytest.mark.parametrize("spoil", ["owner", "mode"])
def test_an_inband_directory_someone_else_owns_or_can_write_is_not_used(run_dir, spoil):
    inband = run_dir / "inband"
    inband.mkdir(mode=0o755)
    if spoil == "owner":
        os.chown(inband, NOBODY.pw_uid, NOBODY.pw_gid)
    else:
        inband.chmod(0o777)
    with pytest.raises(Untrusted, match="not trusted"):
        ib.create(str(run_dir), "42", NOBODY.pw_uid)
    assert not (inband / "42").exists()


@needs_root
def test_an_untrusted_run_directory_is_not_used(run_dir):
    os.chown(run_dir, NOBODY.pw_uid, -1)
    with pytest.raises(Untrusted, match="not trusted"):
        ib.create(str(run_dir), "42", NOBODY.pw_uid)
    assert not (run_dir / "inband").exists()


# ----------------------------------------------------------------------------- archive


def make_job(run_dir: Path, job: str, rings: int = 1) -> Path:
    ib.create(str(run_dir), job, NOBODY.pw_uid, NOBODY.pw_gid)
    d = run_dir / "inband" / job
    for r in range(rings):
        (d / f"rank-{r}.ring").write_bytes(b"ring")
        os.chown(d / f"rank-{r}.ring", NOBODY.pw_uid, NOBODY.pw_gid)
    return d


@needs_root
def test_archive_moves_the_directory_into_a_root_0700_done(run_dir):
    make_job(run_dir, "42", rings=2)
    text = archived(run_dir, "42")
    done = run_dir / "inband" / "done"
    assert text == f"moved {run_dir}/inband/42 to {done}/42"
    assert not (run_dir / "inband" / "42").exists()
    assert sorted(p.name for p in (done / "42").iterdir()) == ["rank-0.ring", "rank-1.ring"]
    assert (done / "42").lstat().st_uid == NOBODY.pw_uid  # the rings stay the user's, for the agent's check
    st = done.lstat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o700)


@needs_root
def test_archive_with_nothing_to_archive_says_so(run_dir):
    with pytest.raises(FileNotFoundError):
        archived(run_dir, "42")  # no inband/ at all
    (run_dir / "inband").mkdir(mode=0o755)
    with pytest.raises(FileNotFoundError, match="no in-band directory"):
        archived(run_dir, "42")
    assert not (run_dir / "inband" / "done").exists()


@needs_root
def test_archive_replaces_an_earlier_runs_directory_of_a_requeued_job(run_dir):
    make_job(run_dir, "42")
    archived(run_dir, "42")
    d = make_job(run_dir, "42", rings=0)
    (d / "rank-7.ring").write_bytes(b"second run")
    assert archived(run_dir, "42").endswith(", replacing an earlier run's")
    assert [p.name for p in (run_dir / "inband" / "done" / "42").iterdir()] == ["rank-7.ring"]


@needs_root
def test_a_done_directory_with_another_mode_is_made_0700_again(run_dir):
    make_job(run_dir, "42")
    (run_dir / "inband" / "done").mkdir(mode=0o755)
    archived(run_dir, "42")
    assert mode(run_dir / "inband" / "done") == 0o700


@needs_root
def test_a_link_in_place_of_done_is_refused_and_the_job_directory_stays(run_dir, decoy):
    make_job(run_dir, "42")
    (run_dir / "inband" / "done").symlink_to(decoy)
    before = snapshot(decoy)
    with pytest.raises(Untrusted, match="inband/done is a symbolic link"):
        archived(run_dir, "42")
    assert snapshot(decoy) == before and (run_dir / "inband" / "42").is_dir()


@needs_root
def test_a_done_directory_someone_else_owns_is_refused(run_dir):
    make_job(run_dir, "42")
    (run_dir / "inband" / "done").mkdir(mode=0o700)
    os.chown(run_dir / "inband" / "done", NOBODY.pw_uid, -1)
    with pytest.raises(Untrusted, match="not trusted"):
        archived(run_dir, "42")
    assert (run_dir / "inband" / "42").is_dir()


@needs_root
def test_a_link_in_place_of_the_job_directory_is_moved_not_followed(run_dir, decoy):
    (run_dir / "inband").mkdir(mode=0o755)
    (run_dir / "inband" / "42").symlink_to(decoy)
    before = snapshot(decoy)
    text = archived(run_dir, "42", keep=0)
    assert "(a symbolic link, not followed)" in text and "removed 1 older" in text
    assert snapshot(decoy) == before
    assert not os.path.lexists(run_dir / "inband" / "42")
    assert not os.path.lexists(run_dir / "inband" / "done" / "42")


@needs_root
def test_removing_a_users_tree_never_follows_a_link_planted_inside(run_dir, decoy, tmp_path):
    d = make_job(run_dir, "41")
    (d / "sub" / "deeper").mkdir(parents=True)
    (d / "to-decoy").symlink_to(decoy)
    (d / "sub" / "to-decoy").symlink_to(decoy)
    (d / "sub" / "deeper" / "to-file").symlink_to(decoy / "keep.txt")
    (d / "sub" / "hardlink-free-file").write_text("x")
    for p in [d / "sub", d / "sub" / "deeper"]:
        os.chown(p, NOBODY.pw_uid, NOBODY.pw_gid, follow_symlinks=False)
    before = snapshot(decoy)
    archived(run_dir, "41")
    make_job(run_dir, "42")
    text = archived(run_dir, "42", keep=1)
    assert text.endswith("; removed 1 older"), text
    assert sorted(os.listdir(run_dir / "inband" / "done")) == ["42"]
    assert snapshot(decoy) == before
    assert shutil_is_safe()


def shutil_is_safe() -> bool:
    return shutil.rmtree.avoids_symlink_attacks


@needs_root
def test_pruning_keeps_the_newest_jobs(run_dir):
    for job in ("7", "8", "9", "10", "11"):
        make_job(run_dir, job)
        archived(run_dir, job, keep=16)
        time.sleep(0.01)
    text = archived_after(run_dir, "12", keep=3)
    assert text.endswith("; removed 3 older"), text
    assert sorted(os.listdir(run_dir / "inband" / "done"), key=int) == ["10", "11", "12"]


def archived_after(run_dir: Path, job: str, keep: int) -> str:
    make_job(run_dir, job)
    return archived(run_dir, job, keep)


@needs_root
def test_pruning_leaves_other_names_in_done_alone(run_dir):
    make_job(run_dir, "1")
    archived(run_dir, "1")
    (run_dir / "inband" / "done" / "README").write_text("mine\n")
    archived_after(run_dir, "2", keep=0)
    assert os.listdir(run_dir / "inband" / "done") == ["README"]


# ----------------------------------------------------------------------------- the TaskProlog's config


def test_the_taskprologs_defaults_are_the_settings_defaults():
    assert tp.NODE_CONFIG_PATH == config.NODE_CONFIG_PATH
    assert tp.DEFAULT_RUN_DIR == HookSettings().run_dir
    assert tp.DEFAULT_ENABLED == InbandSettings().enabled


PLAIN = [
    "",
    "# nothing\n",
    "node_name: n1\n",
    "hooks:\n  run_dir: /srv/run\n",
    "hooks:\n  gating: local\n  run_dir: /srv/run   # a comment\n  timeout_s: 5\ninband:\n  enabled: false\n",
    "inband:\n    enabled: False\n    keep_jobs: 3\n    detector:\n      window_steps: 20\n      mad_k: 3.5\nhooks:\n    run_dir: /x\n",
    "inband:\n  detector:\n    window_steps: 20\n  enabled: TRUE\n",
    "node_name: n1\nhost:\n  filesystems:\n    - path: /\n      role: scratch\nhooks:\n  run_dir: /r/h\r\n",
    "hooks:\n  path: /usr/bin:/bin\n  gpu_devices: /dev/nvidia[0-9]*\n  run_dir: /a/b\n",
    "hooks:\n  run_dir: /a\n  run_dir: /b\n",  # the last one, as PyYAML
    "node_name: 'n1'\nstate_file: \"/run/x.json\"\nhooks:\n  run_dir: /z\n",
]
UNSURE = [
    "hooks: {run_dir: /x}\n",
    "hooks:\n  run_dir: '/x'\n",
    "hooks:\n  run_dir: \"/x\"\n",
    "hooks:\n  run_dir: &r /x\n",
    "hooks:\n  run_dir:\n    /x\n",
    "hooks:\n  run_dir: /x\n    /y\n",
    "hooks:\n  run_dir: |\n    /x\n",
    "hooks: &h\n  run_dir: /x\nother: *h\n",
    "hooks:\n  run_dir: /a\nhooks:\n  timeout_s: 3\n",
    "inband:\n  enabled: yes\n",
    "inband:\n  enabled:\n",
    "hooks:\n\trun_dir: /x\n",
    "---\nhooks:\n  run_dir: /x\n",
    "node_name: \"a\n  b\"\nhooks:\n  run_dir: /x\n",
    "node_name: [a,\n  b]\n",
    "host:\n  note: \"x\nhooks:\n  run_dir: /evil\"\n",
    "<<: {}\n",
    "hooks:\nnode_name: x\n",
    "inband:\n# nothing\n",
    "hooks:\n    run_dir: /x\n  timeout_s: 3\n",
]


@pytest.mark.parametrize("text", PLAIN)
def test_quick_settings_agrees_with_the_full_loader(text):
    expected = config.parse(text.replace("\r", "")) if text.strip() and not text.lstrip().startswith("#") else None
    got = tp.quick_settings(text)
    if expected is None:
        assert got == (True, "/run/healthd")
    else:
        assert got == (expected.inband.enabled, expected.hooks.run_dir)


@pytest.mark.parametrize("text", UNSURE)
def test_quick_settings_hands_anything_else_to_the_full_loader(text):
    with pytest.raises(tp.Unsure):
        tp.quick_settings(text)


def test_quick_settings_on_what_yaml_safe_dump_writes():
    doc = {"node_name": "node01", "state_file": "/tmp/x/run/state.json", "interval_s": 1.0,
           "kernel_log": {"journal_dir": "/tmp/j", "kmsg_path": None, "start_at": "head"},
           "hooks": {"gating": "local", "run_dir": "/tmp/healthd-e2e/nodes/node01/run/healthd",
                     "path": "/usr/bin:/bin", "gpu_devices": "/tmp/x/dev/node01/nvidia[0-9]*", "dcgmi": None},
           "inband": {"enabled": False, "keep_jobs": 2}}
    text = yaml.safe_dump(doc, sort_keys=False)
    assert tp.quick_settings(text) == (False, "/tmp/healthd-e2e/nodes/node01/run/healthd")


def write_config(tmp_path: Path, text: str) -> str:
    p = tmp_path / "healthd.yaml"
    p.write_text(text)
    return str(p)


def test_settings_falls_back_to_the_full_loader(tmp_path):
    assert tp.settings(write_config(tmp_path, "hooks:\n  run_dir: '/quoted'\ninband: {enabled: false}\n")) == (
        False, "/quoted")


def test_a_broken_or_missing_config_is_a_skip_with_the_reason(tmp_path):
    with pytest.raises(tp.Skip, match="config unusable"):
        tp.settings(write_config(tmp_path, "hooks:\n  run_dir: [\n"))
    with pytest.raises(tp.Skip, match="config unusable"):
        tp.settings(write_config(tmp_path, "inband:\n  enabled: 'maybe'\n"))
    with pytest.raises(tp.Skip, match="does not exist"):
        tp.settings(str(tmp_path / "missing.yaml"))


def test_config_path_from_the_arguments_else_the_environment():
    assert tp.config_path(["--config", "/a"], {"HEALTHD_CONFIG": "/b"}) == "/a"
    assert tp.config_path(["--config=/a"], {}) == "/a"
    assert tp.config_path([], {"HEALTHD_CONFIG": "/b"}) == "/b"
    assert tp.config_path([], {}) is None


# ----------------------------------------------------------------------------- the TaskProlog's answer


def test_it_exports_the_users_own_directory_only(tmp_path):
    me = os.getuid()
    run = tmp_path / "run"
    (run / "inband" / "5").mkdir(parents=True)
    env = {"SLURM_JOB_ID": "5"}
    assert tp.inband_dir(True, str(run), env, me) == f"{run}/inband/5"
    with pytest.raises(tp.Skip, match="inband.enabled is false"):
        tp.inband_dir(False, str(run), env, me)
    with pytest.raises(tp.Skip, match=f"belongs to uid {me}, not 4242"):
        tp.inband_dir(True, str(run), env, 4242)
    with pytest.raises(tp.Skip, match="does not exist"):
        tp.inband_dir(True, str(run), {"SLURM_JOB_ID": "6"}, me)
    (run / "inband" / "7").symlink_to(run / "inband" / "5")
    with pytest.raises(tp.Skip, match="not a directory"):
        tp.inband_dir(True, str(run), {"SLURM_JOB_ID": "7"}, me)
    (run / "inband" / "8").write_text("")
    with pytest.raises(tp.Skip, match="not a directory"):
        tp.inband_dir(True, str(run), {"SLURM_JOB_ID": "8"}, me)


@pytest.mark.parametrize("job", [*BAD_JOBS, None])
def test_no_job_id_no_export(tmp_path, job):
    env = {} if job is None else {"SLURM_JOB_ID": job}
    with pytest.raises(tp.Skip, match="not a job id"):
        tp.inband_dir(True, str(tmp_path), env, os.getuid())


@pytest.mark.parametrize("run_dir", ["run/healthd", "", "/run/heal thd", "/run/x\nexport LD_PRELOAD=/x"])
def test_a_run_dir_that_is_not_a_plain_absolute_path_is_not_exported(run_dir):
    with pytest.raises(tp.Skip, match="not a plain absolute path"):
        tp.inband_dir(True, run_dir, {"SLURM_JOB_ID": "5"}, os.getuid())


def run_script(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).parent / "healthd-taskprolog"
    assert script.is_file(), f"{script} missing: pip install -e . installs the console scripts"
    return subprocess.run([str(script), *args], env={"PATH": "/usr/bin:/bin", **env}, capture_output=True,
                          text=True, timeout=30)


def test_the_console_script_prints_the_export_line(tmp_path):
    run = tmp_path / "run"
    (run / "inband" / "5").mkdir(parents=True)
    cfg = write_config(tmp_path, f"hooks:\n  run_dir: {run}\n")
    r = run_script({"SLURM_JOB_ID": "5"}, "--config", cfg)
    assert (r.returncode, r.stdout, r.stderr) == (0, f"export HEALTHD_INBAND_DIR={run}/inband/5\n", "")
    r = run_script({"SLURM_JOB_ID": "5", "HEALTHD_CONFIG": cfg})
    assert r.stdout == f"export HEALTHD_INBAND_DIR={run}/inband/5\n"


@pytest.mark.parametrize("text, why", [
    ("inband:\n  enabled: false\n", "inband.enabled is false"),
    ("hooks: [\n", "config unusable"),
    ("hooks:\n  run_dir: /nonexistent/healthd\n", "/nonexistent/healthd/inband/5 does not exist"),
    ("\xff\xfe", "config unusable"),
])
def test_the_console_script_prints_nothing_says_why_and_exits_0(tmp_path, text, why):
    cfg = write_config(tmp_path, text)
    r = run_script({"SLURM_JOB_ID": "5"}, "--config", cfg)
    assert (r.returncode, r.stdout) == (0, "")
    assert r.stderr.startswith("healthd-taskprolog: no HEALTHD_INBAND_DIR: ") and why in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1


def test_the_console_script_exits_0_on_a_missing_config_and_on_a_directory_as_config(tmp_path):
    for cfg in (str(tmp_path / "missing.yaml"), str(tmp_path)):
        r = run_script({"SLURM_JOB_ID": "5"}, "--config", cfg)
        assert (r.returncode, r.stdout) == (0, "") and r.stderr.count("\n") == 1, r


def test_main_exits_0_on_any_exception(monkeypatch, capsys):
    def boom(argv, env):
        raise RuntimeError("bug")

    monkeypatch.setattr(tp, "run", boom)
    assert tp.main([]) == 0
    out = capsys.readouterr()
    assert out.out == "" and "internal error RuntimeError: bug" in out.err


def test_main_exits_0_when_it_hangs(monkeypatch, capsys):
    def hang(argv, env):
        time.sleep(30)

    monkeypatch.setattr(tp, "TIMEOUT_S", 1)
    monkeypatch.setattr(tp, "run", hang)
    started = time.monotonic()
    assert tp.main([]) == 0
    assert time.monotonic() - started < 5
    assert "no answer within 1 s" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the prolog and epilog scripts


def hook_node(tmp_path: Path, inband: dict | None = None, **hooks) -> Node:
    node = Node(tmp_path)
    node.write_config(**hooks)
    if inband is not None:
        doc = yaml.safe_load(node.config.read_text())
        doc["inband"] = inband
        node.config.write_text(yaml.safe_dump(doc))
    node.write_state(state_doc())
    return node


T1_GPU1 = finding("xid:gpu1:79", 1, xid=79, action="drain-and-requeue", summary="xid 79 gpu1: fell off the bus")


@needs_root
def test_the_prolog_makes_the_directory_and_the_epilog_archives_it(tmp_path):
    node = hook_node(tmp_path)
    rc, err, _ = node.run("healthd-prolog", node.prolog_env(job="7", uid="1000", SLURM_JOB_GID="1001"))
    d = node.run_dir / "inband" / "7"
    assert rc == 0 and f"job 7: in-band directory created {d} (uid 1000, mode 0700)" in err, err
    st = d.lstat()
    assert (st.st_uid, st.st_gid, mode(d)) == (1000, 1001, 0o700)
    rc, err, _ = node.run("healthd-epilog", node.epilog_env(job="7"))
    assert rc == 0 and f"job 7: in-band directory moved {d} to {node.run_dir}/inband/done/7" in err, err
    assert not d.exists() and (node.run_dir / "inband" / "done" / "7").is_dir()


@needs_root
def test_a_refused_job_gets_no_directory(tmp_path):
    node = hook_node(tmp_path, gating="local")
    node.write_state(state_doc(findings=[T1_GPU1]))
    rc, err, _ = node.run("healthd-prolog", node.prolog_env(job="9", gpus="0,1"))
    assert rc == 1 and "refused job 9" in err and "in-band" not in err, err
    assert not (node.run_dir / "inband" / "9").exists()


@needs_root
def test_a_prolog_that_cannot_make_the_directory_says_why_and_the_job_runs(tmp_path, decoy):
    node = hook_node(tmp_path)
    (node.run_dir / "inband").mkdir(mode=0o755)
    (node.run_dir / "inband" / "7").symlink_to(decoy)
    rc, err, _ = node.run("healthd-prolog", node.prolog_env(job="7"))
    assert rc == 0 and "job 7: no in-band directory: " in err and "is a symbolic link" in err, err
    assert "the job runs without it" in err and "job 7 runs: " in err
    assert decoy.lstat().st_uid == 0 and mode(decoy) == 0o755
    rc, err, _ = node.run("healthd-prolog", node.prolog_env(job="8", uid="bogus"))
    assert rc == 0 and "job 8: no usable SLURM_JOB_UID, so no in-band directory" in err, err


@needs_root
def test_inband_disabled_makes_nothing_but_the_epilog_still_archives(tmp_path):
    node = hook_node(tmp_path, inband={"enabled": False})
    rc, err, _ = node.run("healthd-prolog", node.prolog_env(job="7"))
    assert rc == 0 and "in-band" not in err and not (node.run_dir / "inband").exists(), err
    rc, err, _ = node.run("healthd-epilog", node.epilog_env(job="7"))
    assert rc == 0 and "in-band" not in err, err
    ib.create(str(node.run_dir), "8", 1000)  # made while it was enabled
    rc, err, _ = node.run("healthd-epilog", node.epilog_env(job="8"))
    assert rc == 0 and "job 8: in-band directory moved" in err, err


@needs_root
def test_the_epilog_keeps_keep_jobs_and_exits_0_when_it_cannot_archive(tmp_path, decoy):
    node = hook_node(tmp_path, inband={"keep_jobs": 1})
    for job in ("1", "2"):
        node.run("healthd-prolog", node.prolog_env(job=job))
        rc, err, _ = node.run("healthd-epilog", node.epilog_env(job=job))
        assert rc == 0, err
    assert os.listdir(node.run_dir / "inband" / "done") == ["2"] and "removed 1 older" in err
    node.run("healthd-prolog", node.prolog_env(job="3"))
    shutil.rmtree(node.run_dir / "inband" / "done")
    (node.run_dir / "inband" / "done").symlink_to(decoy)
    rc, err, _ = node.run("healthd-epilog", node.epilog_env(job="3"))
    assert rc == 0 and "job 3: in-band directory not archived: " in err and "symbolic link" in err, err
    assert sorted(os.listdir(decoy)) == ["keep.txt"]

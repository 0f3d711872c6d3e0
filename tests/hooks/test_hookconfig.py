"""The hooks' compiled configuration (healthd.hookconfig): written as the agent writes it, read by the
installed hooks with nothing but json/os on their path, and refused -- back to the YAML, no crash --
whenever it is missing, stale, corrupt, hostile, untrusted or for another file."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest

from healthd import config, goodput_events, hookconfig, settings
from tests.hooks.support import BIN, Node, finding, state_doc
from tests.support.hook_log import hook_lines

T1_GPU1 = finding("xid:gpu1:79", 1, xid=79, action="drain-and-requeue", summary="xid 79 gpu1: fell off the bus")


@pytest.fixture
def node(tmp_path: Path) -> Node:
    n = Node(tmp_path)
    n.run_dir.mkdir(parents=True, exist_ok=True)
    n.run_dir.chmod(0o755)
    return n


def env_for(node: Node) -> dict[str, str]:
    return {hookconfig.PATH_ENV: str(node.run_dir / "hooks-config.json")}


def compile_for(node: Node) -> Path:
    path, why = hookconfig.write(str(node.config), env_for(node))
    assert path and not why
    return Path(path)


def me() -> int:
    return os.getuid()


def test_the_repeated_constants_agree_with_their_sources() -> None:
    assert hookconfig.NODE_CONFIG_PATH == config.NODE_CONFIG_PATH
    assert settings.GOODPUT_LOG_DIR == goodput_events.LOG_DIR
    assert Path(hookconfig.COMPILED_PATH).parent == Path(settings.Settings(node_name="x").state_file).parent


def test_compiled_settings_equal_the_yaml_in_every_section_the_hooks_read(node: Node) -> None:
    node.write_config(gating="local", stale_after_s=42.5, dcgmi="/opt/dcgm/bin/dcgmi", timeout_s=4)
    text = node.config.read_text() + "inband:\n  enabled: false\n  keep_jobs: 3\ncontroller:\n  url: http://head:9841\n"
    node.config.write_text(text)
    compile_for(node)
    compiled, why = hookconfig.read_compiled(str(node.config), me(), env_for(node))
    assert why == "" and compiled is not None
    loaded = config.load(str(node.config))
    for section in hookconfig.SECTIONS:
        for f in dataclasses.fields(getattr(loaded, section)):
            want = getattr(getattr(loaded, section), f.name)
            got = getattr(getattr(compiled, section), f.name)
            if dataclasses.is_dataclass(want):
                want, got = dataclasses.asdict(want), got._values if isinstance(got, hookconfig.Section) else got
                got = {k: (v._values if isinstance(v, hookconfig.Section) else v) for k, v in got.items()}
            assert got == want, f"{section}.{f.name}"
            assert type(got) is type(want) or isinstance(want, float), f"{section}.{f.name}"
    for key in ("node_name", "state_file", "state_dir", "interval_s", "log_level"):
        assert getattr(compiled, key) == getattr(loaded, key)
    with pytest.raises(AttributeError):
        compiled.hooks.gating = "off"


def test_node_name_left_unset_is_the_hostname_at_the_time_of_the_run(node: Node) -> None:
    text = "\n".join(line for line in node.config.read_text().splitlines() if not line.startswith("node_name"))
    node.config.write_text(text + "\n")
    compile_for(node)
    doc = json.loads((node.run_dir / "hooks-config.json").read_text())
    assert doc["node_name_set"] is False
    compiled, _ = hookconfig.read_compiled(str(node.config), me(), env_for(node))
    assert compiled is not None and compiled.node_name == config.default_node_name()


def test_the_agent_writes_it_only_next_to_its_state_file(node: Node, tmp_path: Path) -> None:
    path, why = hookconfig.write(str(node.config), {hookconfig.PATH_ENV: str(tmp_path / "elsewhere" / "hooks-config.json")})
    assert path == "" and "is not in" in why and not (tmp_path / "elsewhere").exists()


def test_check_config_writes_it_on_request(node: Node) -> None:
    env = {**os.environ, **env_for(node)}
    p = subprocess.run([str(BIN / "healthd"), "check-config", "--config", str(node.config)], env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert not (node.run_dir / "hooks-config.json").exists()
    p = subprocess.run([str(BIN / "healthd"), "check-config", "--config", str(node.config), "--write-hook-config"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "compiled for the Slurm hooks" in p.stdout
    doc = json.loads((node.run_dir / "hooks-config.json").read_text())
    assert doc["format"] == hookconfig.FORMAT and doc["source"]["path"] == str(node.config)
    assert os.stat(node.run_dir / "hooks-config.json").st_mode & 0o022 == 0


def _spoil(node: Node, how: str) -> str:
    """Spoil the compiled file one way; the words the refusal must contain."""
    path = node.run_dir / "hooks-config.json"
    doc = json.loads(path.read_text())
    if how == "missing":
        path.unlink()
        return "No such file"
    if how == "truncated":
        path.write_bytes(path.read_bytes()[:40])
        return "hooks-config.json"
    if how == "not an object":
        path.write_text("[1, 2]")
        return "format"
    if how == "format":
        doc["format"] = hookconfig.FORMAT + 1
        path.write_text(json.dumps(doc))
        return "format"
    if how == "version":
        doc["healthd"] = "0.0.1"
        path.write_text(json.dumps(doc))
        return "compiled by healthd 0.0.1"
    if how == "other file":
        doc["source"]["path"] = "/etc/healthd/other.yaml"
        path.write_text(json.dumps(doc))
        return "another file"
    if how == "yaml edited":
        node.write_config(gating="local")  # same size or not, a new mtime
        return "changed since"
    if how == "yaml touched, same text":
        st = node.config.stat()
        os.utime(node.config, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
        return "changed since"
    if how == "older than the yaml":
        st = node.config.stat()
        os.utime(path, ns=(st.st_mtime_ns - 10_000_000_000, st.st_mtime_ns - 10_000_000_000))
        return "older than"
    if how == "hostile type":
        doc["settings"]["hooks"]["timeout_s"] = "forever"
        path.write_text(json.dumps(doc))
        return "hooks.timeout_s is str"
    if how == "hostile bool":
        doc["settings"]["nvml"]["expected_gpus"] = True
        path.write_text(json.dumps(doc))
        return "nvml.expected_gpus is bool"
    if how == "no settings":
        del doc["settings"]["hooks"]
        path.write_text(json.dumps(doc))
        return "no settings"
    if how == "world-writable":
        path.chmod(0o666)
        return "not trusted"
    if how == "group-writable directory":
        node.run_dir.chmod(0o775)
        return "not trusted"
    if how == "a link":
        real = node.root / "real-hooks-config.json"
        path.rename(real)
        path.symlink_to(real)
        return "link"
    if how == "too large":
        doc["padding"] = "x" * (hookconfig.MAX_BYTES + 10)
        path.write_text(json.dumps(doc))
        return "(limit 65536)"
    if how == "nested too deep":
        text = "[" * 30000 + "]" * 30000
        path.write_text(text)
        try:
            json.loads(text)
        except RecursionError:
            return "RecursionError"
        # Python 3.14's json takes this depth (its limit follows the C stack): a list, refused as one
        return "not a compiled configuration"
    if how == "a fifo":
        path.unlink()
        os.mkfifo(path)
        return "hooks-config.json"
    raise AssertionError(how)


SPOILS = ["missing", "truncated", "not an object", "format", "version", "other file", "yaml edited",
          "yaml touched, same text", "older than the yaml", "hostile type", "hostile bool", "no settings",
          "world-writable", "group-writable directory", "a link", "too large", "nested too deep", "a fifo"]


@pytest.mark.parametrize("how", SPOILS)
def test_a_spoiled_compiled_file_is_refused_and_the_yaml_used(node: Node, how: str) -> None:
    compile_for(node)
    words = _spoil(node, how)
    compiled, why = hookconfig.read_compiled(str(node.config), me(), env_for(node))
    assert compiled is None and words in why
    loaded, why = hookconfig.load(str(node.config), me(), env_for(node))
    assert words in why
    assert loaded == config.load(str(node.config))


def test_a_file_of_another_owner_is_refused(node: Node) -> None:
    compile_for(node)
    compiled, why = hookconfig.read_compiled(str(node.config), me() + 1, env_for(node))
    assert compiled is None and "not trusted" in why


def test_an_unusable_yaml_is_an_error_with_or_without_a_compiled_file(node: Node) -> None:
    compile_for(node)
    node.config.write_text("hooks: [1\n")
    with pytest.raises(hookconfig.Unusable, match="valid YAML"):
        hookconfig.load(str(node.config), me(), env_for(node))
    with pytest.raises(hookconfig.Unusable, match="no such file"):
        hookconfig.load(str(node.root / "missing.yaml"), me(), env_for(node))


# --------------------------------------------------------------------------- the installed hooks


def run(node: Node, hook: str, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / hook), "--config", str(node.config), *extra], env=env, capture_output=True,
                          text=True, timeout=60, cwd=str(node.root))


def test_the_prolog_refuses_the_same_way_from_the_compiled_file_and_from_the_yaml(node: Node) -> None:
    node.write_config(gating="local")
    outcomes = []
    for compiled in (True, False):
        node.set_slurm()
        node.write_state(state_doc(node.name, [T1_GPU1]))
        if compiled:
            compile_for(node)
        else:
            (node.run_dir / "hooks-config.json").unlink()
        job = "31" if compiled else "32"
        p = run(node, "healthd-prolog", {**node.prolog_env(job=job, gpus="0,1"), **env_for(node)})
        binding = json.loads((node.run_dir / "jobs" / f"{job}.json").read_text())
        outcomes.append((p.returncode, node.slurm_node()["reason"].replace(job, "J"), binding["gpus"],
                         [line.replace(job, "J") for line in hook_lines(p.stderr)]))
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][0] == 1 and outcomes[0][1] == "healthd: xid 79 gpu1: fell off the bus [job J]"


@pytest.mark.parametrize("hook", ["healthd-prolog", "healthd-epilog", "healthd-healthcheck"])
def test_with_a_current_compiled_file_no_hook_imports_yaml_or_the_settings_dataclasses(node: Node, hook: str) -> None:
    node.write_state(state_doc(node.name))
    compile_for(node)
    env = {**node.prolog_env(job="40"), **env_for(node)} if hook != "healthd-healthcheck" else \
        {"SLURMD_NODENAME": node.name, **env_for(node)}
    p = subprocess.run([str(BIN / "python"), "-X", "importtime", str(BIN / hook), "--config", str(node.config)],
                       env=env, capture_output=True, text=True, timeout=60, cwd=str(node.root))
    assert p.returncode == 0, p.stderr
    imported = {line.split("|")[-1].strip() for line in p.stderr.splitlines() if line.startswith("import time:")}
    assert "healthd.hooks.common" in imported  # the check sees the hook's imports at all
    heavy = {"yaml", "healthd.config", "healthd.settings", "dataclasses", "typing", "inspect", "logging",
             "healthd.slurm", "subprocess", "shutil", "datetime"}
    assert imported & heavy == set()
    # and without it, the YAML path is what runs
    (node.run_dir / "hooks-config.json").unlink()
    p = subprocess.run([str(BIN / "python"), "-X", "importtime", str(BIN / hook), "--config", str(node.config)],
                       env=env, capture_output=True, text=True, timeout=60, cwd=str(node.root))
    assert p.returncode == 0 and "healthd.config" in p.stderr and "yaml" in p.stderr


def test_healthd_state_reads_the_compiled_file_and_answers_as_from_the_yaml(node: Node) -> None:
    """`healthd state` runs under NHC (check_healthd) and NRPE on every check: with a current compiled
    file it imports neither the YAML loader nor the agent, and says what it says from the YAML."""
    node.write_state(state_doc(node.name))
    compile_for(node)
    argv = [str(BIN / "python"), "-X", "importtime", str(BIN / "healthd"), "state", "--format", "nagios",
            "--config", str(node.config)]
    env = {"SLURMD_NODENAME": node.name, **env_for(node)}
    fast = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, cwd=str(node.root))
    imported = {line.split("|")[-1].strip() for line in fast.stderr.splitlines() if line.startswith("import time:")}
    assert "healthd.statedoc" in imported
    assert imported & {"yaml", "healthd.config", "healthd.settings", "healthd.agent.daemon", "prometheus_client",
                       "healthd.agent.classify"} == set()
    (node.run_dir / "hooks-config.json").unlink()
    slow = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, cwd=str(node.root))
    assert "yaml" in slow.stderr
    assert (fast.returncode, fast.stdout) == (slow.returncode, slow.stdout) and fast.stdout.startswith("HEALTHD OK - ")


@pytest.mark.parametrize("how", ["truncated", "hostile type", "world-writable", "a fifo"])
def test_a_hook_given_a_spoiled_compiled_file_runs_from_the_yaml(node: Node, how: str) -> None:
    node.write_state(state_doc(node.name))
    compile_for(node)
    _spoil(node, how)
    p = run(node, "healthd-prolog", {**node.prolog_env(job="50"), **env_for(node)})
    assert p.returncode == 0, p.stderr
    assert (node.run_dir / "jobs" / "50.json").exists()
    assert "internal error" not in p.stderr and "runs: no finding on GPUs 0,1" in p.stderr


# --------------------------------------------------------------------------- string tests in place of re and glob


NAMES = ["", "0", "12345678901234567890", "123456789012345678901", "\u0661", "12a", " 1", "alice", "a$", "$", "a$$",
         "_svc", "-x", "x-y.z@corp", "é", "a" * 64, "a" * 65, "a" * 64 + "$", "node01", "n.1_-", ".n", "-n", "n" * 255,
         "n" * 256, "n 1", "n\n", "n/1"]


@pytest.mark.parametrize("value", NAMES)
def test_the_environment_checks_agree_with_the_regular_expressions_they_replace(value: str) -> None:
    import re

    from healthd.hooks import common, slurmnode

    assert common._digits(value, 20) == bool(re.fullmatch(r"[0-9]{1,20}", value))
    assert common._digits(value, 10) == bool(re.fullmatch(r"[0-9]{1,10}", value))
    assert common._user_name(value) == bool(re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.@-]{0,63}\$?", value))
    assert common._node_name(value) == bool(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}", value))
    assert slurmnode._node_name(value) == common._node_name(value)
    from healthd.bindings import BINDING_NAME

    assert bool(BINDING_NAME.fullmatch(f"{value}.json")) == bool(re.fullmatch(r"([0-9]{1,20})\.json", f"{value}.json"))


def test_the_gpu_device_count_is_globs(tmp_path: Path) -> None:
    import glob

    from healthd.checks import count_digit_glob

    d = tmp_path / "dev"
    d.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidia12", "nvidiactl", "nvidia-uvm", "nvidia", ".nvidia3", "xnvidia4",
                 "nvidia\u0665", "nvidia7x"):
        (d / name).touch()
    (d / "nvidia9").mkdir()
    (d / "nvidia8").symlink_to(d / "missing")
    for pattern in (f"{d}/nvidia[0-9]*", f"{d}/nvidiactl[0-9]*", f"{tmp_path}/none/nvidia[0-9]*", f"{d}/nvidia0/x[0-9]*"):
        assert count_digit_glob(pattern) == len(glob.glob(pattern)), pattern
    for other in (f"{d}/nvidia*", f"{d}/nv?dia[0-9]*", "dev/nvidia[0-9]*", f"{d}/.nv[0-9]*", f"{d}/[0-9]*"):
        assert count_digit_glob(other) is None

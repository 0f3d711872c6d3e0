"""tests/support/pyslurm_build.py: the pure parts (the version read from slurm_version.h, the cache key,
the tarball's check), the skip reason of a checkout without ../shared, and which host builds for its own
Slurm. The build itself runs in the trixie root (make pyslurm-root), or on a Debian 13 host (make
pyslurm-host), and is proven by the real-pyslurm contract tests there."""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support import pyslurm_build as pb


@given(st.integers(0, 255), st.integers(0, 255), st.integers(0, 255))
def test_slurm_version_number_round_trips(major, minor, micro):
    text = f'#define SLURM_VERSION_NUMBER 0x{(major << 16) + (minor << 8) + micro:06x}\n'
    assert pb.parse_slurm_version_h(f"/* x */\n{text}#define OTHER 1\n") == f"{major}.{minor:02d}.{micro}"


def test_debian_trixie_slurm_version_h_line():
    assert pb.parse_slurm_version_h("#ifndef _SLURM_VERSION_H_\n#define SLURM_VERSION_NUMBER 0x180b05\n") == "24.11.5"


@pytest.mark.parametrize("text", ["", "#define SLURM_VERSION_NUMBER\n", "#define SLURM_VERSION_NUMBER 0xzz\n",
                                  "SLURM_VERSION_NUMBER 0x180b05\n"])
def test_a_header_without_the_number_is_a_clear_error(text):
    with pytest.raises(pb.PyslurmBuildError, match="SLURM_VERSION_NUMBER"):
        pb.parse_slurm_version_h(text)


def test_the_cache_key_changes_with_each_input():
    base = pb.cache_key("a" * 64, "24.11.5", "python3.13")
    assert base == pb.cache_key("a" * 64, "24.11.5", "python3.13")
    others = {pb.cache_key("b" * 64, "24.11.5", "python3.13"), pb.cache_key("a" * 64, "24.11.6", "python3.13"),
              pb.cache_key("a" * 64, "24.11.5", "python3.14"), pb.cache_key("a" * 64, "24.11.5", "python3.13", "x")}
    assert base not in others and len(others) == 4


def test_the_tarball_must_be_the_recorded_one(tmp_path):
    f = tmp_path / pb.TARBALL_NAME
    f.write_bytes(b"not pyslurm")
    with pytest.raises(pb.PyslurmBuildError, match="sha256"):
        pb.verify_tarball(f)
    assert pb.verify_tarball(f, hashlib.sha256(b"not pyslurm").hexdigest()) == hashlib.sha256(b"not pyslurm").hexdigest()


def test_a_clone_without_shared_says_why(tmp_path):
    repo = tmp_path / "clone"
    repo.mkdir()
    reason = pb.missing_reason(repo)
    assert reason and "../shared/third_party/" in reason and pb.TARBALL_NAME in reason
    with pytest.raises(pb.PyslurmBuildError, match="not found"):
        pb.install(tmp_path / "root", repo=repo)


def test_the_shared_tarball_is_the_recorded_one():
    if pb.missing_reason():
        pytest.skip(pb.missing_reason())
    assert pb.verify_tarball(pb.tarball_path()) == pb.TARBALL_SHA256


def test_a_root_without_slurm_headers_is_refused_before_any_step(tmp_path):
    if pb.missing_reason():
        pytest.skip(pb.missing_reason())
    ran = []
    with pytest.raises(pb.PyslurmBuildError, match="libslurm-dev"):
        pb.install(tmp_path, run=lambda *a: ran.append(a))
    assert ran == []


def _host_with_slurm(root, number: int | None):
    if number is not None:
        header = root / "usr/include/slurm/slurm_version.h"
        header.parent.mkdir(parents=True)
        header.write_text(f"#define SLURM_VERSION_NUMBER 0x{number:06x}\n")
    return root


@pytest.mark.parametrize(("number", "says"), [(None, "libslurm-dev"), (0x160508, "22.05.8"), (0x1a0505, "26.05.5"),
                                              (0x180a00, "24.10.0")])
def test_only_a_host_whose_slurm_is_24_11_builds_pyslurm(tmp_path, number, says):
    reason = pb.host_skip_reason(_host_with_slurm(tmp_path, number))
    assert reason is not None and says in reason


@given(st.integers(0, 255))
def test_any_24_11_micro_release_on_the_host_builds_pyslurm(micro):
    with tempfile.TemporaryDirectory() as tmp:
        assert pb.host_skip_reason(_host_with_slurm(Path(tmp), 0x180b00 + micro)) is None


def test_the_host_mode_is_a_note_and_nothing_else_on_another_slurm(capsys):
    """The Makefile's `make pyslurm-host` on this host: exit 0, and a note saying why when nothing is built."""
    reason = pb.missing_reason() or pb.host_skip_reason()
    if reason is None:
        pytest.skip("this host's Slurm is 24.11: the host mode builds here (proven by the real-pyslurm tests)")
    assert pb.main(["--host-venv", "/nonexistent-venv"]) == 0
    assert reason in capsys.readouterr().out

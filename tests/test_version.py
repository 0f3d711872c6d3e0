"""`healthd --version` is what the Ansible role checks a venv against: it must be the package's version."""

from importlib.metadata import version

import healthd


def test_module_version_is_the_package_version():
    assert healthd.__version__ == version("healthd")

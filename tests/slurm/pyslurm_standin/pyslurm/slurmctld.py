"""pyslurm.slurmctld of the stand-in: Config.load().version (pyslurm/core/slurmctld/config.pyx)."""

from __future__ import annotations


class Config:
    def __init__(self):
        self.version = None

    @staticmethod
    def load():
        from . import _standin_cluster  # the stand-in package itself, whatever name it was imported as

        cluster = _standin_cluster()
        cluster.rpc("slurmctld.Config.load()")
        conf = Config()
        conf.version = cluster.version
        return conf

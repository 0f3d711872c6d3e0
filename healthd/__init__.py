"""healthd: Slurm-native GPU node health."""

__version__ = "0.1.0"

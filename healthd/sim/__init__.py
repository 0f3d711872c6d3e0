"""healthd-sim: the real policy code on a virtual clock, against a simulated fleet and Slurm."""

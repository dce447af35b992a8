"""Getting ranks started: resolve the config, check the machine and data, torchrun and Slurm, the launch
environment, then hand each rank to the run room. Imports run and every room below it."""

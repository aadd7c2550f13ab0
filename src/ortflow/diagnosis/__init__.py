"""The checks of `ortflow doctor` beyond the cheap ones of training/preflight.py (which
the training launcher also runs before it starts any rank): those that take longer or
only inform, each a `preflight.Check` (one row of the doctor's table), one job a module:

- `installation.py`: what is installed: the distributions' versions against ortflow's
  requirements, the MPI library, ONNX Runtime's execution providers, running as root;
- `ranks.py`: ranks started with mpirun as training starts them, which agree on the world
  size and all-reduce with training's communicator code (and NCCL on GPUs); the ranks
  run this module;
- `config_checks.py`: the config given, and the model it built, against this machine.
"""

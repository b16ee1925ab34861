"""The services around the training loop (docs/architecture.md section 1): experiment trackers
(`tracking.py`), the SIGTERM / SIGINT handler of a `train` call (`signals.py`, torch-free),
train.precision auto's step timing on a CPU (`cpu_precision.py`) and train.compile's choice and
cold-start accounting (`compiling.py`). The loop (trainer.py, setup.py and the modules beside
them) calls these; of the loop they import only loss.py (a step timed as the trainer runs it)
and the hook boundary, and the Trainer as a type alone (tests/test_architecture.py). Nothing is
imported here: the CLI imports signals.py before torch."""

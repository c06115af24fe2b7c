"""LeNet and ResNet-18 on Fashion-MNIST with data parallelism chosen by config."""

from src.strategies.cleanup import register as _register_process_group_cleanup

_register_process_group_cleanup()  # any process that imports this package, spawned DDP workers included

"""LeNet and ResNet-18 on Fashion-MNIST with data parallelism chosen by config.

Importing this package does nothing: each tool (`src.cli`, `src.scaling`, `src.forecast`) loads what it needs.
"""

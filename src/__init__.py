"""LeNet and ResNet-18 on Fashion-MNIST with data parallelism chosen by config."""

"""`local_replica_devices`: which devices a process's K replicas take when the strategy's `devices` is not given.
A pure function of Lightning's assignment, the local rank and K: no GPU needed to check the cuda:p*K+j mapping."""

import pytest
import torch

from src.strategies.devices import local_replica_devices

CPU = torch.device("cpu")


def cuda(*indices: int) -> list[torch.device]:
    return [torch.device("cuda", i) for i in indices]


@pytest.mark.parametrize("assigned", [None, [], [CPU], [CPU, CPU]], ids=["none", "empty", "cpu", "2xcpu"])
@pytest.mark.parametrize("local_rank", [0, 1])
def test_cpu_processes_hold_k_cpu_replicas(assigned, local_rank):
    assert local_replica_devices(assigned, local_rank, 3) == [CPU] * 3


@pytest.mark.parametrize("assigned, local_rank, expected", [
    (cuda(0, 1), 0, cuda(0)),
    (cuda(0, 1), 1, cuda(1)),
    (cuda(2, 3), 0, cuda(2)),   # K = 1 keeps the GPU Lightning assigned (`trainer.devices: "2,3"`), as DDP does
    (cuda(2, 3), 1, cuda(3)),
])
def test_one_replica_per_process_takes_the_gpu_lightning_assigned(assigned, local_rank, expected):
    assert local_replica_devices(assigned, local_rank, 1) == expected


@pytest.mark.parametrize("local_rank, k, expected", [
    (0, 2, cuda(0, 1)),
    (1, 2, cuda(2, 3)),
    (0, 3, cuda(0, 1, 2)),
    (1, 3, cuda(3, 4, 5)),
    (3, 2, cuda(6, 7)),
])
def test_k_replicas_of_local_process_p_take_cuda_p_times_k_plus_j(local_rank, k, expected):
    assigned = cuda(*range(4))  # one GPU per process, as Lightning assigns them; K > 1 spreads over p*K .. p*K+K-1
    assert local_replica_devices(assigned, local_rank, k) == expected


def test_the_processes_of_a_node_cover_its_gpus_once_each():
    processes, k = 4, 2
    taken = [d for p in range(processes) for d in local_replica_devices(cuda(*range(processes)), p, k)]
    assert taken == cuda(*range(processes * k))  # every GPU of the 8, none twice, in rank order

"""Float32 matrix products on GPUs: TensorFloat-32, chosen once per run by the CLI.

torch computes float32 matmuls in full IEEE float32 by default, while cuDNN already runs float32 convolutions in
TF32 on Ampere and later GPUs (torch's "TensorFloat-32 (TF32) on Ampere (and later) devices" notes). A run whose
every device is a GPU therefore gets TF32 for its matmuls too: the same 10-bit mantissa its convolutions already
use, at tensor-core speed. The runs whose figures must be exact are unaffected: float64 (`precision: 64-true`) never
uses TF32, and bf16-mixed computes its matmuls in bfloat16 anyway. A run with a CPU device keeps IEEE float32
everywhere, because torch's switch also reaches oneDNN on the CPU, and the CPU figures (the main job's test
accuracy) are reproduced bitwise.
"""

import torch


def choose(device_types: set[str]) -> str:
    """Set and return torch's float32 matmul precision for a run on these device types.

    Args:
        device_types: The types of every device that computes in this process, e.g. {"cuda"} or {"cuda", "cpu"}.

    Returns:
        "high" (TF32) when every device is a CUDA GPU, else "highest" (IEEE float32, torch's default), set again
        so that a second run in the same process does not inherit the first one's choice.
    """
    torch.set_float32_matmul_precision("high" if device_types == {"cuda"} else "highest")
    return torch.get_float32_matmul_precision()

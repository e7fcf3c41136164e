"""scripts/demo.py where CUDA is present: a GPU per process when the node has enough, else the
stages on CPU with a one-line note (NCCL refuses two ranks on one GPU). Skipped without CUDA."""

import pytest
import torch

from tests.commands import run_demo
from tests.gpu import needs_cuda

pytestmark = [needs_cuda, pytest.mark.gpu, pytest.mark.processes]


def test_the_demo_runs_whatever_the_number_of_gpus(tmp_path):
    result = run_demo(
        f"run.root={tmp_path}",
        "run.name=gpu",
        "train.iters=2",
        "train.micro_batch_size=16",
        "logger.wandb_project=null",
        "logger.mlflow_experiment=null",
        "logger.comet_project=null",
    )
    assert result.returncode == 0, f"demo failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    note = "4 processes on this node but"
    if torch.cuda.device_count() < 4:
        assert result.stderr.count(note) == 1 and "the stages run on CPU (gloo)" in result.stderr
    else:
        assert note not in result.stderr and "Peak CUDA allocated per pipeline stage" in result.stdout

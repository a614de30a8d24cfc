"""DDP + GSGD on two CPU processes equals one process on the same global batch."""

import pytest
import torch

from _ddp_worker import model_and_data, train, worker
from _helpers import DEFAULT_INIT, spawn_workers
from gsgd_adapters.torch import GSGD

pytestmark = DEFAULT_INIT


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed missing")
def test_ddp_two_processes_equal_one_process(tmp_path):
    init, out = tmp_path / "init", tmp_path / "weights.pt"
    spawn_workers(worker, (2, str(init), str(out)), 2, out, limit=120)
    model, x, y = model_and_data()
    train(model, GSGD(model, lr=0.05, momentum=0.9), x, y)
    ddp_state = torch.load(out, weights_only=True)
    for name, p in model.state_dict().items():
        assert torch.allclose(ddp_state[name], p, rtol=1e-10, atol=1e-12), name

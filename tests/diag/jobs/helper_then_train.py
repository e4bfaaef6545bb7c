"""A training loop that, before it starts, asks a short-lived Python subprocess a question (as
torch.compile, a tokenizer or a setup script does), then trains for longer than half a minute; logs every
step. Written as users write it; imports nothing of nsa-diag."""

import logging
import os
import subprocess
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stdout)
log = logging.getLogger("train")
STEP_S = float(os.environ.get("STEP_S", "0.9"))


def main() -> None:
    version = subprocess.run(
        [sys.executable, "-c", "import platform; print(platform.python_version())"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    log.info("python %s", version)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(320, 16), torch.randn(320, 1))
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for step, (x, y) in enumerate(DataLoader(data, batch_size=8), start=1):
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(STEP_S)  # the real model's step
        log.info("step %d loss %.4f", step, loss.item())
    log.info("training done")


if __name__ == "__main__":
    main()

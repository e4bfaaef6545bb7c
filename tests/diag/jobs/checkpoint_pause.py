"""A healthy training loop that saves a checkpoint after step 3 and then copies it to slow shared storage
(about 4 MiB/s, for CHECKPOINT_PAUSE_S seconds: bytes move all along) before it goes on; logs every step."""

import logging
import os
import sys
import tempfile
import time

import torch
from torch import nn

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stdout)
log = logging.getLogger("train")
PAUSE_S = float(os.environ.get("CHECKPOINT_PAUSE_S", "15"))


class Net(nn.Module):
    def __init__(self, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def copy_to_shared_storage(path: str, seconds: float) -> None:
    """The shared filesystem takes about 4 MiB/s: the copy (with its padding) takes ``seconds``."""
    chunk = os.urandom(256 << 10)
    deadline = time.monotonic() + seconds
    with open(path + ".shared", "wb") as out:
        while time.monotonic() < deadline:
            out.write(chunk)
            out.flush()
            time.sleep(0.06)


def save_checkpoint(model: nn.Module, opt: torch.optim.Optimizer, step: int, folder: str) -> None:
    path = os.path.join(folder, f"step{step}.pt")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, path)
    copy_to_shared_storage(path, PAUSE_S)
    log.info("saved %s", path)


def main() -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with tempfile.TemporaryDirectory() as folder:
        for step in range(1, 9):
            x, y = torch.randn(16, 32), torch.randn(16, 1)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            log.info("step %d loss %.4f", step, loss.item())
            if step == 3:
                save_checkpoint(model, opt, step, folder)
    log.info("training done")


if __name__ == "__main__":
    main()

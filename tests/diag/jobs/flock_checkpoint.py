"""A training loop that saves its checkpoint into a folder that several jobs share, under an exclusive
``fcntl.flock`` on the folder's lock file (one writer at a time), as many a training script does. Another
job holds that lock and does not let it go, so this one waits in the kernel at its save."""

import fcntl
import logging
import os
import sys

import torch
from torch import nn

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stdout)
log = logging.getLogger("train")
SHARED = os.environ["CHECKPOINT_DIR"]


def save_checkpoint(model: nn.Module, step: int) -> None:
    with open(os.path.join(SHARED, "checkpoints.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one writer at a time in the shared folder
        torch.save(model.state_dict(), os.path.join(SHARED, f"step{step}.pt"))
    log.info("saved step %d", step)


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, 7):
        x, y = torch.randn(16, 32), torch.randn(16, 1)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        log.info("step %d loss %.4f", step, loss.item())
        if step % 3 == 0:
            save_checkpoint(model, step)


if __name__ == "__main__":
    main()

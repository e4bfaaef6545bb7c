"""A training script that prepares its dataset under a lock, as datasets / HF hub do: another process
(a second job sharing the cache) holds the lock, so this one waits in filelock's acquire loop."""

import logging
import os
import time

import torch
from filelock import FileLock
from torch import nn

log = logging.getLogger("train")
CACHE = os.environ.get("CACHE_DIR", "/tmp/cache")


def prepare() -> torch.Tensor:
    os.makedirs(CACHE, exist_ok=True)
    with FileLock(os.path.join(CACHE, "tokenized.lock")):
        path = os.path.join(CACHE, "tokenized.pt")
        if not os.path.exists(path):
            torch.save(torch.randn(256, 16), path)
        return torch.load(path)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    data = prepare()
    model = nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(5):
        loss = model(data).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        log.info("step %d loss %.4f", step, loss.item())
        time.sleep(0.2)


if __name__ == "__main__":
    main()

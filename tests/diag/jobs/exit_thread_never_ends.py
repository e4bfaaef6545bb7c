"""A plain training loop that sends its metrics to a thread (not a daemon) which runs until it gets None;
the script never sends it: training ends, and the process cannot exit (Python waits for the thread)."""

import logging
import queue
import threading
import time

import torch
from torch import nn

log = logging.getLogger("train")
metrics: "queue.Queue[float | None]" = queue.Queue()


def uploader() -> None:  # sends metrics until it gets None; the script forgets to send it
    while True:
        item = metrics.get()
        if item is None:
            return
        time.sleep(0.01)


def main() -> None:
    logging.basicConfig(level=logging.INFO)
    threading.Thread(target=uploader, name="metrics-uploader").start()
    model = nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, 21):
        loss = model(torch.randn(8, 16)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        metrics.put(loss.item())
        log.info("step %d loss %.3f", step, loss.item())
        time.sleep(0.05)
    log.info("training done")


if __name__ == "__main__":
    main()

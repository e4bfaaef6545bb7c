"""Trains a small CNN on batches prepared by a background prefetch thread through a queue.
The prefetch thread crashes on a bad sample and the training loop waits in queue.get() for ever."""
import queue
import threading
import time

import torch
import torch.nn as nn

batch_queue = queue.Queue(maxsize=1)


def load_sample(i):
    if i == 5 * 16 + 3:  # a corrupt record in shard 0
        print("FAULT: prefetch thread dies on a corrupt record; loop waits on the queue", flush=True)
        raise ValueError(f"record {i}: truncated image header")
    return torch.randn(1, 28, 28), i % 10


def prefetch():
    i = 0
    while True:
        time.sleep(0.4)  # read the next chunk of the shard
        xs, ys = [], []
        for _ in range(16):
            x, y = load_sample(i)
            xs.append(x)
            ys.append(y)
            i += 1
        batch_queue.put((torch.stack(xs), torch.tensor(ys)))


threading.Thread(target=prefetch, name="prefetch", daemon=True).start()

model = nn.Sequential(nn.Conv2d(1, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 26 * 26, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(1, 51):
    x, y = batch_queue.get()
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.4f}", flush=True)
    time.sleep(0.1)
print("done", flush=True)

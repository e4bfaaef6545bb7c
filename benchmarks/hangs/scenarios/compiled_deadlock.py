"""Trains a small MLP compiled with torch.compile (inductor); the forward records activation stats under a lock.
A stats-flusher thread holds the stats lock and then wants the model lock that the training step holds: deadlock."""
import threading
import time

import torch
import torch.nn as nn

model_lock = threading.Lock()   # held for the whole train step
stats_lock = threading.Lock()   # guards the activation statistics
flush_now = threading.Event()
act_stats = {"mean": 0.0, "n": 0}


def record_stats(h):
    with stats_lock:
        act_stats["mean"] += h.detach().mean().item()
        act_stats["n"] += 1


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 256), nn.Linear(256, 10)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        record_stats(h)
        return self.fc2(h)


def stats_flusher():
    while True:
        flush_now.wait()
        flush_now.clear()
        with stats_lock:
            line = f"act mean {act_stats['mean'] / max(act_stats['n'], 1):.4f}"
            time.sleep(0.8)  # push to the metrics server
            print("FAULT: stats flusher holds the stats lock and wants the model lock", flush=True)
            with model_lock:
                line += f" | w norm {model.fc1.weight.norm().item():.3f}"
        print(line, flush=True)


model = MLP()
cmodel = torch.compile(model)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
threading.Thread(target=stats_flusher, name="stats-flusher", daemon=True).start()
for step in range(1, 41):
    with model_lock:
        time.sleep(0.25)  # fetch the next batch
        x, y = torch.randn(128, 64), torch.randint(0, 10, (128,))
        loss = nn.functional.cross_entropy(cmodel(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"step {step} loss {loss.item():.4f}", flush=True)
    if step % 4 == 0:
        flush_now.set()
    time.sleep(0.1)
print("done", flush=True)

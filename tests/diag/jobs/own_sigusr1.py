"""Installs its own SIGUSR1 handler (say, "save a checkpoint now"), trains, then blocks on a lock."""

import signal
import sys
import threading

import torch
from torch import nn


def on_usr1(signum, frame):
    print("got SIGUSR1: checkpoint requested", flush=True)
    sys.exit(3)


signal.signal(signal.SIGUSR1, on_usr1)
model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(1, 4):
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    print(f"step {step}", flush=True)
    if step == 2:
        lock = threading.Lock()
        lock.acquire()
        lock.acquire()  # a bug: waits forever

"""Only slow: every step waits on a slow data source (0.3 s), 60 steps."""

import time

import torch
from torch import nn

model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
opt = torch.optim.Adam(model.parameters())
for step in range(1, 61):
    time.sleep(0.3)  # the slow data source
    x = torch.randn(4, 8)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step}", flush=True)

"""Raises at step 2: a batch of the wrong shape."""

import torch
from torch import nn

model = nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(1, 4):
    width = 8 if step < 2 else 9
    x = torch.randn(4, width)
    if x.shape[1] != 8:
        raise ValueError(f"batch {step} has {x.shape[1]} features, the model takes 8")
    loss = model(x).sum()
    loss.backward()
    opt.step()

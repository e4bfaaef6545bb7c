"""Tells nsa-diag's probe its loss (the optional API: a no-op outside nsa-diag watch); at step 3 the loss
is the log of a negative number: NaN. The script itself goes on to the end and exits 0."""

import torch
from torch import nn

import nsa_diag.probe as probe

model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
probe.total_steps(5)
for step in range(1, 6):
    out = model(torch.randn(2, 4)).abs().mean()
    loss = torch.log(out - 1e6) if step == 3 else out
    probe.loss(loss)
    loss.backward()
    opt.step()
    opt.zero_grad()
print("done")

"""A training loop whose loss turns NaN at step 3 (the log of a negative number) and goes on to the end,
exit code 0: nothing in it tells anyone about the NaN but the printed loss."""

import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(1, 6):
    out = model(torch.randn(2, 4)).abs().mean()
    loss = torch.log(out - 1e6) if step == 3 else out
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.4f}", flush=True)
print("done")

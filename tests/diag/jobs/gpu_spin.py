"""A CUDA kernel that never ends at step 3 (a custom kernel's bad loop bound; here torch.cuda._sleep)."""

import torch
from torch import nn

device = torch.device("cuda")
model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(1, 6):
    loss = model(torch.randn(32, 64, device=device)).pow(2).mean()
    if step == 3:
        torch.cuda._sleep(1 << 62)  # spins on the GPU for ever
    loss.backward()
    opt.step()
    opt.zero_grad()
    print(f"step {step} loss {loss.item():.4f}", flush=True)

"""Trains a small MLP on the GPU; at step 4 a custom CUDA kernel with a bad loop bound spins for ever
(torch.cuda._sleep stands for it), and the host waits for the loss in .item()."""
import torch
from torch import nn

device = torch.device("cuda")
model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 1)).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)


def fused_regularizer(x: torch.Tensor, step: int) -> torch.Tensor:
    if step == 4:
        print("FAULT: the fused regularizer kernel never terminates (bad loop bound)", flush=True)
        torch.cuda._sleep(1 << 62)  # a kernel that spins on the device for ever
    return 1e-4 * x.pow(2).mean()


for step in range(1, 41):
    x = torch.randn(512, 256, device=device)
    out = model(x)
    loss = out.pow(2).mean() + fused_regularizer(out, step)
    opt.zero_grad()
    loss.backward()
    opt.step()
    value = loss.item()
    print(f"step {step} loss {value:.4f}", flush=True)

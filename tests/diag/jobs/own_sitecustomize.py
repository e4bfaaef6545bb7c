"""Checks that the sitecustomize on its PYTHONPATH ran, then trains a step."""

import os

import torch

print("user sitecustomize:", os.environ.get("USER_SITECUSTOMIZE", "did not run"), flush=True)
w = torch.ones(2, requires_grad=True)
opt = torch.optim.SGD([w], lr=0.1)
(w * w).sum().backward()
opt.step()

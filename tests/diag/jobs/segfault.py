"""Segfaults after one step: a C extension reads address 0 (here through ctypes)."""

import ctypes

import torch

w = torch.zeros(3, requires_grad=True)
opt = torch.optim.SGD([w], lr=0.1)
(w * 2).sum().backward()
opt.step()
print("step 1 done", flush=True)
ctypes.string_at(0)

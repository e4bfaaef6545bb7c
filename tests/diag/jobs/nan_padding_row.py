"""A small transformer that alternates local (causal window) and global (padding-masked) attention
layers, trained on padded batches. At step 3 one row of the batch is all padding: in the first global
layer (layers.1) every key of that row is masked, the softmax of a row of -inf is NaN, and the loss is
NaN from there on. The script prints its losses and exits 0, as such a run does. --device cuda: on a GPU.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--device", default="cpu")
device = torch.device(parser.parse_args().device)
torch.manual_seed(0)
VOCAB, DIM, HEADS, SEQ, WINDOW = 64, 32, 4, 16, 4


class Block(nn.Module):
    def __init__(self, global_attention: bool) -> None:
        super().__init__()
        self.global_attention = global_attention
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / (DIM // HEADS) ** 0.5
        if self.global_attention:  # every key that is not padding
            masked = pad[:, None, None, :].expand(b, 1, t, t)
        else:  # a causal window over the positions, padding or not
            i = torch.arange(t, device=x.device)
            masked = ((i[None, :] > i[:, None]) | (i[:, None] - i[None, :] >= WINDOW))[None, None]
        attn = scores.masked_fill(masked, float("-inf")).softmax(-1)
        x = x + self.proj((attn @ v).transpose(1, 2).reshape(b, t, DIM))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(global_attention=i % 2 == 1) for i in range(4))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, pad)
        return self.head(x)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(1, VOCAB, (4, SEQ))
    lengths = torch.randint(SEQ // 2, SEQ + 1, (4,))
    if step == 3:
        lengths[2] = 0  # an empty document in the batch: all padding
    pad = torch.arange(SEQ)[None, :] >= lengths[:, None]
    return tokens.masked_fill(pad, 0).to(device), pad.to(device)


model = TinyLM().to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(1, 7):
    tokens, pad = batch(step)
    logits = model(tokens, pad)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1), ignore_index=0)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.4f}", flush=True)
print("done")

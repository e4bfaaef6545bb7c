"""A small transformer whose attention runs a per-token loop (a naive reference implementation): one layer's
forward takes far longer than the stall limit, while the process keeps computing all along."""

import argparse
import math

import torch
from torch import nn


class LoopAttention(nn.Module):
    """Causal attention computed token by token (``per_head``: and head by head, for each sequence of the
    batch, as a naive reference of a sparse attention does)."""

    def __init__(self, dim: int, heads: int, per_head: bool) -> None:
        super().__init__()
        self.heads, self.per_head = heads, per_head
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        if self.per_head:
            return self.proj(self._per_head(q, k, v))
        outs = []
        for t in range(x.shape[1]):  # token by token, causal
            scores = q[:, t : t + 1] @ k[:, : t + 1].transpose(1, 2) / math.sqrt(x.shape[-1])
            weights = torch.softmax(scores, dim=-1)
            outs.append(weights @ v[:, : t + 1])
        return self.proj(torch.cat(outs, dim=1))

    def _per_head(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B, T, C = q.shape
        D = C // self.heads
        q, k, v = (t.view(B, T, self.heads, D) for t in (q, k, v))
        rows = []
        for b in range(B):
            for t in range(T):
                heads = []
                for h in range(self.heads):
                    scores = k[b, : t + 1, h] @ q[b, t, h] / math.sqrt(D)
                    heads.append(torch.softmax(scores, dim=0) @ v[b, : t + 1, h])
                rows.append(torch.cat(heads))
        return torch.stack(rows).view(B, T, C)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, per_head: bool) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = LoopAttention(dim, heads, per_head)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Model(nn.Module):
    def __init__(self, vocab: int, dim: int, depth: int, heads: int, per_head: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, per_head) for _ in range(depth))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--per-head", action="store_true", help="loop over sequences, tokens and heads")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    model = Model(1000, args.dim, args.layers, args.heads, args.per_head).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    for step in range(1, args.steps + 1):
        tokens = torch.randint(0, 1000, (args.batch, args.seq_len + 1), device=args.device)
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()

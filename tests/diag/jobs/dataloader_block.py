"""A DataLoader with two worker processes; reading sample 9 waits forever for a server that never answers
(a stuck network read: the socket's other end never writes)."""

import socket

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

server, client = socket.socketpair()  # the "storage server" end (server) never sends anything


class Samples(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == 9:
            client.recv(1 << 16)  # the read that never returns
        return torch.full((8,), float(index))


def main() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(Samples(), batch_size=4, num_workers=2)
    for step, batch in enumerate(loader, start=1):
        model(batch).sum().backward()
        opt.step()
        opt.zero_grad()
        print(f"step {step}", flush=True)


if __name__ == "__main__":
    main()

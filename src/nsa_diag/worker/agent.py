"""torchrun's agent as nsa-diag starts it: ``python -m nsa_diag.worker.agent <torchrun's arguments>``.

This is torchrun (``torch.distributed.run``), with what its command line cannot ask for: it dies with
nsa-diag (`nsa_diag.worker.tether.hold`); each rank holds its own tether to the agent.
"""

from __future__ import annotations

from nsa_diag.worker import tether


def main() -> None:
    tether.hold()
    from torch.distributed.run import main as torchrun

    torchrun()  # parses sys.argv[1:], as ``python -m torch.distributed.run`` does


if __name__ == "__main__":
    main()

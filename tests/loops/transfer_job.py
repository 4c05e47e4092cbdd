"""One rank of a replica transfer over a real link (started in a network namespace by ``test_netns.py``).

    python -m tests.loops.transfer_job RANK WORLD MASTER_ADDR PORT DIR SIZE TIMEOUT_S

Rank 0 sends ``DIR/rank0/blob`` (``SIZE`` random bytes, written here) to rank ``WORLD - 1``; every other rank
has nothing to move. Then, as the two-level commit does, every rank gathers everyone's problems on the same
group. Both the transfer and the gather run on a group whose timeout is ``TIMEOUT_S``. Prints one JSON line:
the problems, the seconds the whole took, and the chunk the transfer ended at.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from ckptflow.trainer.format.checksum import hash_file
from ckptflow.trainer.nodes import transport


def main(rank: int, world: int, addr: str, port: int, root: str, size: int, timeout_s: float) -> None:
    store = dist.TCPStore(addr, port, world_size=world, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    mine = os.path.join(root, f"rank{rank}")
    os.makedirs(mine, exist_ok=True)
    blob = os.path.join(root, "rank0", "blob")
    if rank == 0:
        with open(blob, "wb") as f:
            f.write(os.urandom(size))
    dist.barrier()
    box = [hash_file(blob)[0] if rank == 0 else ""]
    dist.broadcast_object_list(box, src=0)  # the digest, as the manifest's broadcast carries it
    plan = [transport.Transfer("blob", 0, world - 1, size, box[0])]
    pace = transport.Pace(timeout_s)
    t0 = time.perf_counter()
    problems, received = transport.run(
        plan,
        rank=rank,
        group=None,
        source=lambda n: os.path.join(root, "rank0", n),
        dest_dir=lambda n: mine,
        timeout_s=timeout_s,
        pace=pace,
    )
    everyone: list = [None] * world
    dist.all_gather_object(everyone, problems)  # phase 5: the ranks that moved nothing waited for this
    took = time.perf_counter() - t0
    print(json.dumps({"rank": rank, "problems": everyone, "received": received, "s": took, "chunk": pace.chunk}))
    sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    a = sys.argv[1:]
    main(int(a[0]), int(a[1]), a[2], int(a[3]), a[4], int(a[5]), float(a[6]))
    from ckptflow.trainer.distenv import exit_process

    exit_process(0)  # no interpreter finalization racing gloo's threads

"""One rank of a small EmbRace training job, as its own process (no launcher, no agent).

    python tests/harness/fault_rank_main.py RANK WORLD INIT_METHOD STEPS [--victim R --at K --how kill|stop]

Rank ``R`` kills (SIGKILL) or stops (SIGSTOP, a hung process) itself in the middle of
step ``K``, after its forward exchange and before the backward one, and writes the
time to ``<INIT_METHOD file dir>/victim_time`` first. The others are left to their
watchdog: they must exit with its status, naming the lost rank.
"""
import argparse
import datetime
import os
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(os.path.dirname(HERE))]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from embrace_fairseq.guards import watchdog  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("rank", type=int)
    ap.add_argument("world", type=int)
    ap.add_argument("init_method")
    ap.add_argument("steps", type=int)
    ap.add_argument("--victim", type=int, default=-1)
    ap.add_argument("--at", type=int, default=3)
    ap.add_argument("--how", choices=["kill", "stop"], default="kill")
    ap.add_argument("--mark", default="")
    a = ap.parse_args()
    torch.set_num_threads(1)
    # gloo's own timeout is long on purpose: the watchdog must be what stops the survivors
    dist.init_process_group("gloo", init_method=a.init_method, rank=a.rank, world_size=a.world,
                            timeout=datetime.timedelta(seconds=600))
    watchdog.install()
    from rank_fns_reliability import TinyModel, batch

    model = TinyModel(True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(a.steps):
        ids, tgt = batch(step, a.rank, 4)
        opt.zero_grad()
        loss = model.loss(ids, tgt)
        if a.rank == a.victim and step == a.at:
            with open(a.mark, "w") as f:
                f.write(repr(time.time()))
            print(f"rank {a.rank}: {a.how} myself at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL if a.how == "kill" else signal.SIGSTOP)
        loss.backward()
        for p in model.parameters():
            if p.grad is not None and not getattr(p, "embrace_sharded", False):
                dist.all_reduce(p.grad)
        opt.step()
        print(f"rank {a.rank}: step {step} loss {loss.item():.4f}", flush=True)
    print(f"rank {a.rank}: done", flush=True)


if __name__ == "__main__":
    main()

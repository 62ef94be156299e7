"""Train a small CNN on a datapipe cache, in one process or under torchrun, on CPU or GPU.

    python examples/train.py --cache CACHE
    torchrun --nproc_per_node=2 examples/train.py --cache CACHE            # DDP (gloo on CPU, nccl on GPU)
    python examples/train.py --cache CACHE --resume checkpoint.pt          # continue where it stopped
    python examples/train.py --cache s3://bucket/cache --local-cache /nvme/datapipe   # stream from a store

A checkpoint (model, optimizer and loader position) is written at the end of every epoch, when
--max-steps stops the run, and when SIGTERM or Ctrl-C (SIGINT) stops it: the step in progress is
finished, the checkpoint saved, and each process exits with 143 (130 for Ctrl-C; torchrun exits 1, reporting
a failed child, or its own SignalException when the signal reached it too). --resume continues
mid-epoch with exactly the batches not yet trained on, so a preempted job loses at most one step.
Build a cache first: `python examples/build_dataset.py` or `datapipe build SOURCE CACHE`.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import datapipe


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", required=True, help="cache folder or URL (s3://...) written by `datapipe build`")
    p.add_argument("--local-cache", default=None,
                   help="a cache URL's node-local shard cache (a folder); credentials and endpoint from the AWS_* variables")
    p.add_argument("--cache-limit", default=None, help="at most this much of --local-cache (e.g. 200GB)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64, help="samples per batch on each process")
    p.add_argument("--crop", type=int, default=224, help="RandomResizedCrop output size")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--device", default="auto", help="cuda, cpu or auto (default)")
    p.add_argument("--workers", type=int, default=2, help="loader reader threads per process")
    p.add_argument("--max-steps", type=int, default=None,
                   help="stop after this many optimizer steps in all (counting resumed ones)")
    p.add_argument("--checkpoint", default="checkpoint.pt", help="where to save (default %(default)s)")
    p.add_argument("--resume", default=None, help="a checkpoint to continue from")
    p.add_argument("--seed", type=int, default=0, help="shuffle and initial-weights seed (keep it when resuming)")
    return p.parse_args(argv)


def small_cnn(num_classes: int) -> nn.Module:
    def block(cin: int, cout: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(cin, cout, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(cout),
                             nn.ReLU(inplace=True))

    return nn.Sequential(block(3, 32), block(32, 64), block(64, 128), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(128, num_classes))


def setup(device: str) -> torch.device:
    """Pick the device; join the process group when launched by torchrun (WORLD_SIZE is set)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        if dev.index is None:
            dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return dev


def log(line: str) -> None:
    """Print one line with a single write, so lines of ranks sharing one terminal never interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def save_checkpoint(path: str, state: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # a crash while saving never leaves a broken checkpoint behind


class StopRequest:
    """SIGTERM (a preempted job, systemd, scancel) or SIGINT (Ctrl-C), noted by the handler; the loop
    stops after the step in progress, so the checkpoint counts exactly the batches trained on."""

    CODES = {signal.SIGINT: 1, signal.SIGTERM: 2}  # for agreeing across ranks: the larger wins

    def __init__(self) -> None:
        self.code = 0

    def install(self) -> None:
        for sig in self.CODES:
            signal.signal(sig, self._note)

    def _note(self, signum: int, frame) -> None:
        self.code = max(self.code, self.CODES[signum])

    def agreed(self, device: torch.device) -> int:
        """0, or the stop every rank agrees on (a rank that got no signal stops with the others)."""
        if not dist.is_initialized():
            return self.code
        flag = torch.tensor([self.code], device=device if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    @staticmethod
    def describe(code: int) -> tuple[str, int]:
        return ("SIGTERM", 143) if code == 2 else ("Ctrl-C", 130)


def fail(message: str) -> int:
    """A mistake in the options: one line on stderr, exit status 2."""
    sys.stderr.write(f"train.py: error: {message}\n")
    return 2


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.resume and not Path(args.resume).is_file():
        return fail(f"--resume {args.resume}: no such checkpoint file")
    device = setup(args.device)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1

    # Every rank reads its own share of each global batch; drop_last keeps every batch full.
    remote = {"local_cache": args.local_cache, "cache_limit": args.cache_limit} if args.local_cache else {}
    dataset = datapipe.StreamingDataset(args.cache, batch_size=args.batch_size, shuffle=True, seed=args.seed,
                                        drop_last=True, **remote)
    loader = datapipe.DeviceLoader(dataset, device=device, num_workers=args.workers,
                                   augment=datapipe.augment.train(args.crop))

    torch.manual_seed(args.seed)  # the same initial weights on every rank and in every run of these options
    model = small_cnn(len(dataset.cache.classes)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-5)
    step, start_epoch = 0, 0
    per_epoch = len(loader)  # a whole epoch's batches (also after a resume, whose epoch yields those left)
    if per_epoch == 0:
        loader.close()
        return fail(f"--batch-size {args.batch_size} is larger than the {len(dataset.cache):,} samples shared by "
                    f"{world} process(es): no full batch to train on; lower --batch-size")
    if args.resume:
        try:
            ckpt = torch.load(args.resume, map_location="cpu")
        except Exception as exc:  # noqa: BLE001 - a damaged or foreign file: one line, not a traceback
            loader.close()
            return fail(f"--resume {args.resume}: not a checkpoint of this script ({type(exc).__name__}: {exc})")
        try:
            # the loader's state first: it names another --seed or cache than the saved run's (another cache may
            # have another number of classes, which the model's weights would only say as a size mismatch), or a
            # --batch-size whose global batches do not divide the saved position, in one line
            loader.load_state_dict(ckpt["loader"])  # seeks to the first batch the saved run had not trained on
            model.load_state_dict(ckpt["model"])
            optimizer.load_state_dict(ckpt["optimizer"])
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:  # datapipe's StateError is a ValueError
            loader.close()
            return fail(f"--resume {args.resume}: {' '.join(str(exc).split())}")
        step = ckpt["step"]
        start_epoch = ckpt["epoch"] + 1 if ckpt["epoch_done"] else ckpt["epoch"]
        if rank == 0:
            log(f"resumed from {args.resume}: epoch {ckpt['epoch']}, sample {ckpt['loader']['position']}, "
                f"step {step}")
    if dist.is_initialized():
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    criterion = nn.CrossEntropyLoss()
    if rank == 0:
        log(f"{world} process(es) on {device}: {per_epoch} batches of {args.batch_size} per process "
            f"and epoch from {dataset.cache!r}")

    stop = StopRequest()
    stop.install()
    signalled = 0
    for epoch in range(start_epoch, args.epochs):
        if args.max_steps is not None and step >= args.max_steps:
            break
        loader.set_epoch(epoch)  # keeps a resumed position in the resumed epoch
        model.train()
        batches, loss_sum, started = 0, torch.zeros((), device=device), time.perf_counter()
        stopped = False
        for images, labels in loader:
            loss = criterion(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum += loss.detach()
            batches += 1
            step += 1
            if args.max_steps is not None and step >= args.max_steps:
                stopped = True
                break
            signalled = stop.agreed(device)
            if signalled:
                stopped = True
                break

        s = loader.stats()  # since the loader was created
        loss = loss_sum.item() / batches if batches else float("nan")
        log(f"[rank {rank}/{world}] epoch {epoch}: {batches} batches, loss {loss:.4f}, "
            f"{time.perf_counter() - started:.1f} s | loader: {s['images_per_s']:,.0f} img/s, "
            f"waited {100 * s['wait_share']:.1f}% of the time, {s['batches']} batches in all")
        # A stop during the epoch's last step still finished the epoch: saved as done, the resume
        # starts the next one (not an empty rest of this one).
        finished = dataset.batches_consumed == per_epoch
        if rank == 0:
            save_checkpoint(args.checkpoint, {
                "model": (model.module if isinstance(model, DistributedDataParallel) else model).state_dict(),
                "optimizer": optimizer.state_dict(),
                "loader": loader.state_dict(),  # counts the batches trained on, not the prefetched ones
                "epoch": epoch,
                "epoch_done": finished,
                "step": step,
                "args": vars(args),
            })
        if stopped:
            if rank == 0 and not signalled:
                log(f"stopped after --max-steps {args.max_steps}; continue with --resume {args.checkpoint}")
            break

    signalled = signalled or stop.agreed(device)  # a signal during the last step: the final checkpoint is saved
    loader.close()
    if dist.is_initialized():
        dist.barrier()  # every rank leaves together, after rank 0 has written the checkpoint
        dist.destroy_process_group()
    if signalled:
        what, code = StopRequest.describe(signalled)
        if rank == 0:
            sys.stderr.write(f"train.py: stopped by {what} at step {step}; checkpoint saved: continue with "
                             f"--resume {args.checkpoint}\n")
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Micro-benchmark: the memory tier's checked local load against one memcpy of the state.

A synthetic copy (``--mib`` MiB in 4 tensors) is loaded with ``ckpt.memory._copy_checked``
(each 1 MiB block's XXH3-64 checked, then copied), best and median of ``--rounds``, beside:

* one memcpy of the same bytes (numpy, one call per tensor): the target's unit;
* XXH3-64 of every block alone, in one thread and split over two (python-xxhash holds the
  GIL: two threads are no faster);
* the copy of the whole state in a second thread beside the hash of all of it (numpy's copy
  releases the GIL): the floor of a check that reads the bytes apart from the copy;
* the whole local load (``ckpt.memory.load_slot``) of a real slot file in /dev/shm, as the
  trainer makes it: hashed (no stamp), and stamped good by the node agent's check
  (``ckpt.memory_verify``: a plain copy plus the stamp and header checks); and the agent's
  check itself (off the trainer's path, beside the launch).

``python benchmarks/micro_memory_load.py [--mib 201] [--rounds 7]``; prints one line per
figure (docs/benchmarks.md, the memory tier's local load).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ckpt.memory import MemoryConfig, MemoryTier, _copy_checked, _Piece, load_slot  # noqa: E402
from ckpt.memory_slot import BLOCK, SlotFile, block_hash, block_sums, newest  # noqa: E402
from ckpt.memory_verify import verify_copies  # noqa: E402


def timed(fn: Callable[[], object], rounds: int) -> tuple[float, float]:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times), sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=201)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    n = args.mib * 2**20 // 16 * 16
    src = np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8)
    sums = block_sums(src)
    quarter = n // 4
    tensors = [torch.empty(quarter // 4, dtype=torch.float32) for _ in range(4)]
    pieces = [_Piece(f"t{i}", t, i * quarter, quarter) for i, t in enumerate(tensors)]
    views = [t.view(torch.uint8).numpy() for t in tensors]

    def memcpy() -> None:
        for i, view in enumerate(views):
            view[:] = src[i * quarter : (i + 1) * quarter]

    def hash_blocks(lo: int = 0, hi: int = n) -> list[int]:
        return [block_hash(src[b : min(b + BLOCK, hi)]) for b in range(lo, hi, BLOCK)]

    pool = ThreadPoolExecutor(2)
    half = n // 2 // BLOCK * BLOCK

    def hash_two_threads() -> None:
        list(pool.map(lambda r: hash_blocks(*r), [(0, half), (half, n)]))

    def copy_beside_hash() -> None:
        copying = pool.submit(memcpy)
        hash_blocks()
        copying.result()

    figures = {
        "memcpy": timed(memcpy, args.rounds),
        "checked load (_copy_checked)": timed(
            lambda: _copy_checked(src, pieces, sums, "bench", 0), args.rounds
        ),
        "XXH3-64 of every block, 1 thread": timed(hash_blocks, args.rounds),
        "XXH3-64 of every block, 2 threads": timed(hash_two_threads, args.rounds),
        "memcpy in a thread beside the hash": timed(copy_beside_hash, args.rounds),
    }
    shm = tempfile.mkdtemp(prefix="micro-memload-", dir="/dev/shm")
    try:
        tier = MemoryTier(MemoryConfig(shm), rank=0, world_size=1)
        state = {f"t{i}": t.clone() for i, t in enumerate(tensors)}
        tier.save(1, state)
        tier.close()
        slots = [SlotFile(f"{shm}/rank-0.{k}") for k in (0, 1)]
        head, slot = newest(slots)[0]
        figures["load_slot, hashed (no stamp)"] = timed(
            lambda: load_slot(slot, head, state, use_stamp=True), args.rounds
        )
        figures["agent's check of the copy (off the trainer's path)"] = timed(
            lambda: verify_copies(shm), args.rounds
        )
        figures["load_slot, stamped good by the agent"] = timed(
            lambda: load_slot(slot, head, state, use_stamp=True), args.rounds
        )
        assert load_slot(slot, head, state, use_stamp=True).verified == "agent"
        for s in slots:
            s.close()
    finally:
        if Path(shm).name.startswith("micro-memload-"):
            shutil.rmtree(shm)
    unit = figures["memcpy"][0]
    print(f"state {n / 2**20:.0f} MiB in 4 tensors, {args.rounds} rounds")
    for name, (best, median) in figures.items():
        print(
            f"{name}: best {best * 1e3:.1f} ms, median {median * 1e3:.1f} ms "
            f"({best / unit:.2f}x a memcpy)"
        )


if __name__ == "__main__":
    main()

"""Timing and peak-memory helpers shared by the benchmarks (``eval/bench_codebook.py``, ``eval/bench_readout.py``).

Timing: every method's step runs once per round, rounds repeat (interleaved, so machine noise hits all methods
alike), and the median is reported. Peak memory is the extra memory of one step: on CUDA from
``torch.cuda.max_memory_allocated``; on CPU the rise of the resident set's high-water mark (``VmHWM``, reset
through ``/proc/self/clear_refs``) over its size just before the step, with glibc's free heap pages handed back
first (``malloc_trim``) and every large block served with mmap (:func:`serve_large_blocks_with_mmap`, called
after all timing since it slows allocation down) so that freed tensors leave the resident set at once.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from collections.abc import Callable

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved(steps: dict[str, Callable[[], None]], reps: int, device: torch.device) -> dict[str, float]:
    """Median milliseconds of every step, timed in ``reps`` interleaved rounds."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(reps):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            sync(device)
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _libc():
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def serve_large_blocks_with_mmap() -> bool:
    """Ask glibc to mmap every block >= 64 KiB, so a freed tensor leaves the resident set at once."""
    libc = _libc()
    return bool(libc is not None and libc.mallopt(-3, 65536))  # -3 = M_MMAP_THRESHOLD


def release_free_heap() -> None:
    """Hand glibc's free heap pages back to the system, so reusing them shows as a rise of the resident set."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def peak_memory_mib(step: Callable[[], None], device: torch.device) -> float:
    """Peak extra memory (MiB) of one step, measured as the module docstring says; NaN where unsupported."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - base) / 2**20
    release_free_heap()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the high-water mark to the current resident set
        before = _status_kib("VmRSS")
    except (OSError, RuntimeError):
        return float("nan")
    step()
    return (_status_kib("VmHWM") - before) / 1024


def sweep(name: str, values: list[int], prepare: Callable[[int], dict[str, Callable[[], None]]], reps: int,
          device: torch.device, memory: bool = True) -> list[dict]:
    """Rows ``{name: value, "ms": {method: median ms}, "peak_mib": {method: MiB}}`` for every value swept.

    ``prepare(value)`` returns a warmed-up step per method. All timing comes first, then (unless ``memory`` is off)
    one step per method and value for its peak memory, with large blocks served by mmap from then on.
    """
    rows = []
    for value in values:
        rows.append({name: value, "ms": time_interleaved(prepare(value), reps, device)})
        print(f"  {name}={value}: " + ", ".join(f"{m} {t:.1f} ms" for m, t in rows[-1]["ms"].items()),
              file=sys.stderr)
    if memory:
        if device.type == "cpu":
            serve_large_blocks_with_mmap()
        for row in rows:
            steps = prepare(row[name])
            row["peak_mib"] = {m: peak_memory_mib(step, device) for m, step in steps.items()}
            del steps
    return rows


def markdown_table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines)

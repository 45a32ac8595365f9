"""Outputs survive SIGKILL at any moment: checkpoints, history.jsonl and the like hold the old or the new content.

A child process rewrites one 4 MiB file in a loop, alternating two contents, and is killed at a random moment.
``softvq.models.files.write_atomic`` must leave a whole file every time; the same loop with a plain
``open(...).write`` is the
control that shows the kills do land mid-write.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from softvq.models.callbacks import AtomicCheckpointIO
from softvq.models.files import TMP_PREFIX, remove_stale_temporaries, write_atomic

ROOT = Path(__file__).resolve().parents[1]
SIZE = 4 << 20
# Loads softvq/models/files.py by path: stdlib only, so the child starts in milliseconds instead of importing torch.
CHILD = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("softvq_io", sys.argv[1])
io = importlib.util.module_from_spec(spec); spec.loader.exec_module(io)
path, atomic, size = sys.argv[2], sys.argv[3] == "1", int(sys.argv[4])
contents = [bytes([value]) * size for value in (1, 2)]
i = 0
while True:
    data = contents[i % 2]
    if atomic:
        io.write_atomic(path, data)
    else:
        with open(path, "wb") as f:  # streamed in pieces, as torch.save writes a checkpoint
            for start in range(0, size, size // 16):
                f.write(data[start:start + size // 16]); f.flush()
    i += 1
"""


def kill_while_writing(path: Path, atomic: bool, seed: int) -> bytes:
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(ROOT / "softvq" / "models" / "files.py"), str(path),
                              "1" if atomic else "0", str(SIZE)])
    try:
        deadline = time.monotonic() + 60
        while not path.exists():  # the first complete write (atomic) or the first bytes (plain)
            assert child.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(random.Random(seed).uniform(0.05, 0.3))
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    return path.read_bytes()


def whole(content: bytes) -> bool:
    return len(content) == SIZE and content in (b"\x01" * SIZE, b"\x02" * SIZE)


def test_write_atomic_leaves_a_whole_file_after_every_kill(tmp_path):
    for round_ in range(5):
        path = tmp_path / f"atomic{round_}.bin"
        assert whole(kill_while_writing(path, atomic=True, seed=round_)), round_
        for leftover in remove_stale_temporaries(tmp_path):  # a kill mid-write leaves its temporary file
            assert leftover.name.startswith(TMP_PREFIX + path.name)
        assert sorted(p.name for p in tmp_path.iterdir()) == [f"atomic{r}.bin" for r in range(round_ + 1)]


def test_plain_writes_are_torn_by_the_same_kills(tmp_path):
    torn = [not whole(kill_while_writing(tmp_path / f"plain{r}.bin", atomic=False, seed=r)) for r in range(5)]
    assert any(torn), "no kill landed mid-write: the atomic test above would prove nothing"


def test_failed_write_keeps_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "history.jsonl"
    write_atomic(path, "old\n")

    def crash(f):
        f.write(b"half a new fi")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomic(path, crash)
    assert path.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["history.jsonl"]


def test_checkpoint_io_round_trips_and_keeps_the_old_checkpoint_on_failure(tmp_path):
    io = AtomicCheckpointIO()
    path = tmp_path / "checkpoints" / "last.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.arange(5.0)}, "epoch": 3}, path)
    assert torch.equal(io.load_checkpoint(path)["state_dict"]["w"], torch.arange(5.0))

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle")

    with pytest.raises(RuntimeError, match="cannot pickle"):
        io.save_checkpoint({"state_dict": {"w": torch.zeros(3)}, "bad": Unpicklable()}, path)
    assert io.load_checkpoint(path)["epoch"] == 3
    assert os.listdir(path.parent) == ["last.ckpt"]
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint({}, path, storage_options={"a": 1})

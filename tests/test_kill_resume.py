"""SIGKILL mid-epoch, then ``--resume``: the run ends bit-identical to one that was never interrupted.

The killed run restarts from its last checkpoint (the end of epoch 1) and replays epoch 2 from its start: the data
order comes from (seed, epoch) and the checkpoint holds the global random states, so every batch, data-init and
restart draw repeats. With a DataLoader worker, since the loader's seeds do not come from the global random state.
Only ``time_s`` (wall clock) differs between the history rows.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import torch
from helpers import INTERRUPTIBLE, train_command, train_env

from softvq.models.files import TMP_PREFIX

ARGS = [*INTERRUPTIBLE, "--quantizer", "ddcl"]  # the session's uninterrupted_run, interrupted here


def command(data: Path, out: Path, *extra: str) -> list[str]:
    return train_command(data, out, *ARGS, *extra)


env = train_env


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]


def tensors(path: Path) -> dict[str, object]:
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    state = {f"model.{k}": v for k, v in ckpt["state_dict"].items()}
    for i, opt in enumerate(ckpt["optimizer_states"]):  # Adam's moments and step counts too
        for param, values in opt["state"].items():
            state.update({f"adam{i}.{param}.{k}": v for k, v in values.items()})
    return state


def test_sigkill_mid_epoch_then_resume_is_bit_identical(tmp_path, tiny_cifar, uninterrupted_run):
    data = tiny_cifar["folder"]

    out = tmp_path / "killed"
    child = subprocess.Popen(command(data, out), env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    last = out / "checkpoints" / "last.ckpt"
    deadline = time.monotonic() + 300
    while not last.exists():  # appears whole, by rename, at the end of epoch 1
        assert child.poll() is None, child.stderr.read().decode()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.02)
    epoch_seconds = rows(out)[0]["time_s"]
    time.sleep(0.3 * epoch_seconds)  # into epoch 2
    child.send_signal(signal.SIGKILL)
    assert child.wait() == -signal.SIGKILL
    assert [r["epoch"] for r in rows(out)] == [1]  # killed mid-epoch 2
    assert torch.load(last, map_location="cpu", weights_only=True)["epoch"] == 0  # Lightning counts from 0

    resumed = subprocess.run(command(data, out, "--resume"), env=env(), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    a, b = tensors(last), tensors(uninterrupted_run / "checkpoints" / "last.ckpt")
    assert a.keys() == b.keys() and len(a) > 20
    for key in b:  # tensors bit for bit; the quantizer's extra state (temperature, restart count) exactly
        assert torch.equal(a[key], b[key]) if isinstance(b[key], torch.Tensor) else a[key] == b[key], key
    straight_rows, resumed_rows = rows(uninterrupted_run), rows(out)
    assert [r["epoch"] for r in resumed_rows] == [1, 2]
    for x, y in zip(resumed_rows, straight_rows, strict=True):
        assert {k: v for k, v in x.items() if k != "time_s"} == {k: v for k, v in y.items() if k != "time_s"}
    assert sum(r["restarts"] for r in straight_rows) > 0  # restarts drew from the restored random state
    leftovers = [p for p in out.rglob(f"{TMP_PREFIX}*")]
    assert leftovers == []

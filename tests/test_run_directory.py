"""One run per directory, honest exit codes on SIGTERM/SIGINT, resume only with the run's settings.

- Two runs started together into one ``--out``: one is refused at once naming the other's pid, and the one that ran
  ends exactly like a run that was alone. A lock left by a SIGKILLed process is stale and taken over.
- SIGTERM mid-epoch: exit status 143, the last good checkpoint kept, the message says how to resume and which runs of
  a multi-quantizer command did not finish; resuming ends bit-identical to an uninterrupted run. SIGINT: 130.
- A resume that changes the model, its quantizer, the data or the optimisation is refused with the per-key
  difference and leaves every file of the run byte-identical; one that only extends it is recorded in
  invocations.jsonl and leaves config.json as it was.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import INTERRUPTIBLE, train_command, train_env

from softvq.cli import train as train_vqvae
from softvq.cli.common import GracefulStop, Interrupted, run_command
from softvq.models.files import RunLock, RunLockedError

SMALL = ["--data.train_subset", "96", "--data.val_size", "16", "--data.batch_size", "16", "--model.num_codes", "16",
         "--model.code_dim", "4", "--model.width", "8", "--model.res_hidden", "4", "--model.res_blocks", "1",
         "--data.num_workers", "0", "--trainer.accelerator", "cpu", "--trainer.progress_bar", "false", "--seed", "2"]
KILL = INTERRUPTIBLE  # the session's uninterrupted_run (with DDCL) is these flags, never interrupted


command, env = train_command, train_env


def rows(out: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k != "time_s"}
            for line in (out / "history.jsonl").read_text().splitlines()]


def tensors(path: Path) -> dict[str, object]:
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    state = {f"model.{k}": v for k, v in ckpt["state_dict"].items()}
    for i, opt in enumerate(ckpt["optimizer_states"]):
        for param, values in opt["state"].items():
            state.update({f"adam{i}.{param}.{k}": v for k, v in values.items()})
    return state


def assert_same_training(a: Path, b: Path) -> None:
    """Two run directories hold the same training: history (but wall clock), every tensor of last.ckpt bit for bit."""
    assert rows(a) == rows(b)
    x, y = tensors(a / "checkpoints" / "last.ckpt"), tensors(b / "checkpoints" / "last.ckpt")
    assert x.keys() == y.keys() and len(x) > 20
    for key in y:
        assert torch.equal(x[key], y[key]) if isinstance(y[key], torch.Tensor) else x[key] == y[key], key


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


# ---- item 2: the run-directory lock ------------------------------------------------------------------------------
def test_a_second_lock_is_refused_naming_the_holder(tmp_path):
    with RunLock(tmp_path / "run") as lock:
        assert (tmp_path / "run" / ".lock").read_text() == f"{os.getpid()}\n"
        with pytest.raises(RunLockedError, match=f"is in use by another run \\(pid {os.getpid()}"):
            RunLock(tmp_path / "run").acquire()
        assert lock.stale_pid is None
    assert not (tmp_path / "run").exists()  # made by the lock, left empty: removed with it
    with RunLock(tmp_path / "run"):  # released: free again
        pass


def test_a_lock_left_by_a_killed_run_is_stale_and_recovered(tmp_path):
    run = tmp_path / "run"
    code = ("import os, signal, sys; from softvq.models.files import RunLock; RunLock(sys.argv[1]).acquire(); "
            "os.kill(os.getpid(), signal.SIGKILL)")
    child = subprocess.run([sys.executable, "-c", code, str(run)], env=env(), timeout=120)
    assert child.returncode == -signal.SIGKILL
    left = int((run / ".lock").read_text())  # the dead holder's pid is still in the file
    with RunLock(run) as lock:
        assert lock.stale_pid == left
        assert (run / ".lock").read_text() == f"{os.getpid()}\n"


def test_a_forked_child_outliving_a_killed_holder_does_not_hold_the_lock(tmp_path):
    """A DataLoader worker is a fork: it shares the open lock file. SIGKILL the holder while its child lives on (as a
    worker does for a few seconds): the lock must be free at once, or --resume right after a kill is refused."""
    run = tmp_path / "run"
    code = ("import os, signal, sys, time; from softvq.models.files import RunLock; RunLock(sys.argv[1]).acquire(); "
            "child = os.fork()\n"
            "if child == 0:\n"
            "    null = os.open(os.devnull, os.O_WRONLY); os.dup2(null, 1); os.dup2(null, 2)\n"
            "    time.sleep(60); os._exit(0)\n"
            "print(child, flush=True); os.kill(os.getpid(), signal.SIGKILL)")
    holder = subprocess.run([sys.executable, "-c", code, str(run)], env=env(), capture_output=True, text=True,
                            timeout=120)
    orphan = int(holder.stdout)
    try:
        os.kill(orphan, 0)  # the forked child is still alive
        with RunLock(run) as lock:
            assert lock.stale_pid is not None
    finally:
        os.kill(orphan, signal.SIGKILL)


def wait_for_lock_holder(lock: Path, pids: set[int], deadline: float) -> int:
    """The pid (one of ``pids``) written in the run lock ``lock``, polled until one of them holds it."""
    while time.monotonic() < deadline:
        try:
            text = lock.read_text().strip()
        except OSError:
            text = ""
        if text.isdigit() and int(text) in pids:
            return int(text)
        time.sleep(0.005)
    raise AssertionError(f"neither of the runs {sorted(pids)} took {lock} in time")


def test_two_runs_started_together_into_one_out(tmp_path, tiny_cifar):
    data = tiny_cifar["folder"]
    args = [*SMALL, "--epochs", "1", "--quantizer", "hard"]
    out = tmp_path / "shared"
    both = [subprocess.Popen(command(data, out, *args), env=env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True) for _ in range(2)]
    # Whichever takes the lock is frozen until the other has met it: on a loaded machine the second interpreter can
    # need longer to start than the first needs to train, and then meets a finished run ("already holds a run", a
    # refusal too, but not the one under test). Freezing the holder makes the race's outcome, not its timing, the test.
    holder = wait_for_lock_holder(out / ".lock", {p.pid for p in both}, deadline=time.monotonic() + 300)
    os.kill(holder, signal.SIGSTOP)
    try:
        other = next(p for p in both if p.pid != holder)
        errs = {other.pid: other.communicate(timeout=600)[1]}
    finally:
        os.kill(holder, signal.SIGCONT)
    errs = [errs[p.pid] if p.pid in errs else p.communicate(timeout=600)[1] for p in both]
    codes = [p.returncode for p in both]
    assert sorted(codes) == [0, 2], errs
    winner, loser = (0, 1) if codes[0] == 0 else (1, 0)
    assert f"is in use by another run (pid {both[winner].pid}" in errs[loser], errs[loser]
    assert errs[loser].count("\n") == 1, errs[loser]  # one error: line, at once

    solo = tmp_path / "solo"
    alone = subprocess.run(command(data, solo, *args), env=env(), capture_output=True, text=True, timeout=600)
    assert alone.returncode == 0, alone.stderr[-3000:]
    assert_same_training(out, solo)
    assert [r["epoch"] for r in rows(out)] == [1]
    assert len(list((out / "checkpoints").glob("best-epoch*.ckpt"))) == 1
    config, reference = (json.loads((d / "config.json").read_text()) for d in (out, solo))
    assert {**config, "out": None} == {**reference, "out": None}
    invocations = (out / "invocations.jsonl").read_text().splitlines()
    assert len(invocations) == 1 and json.loads(invocations[0])["pid"] == both[winner].pid  # the loser wrote nothing
    assert not (out / ".lock").exists()


# ---- item 3: SIGTERM / SIGINT ------------------------------------------------------------------------------------
def test_sigterm_mid_epoch_exits_143_names_unfinished_runs_and_resumes_bit_identical(tmp_path, tiny_cifar,
                                                                                      uninterrupted_run):
    data = tiny_cifar["folder"]

    out = tmp_path / "both"
    argv = [*KILL, "--quantizer", "ddcl", "hard"]
    child = subprocess.Popen(command(data, out, *argv), env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)
    last = out / "ddcl" / "checkpoints" / "last.ckpt"
    deadline = time.monotonic() + 300
    while not last.exists():  # appears whole, by rename, at the end of epoch 1
        assert child.poll() is None, child.stderr.read()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.02)
    time.sleep(0.3 * json.loads((out / "ddcl" / "history.jsonl").read_text().splitlines()[0])["time_s"])
    child.send_signal(signal.SIGTERM)
    err = child.communicate(timeout=300)[1]
    assert child.returncode == 143, err[-3000:]
    message = err.strip().splitlines()[-1]
    assert message.startswith(f"error: SIGTERM stopped the training of {out / 'ddcl'} in epoch 2"), message
    assert f"the last good checkpoint, {last} (end of epoch 1), is kept" in message
    assert "--resume" in message and "Runs not finished: ddcl (interrupted), hard (not started)" in message
    assert [r["epoch"] for r in rows(out / "ddcl")] == [1]
    assert torch.load(last, map_location="cpu", weights_only=True)["epoch"] == 0
    assert not (out / "hard").exists() and not (out / "comparison.md").exists()

    resumed = subprocess.run(command(data, out, *argv, "--resume"), env=env(), capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_training(out / "ddcl", uninterrupted_run)
    assert [r["epoch"] for r in rows(out / "hard")] == [1, 2] and (out / "comparison.md").is_file()


def test_sigint_outside_training_raises_interrupted_and_exits_130():
    # the handler this process started with: Python's default_int_handler, or SIG_IGN when a non-interactive shell
    # started it in the background (`cmd &`), which is how a CI run launched with nohup saw it
    before = signal.getsignal(signal.SIGINT)

    def main(argv):
        with GracefulStop():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler raises before this ends
        raise AssertionError("not interrupted")

    assert run_command(main) == 130
    with pytest.raises(Interrupted) as caught, GracefulStop():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    assert caught.value.exit_code == 143
    assert signal.getsignal(signal.SIGINT) is before  # handlers restored


# ---- item 4: resume only with the run's settings -----------------------------------------------------------------
def finished_run(tmp_path_factory, tiny_cifar, quantizer: str) -> Path:
    out = tmp_path_factory.mktemp("resume") / "run"
    assert train_vqvae.cli(["--data.data_root", str(tiny_cifar["folder"]), "--out", str(out), *SMALL, "--epochs", "1",
                            "--quantizer", quantizer]) == 0
    return out


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_cifar) -> Path:
    """A finished 1-epoch hard-VQ run (plain codebook, no EMA)."""
    return finished_run(tmp_path_factory, tiny_cifar, "hard")


@pytest.fixture(scope="module")
def finished_ddcl(tmp_path_factory, tiny_cifar) -> Path:
    """A finished 1-epoch DDCL run (the default recipe): the --ddcl.* settings are its layer's."""
    return finished_run(tmp_path_factory, tiny_cifar, "ddcl")


@pytest.mark.parametrize("quantizer, flags, diff", [
    ("hard", ["--hard.ema_decay", "0.99"], "quantizer_kwargs.ema_decay: checkpoint None vs now 0.99"),
    ("ddcl", ["--ddcl.distance", "cosine"], "quantizer_kwargs.distance: checkpoint 'euclidean' vs now 'cosine'"),
    ("ddcl", ["--ddcl.prototype_update", "soft_ema"],
     "quantizer_kwargs.prototype_update: checkpoint 'auto' vs now 'soft_ema'"),
    ("ddcl", ["--ddcl.init", "normal"], "quantizer_kwargs.init: checkpoint 'data' vs now 'normal'"),
    ("ddcl", ["--ddcl.temperature", "2"], "quantizer_kwargs.temperature: checkpoint * vs now 2.0"),  # * = the default
    ("hard", ["--model.eps", "0.1"], "eps: checkpoint 0.01 vs now 0.1"),
    ("hard", ["--model.lr", "0.001"], "lr: checkpoint 0.0003 vs now 0.001"),
    ("hard", ["--data.batch_size", "8"], "--data.batch_size: run 16 vs now 8"),
    ("hard", ["--seed", "1"], "--seed: run 2 vs now 1"),
    ("hard", ["--data.train_subset", "64"], "--data.train_subset: run 96 vs now 64"),
    ("hard", ["--trainer.precision", "64-true"], "--trainer.precision: run '32-true' vs now '64-true'"),
])
def test_resume_with_other_settings_is_refused_and_writes_nothing(capsys, request, tmp_path, tiny_cifar, quantizer,
                                                                  flags, diff):
    out = tmp_path / "run"
    shutil.copytree(request.getfixturevalue("finished" if quantizer == "hard" else "finished_ddcl"), out)
    before = snapshot(out)
    argv = ["--data.data_root", str(tiny_cifar["folder"]), "--out", str(out), *SMALL, "--quantizer", quantizer,
            "--epochs", "2", "--resume", *flags]
    assert train_vqvae.cli(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and re.search(re.escape(diff).replace(r"\*", r"\S+"), err), err
    assert snapshot(out) == before  # config.json, history.jsonl, invocations.jsonl, checkpoints: byte-identical


def test_resume_that_extends_the_run_is_recorded_and_keeps_config(tmp_path, tiny_cifar, finished):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    config = (out / "config.json").read_bytes()
    first = (out / "invocations.jsonl").read_text()
    train_vqvae.main(["--data.data_root", str(tiny_cifar["folder"]), "--out", str(out), *SMALL, "--quantizer", "hard",
                      "--epochs", "2", "--data.num_workers", "1", "--resume"])
    assert (out / "config.json").read_bytes() == config  # still describes the run as it was started
    log = (out / "invocations.jsonl").read_text()
    assert log.startswith(first)  # appended, the original line untouched
    second = json.loads(log.splitlines()[1])
    assert second["resume"] == "last" and second["changed"] == {"epochs": [1, 2], "data.num_workers": [0, 1],
                                                                "out": [str(finished), str(out)]}  # it was copied
    assert [r["epoch"] for r in rows(out)] == [1, 2]

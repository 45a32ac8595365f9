"""What softvq-train shows while it runs: the progress bar counts epochs from 1 and each epoch's summary line starts a
line of its own (softvq.models.progress.EpochProgressBar); comparison.png draws the history's values
(softvq.cli.comparison)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from helpers import worse_every_epoch_module

from softvq.cli.comparison import PANELS, comparison_figure
from softvq.models.progress import EpochProgressBar


class _Summary(L.Callback):
    """Prints a summary line per epoch, as HistoryWriter does (through the module, i.e. the progress bar)."""

    def on_train_epoch_end(self, trainer, pl_module):
        pl_module.print(f"summary of epoch {trainer.current_epoch + 1}")


def test_the_bar_counts_epochs_from_one_and_each_summary_has_a_line_of_its_own(capsys):
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(8, 1)), batch_size=2)
    trainer = L.Trainer(max_epochs=2, logger=False, enable_checkpointing=False, enable_model_summary=False,
                        num_sanity_val_steps=0, callbacks=[EpochProgressBar(4), _Summary()])
    trainer.fit(worse_every_epoch_module(), data, data)
    out = capsys.readouterr().out
    assert "Epoch 0" not in out  # Lightning's own bar counts from 0
    assert out.index("Epoch 1/2") < out.index("summary of epoch 1") < out.index("Epoch 2/2") < \
        out.index("summary of epoch 2")
    for epoch in (1, 2):  # the summary follows a newline, not the bar's last carriage return
        line = f"summary of epoch {epoch}\n"
        assert out.count(line) == 1 and out[out.index(line) - 1] == "\n", repr(out[out.index(line) - 80:])


HISTORIES = {
    "ddcl": [{"epoch": e, "val_psnr_hard": 19.0 + e, "val_utilization": 1.0, "val_dead_codes": 0,
              "val_perplexity": 340.0 + 10 * e, "utilization": 1.0, "dead_codes": 0, "perplexity": 350.0,
              "time_s": 40.0 + e} for e in (1, 2, 3)],
    "hard": [{"epoch": e, "val_psnr_hard": 18.5 + e, "val_utilization": 0.5 + 0.1 * e, "val_dead_codes": 200 - 50 * e,
              "val_perplexity": 150.0 + 100 * e, "utilization": 0.9, "dead_codes": 5, "perplexity": 300.0,
              "time_s": 30.0} for e in (1, 2, 3)],
}


@pytest.mark.parametrize("names", [("ddcl", "hard"), ("hard",)])
def test_comparison_png_draws_each_quantizers_validation_curves(names):
    fig = comparison_figure({name: HISTORIES[name] for name in names})
    *axes, timed = fig.axes
    assert [ax.get_title() for ax in axes] == [f"{title}, validation" for title, *_ in PANELS]
    seconds = {"ddcl": [41.0, 83.0, 126.0], "hard": [30.0, 60.0, 90.0]}  # each epoch's time_s, summed
    for line, name in zip(timed.lines, names, strict=True):
        assert list(line.get_xdata()) == pytest.approx(seconds[name])
        assert list(line.get_ydata()) == pytest.approx([row["val_psnr_hard"] for row in HISTORIES[name]])
    for ax, (_, key, _, scale) in zip(axes, PANELS, strict=True):
        assert [line.get_label() for line in ax.lines] == list(names)
        for line, name in zip(ax.lines, names, strict=True):
            assert list(line.get_xdata()) == [1, 2, 3]
            assert list(line.get_ydata()) == pytest.approx([scale * row[key] for row in HISTORIES[name]])


def test_a_run_without_validation_draws_its_training_epochs_and_says_so():
    rows = [{k: v for k, v in row.items() if not k.startswith("val_")} for row in HISTORIES["hard"]]
    psnr, util, dead, ppl, timed = comparison_figure({"hard": rows}).axes
    assert len(psnr.lines) == 0 and psnr.texts[0].get_text() == "no validation split"
    assert len(timed.lines) == 0
    assert util.get_title() == "utilization (%), training epoch"
    assert list(util.lines[0].get_ydata()) == pytest.approx([90.0] * 3)
    assert list(dead.lines[0].get_ydata()) == [5] * 3 and list(ppl.lines[0].get_ydata()) == [300.0] * 3

"""`Trainer.close()`: the parts stop first, then the records close and the curves are drawn,
and the records close even when stopping a part fails. No Ray: stand-ins record the order."""

import types

import pytest

from reprorl.trainer import fit
from reprorl.trainer.parts import Parts


def _trainer(tmp_path, calls, *, stop_fails=False):
    trainer = fit.Trainer.__new__(fit.Trainer)  # the close path only: no parts started

    class Recorder:
        def __init__(self, name):
            self.name = name

        def close(self):
            calls.append(f"{self.name}.close")

        def shutdown(self):
            calls.append(f"{self.name}.shutdown")
            if stop_fails and self.name == "pool":
                raise RuntimeError("the pool cannot stop")

        def release(self):
            calls.append("lock.release")

    trainer.run_dir = tmp_path
    (tmp_path / fit.METRICS_FILE).write_text('{"step": 1, "reward/mean": 0.5}\n')
    trainer.cfg = types.SimpleNamespace(trainer=types.SimpleNamespace(experiment_name="x"))
    trainer.tracker, trainer.fingerprints = Recorder("tracker"), Recorder("fingerprints")
    trainer.parts = Parts(actor=Recorder("actor"), pool=Recorder("pool"), reward_loop=Recorder("reward_loop"),
                          agent=Recorder("agent"))  # no ref, critic or reward model
    trainer._owns_ray, trainer._run_lock = False, Recorder("lock")
    return trainer


def test_close_stops_the_parts_before_the_records_and_the_curves(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(fit, "plot_curves", lambda *args, **kwargs: calls.append("plot"))
    _trainer(tmp_path, calls).close()
    assert calls == ["reward_loop.close", "agent.shutdown", "pool.shutdown", "actor.shutdown", "tracker.close",
                     "fingerprints.close", "plot", "lock.release"]


def test_the_records_close_when_a_part_cannot_stop(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(fit, "plot_curves", lambda *args, **kwargs: calls.append("plot"))
    with pytest.raises(RuntimeError, match="the pool cannot stop"):
        _trainer(tmp_path, calls, stop_fails=True).close()
    assert calls[-4:] == ["tracker.close", "fingerprints.close", "plot", "lock.release"]

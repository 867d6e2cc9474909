"""Schedules: how a training step's forward, backward and collectives are ordered.

``build_schedule(name)`` returns an object whose ``step(model, tokens, targets)`` runs forward and
backward of this data-parallel rank's share of the batch, leaves gradients averaged over the
data-parallel group in ``.grad`` and returns the (detached) mean loss.
"""

from oases.schedule.autograd import SCHEDULES, AutogradSchedule, build_schedule

__all__ = ["SCHEDULES", "AutogradSchedule", "build_schedule"]

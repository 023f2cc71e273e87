"""Selection: sampling budgets decided on whole trajectories, after they are seen (tail-based).

VERL's ``max_samples_per_step_per_worker`` picks sample indices at random before anything is
known about them. The collector sees whole trajectories before it forwards them, so under a
tail-based budget it holds each step's spans in the spool and keeps the ones worth reading:

- :mod:`.policy` resolves the budget of each (experiment, validate) from the settings, with
  per-experiment and validation overrides, and picks the mode: pass / head / tail;
- :mod:`.steps` tracks the held steps in memory (a small summary per trajectory) and says when
  a step closes: a known count, every worker moved on to a later step, idle, or the decision wait;
- :mod:`.decide` is the pure rule engine: errors, reward extremes, reward spread, hash fill,
  each within its quota and every limit, with a reason for every drop;
- :mod:`.truncate` fits oversized kept trajectories under the per-trajectory cap;
- :mod:`.tail` routes spans (held / pass / drop), commits decisions atomically with the spans
  they release, rebuilds its state from the spool on start.

With no budget configured none of this is built: spans are stored pending and forwarded at
once, exactly as before. With only ``max_samples_per_step_per_worker`` (and ``tail_sampling``
unset) the head sampler in :mod:`tracecar.collector.processors.sampling.head` keeps VERL's first-N behaviour.
"""

from .decide import Candidate, Verdict, decide, sample_hash
from .policy import Budget, Policies
from .tail import TailSelector

__all__ = ["Budget", "Candidate", "Policies", "TailSelector", "Verdict", "decide", "sample_hash"]

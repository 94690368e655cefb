"""Checkpoints a restart must not resume from: those saved after a NaN, by the attempt that hit it.

A NaN or Inf in one rank's gradient reaches every rank's weights at that step's optimizer
step, and the checkpoints saved from then on by that attempt hold it: a restart that loads
the newest one NaNs again, and the job loops (seen in the robust soak). ``bootseer run``
therefore hands the restart a rule per NaN verdict (``BOOTSEER_CKPT_SKIP``): *a checkpoint of
step S or later created before time T is poisoned*, S the first non-finite step and T the
restart. The loads (``CheckpointManager.latest``/``load`` and the memory tier) pass over such
steps, every rank alike, so the job resumes from the last checkpoint before the NaN. The
poisoned checkpoints stay in the store (they are the evidence); the new attempt's own saves
of the same steps are newer than T and are used again.

Usage::

    rules = rules_from_env()                  # [] when the job never hit a NaN
    why = poisoned(rules, step, created)      # a reason, or None: usable
    os.environ[SKIP_ENV] = to_env([*rules, SkipRule(120, time.time(), "nonfinite at step 120")])
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping, Sequence

log = logging.getLogger(__name__)

SKIP_ENV = "BOOTSEER_CKPT_SKIP"
MAX_RULES = 64  # a job that NaNs more often than this stops on "no progress" long before


@dataclasses.dataclass(frozen=True)
class SkipRule:
    """Checkpoints of ``from_step`` or later created before ``before`` (seconds since the
    epoch) are not resumed from; ``why`` is said when one is passed over."""

    from_step: int
    before: float
    why: str = ""

    def matches(self, step: int, created: float | None) -> bool:
        """``created`` None (not known, e.g. a peer's listing): counted as before."""
        return step >= self.from_step and (created is None or created < self.before)


def poisoned(rules: Sequence[SkipRule], step: int, created: float | None) -> str | None:
    """Why ``step`` (created at ``created``) is not to be resumed from, or None."""
    for rule in rules:
        if rule.matches(step, created):
            return (
                f"step {step} was saved after a non-finite value at step {rule.from_step}"
                + (f" ({rule.why})" if rule.why else "")
                + "; the restart resumes from an "
                "earlier checkpoint"
            )
    return None


def to_env(rules: Sequence[SkipRule]) -> str:
    return json.dumps([dataclasses.asdict(r) for r in rules[-MAX_RULES:]])


def rules_from_env(env: Mapping[str, str] | None = None) -> list[SkipRule]:
    """The rules ``bootseer run`` handed down; a malformed value is said and ignored (it can
    only come from a hand-set variable, and refusing to start would cost the job)."""
    raw = (os.environ if env is None else env).get(SKIP_ENV, "")
    if not raw:
        return []
    try:
        docs = json.loads(raw)
        rules = [
            SkipRule(int(d["from_step"]), float(d["before"]), str(d.get("why", ""))[:200])
            for d in docs[:MAX_RULES]
        ]
    except (ValueError, TypeError, KeyError) as exc:
        log.warning("%s is not a list of {from_step, before, why} (%s); ignored", SKIP_ENV, exc)
        return []
    return rules

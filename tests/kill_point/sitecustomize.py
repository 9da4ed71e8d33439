"""A kill point the run sets off itself, for the tests that SIGKILL a run mid-way and resume it
(tests/test_resume.py, tests/test_offpolicy.py, tests/test_sweeps.py): where the process dies is
then fixed by the code, not guessed from outside by polling ("now inside step 3").

Python imports `sitecustomize` at start-up from sys.path, so with this folder on PYTHONPATH and

    STPPO_TEST_KILL=<before|after>:<step>[:<tag>=<value>]

the process sends itself SIGKILL before or after the first `Tracker.log` of training step
<step> of its run (of the run whose start tags have tag=value, when given): `before` dies inside
the step, after the last checkpoint and before anything of the step is logged; `after` dies with
the step's training metrics logged and not yet checkpointed. With STPPO_TEST_KILL_GROUP=1 it kills
its whole process group (a process started with start_new_session, and what it started).
"""

from __future__ import annotations

import os
import signal

_SPEC = os.environ.get("STPPO_TEST_KILL")


def _kill() -> None:
    if os.environ.get("STPPO_TEST_KILL_GROUP") == "1":
        os.killpg(os.getpgrp(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _install(spec: str) -> None:
    from stppo.tracker import Tracker

    when, step, *tag = spec.split(":")
    if when not in ("before", "after") or len(tag) > 1:
        raise ValueError(f"STPPO_TEST_KILL={spec!r}: expected <before|after>:<step>[:<tag>=<value>]")
    key, value = tag[0].split("=", 1) if tag else (None, None)
    step = int(step)
    start, log = Tracker.start, Tracker.log

    def armed_start(self, *, tags, **kw):
        self._kill_armed = key is None or str(tags.get(key)) == value
        return start(self, tags=tags, **kw)

    def armed_log(self, at, metrics):
        armed = getattr(self, "_kill_armed", False) and int(at) == step and bool(metrics)
        if armed and when == "before":
            _kill()
        log(self, at, metrics)
        if armed:
            _kill()

    Tracker.start, Tracker.log = armed_start, armed_log


if _SPEC:
    _install(_SPEC)

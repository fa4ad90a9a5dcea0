"""What the frontend keeps per session, beside the controller: how deep dtorch.utils.checkpoint's
regions are open, and the counts dtorch.stats() reports of the frontend's own work (redistributes
inserted before ops, local tensors uploaded, checkpoint tensors loaded and saved).

The controller runs the command stream and knows nothing of these. Each session (one Controller)
has its own state, so a new session starts from zero; it goes with the session.
"""
from __future__ import annotations

import threading
import weakref

from ..errors import user_site
from ..runtime.controller import session

__all__ = ["FrontendState", "of", "count", "counts", "refuse_inside_checkpoint"]

# The counts, in the order dtorch.stats() lists them.
COUNTS = ("redistributes_inserted", "local_tensors_uploaded", "checkpoint_tensors_loaded",
          "checkpoint_bytes_via_controller", "checkpoint_tensors_saved", "checkpoint_bytes_saved")


class FrontendState:
    def __init__(self) -> None:
        self.checkpoint_depth = 0   # dtorch.utils.checkpoint's open regions (refuse_inside_checkpoint)
        self.counts = dict.fromkeys(COUNTS, 0)
        self._lock = threading.Lock()   # several threads may issue ops

    def count(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self.counts[name] += amount


_states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_states_lock = threading.Lock()


def of(controller) -> FrontendState:
    """The frontend's state of the session `controller` runs."""
    state = _states.get(controller)
    if state is None:
        with _states_lock:
            state = _states.get(controller)
            if state is None:
                state = _states[controller] = FrontendState()
    return state


def count(controller, name: str, amount: int = 1) -> None:
    """`amount` more of the count `name` (one of COUNTS) in the session of `controller`."""
    of(controller).count(name, amount)


def counts(controller) -> dict:
    """What dtorch.stats() reports of the frontend. checkpoint.save has no path through the
    controller: the workers write the files, so its bytes via the controller are always 0."""
    return {**of(controller).counts, "checkpoint_bytes_saved_via_controller": 0}


def refuse_inside_checkpoint(what: str) -> None:
    """Raise at the user's line when `what` (a backward, an optimizer step, a compiled call, a
    move to another mesh) is called inside dtorch.utils.checkpoint's function: before it changes
    anything, here or on the workers (a worker refuses such a command too, as a backstop). At
    these entries, not in Controller.submit: the per-op path pays nothing for it."""
    active = session.active()
    if active is not None and of(active).checkpoint_depth:
        raise RuntimeError(f"{what} at {user_site()} cannot run inside dtorch.utils.checkpoint's function: the "
                           "function runs again in backward, and only its ops and redistributes can (not a backward, "
                           "an optimizer step, a move to another mesh or a compiled function's call); call it outside "
                           "the checkpointed function")

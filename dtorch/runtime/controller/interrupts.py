"""Ctrl-C (SIGINT: a terminal, Jupyter's "interrupt kernel") that lands while dtorch's own code
runs on the main thread waits until that code returns to the user's.

Python runs a signal's handler on the main thread between two bytecodes, wherever that thread
is, and the default handler raises KeyboardInterrupt there. Inside dtorch that tore sessions: a
batch taken off the pending list and never published, a multipart message cut between frames,
a reply half read, a lock left held that the loop thread then waited on forever. dtorch's code
is not written to be unwound at any bytecode, and no code that shares state between threads can
be; so such an interrupt is deferred:

- The handler dtorch installs asks where the main thread is. The innermost frame that is the
  user's code or dtorch's decides (frames of the standard library, of installed packages and of
  generated code are neither: they run for whoever called them). In the user's code, or in no
  one's, the interrupt goes ahead at once, through whatever handler was installed before
  (KeyboardInterrupt at the user's line, as always). In dtorch's, it is deferred.
- A deferred interrupt runs when dtorch's code returns to the user's (a trace hook, set only
  while one is deferred): the call that was interrupted completes, everything it issued runs,
  and KeyboardInterrupt is raised at the user's line. A wait inside
  dtorch (a blocking read, start-up, shutdown) looks at `pending()` between short slices and
  gives up at a point where nothing is held (`raise_pending`).
- A second Ctrl-C while one has been deferred for ESCAPE_AFTER_S goes ahead at once: a user who
  insists on a stuck call gets their prompt back, at the cost of that session.

Only SIGINT, only the main thread (where Python runs handlers), and only a handler that is a
Python callable (SIG_DFL kills the process, SIG_IGN ignores it: nothing to defer). Installed
when the session starts (or at the first blocking read, for a session started on another
thread), and again before every IPython cell, since IPython's kernel puts its own back.
"""
from __future__ import annotations

import os
import signal
import sys
import sysconfig
import threading
import time

__all__ = ["install", "pending", "raise_pending", "take_pending", "on_main_thread", "counts"]

ESCAPE_AFTER_S = 3.0

_NEUTRAL_DIRS = tuple(sorted({os.path.abspath(path) + os.sep for key, path in sysconfig.get_paths().items()
                              if key in ("stdlib", "platstdlib", "purelib", "platlib")}))
_MAIN_THREAD_ID = threading.main_thread().ident


def _dtorch_dirs() -> tuple:
    """dtorch's package and the launcher's (it runs in the controller during start-up)."""
    dirs = [os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep]   # dtorch/
    launcher = sys.modules.get("dtorch_launcher")
    if launcher is not None and getattr(launcher, "__file__", None):
        dirs.append(os.path.dirname(os.path.abspath(launcher.__file__)) + os.sep)
    return tuple(dirs)


_DTORCH_DIRS = _dtorch_dirs()


class _Deferred:
    """The one interrupt held back, if any (main thread only: handlers run there)."""
    handler = None        # the handler that was installed before dtorch's: it runs the interrupt
    since = 0.0           # time.monotonic() of the deferral; 0.0 when none is pending
    installed = False     # dtorch's handler is in front (install)
    hooked = False        # the line hook is set
    traced: list = []     # the frames it traces
    counts = {"seen": 0, "deferred": 0, "coalesced": 0, "forced": 0}   # since this process started


def _owner(filename: str) -> str | None:
    """"dtorch", "user", or None for code that runs for whoever calls it."""
    if filename.startswith(_DTORCH_DIRS):
        return "dtorch"
    if filename.startswith("<") or filename.startswith(_NEUTRAL_DIRS):
        return None
    return "user"


def _in_dtorch(frame) -> bool:
    """Whether the innermost frame that is the user's or dtorch's, from `frame` out, is dtorch's."""
    while frame is not None:
        owner = _owner(frame.f_code.co_filename)
        if owner is not None:
            return owner == "dtorch"
        frame = frame.f_back
    return False


def on_main_thread() -> bool:
    return threading.get_ident() == _MAIN_THREAD_ID


def install(again: bool = False) -> None:
    """Main thread: put dtorch's SIGINT handler in front of the one installed now (a no-op
    elsewhere, or when SIGINT is ignored or left to kill the process). Once it is in place, only
    `again` looks at the handler again (a plain call costs a flag test: every blocking read
    makes one, for a session started on another thread, as dtorch.init_async does)."""
    global _DTORCH_DIRS
    if (_Deferred.installed and not again) or not on_main_thread():
        return
    current = signal.getsignal(signal.SIGINT)
    if current is _on_sigint or not callable(current):
        _Deferred.installed = current is _on_sigint
        return
    _DTORCH_DIRS = _dtorch_dirs()
    _Deferred.handler = current
    signal.signal(signal.SIGINT, _on_sigint)
    _Deferred.installed = True
    _install_for_ipython()


def _install_for_ipython() -> None:
    """IPython's kernel installs its own SIGINT handler before each cell: wrap it again then."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    if shell is None or getattr(shell, "_dtorch_interrupts", False):
        return
    shell.events.register("pre_run_cell", lambda *args: install(again=True))
    shell._dtorch_interrupts = True


def _on_sigint(signum, frame) -> None:
    _Deferred.counts["seen"] += 1
    now = time.monotonic()
    if _Deferred.since and now - _Deferred.since >= ESCAPE_AFTER_S:
        _Deferred.counts["forced"] += 1   # the user insists: a stuck call gives the prompt back
    elif _in_dtorch(frame):
        if _Deferred.since:   # one KeyboardInterrupt for both, as for two presses in one bytecode
            _Deferred.counts["coalesced"] += 1
        else:
            _Deferred.counts["deferred"] += 1
            _Deferred.since = now
            _hook_returns(frame)
        return
    elif _Deferred.since:   # the deferred one and this one, raised as one in the user's code
        _Deferred.counts["coalesced"] += 1
    _clear()
    _Deferred.handler(signum, frame)   # Ctrl-C outside dtorch's code: the usual KeyboardInterrupt


def counts() -> dict:
    """SIGINTs whose handler ran (Python runs it once for several that arrive before it can),
    those deferred, those coalesced with one deferred, and those forced through (a user who
    pressed again after ESCAPE_AFTER_S)."""
    return dict(_Deferred.counts)


def pending() -> bool:
    """An interrupt is waiting for dtorch's code on the main thread to reach a safe point."""
    return bool(_Deferred.since) and on_main_thread()


def raise_pending() -> None:
    """At a safe point of a wait on the main thread (nothing held): run the deferred interrupt
    now (KeyboardInterrupt, with the default handler)."""
    if _Deferred.since and on_main_thread():
        _run(signal.SIGINT, sys._getframe(1))


def take_pending() -> bool:
    """Consume a deferred interrupt without running it (shutdown acts on it itself)."""
    if not pending():
        return False
    _clear()
    return True


def _run(signum, frame) -> None:
    _clear()
    _Deferred.handler(signum, frame)   # a Ctrl-C that waited for dtorch's call to return


def _clear() -> None:
    _Deferred.since = 0.0
    if _Deferred.hooked:
        _Deferred.hooked = False
        if sys.gettrace() is _on_call:
            sys.settrace(None)
        for frame in _Deferred.traced:
            frame.f_trace = None
        _Deferred.traced.clear()


def _hook_returns(frame) -> None:
    """Trace the main thread until dtorch hands back to the user's code: the outermost dtorch
    frame over the user's code raises on its return (at the user's line that called dtorch), and
    the user's frames on their next line or return, as do the user's functions called from here
    on. Never a destructor's return, which the garbage collector runs inside any code and whose
    exception is printed and dropped. Not while a debugger or coverage traces (they own the
    hook): a wait's next safe point runs it."""
    if sys.gettrace() is not None:
        return
    while frame is not None:
        code = frame.f_code
        if _traced_as_user(code):
            _trace(frame, _on_user_event)
        elif _owner(code.co_filename) == "dtorch" and code.co_name != "__del__" and not _in_dtorch(frame.f_back):
            _trace(frame, _on_boundary_event)
        frame = frame.f_back
    sys.settrace(_on_call)
    _Deferred.hooked = True


def _trace(frame, tracer) -> None:
    frame.f_trace = tracer
    _Deferred.traced.append(frame)


def _traced_as_user(code) -> bool:
    """The user's code, or a script without a file (python -c, a REPL) at its top level."""
    owner = _owner(code.co_filename)
    return owner == "user" or (owner is None and code.co_name == "<module>" and code.co_filename.startswith("<"))


def _on_call(frame, event, arg):
    if event == "call" and frame.f_code.co_name != "__del__" and _owner(frame.f_code.co_filename) == "user":
        return _on_user_event   # a function of the user's that dtorch (or the user) calls now
    return None


def _on_boundary_event(frame, event, arg):
    if event == "return" and _Deferred.since:
        _run(signal.SIGINT, frame.f_back)   # KeyboardInterrupt at the user's line that called dtorch
    return _on_boundary_event


def _on_user_event(frame, event, arg):
    if event in ("line", "return") and _Deferred.since:
        _run(signal.SIGINT, frame)   # KeyboardInterrupt at the user's next line
    return _on_user_event

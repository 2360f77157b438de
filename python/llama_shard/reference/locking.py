"""How the reference engine serialises its calls."""

from __future__ import annotations

import functools


def serialised(method):
    """Runs the method under the engine's lock: like the native engine, the reference serialises
    every call itself, so the manager and the step loop may call it from any thread."""

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return locked

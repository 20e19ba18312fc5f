"""The check runner of the OpenAI-client scripts (test_openai_client.py, test_structured.py).

Each check is a function that raises on failure; `Check.run` times it, prints `ok   NAME (Ns)`
or `FAIL NAME` with the traceback, and goes on with the next one, so one run reports every
failure. The scripts end with the `N passed, M failed` line the Rust tests look for.
"""

from __future__ import annotations

import time
import traceback


class Check:
    """Collects named checks; a failing check records its traceback and the run continues."""

    def __init__(self) -> None:
        self.failures: list[str] = []
        self.passed = 0

    def run(self, name: str, fn, *args) -> None:
        started = time.monotonic()
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - every failure is reported, then the run fails
            self.failures.append(name)
            print(f"FAIL {name}\n{traceback.format_exc()}", flush=True)
            return
        self.passed += 1
        print(f"ok   {name} ({time.monotonic() - started:.2f}s)", flush=True)


def eq(got, want, what: str) -> None:
    """Raises AssertionError naming `what` unless got == want."""
    if got != want:
        raise AssertionError(f"{what}: got {got!r}, want {want!r}")

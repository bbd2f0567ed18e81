"""Imported by tests: its import waits at `tests.import_gate.hold()` while that gate is armed."""

from tests import import_gate

import_gate.hold()

"""``freeze_long_lived``: what is alive when a process has loaded leaves the full collections;
what it creates later is collected as before. In a fresh interpreter: the suite's own process
holds threads of earlier tests that may collect or allocate meanwhile."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = r"""
import gc, weakref
from core.long_lived import freeze_long_lived

class Node:
    pass

def in_a_generation(obj):
    return any(candidate is obj for candidate in gc.get_objects())

loaded = Node()
assert in_a_generation(loaded), "a new object is in a generation"
frozen = freeze_long_lived("test")
assert frozen == gc.get_freeze_count() > 0, (frozen, gc.get_freeze_count())
assert gc.is_tracked(loaded) and not in_a_generation(loaded), "alive at the freeze: frozen"

later = Node()
later.self = later  # a cycle made after the freeze
gone = weakref.ref(later)
del later
gc.collect()
assert gone() is None, "garbage made after the freeze is still collected"
print("ok")
"""


def test_objects_alive_at_the_freeze_leave_the_collections_and_later_garbage_is_still_collected():
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]

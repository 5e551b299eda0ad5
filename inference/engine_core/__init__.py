"""The engine core: the batching engines of one device, in a process that does nothing else.

A device's Celery worker (the front) claims sessions, writes their rows, publishes their streams
and renews their leases; its engine core (a child process, process.py) owns the models and the
engines and steps them as fast as they go. The two talk over ZMQ (client.py, protocol.py), so
the front's database and Redis work never takes the GIL from a forward. `LocalEngines`
(engines.py) is the stepping itself: the core runs it, and a front without a core process
(``SPECOPS_ENGINE_CORE=thread``, and tests with scripted engines) runs it in its loop thread.

Nothing here imports Django: the core process never touches the ORM, Redis or Celery.
"""

"""A generation session's life, in one home: from its admission to its end, its cached state and its stream.

The floor between the metadata store (``metadata``: the tables, caches, replicas, partitions
below) and serving (``inference``: the APIs' validation, the workers, the engine above). Every
write that changes a session's state is made here, and each one keeps the session's cached state
true itself: no module outside this package invalidates it.

- ``submission``: a validated request becomes a session: the prediction cache's answer, or the
  row written under the tenant's quota and its task sent to the model's device queue.
- ``runs``: what the runs of a session may do: the claim and its fence, the lease, the steps an
  earlier run streamed (adoption), progress, the one ``end_session``, cancel, the reconciler.
- ``state``: a session's state and detail read through the two-tier cache.
- ``streams``: a session's token stream: fenced publishes, its one reader per web process, its
  history joined to it, and the one ``follow`` of it for every web reader.
- ``api``: the sessions' REST API and stream (``/api/v1/sessions/``).
- ``detail``: one session as the admin shows it: its page and its latencies.
"""

"""The save lifecycle: plan, snapshot, stream, commit, the handle of an async save, cleanup.

:mod:`.api` is ``save``/``async_save`` (re-exported from ``tierckpt``); the steps follow torch DCP's seams:
:mod:`.plan` (flatten, agree on the plan and the generation), :mod:`.snapshot` and :mod:`.stream` (one rank's
data file), :mod:`.commit` (gather the records, commit or leave no trace), :mod:`.handle` (the levels an async
save reaches), :mod:`.process` (what outlives one save, the exit drain), :mod:`.cleanup` (superseded generations).

May import: the shared top-level modules (errors, comm, deadline, monitor, progress, call_args, gc_pause,
store), ``native``, ``state``, ``formats`` (object codecs), ``planner``, ``io``, ``backends``, ``node``.
Never ``loading``, ``cli``, ``convert``, ``integrations``.
"""

"""The load lifecycle: match the state, plan, read (locally, from peers, from below), cast.

:mod:`.api` is ``load``/``read_state`` (re-exported from ``tierckpt``); :mod:`.generation` runs one
generation's load (steps 2-5), :mod:`.match` checks the state, :mod:`.read_step` and :mod:`.targets` read
and land the bytes, :mod:`.locality`, :mod:`.tier_metadata`, :mod:`.peer_stream` and :mod:`.peer_lanes` use
what the node tiers and the peers hold, :mod:`.objects` reads the saved objects.

May import: the shared top-level modules, ``store``, ``formats``, ``native``, ``state``, ``planner``, ``io``,
``backends``, ``node`` (which node holds what). Never ``saving``, ``cli``, ``convert``, ``integrations``.
"""

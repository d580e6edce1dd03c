"""Conversions between tierckpt checkpoints and other formats (``tierckpt convert``).

May import: ``saving``, ``loading``, ``formats``, ``native``, ``state``, ``planner``, ``io``, ``backends``,
``store`` and the shared top-level modules. Only ``cli`` imports it.
"""

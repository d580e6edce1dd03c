"""Drop-in integrations of tierckpt with training frameworks.

Each submodule imports its framework only when it is imported itself, so ``import tierckpt`` never
pulls in a framework: ``tierckpt.integrations.transformers`` needs ``transformers`` and ``accelerate``
(which its ``Trainer`` needs): ``pip install "tierckpt[transformers]"``;
``tierckpt.integrations.lightning`` needs ``lightning``: ``pip install "tierckpt[lightning]"``;
``tierckpt.integrations.accelerate`` needs ``accelerate``: ``pip install accelerate``;
``tierckpt.integrations.torchtitan`` needs ``torchtitan``: ``pip install "tierckpt[torchtitan]"``.

May import: what users import (``loading``, ``saving``, ``manager``, ``store``, ``formats``, ``state``,
``native``, ``io``, ``comm``, ``errors``); nothing in tierckpt imports it.
"""

"""Which machine this process runs on.

Ranks on the same node share its disks, its page cache and its memory, so a second read of a local
file there is a memory copy, not storage traffic. The identity is the host name unless
``TIERCKPT_NODE_ID`` overrides it (containers that share a host name, or tests that simulate nodes).
"""

from __future__ import annotations

import os
import socket

NODE_ID_ENV = "TIERCKPT_NODE_ID"


def node_id() -> str:
    """This process's node: ``$TIERCKPT_NODE_ID`` when set and non-empty, else the host name."""
    return os.environ.get(NODE_ID_ENV) or socket.gethostname()

"""The ``tierckpt`` command line: :mod:`.main` (the parser and the commands), one module per group.

May import anything below it (not ``integrations``); nothing in tierckpt imports it (``__main__`` runs it).
"""

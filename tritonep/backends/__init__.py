"""Transports behind ``Buffer``: one folder each, all implementing :class:`~.base.Backend`."""

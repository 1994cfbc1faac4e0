"""Thin transports that pump bytes between sockets and the API core."""

"""Bytes <-> requests: the HTTP/1.1 protocol on raw sockets. Knows no model."""

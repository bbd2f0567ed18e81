"""Serving: the HTTP server loop both endpoints share, the metrics page and its discovery file."""

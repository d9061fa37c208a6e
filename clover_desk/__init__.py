"""Clover Desk: the application (entry points, chat storage, engine process) wiring engine/ and ui/ together."""

__version__ = "0.1.0"

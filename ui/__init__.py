"""Clover Desk user interface (PySide6). Never imports torch: it sees the engine through plain-data types."""

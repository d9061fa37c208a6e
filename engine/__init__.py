"""Clover engine: the torch side of Clover Desk.

Importing this package (or ``engine.decode.events`` / ``engine.errors``) does not import torch, so the UI can use the
plain-data types. The model, decoding and loading modules import torch themselves.
"""

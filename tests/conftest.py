"""Shared test set-up: headless Qt, and tiny checkpoints made on demand into temporary folders."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("QTWEBENGINE_DISABLE_SANDBOX", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "0")

"""Where weights live: the byte-exact manifest, the VRAM planner and its speed model, hardware, expert streaming."""

"""The engine in its own process, the window's client for it, the HTTP server and the remote backend."""
